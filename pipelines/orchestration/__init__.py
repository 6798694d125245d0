"""The whole pipeline's machinery (the CLI is ``pipelines/run_all.py``): ``profiles`` (what each profile of
``run_all`` runs: recipes, sweep, evaluation settings) and ``summary`` (the table, the champion's samples,
the checks that the demo does what it promises, and the README's demo block written from a run)."""
