"""A tracking server that goes down mid-training, with MLflow's default retry settings (a single call waits
about 4 minutes before it gives up): training keeps its step rate through an outage longer than that, the
metrics reach the server once it is back, and the run registers at its end; a run that ends during an outage
says so in one clear message and the next run of the same command sends its metrics and registers it."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import pytest

from tests.support_cluster import MLflowServer

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
        outage: dict[str, float] = {}

        def outage_mid_run() -> None:
            deadline = time.time() + 300
            while time.time() < deadline:  # a few windows logged first
                runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                          "tags.`adlm.run_name` = 'long'") if client.search_experiments() else []
                if runs and len(client.get_metric_history(runs[0].info.run_id, "train/loss")) >= 5:
                    break
                time.sleep(1)
            outage["start"] = time.time()
            server.stop()
            time.sleep(OUTAGE_S)
            server.start()
            outage["end"] = time.time()

        t = threading.Thread(target=outage_mid_run, daemon=True)
        t.start()
        # About 7 minutes here (64 x 32 tokens a step): the outage starts after a few windows and ends with
        # training still running.
        res = train(_cfg(tiny_data, "long", STEPS, micro=64), workdir=str(wd), tracking_uri=server.url, quiet=True)
        t.join(timeout=OUTAGE_S + 60)
        assert outage.get("end"), "the outage never happened"
        assert time.time() > outage["end"], "training ended before the server was back: lengthen STEPS"
        assert res.step == STEPS and res.registered_version is not None  # the server was back at the end

        rate = client.get_metric_history(res.run_id, "train/tokens_per_s")
        before = [m.value for m in rate if m.timestamp / 1000 < outage["start"]][1:]  # the first window warms up
        during = [m.value for m in rate if outage["start"] + 5 < m.timestamp / 1000 < outage["end"]]
        assert len(before) >= 3 and len(during) >= 20, (len(before), len(during))
        ratio = statistics.median(during) / statistics.median(before)
        print(f"step rate during the outage / before: {ratio:.3f} ({len(during)} windows in {OUTAGE_S:.0f} s down)")
        assert ratio > 0.8
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
