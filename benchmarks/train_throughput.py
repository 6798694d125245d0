"""Training throughput of pipelines.train, run by hand.

On the ``demo`` recipe (configs/demo.yaml: ADLM, 8,192-entry BPE, rows of 128, micro-batch 8, global
batch 16, so accumulation 2 on one worker) with the embedded demo data (prepared once with
``pipelines.prepare_data`` under ``--workdir`` and reused), runs of ``--steps`` optimiser steps, each
with ``--threads`` torch threads:

- Ray Train: ``pipelines.training.trainer.train`` with one Ray Train worker (``num_workers=1``,
  ``cpus_per_worker=--threads``, which the loop turns into ``torch.set_num_threads(--threads)``).
  Batches stream from the shards through Ray Data (``iter_torch_batches``, local shuffle buffer);
  rank 0 logs to a sqlite MLflow store every ``--window`` steps; its tokens/s are read back from the
  MLflow metric ``train/tokens_per_s`` (one value per window). Ray is started with one logical CPU
  more than the worker reserves, so that Ray Data's read tasks can be scheduled at all (a worker that
  holds every CPU starves Ray Data: its read tasks never start); those tasks then share the physical cores with
  the worker, a cost of the Ray loop that is counted here. Validation and the checkpoint happen only
  at the last step, after the last window.
- Plain PyTorch: the same step (``adlm_model.train.train_step.TrainStep``: the objective, AdamW, the warm-up
  schedule, global-norm clipping, the EMA) in this one process, no Ray, no MLflow: same model config and
  seed, same micro-batch and accumulation, batches read from the same Parquet shards with pyarrow
  (``iter_batches``, in shard order), ``torch.set_num_threads(--threads)``.

Order: plain ADLM and plain MDLM (``model.kind=mdlm``, the recipe otherwise unchanged) alternating
window by window, then the Ray Train run, then plain ADLM once more, so that a change of load on
the machine's cores hits both sides of each comparison.

Steady state against steady state: tokens/s are measured per window of ``--window`` steps (tokens =
non-pad tokens of the batches, as ``train/tokens_per_s`` counts them); the first ``--skip-windows``
windows of every run are dropped (Ray Train's start-up and its first Ray Data reads, allocator
warm-up), and medians of the remaining windows are compared. Ray's ~20 s start-up is not in the ratio.

- ``RESULT ray_train_overhead`` = plain ADLM tokens/s / Ray Train ADLM tokens/s (goal <= 1.10).
- ``RESULT adlm_over_mdlm_train_time`` = ADLM time per token / MDLM time per token in the plain loop,
  the median of the ratios of paired windows (ADLM has an extra denoiser block, a dense
  vocabulary-sized input projection and a second output projection).

Other work on the machine's cores still moves single windows; compare ratios measured in one run.

    python benchmarks/train_throughput.py                       # 30 steps a run, ~4 minutes on 2 idle cores
    python benchmarks/train_throughput.py --steps 60 --window 10   # longer windows
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import add_argument, recording  # noqa: E402
from _util import result  # noqa: E402

from adlm_model import EMA, build_model  # noqa: E402
from adlm_model.train.train_step import Objective, TrainStep  # noqa: E402
from pipelines.training.config import TrainConfig, load_config  # noqa: E402
from pipelines.training.optim import build_optimizer, build_schedule  # noqa: E402

EXPERIMENT = "bench-train-throughput"


def prepare_demo_data(workdir: Path) -> Path:
    """The embedded demo data under ``workdir/data/embedded`` (where the demo recipe looks); reused if complete."""
    from pipelines.data.prepare import PrepareConfig, prepare

    out = workdir / "data" / "embedded"
    # Ray (if this has to start it) stops again: the plain loops run without it, the Ray loop starts its own.
    prepare(PrepareConfig(source=["embedded"], out=str(out), workdir=str(workdir)), shutdown_ray=True)
    return out


def recipe(args: argparse.Namespace, *extra: str) -> TrainConfig:
    """The demo recipe resized to this benchmark: validation and checkpoint only at the last step."""
    s = args.steps
    return load_config(args.config, [
        f"run.max_steps={s}", f"run.log_every={args.window}", f"run.val_every={s}", f"run.ckpt_every={s}",
        "run.val_batches=1", "scaling.num_workers=1", f"scaling.cpus_per_worker={args.threads}",
        "failure.max_failures=0", f"mlflow.experiment={EXPERIMENT}", "mlflow.register=false", *extra])


# ------------------------------------------------------------------------------------------------------
# 1. Ray Train


def ray_train_rates(args: argparse.Namespace, workdir: Path) -> list[float]:
    """Tokens/s per window of a one-worker Ray Train run of the demo recipe (from MLflow)."""
    import mlflow
    import ray

    from pipelines.core.runtime import init_ray
    from pipelines.training.trainer import train

    started = not ray.is_initialized()
    if started:
        env = {k: v for k, v in os.environ.items() if k.startswith(("RAY_TRAIN_", "MLFLOW_", "TOKENIZERS_", "HF_"))}
        # Ray Train's PlacementGroupCleaner asks the state API whether the controller lives, at the address
        # in <RAY_TMPDIR or /tmp>/ray/ray_current_cluster: the last `ray start` on this machine. If that
        # is another live cluster, it finds no such controller and removes this run's placement group,
        # killing the worker (seen while another process ran `ray start`). An empty RAY_TMPDIR for
        # this job's processes makes it look for running clusters instead (one: this; several: it gives up).
        private = workdir / "ray-address"
        private.mkdir(exist_ok=True)
        env["RAY_TMPDIR"] = str(private)
        init_ray(num_cpus=args.threads + 1, dashboard=False, env_vars=env)
    name = f"bench-ray-{time.strftime('%Y%m%d-%H%M%S')}"  # a new name: an old one would resume
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    try:
        res = train(recipe(args, f"run.name={name}"), workdir=workdir, tracking_uri=uri, register=False)
    finally:
        shutil.rmtree(workdir / "ray_results" / name, ignore_errors=True)
        shutil.rmtree(workdir / "checkpoints" / name, ignore_errors=True)
        if started:
            ray.shutdown()  # the plain loop that follows runs without Ray's processes
    hist = mlflow.MlflowClient(uri).get_metric_history(res.run_id, "train/tokens_per_s")
    return [m.value for m in sorted(hist, key=lambda m: m.step)]


# ------------------------------------------------------------------------------------------------------
# 2./3. The same loop in plain PyTorch


def parquet_batches(paths: list[Path], columns: list[str], micro: int, length: int) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches of full rows from the shards, in order, epoch after epoch (pyarrow only)."""
    import pyarrow.parquet as pq

    while True:
        for p in paths:
            for rb in pq.ParquetFile(p).iter_batches(batch_size=micro, columns=columns):
                if rb.num_rows < micro:
                    continue
                yield {c: torch.from_numpy(rb.column(c).flatten().to_numpy().reshape(-1, length)) for c in columns}


def plain_windows(cfg: TrainConfig, data_dir: Path, threads: int, label: str) -> Iterator[float]:
    """pipelines.train's loop in this process (world size 1), no Ray, no MLflow: yields the tokens/s of
    each window of ``run.log_every`` steps, up to ``run.max_steps`` steps."""
    from pipelines.data.manifest import read_manifest

    torch.set_num_threads(threads)
    mc, o, r = cfg.model, cfg.optim, cfg.run
    m = read_manifest(data_dir / "train")
    m.check_fits(mc)
    columns = ["input_ids"] + (["attention_mask"] if m.mode == "pad" else [])
    batches = parquet_batches(m.shard_paths(), columns, cfg.batch.micro_batch, mc.seq_len)

    torch.manual_seed(r.seed)
    model = build_model(mc)
    opt = build_optimizer(model.parameters(), o)
    step_fn = TrainStep(Objective(model, mc), model, opt, sched=build_schedule(opt, o, r.max_steps),
                        ema=EMA(model, cfg.ema), clip=o.clip)
    noise = torch.Generator().manual_seed(r.seed)
    accum, window = cfg.accumulation, r.log_every
    model.train()
    t, ntok, loss = time.perf_counter(), 0.0, 0.0
    for step in range(r.max_steps):
        micro = [next(batches) for _ in range(accum)]
        out = step_fn([(b["input_ids"].long(), b.get("attention_mask")) for b in micro], step=step, generator=noise)
        loss += float(out.loss)
        ntok += float(out.n_tokens)
        if (step + 1) % window == 0:
            rate = ntok / (time.perf_counter() - t)
            print(f"[plain {label}] step {step + 1}/{r.max_steps} loss {loss / window:.4f} tok/s {rate:,.0f}",
                  flush=True)
            yield rate
            t, ntok, loss = time.perf_counter(), 0.0, 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="optimiser steps of each run (a multiple of --window; default 30)")
    ap.add_argument("--window", type=int, default=5, help="steps per tokens/s window (run.log_every; default 5)")
    ap.add_argument("--skip-windows", type=int, default=1,
                    help="leading windows left out of the steady state (default 1)")
    ap.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)),
                    help="torch threads of every loop = CPUs of the Ray Train worker (default: 2, or 1 on one core)")
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"), help="the recipe (default configs/demo.yaml)")
    ap.add_argument("--workdir", default=str(ROOT / "work" / "bench-train"),
                    help="holds the prepared demo data (reused between runs), Ray results and the MLflow store "
                         "(default work/bench-train)")
    add_argument(ap)
    args = ap.parse_args()
    if args.steps < 1 or args.window < 1 or args.threads < 1 or args.skip_windows < 0:
        raise SystemExit("error: --steps, --window and --threads must be >= 1, --skip-windows >= 0")
    if args.steps % args.window or args.steps // args.window <= args.skip_windows:
        raise SystemExit(f"error: --steps {args.steps} must be a multiple of --window {args.window} giving more than "
                         f"--skip-windows {args.skip_windows} windows, e.g. --steps {args.window * (args.skip_windows + 2)}")
    with recording("train_throughput", args.record):
        measure(args)


def measure(args: argparse.Namespace) -> None:
    for k, v in {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true",
                 "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}.items():
        os.environ.setdefault(k, v)
    adlm, mdlm = recipe(args), recipe(args, "model.kind=mdlm")  # config errors before any work
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    print(f"preparing (or verifying) the embedded demo data under {workdir}", flush=True)
    data = prepare_demo_data(workdir)
    print(f"data ready in {time.perf_counter() - t0:.0f} s; {args.steps} steps per loop, windows of {args.window}, "
          f"first {args.skip_windows} skipped, {args.threads} torch threads; global batch "
          f"{adlm.batch.global_batch} = micro-batch {adlm.batch.micro_batch} x accumulation {adlm.accumulation}",
          flush=True)

    # 1. Plain ADLM and MDLM, alternating window by window: both see the same load on the cores.
    plain_a, plain_m = [], []
    for ra, rm in zip(plain_windows(adlm, data, args.threads, "adlm"), plain_windows(mdlm, data, args.threads, "mdlm"),
                      strict=True):
        plain_a.append(ra)
        plain_m.append(rm)
    # 2. Ray Train.
    ray_a = ray_train_rates(args, workdir)
    # 3. Plain ADLM once more: plain windows before and after the Ray run, so a drift of the load hits both sides.
    plain_a += list(plain_windows(adlm, data, args.threads, "adlm"))

    k, n = args.skip_windows, args.steps // args.window
    steady_plain = statistics.median(plain_a[k:n] + plain_a[n + k:])
    steady_ray = statistics.median(ray_a[k:])
    adlm_time = statistics.median(m / a for a, m in zip(plain_a[k:n], plain_m[k:], strict=True))

    def show(v: list[float]) -> str:
        return ", ".join(f"{x:,.0f}" for x in v)

    print(f"plain adlm      {steady_plain:8,.0f} tok/s (median of steady windows)  windows: {show(plain_a)}")
    print(f"plain mdlm      {statistics.median(plain_m[k:]):8,.0f} tok/s                             "
          f"windows: {show(plain_m)}")
    print(f"ray train adlm  {steady_ray:8,.0f} tok/s                             windows: {show(ray_a)}")
    overhead = steady_plain / steady_ray
    # Other load only ever slows a window down: the ratio of the best windows is a cross-check of the medians.
    best = max(plain_a[k:n] + plain_a[n + k:]) / max(ray_a[k:])
    print(f"cross-check, best steady window of each: plain/Ray {best:.3f}, ADLM/MDLM time per token "
          f"{max(plain_m[k:]) / max(plain_a[k:n]):.3f}")
    print(f"Ray Train loop: {overhead:.3f}x the plain loop's time per token (goal <= 1.10); ADLM/MDLM time per "
          f"token {adlm_time:.3f} (median of paired windows); total {time.perf_counter() - t0:.0f} s")
    result("ray_train_overhead", overhead)
    result("adlm_over_mdlm_train_time", adlm_time)


if __name__ == "__main__":
    main()
