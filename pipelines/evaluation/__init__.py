"""Evaluation's machinery (the CLI is ``pipelines/evaluate.py``).

``config`` (suites and settings), ``plan`` (every check before weights load), ``jobs`` (units of work),
``executors`` (in-process or Ray tasks), ``run`` (the evaluation and its MLflow run), ``report`` (result,
table, plots, version tags), ``metrics`` (one definition per metric), ``eval_lm`` (evaluation LMs and
featurizers), ``promotion`` (staged evaluation and the champion gate).
"""
