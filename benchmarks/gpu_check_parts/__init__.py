"""``benchmarks/gpu_check.py``'s items by family (it is the command: the items' table, the runner, the
report). Standard library, torch and ``adlm_model`` only, as the command."""
