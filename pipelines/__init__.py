"""The ADLM pipeline's commands, on Ray Data, Ray Train, Ray Tune and MLflow.

Each top-level module is a command, ``python -m pipelines.<name>``, and stays thin (argument parsing, the plan,
the calls, the exit code): ``prepare_data``, ``train``, ``tune``, ``evaluate``, ``run_all``, ``generate``,
``serve``, ``export``, ``import_model``, ``distill`` and ``study``. Their machinery lives in subpackages named for
what they are: ``data/``, ``training/``, ``tuning/``, ``evaluation/``, ``serving/``, ``studies/`` and
``orchestration/`` for the stages; ``core/`` for what every command shares (the command runner, logging, settings,
configs, storage, starting Ray, placement); ``tracking/`` for MLflow (runs, the spool, the registry, the MLflow
Model); ``compat/`` for the private names of Ray and MLflow.
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
