"""The gamma/tau sweeps' machinery (the CLI is ``pipelines/tune.py``).

``space`` (the ``tune_spaces/*.yaml`` schema), ``sweep`` (plan, trials, Tune, MLflow bookkeeping,
registration of the best trial), ``report`` (the trial table and the search plot).
"""
