"""Does the data path keep up with the training step? The loop's optimiser step fed by Ray Data against the same
step fed from memory, in one process, on the demo recipe and its embedded data (prepared once under
``--workdir``, as ``train_throughput.py`` does).

- Ray Data: the training split read as the trainer reads it (``pipelines.data.ray_source.split_dataset``, block
  order seeded), streamed by the loop's ``batch_stream`` (``iter_torch_batches`` with its prefetch and local
  shuffle buffer) into the loop's ``optimiser_step``.
- Memory: the same number of micro-batches taken from that stream beforehand, fed to the same ``optimiser_step``
  from a list.

Both run on one worker built by the loop's ``build`` (no Ray Train: the step is what is timed, its results read
after each), step by step alternately, so that a change of load on the cores hits both; the first ``--skip`` of
each are left out (allocation, Ray Data's first reads). ``RESULT data_path_step_ratio`` = median step time fed by
Ray Data / median step time fed from memory (goal <= 1.05); ``data_path_paired_step_ratio``: the median of the
ratios of neighbouring steps (what other work on the cores moves least).

    python benchmarks/data_path.py                     # 30 steps each way, a few minutes on 2 idle cores
    python benchmarks/data_path.py --record            # and a dated record under benchmarks/results/
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import add_argument, recording  # noqa: E402
from _util import result  # noqa: E402

from pipelines.training.config import TrainConfig  # noqa: E402
from pipelines.training.data import DataPlan  # noqa: E402
from pipelines.training.worker import LoopConfig, Worker, build  # noqa: E402

GOAL = 1.05


def build_worker(cfg: TrainConfig, plan: DataPlan, threads: int) -> Worker:
    lc = LoopConfig(cfg=cfg, run_id=None, tracking_uri="sqlite:///unused.db", val_split=plan.val_split,
                    val_rows=plan.val_rows, manifest_hash=plan.manifest_hash, tokenizer_spec=plan.tokenizer_spec,
                    tokenizer_path=None, tokenizer_hash="", threads=threads, local_mode=True, run_dir="unused",
                    resume_dir=None)
    torch.set_num_threads(threads)
    return build(lc, rank=0, world=1, device=torch.device("cpu"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="timed optimiser steps each way, alternating step by "
                                                          "step (default 30)")
    ap.add_argument("--skip", type=int, default=3, help="leading steps each way left out (default 3)")
    ap.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)),
                    help="torch threads of the step (default: 2, or 1 on one core)")
    ap.add_argument("--kind", default="adlm", help="model.kind of the demo recipe (default adlm)")
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"), help="the recipe (default demo.yaml)")
    ap.add_argument("--workdir", default=str(ROOT / "work" / "bench-train"),
                    help="holds the prepared demo data, reused between runs (default work/bench-train)")
    add_argument(ap)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.skip < 0 or args.threads < 1:
        print("error: --steps and --threads must be >= 1, --skip >= 0", file=sys.stderr)
        return 2
    for k, v in {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true",
                 "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}.items():
        os.environ.setdefault(k, v)
    from adlm_model.config import ConfigError
    from pipelines.training.config import load_config

    try:
        cfg = load_config(args.config, [f"model.kind={args.kind}", "scaling.num_workers=0",
                                        f"run.max_steps={10 ** 6}", "run.log_every=1000000"])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with recording("data_path", args.record) as rec:
        ratio = run(args, cfg)
        rec.note(f"{args.steps} steps each way after {args.skip} left out, alternating, {args.threads} torch threads, "
                 f"kind {args.kind}, micro-batch {cfg.batch.micro_batch} x accumulation {cfg.accumulation}.")
    return 0 if ratio == ratio else 1


def run(args: argparse.Namespace, cfg: TrainConfig) -> float:
    import ray
    import ray.data
    from train_throughput import prepare_demo_data

    from pipelines.core.runtime import init_ray
    from pipelines.data.ray_source import split_dataset
    from pipelines.training.data import plan_data
    from pipelines.training.loop import batch_stream, optimiser_step

    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    prepare_demo_data(workdir)
    plan = plan_data(cfg, str(workdir))
    init_ray(num_cpus=args.threads + 1, dashboard=False)
    try:
        ray.data.DataContext.get_current().execution_options.preserve_order = True
        ds = split_dataset(plan.train_manifest, plan.columns, blocks=max(len(plan.train_uris), 2),
                           num_cpus=cfg.data.read_cpus).randomize_block_order(seed=cfg.run.seed)
        w = build_worker(cfg, plan, args.threads)
        streamed = batch_stream(w, ds)
        held = list(itertools.islice(batch_stream(w, ds), 8 * w.accumulation))  # the same batches, read before
        memory = itertools.cycle(held)
        times: dict[str, list[float]] = {"ray": [], "memory": []}
        for i in range(args.skip + args.steps):
            for name, stream in (("ray", streamed), ("memory", memory)):
                t = time.perf_counter()
                optimiser_step(w, stream)
                float(w.window.loss)  # the step's results read: the step is done, as a log line would
                if i >= args.skip:
                    times[name].append(time.perf_counter() - t)
            if i >= args.skip and (i - args.skip + 1) % 5 == 0:
                print(f"step {i - args.skip + 1}/{args.steps}: median so far, Ray Data "
                      f"{statistics.median(times['ray']) * 1e3:.0f} ms, memory "
                      f"{statistics.median(times['memory']) * 1e3:.0f} ms", flush=True)
    finally:
        ray.shutdown()
    ray_s, mem_s = statistics.median(times["ray"]), statistics.median(times["memory"])
    paired = statistics.median(r / m for r, m in zip(times["ray"], times["memory"], strict=True))
    ratio = ray_s / mem_s
    print(f"step fed by Ray Data {ray_s * 1e3:.1f} ms, from memory {mem_s * 1e3:.1f} ms: {ratio:.3f} "
          f"(median of paired steps {paired:.3f}; goal <= {GOAL})", flush=True)
    result("data_path_step_s_ray", ray_s)
    result("data_path_step_s_memory", mem_s)
    result("data_path_step_ratio", ratio)
    result("data_path_paired_step_ratio", paired)
    return ratio


if __name__ == "__main__":
    sys.exit(main())
