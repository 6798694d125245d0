"""Defaults every pipeline shares: the work directory, the MLflow store, the offline environment.

- work directory: ``--workdir`` > env ``ADLM_WORKDIR`` > ``./work``
- MLflow: env ``MLFLOW_TRACKING_URI`` > ``sqlite:///<workdir>/mlflow.db``; artifacts of the
  experiments created here go to ``<workdir>/mlartifacts`` unless the server decides.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def resolve_workdir(workdir: str | os.PathLike | None = None) -> Path:
    d = Path(workdir or os.environ.get("ADLM_WORKDIR") or "work").expanduser().resolve()
    d.mkdir(parents=True, exist_ok=True)
    return d


def resolve_tracking_uri(workdir: str | os.PathLike | None = None) -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{resolve_workdir(workdir) / 'mlflow.db'}"


def quiet_environment() -> None:
    """Environment defaults for local runs: no telemetry, no Ray auth token in $HOME."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def ensure_experiment(name: str, tracking_uri: str, workdir: str | os.PathLike | None = None) -> str:
    """Create (or find) an MLflow experiment; local stores get an explicit artifact location."""
    import mlflow  # noqa: PLC0415 - keep import time of CLIs' --help low

    client = mlflow.MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    artifact_location = None
    if tracking_uri.startswith("sqlite:") or tracking_uri.startswith("file:"):
        artifact_location = (resolve_workdir(workdir) / "mlartifacts").as_uri()
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except Exception:  # noqa: BLE001 - a concurrent creator won the race
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def init_ray(num_cpus: int | None = None) -> None:
    """Connect to ``$RAY_ADDRESS`` when set (a cluster, ``ray job submit``), else start a local Ray.

    A local Ray gets its dashboard on a free loopback port: Ray Tune over Ray Train V2 needs the
    state API the dashboard serves, or finished trials' placement groups are never released
    (ENVIRONMENT.md); loopback only, never open to the network.
    """
    import ray  # noqa: PLC0415

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True, configure_logging=False)
        return
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # address="local": always a fresh local Ray, never a stale `ray start` head that
    # /tmp/ray/ray_current_cluster may still name.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port,
             log_to_driver=True, configure_logging=False)
