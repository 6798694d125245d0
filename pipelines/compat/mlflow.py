"""MLflow's private names the pipeline uses, and why no public API serves each."""

from __future__ import annotations

from pipelines.compat import PrivateName

TRACKING_UTILS = PrivateName("mlflow.tracking._tracking_service", "utils", "the process-wide tracking URI set "
                             "by mlflow.set_tracking_uri has no public reader apart from the environment variable it "
                             "also writes (get_tracking_uri falls back to that and to a default)",
                             "pipelines/compat/mlflow.py")
PRIVATE = [TRACKING_UTILS]


def global_tracking_uri() -> str | None:
    """The URI ``mlflow.set_tracking_uri`` set in this process, None where none is set."""
    return TRACKING_UTILS.load()._tracking_uri


def forget_global_tracking_uri() -> None:
    """Unset that URI without touching ``MLFLOW_TRACKING_URI`` (``set_tracking_uri(None)`` deletes the variable)."""
    TRACKING_UTILS.load()._tracking_uri = None
