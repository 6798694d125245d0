"""MLflow tracking that never stops training.

- ``resolve_tracking_uri``: env ``MLFLOW_TRACKING_URI`` > ``sqlite:///<workdir>/mlflow.db``; artifacts of
  the experiments created here go to ``<workdir>/mlartifacts`` unless the server decides.
- ``client``: the one way the pipeline makes an ``MlflowClient`` (tracking and registry on one URI).
- ``find_or_create_run``: one MLflow run per training run name. The run id is fixed when the run
  starts, stored in every checkpoint (meta ``mlflow_run_id``) and reopened on resume, so that a
  resumed or restarted run keeps logging into the same run.
- ``ResilientLogger``: rank 0's metric logger. Metrics are buffered and sent in batches; when the
  tracking store is unreachable it logs one warning, keeps the buffer and retries later with
  backoff (dropping the oldest entries only past ``max_buffer``). Steps at or below the last step
  already stored are skipped, so a restart from a checkpoint never duplicates steps.
- ``plot_loss_curve``: the loss-curve artifact, drawn from the run's stored metric history.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

from pipelines.storage import resolve_workdir

log = logging.getLogger("adlm.tracking")

RUN_NAME_TAG = "adlm.run_name"


def resolve_tracking_uri(workdir: str | os.PathLike | None = None) -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{resolve_workdir(workdir) / 'mlflow.db'}"


def client(tracking_uri: str | None) -> Any:
    """An ``MlflowClient`` whose tracking and registry URIs are both ``tracking_uri``."""
    import mlflow

    return mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def ensure_experiment(name: str, tracking_uri: str, workdir: str | os.PathLike | None = None) -> str:
    """Create (or find) an MLflow experiment; local stores get an explicit artifact location."""
    c = client(tracking_uri)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    artifact_location = None
    if tracking_uri.startswith("sqlite:") or tracking_uri.startswith("file:"):
        artifact_location = (resolve_workdir(workdir) / "mlartifacts").as_uri()
    try:
        return c.create_experiment(name, artifact_location=artifact_location)
    except Exception:
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def find_or_create_run(tracking_uri: str, experiment_id: str, run_name: str, *, run_id: str | None = None,
                       tags: dict[str, str] | None = None, parent_run_id: str | None = None) -> tuple[str, bool]:
    """(run id, created). ``run_id`` (from a checkpoint) wins; else the run tagged with this name."""
    c = client(tracking_uri)
    if run_id:
        try:
            c.get_run(run_id)
            c.update_run(run_id, status="RUNNING")
            return run_id, False
        except Exception:  # noqa: BLE001 - the store was reset: fall back to lookup / create
            log.warning("MLflow run %s from the checkpoint is not in %s; looking it up by name", run_id, tracking_uri)
    found = c.search_runs([experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'",
                               max_results=1, order_by=["attributes.start_time DESC"])
    if found:
        rid = found[0].info.run_id
        c.update_run(rid, status="RUNNING")
        return rid, False
    all_tags = {RUN_NAME_TAG: run_name, **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = c.create_run(experiment_id, run_name=run_name, tags=all_tags)
    return run.info.run_id, True


def log_params_once(tracking_uri: str, run_id: str, params: dict[str, Any]) -> None:
    """Log params that the run does not have yet (MLflow params are immutable); changed values of a
    resumed run (e.g. a longer max_steps) go to tags ``resumed.<key>``."""
    from mlflow.entities import Param, RunTag

    c = client(tracking_uri)
    have = c.get_run(run_id).data.params
    new = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in have]
    changed = [RunTag(f"resumed.{k}", str(v)[:5000]) for k, v in params.items() if k in have and have[k] != str(v)[:6000]]
    for i in range(0, len(new), 100):
        c.log_batch(run_id, params=new[i:i + 100])
    for i in range(0, len(changed), 100):
        c.log_batch(run_id, tags=changed[i:i + 100])


class ResilientLogger:
    """Buffered MLflow metric logging that survives tracking outages (warns, retries, never raises)."""

    def __init__(self, tracking_uri: str, run_id: str, *, max_buffer: int = 200_000, retry_s: float = 5.0,
                 skip_through_step: int | None = None) -> None:
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.max_buffer = max_buffer
        self.retry_s = retry_s
        self.buffer: deque = deque()
        self.failures = 0
        self.dropped = 0
        self._next_try = 0.0
        self._warned = False
        self.skip_through = skip_through_step if skip_through_step is not None else self._last_logged_step()

    def _last_logged_step(self, key: str = "train/loss") -> int:
        try:
            hist = client(self.tracking_uri).get_metric_history(self.run_id, key)
            return max((m.step for m in hist), default=-1)
        except Exception as e:  # noqa: BLE001
            log.warning("MLflow unreachable at start (%s); logging will be retried", str(e).splitlines()[0][:200])
            return -1

    def log_metrics(self, metrics: dict[str, float], step: int, *, force: bool = False) -> None:
        """Queue metrics of one step; steps already stored before a restart are skipped."""
        if step <= self.skip_through and not force:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        for k, v in metrics.items():
            if v is None:
                continue
            self.buffer.append(Metric(k, float(v), ts, int(step)))
        while len(self.buffer) > self.max_buffer:
            self.buffer.popleft()
            self.dropped += 1

    def flush(self, *, block: bool = False) -> bool:
        """Send the buffer; False (and a warning, once per outage) when the store is unreachable."""
        if not self.buffer:
            return True
        now = time.monotonic()
        if now < self._next_try and not block:
            return False
        try:
            c = client(self.tracking_uri)
            while self.buffer:
                chunk = [self.buffer[i] for i in range(min(1000, len(self.buffer)))]
                c.log_batch(self.run_id, metrics=chunk)
                for _ in chunk:
                    self.buffer.popleft()
        except Exception as e:  # noqa: BLE001 - any outage: keep training
            self.failures += 1
            self._next_try = now + min(300.0, self.retry_s * 2 ** min(self.failures - 1, 6))
            if not self._warned:
                log.warning("MLflow logging failed (%s); %d metrics buffered, retrying, training goes on",
                            str(e).splitlines()[0][:200] if str(e) else type(e).__name__, len(self.buffer))
                print(f"WARNING: MLflow logging failed ({type(e).__name__}); metrics buffered, training continues",
                      flush=True)
                self._warned = True
            return False
        if self._warned:
            print("MLflow logging recovered; buffered metrics sent", flush=True)
        self._warned = False
        self.failures = 0
        return True


def metric_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    hist = client(tracking_uri).get_metric_history(run_id, key)
    return sorted((m.step, m.value) for m in hist)


def plot_loss_curve(tracking_uri: str, run_id: str, out: str | os.PathLike) -> Path | None:
    """PNG of training loss / NLL and validation PPL against steps from the stored history."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {k: metric_history(tracking_uri, run_id, k) for k in ("train/loss", "train/nll", "val/ppl")}
    if not any(series.values()):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for k in ("train/loss", "train/nll"):
        if series[k]:
            s, v = zip(*series[k], strict=True)
            axes[0].plot(s, v, label=k)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("per-token loss (nats)")
    axes[0].legend()
    axes[0].set_title("training")
    if series["val/ppl"]:
        s, v = zip(*series["val/ppl"], strict=True)
        axes[1].plot(s, v, "o-", color="C2")
        axes[1].set_yscale("log")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("validation PPL bound (EMA)")
    axes[1].set_title("validation")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def log_artifact_safely(tracking_uri: str, run_id: str, local: str | os.PathLike, artifact_path: str | None = None) -> bool:
    try:
        c = client(tracking_uri)
        if Path(local).is_dir():
            c.log_artifacts(run_id, str(local), artifact_path)
        else:
            c.log_artifact(run_id, str(local), artifact_path)
        return True
    except Exception as e:  # noqa: BLE001
        log.warning("could not log artifact %s: %s", local, e)
        print(f"WARNING: could not log artifact {local} to MLflow: {type(e).__name__}", flush=True)
        return False


def temp_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="adlm-"))
