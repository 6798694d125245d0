"""Orchestration of the ADLM pipeline: Ray Data, Ray Train, Ray Tune and MLflow.

The stage entry points are thin modules (argument parsing, the plan, the calls, the exit code):
``prepare_data``, ``train``, ``tune``, ``evaluate``, ``run_all``. Their machinery lives in ``data/``,
``training/``, ``tuning/`` and ``evaluation/``; the pieces every stage shares are ``storage`` (work
directory URIs and filesystems), ``tracking`` (MLflow runs), ``registry`` (the registered-model contract),
``runtime`` (environment defaults, starting Ray), ``overrides`` (``--set``), ``seeds``, ``assets`` (offline
files of pip packages) and ``faults`` (fault injection for the recovery tests).
"""
