"""Training's step rate through a tracking-server outage (the goal: training keeps its step rate, within a few
percent), run by hand: about 10 minutes.

A one-worker Ray Train run of a tiny ADLM (the test suite's tiny real data: embedded-corpus text, a 512-entry
BPE, rows of 32; 64 rows a step, a metrics window every 20 steps) logs to a real ``mlflow server`` on
loopback, with MLflow's default retry settings (7 retries, backoff factor 2: a call gives up after about
250 s). After ``--warmup-windows`` windows with the server up (60, about a minute, so that the up windows
lie on both sides of the outage: here a run's step rate drifts by several percent over its first minutes,
which with only five windows before the outage was counted against it: 0.946 and 0.908 in two runs) the
server is stopped for ``--outage-s`` (270 s: longer than those retries) and started again on the same port and store. The loop measures its own tokens/s per window; they reach the
server late (the background sender keeps them) with the time they were measured.

RESULT ``outage_step_rate_ratio``: median tokens/s of the windows measured while the server was down over the
median of those measured while it was up (before and after; the first window is warm-up). Goal >= 0.95.
The test suite (tests/e2e/test_tracking_outage.py) runs the same scenario and asserts only that nothing stalls.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import add_argument, recording  # noqa: E402
from _util import result  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/adlm-bench-outage"), help="scratch folder (emptied)")
    p.add_argument("--outage-s", type=float, default=270.0, help="how long the server is down (s)")
    p.add_argument("--warmup-windows", type=int, default=60,
                   help="metric windows (20 steps each) logged with the server up before it is stopped")
    p.add_argument("--steps", type=int, default=10000, help="optimiser steps (enough to outlast the outage)")
    add_argument(p)
    args = p.parse_args()
    with recording("tracking_outage", args.record):
        measure(args)


def measure(args: argparse.Namespace) -> None:
    for k in [k for k in os.environ if k.startswith("MLFLOW_HTTP_REQUEST")]:
        del os.environ[k]  # MLflow's own retry defaults
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(k, "1")
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)

    from pipelines.core.runtime import init_ray
    from pipelines.training.config import load_config
    from pipelines.training.trainer import train
    from tests.support.cluster import MLflowServer, outage_step_rates, tracking_outage
    from tests.support.data import TINY_MODEL, data_overrides, make_tiny_data

    init_ray(num_cpus=2)
    data = make_tiny_data(args.workdir / "data")
    cfg = load_config(ROOT / "configs" / "demo.yaml", [
        *data_overrides(data), *TINY_MODEL, "run.name=outage", f"run.max_steps={args.steps}", "run.log_every=20",
        "run.val_every=100000", "run.ckpt_every=100000", "run.val_batches=1", "batch.global_batch=64",
        "batch.micro_batch=64", "scaling.num_workers=1", "scaling.cpus_per_worker=0.5", "optim.warmup_steps=2",
        "mlflow.experiment=bench-outage", "mlflow.register=false"])
    server = MLflowServer(args.workdir / "mlflow.db", str(args.workdir / "artifacts"),
                          args.workdir / "mlflow.log").start()
    try:
        outage = tracking_outage(server, "outage", args.outage_s, after_windows=args.warmup_windows)
        t0 = time.time()
        res = train(cfg, workdir=str(args.workdir / "work"), tracking_uri=server.url)
        outage.thread.join(timeout=args.outage_s + 60)
        if not outage.end or time.time() < outage.end:
            raise SystemExit("the run ended before the outage did: raise --steps")
        up, down = outage_step_rates(server.url, res.run_id, outage)
    finally:
        server.stop()
    ratio = statistics.median(down) / statistics.median(up)
    print(f"{res.step} steps in {time.time() - t0:.0f} s; server down {outage.end - outage.start:.0f} s")
    print(f"tokens/s with the server up: median {statistics.median(up):,.0f} over {len(up)} windows "
          f"({statistics.median(up[:args.warmup_windows - 1]):,.0f} before the outage, "
          f"{statistics.median(up[args.warmup_windows - 1:]):,.0f} after)")
    print(f"tokens/s with the server down: median {statistics.median(down):,.0f} over {len(down)} windows")
    result("outage_step_rate_ratio", ratio)


if __name__ == "__main__":
    main()
