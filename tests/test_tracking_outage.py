"""A tracking server that goes down mid-training, with MLflow's default retry settings (a single call waits
about 4 minutes before it gives up): training keeps its step rate through an outage longer than that, the
metrics reach the server once it is back, and the run registers at its end; a run that ends during an outage
says so in one clear message and the next run of the same command sends its metrics and registers it."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest

from tests.support_cluster import MLflowServer, outage_step_rates, tracking_outage

pytestmark = pytest.mark.slow

STEPS = 8000
OUTAGE_S = 270.0
"""Longer than MLflow's default retries: 7 retries, backoff factor 2, capped at 120 s: about 250 s."""


def _cfg(tiny_data: Path, name: str, steps: int, micro: int = 8):
    from pipelines.training.config import load_config
    from tests.support_data import TINY_MODEL, data_overrides

    root = Path(__file__).resolve().parents[1]
    return load_config(root / "configs" / "demo.yaml", [
        *data_overrides(tiny_data), *TINY_MODEL, f"run.name={name}", f"run.max_steps={steps}", "run.log_every=20",
        "run.val_every=1000", "run.ckpt_every=2000", "run.val_batches=1", f"batch.global_batch={micro}",
        f"batch.micro_batch={micro}", "scaling.num_workers=1", "scaling.cpus_per_worker=0.5", "optim.warmup_steps=2",
        "mlflow.experiment=outage", "mlflow.drain_timeout_s=30"])


def test_training_outlives_a_tracking_outage(tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capfd: pytest.CaptureFixture[str]) -> None:
    import mlflow

    from pipelines.training.trainer import train

    for k in [k for k in __import__("os").environ if k.startswith("MLFLOW_HTTP_REQUEST")]:
        monkeypatch.delenv(k)  # MLflow's own defaults
    server = MLflowServer(tmp_path / "mlflow.db", str(tmp_path / "artifacts"), tmp_path / "mlflow.log").start()
    wd = tmp_path / "work"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
    try:
        client = mlflow.MlflowClient(server.url)
        outage = tracking_outage(server, "long", OUTAGE_S)
        # About 7 minutes here (64 x 32 tokens a step): the outage starts after a few windows and ends with
        # training still running.
        res = train(_cfg(tiny_data, "long", STEPS, micro=64), workdir=str(wd), tracking_uri=server.url, quiet=True)
        outage.thread.join(timeout=OUTAGE_S + 60)
        assert outage.end, "the outage never happened"
        assert time.time() > outage.end, "training ended before the server was back: lengthen STEPS"
        assert res.step == STEPS and res.registered_version is not None  # the server was back at the end

        # The loop never waited on the server: windows kept coming at the rate they came with it up. A stall
        # (a call waiting out MLflow's ~250 s of retries) would leave a handful of windows at a fraction of it.
        # How close the rates are is a measurement, not an assertion: benchmarks/tracking_outage.py.
        up, down = outage_step_rates(server.url, res.run_id, outage)
        assert len(up) >= 3 and len(down) >= 20, (len(up), len(down))
        ratio = statistics.median(down) / statistics.median(up)
        with capfd.disabled():
            print(f"\nstep rate during the outage / with the server up: {ratio:.3f} ({len(down)} windows in "
                  f"{OUTAGE_S:.0f} s down)")
        assert ratio > 0.8, ratio
        steps = [m.step for m in client.get_metric_history(res.run_id, "train/loss")]
        assert sorted(steps) == list(range(20, STEPS + 1, 20))  # every window once, the outage's included

        # A run that ends while the server is down: one clear message, nothing registered; the next run of the
        # same command (server back) trains nothing, sends the metrics it kept and registers.
        server.stop()
        short = train(_cfg(tiny_data, "short", 60), workdir=str(wd), tracking_uri=server.url, quiet=True)
        assert short.registered_version is None
        assert "is unreachable: the run is trained" in capfd.readouterr().out
        server.start()
        again = train(_cfg(tiny_data, "short", 60), workdir=str(wd), tracking_uri=server.url, quiet=True)
        assert again.registered_version is not None and again.step == 60
        steps = [m.step for m in client.get_metric_history(again.run_id, "train/loss")]
        assert sorted(steps) == [20, 40, 60]
    finally:
        server.stop()
