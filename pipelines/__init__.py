"""Orchestration of the ADLM pipeline: Ray Data, Ray Train, Ray Tune and MLflow.

The stage entry points are thin modules (argument parsing, the plan, the calls, the exit code):
``prepare_data``, ``train``, ``tune``, ``evaluate``, ``run_all``. Their machinery lives in ``data/``,
``training/``, ``tuning/`` and ``evaluation/``; the pieces every stage shares are ``storage`` (work
directory URIs and filesystems), ``tracking`` (MLflow runs), ``registry`` (the registered-model contract),
``runtime`` (environment defaults, starting Ray), ``overrides`` (``--set``), ``seeds``, ``assets`` (offline
files of pip packages) and ``faults`` (fault injection for the recovery tests).
"""

import sys as _sys
from pathlib import Path as _Path


def _only_this_copy() -> None:
    """Every process of a Ray job imports this package from the job's uploaded working directory (first on its
    path). A node whose environment holds an editable install of some checkout (a development venv; never the
    images: ``configs/gpu.Dockerfile`` installs the dependencies only) also has that install's import hook: a
    finder appended to ``sys.meta_path`` that maps ``pipelines`` and ``adlm_model`` and their modules to the
    checkout's folders. It runs after the path finder, so a module the submitter deleted would still import, from
    that checkout. When this package is not the folder such a finder maps, the finder goes: the job runs
    exactly the code it was submitted with."""
    here = _Path(__file__).resolve().parent
    for finder in list(_sys.meta_path):
        mapping = getattr(_sys.modules.get(getattr(finder, "__module__", "") or ""), "MAPPING", None)
        if isinstance(mapping, dict) and "pipelines" in mapping and _Path(mapping["pipelines"]).resolve() != here:
            _sys.meta_path.remove(finder)


_only_this_copy()
