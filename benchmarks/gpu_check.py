"""The GPU check: the training step of every kind measured against a plain transformer in the same run, with the
correctness of the bf16 step, of BD3-LM's compiled step (FlexAttention) against its eager one (the dense mask), of
the samplers' cached paths, and the sampling speed; ``RESULT name=value`` lines and
``DIR/gpu_check.json``. ``--help`` lists the options, ``--list`` the items and their RESULT names.

The kinds train through the pipeline's own step (``adlm_model.train.train_step.TrainStep``: the objective compiled with
the noise drawn outside it, bf16 autocast, fused AdamW, clipping, EMA). The anchor is a GPT-2-small-shaped
transformer written here (pre-LN, fused qkv, SDPA, tied embeddings, bidirectional, the whole model compiled) at
each kind's length and batch; ``train_over_anchor_<kind>`` is the kind's achieved FLOP/s over the anchor's, both
counted by ``torch.utils.flop_counter``. Goals (``GOALS``): at least 1.0 for MDLM and AR, 0.95 for ADLM, SEDD and A2R,
0.85 for BD3-LM, and MDLM at 55% of the measured matmul peak; a kind that misses gets a profiler table of its top
kernels in the JSON.

Imports only the standard library, torch, ``adlm_model``, ``benchmarks/_record.py`` (standard library) and its
items (``benchmarks/gpu_check_parts/``), so it runs on a machine that has nothing but torch. Every item is guarded (a failure or an out-of-memory error is
recorded and the run goes on), ``--budget-s`` skips what no longer fits, ``--resume`` keeps an earlier run's
finished items, and every RESULT name is printed on every run (``nan`` where an item did not run).

This file is the command: the items' table (``ITEMS``, ``RESULT_NAMES``), the guarded runner and the report. The
items live by family in ``benchmarks/gpu_check_parts/``: ``context`` (settings, sizes, the run's context),
``hardware`` (environment, matmul peak), ``correctness`` (bf16, compiled, cached samplers, attention kernels),
``anchor`` (the plain transformer), ``training`` (throughput, compiled runs, ratios), ``sampling`` (sampling speed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fnmatch
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
from _record import add_argument, recording  # noqa: E402
from gpu_check_parts.context import (  # noqa: E402
    FULL,
    GOALS,
    KINDS,
    MFU_GOAL,
    SAMPLER_OPTIONS,
    TINY,
    TRAINED,
    CheckFailed,
    Ctx,
    free_memory,
    is_oom,
)
from gpu_check_parts.correctness import (  # noqa: E402
    attention_item,
    correct_bf16,
    correct_compiled,
    sampler_cache,
    sampler_dual,
    sampler_kv,
)
from gpu_check_parts.hardware import env_item, matmul_peak  # noqa: E402
from gpu_check_parts.sampling import SAMPLE_NEED_S, SAMPLE_RUNS, sample_forward, sample_item  # noqa: E402
from gpu_check_parts.training import adlm_over_mdlm, anchor_item, compiled_item, flex_item, train_item  # noqa: E402

from adlm_model.compat.torch import dynamo_config  # noqa: E402

# --------------------------------------------------------------------------------------------
# The items


@dataclass(frozen=True)
class Item:
    name: str
    run: Callable[[Ctx], dict[str, Any]]
    results: tuple[str, ...]
    need_s: float = 5.0
    """Seconds the item is expected to take on an H200 (an estimate): it starts only while that much of the budget
    is left, so that the run ends near the budget instead of a long item past it."""


def _train_results(tag: str) -> tuple[str, ...]:
    return (f"train_batch_{tag}", f"train_step_s_{tag}", f"train_tokens_per_s_{tag}", f"train_peak_mem_gib_{tag}",
            f"train_mfu_measured_{tag}", f"train_mfu_datasheet_{tag}")


def _items() -> list[Item]:
    """In the order they run: what the goals need first (the peak, the anchor, the compiled kinds), then the eager
    batch search, the correctness of the samplers and the sampling speed."""
    items = [Item("env", env_item, ("env_gpu", "env_torch", "env_cuda", "env_flash_attn")),
             Item("matmul_peak", matmul_peak, ("matmul_peak_tflops", "datasheet_peak_tflops"), need_s=3)]
    for k in TRAINED:
        items.append(Item(f"correct_bf16_{k}", lambda c, k=k: correct_bf16(c, k),
                          (f"correct_bf16_ok_{k}", f"correct_bf16_loss_rel_diff_{k}", f"correct_bf16_grad_cosine_{k}")))
    items.append(Item("anchor", anchor_item, ("anchor_batch", "anchor_step_s", "anchor_tokens_per_s",
                                              "anchor_mfu_measured", "anchor_compile_s", "anchor_graph_breaks"),
                      need_s=45))
    for k in TRAINED:
        items.append(Item(f"train_compiled_{k}", lambda c, k=k: compiled_item(c, k),
                          (*_train_results(f"compiled_{k}"), f"train_graph_breaks_compiled_{k}",
                           f"train_compile_s_compiled_{k}", f"train_over_anchor_{k}", f"train_goal_met_{k}"),
                          need_s=60))
    if "bd3lm" in TRAINED:
        items.append(Item("correct_compiled_bd3lm", correct_compiled,
                          ("correct_compiled_ok_bd3lm", "correct_compiled_loss_rel_diff_bd3lm",
                           "correct_compiled_grad_cosine_bd3lm", "correct_compiled_grad_max_rel_diff_bd3lm"),
                          need_s=60))
        items.append(Item("flex_bd3lm", flex_item, ("flex_ms_bd3lm", "dense_ms_bd3lm", "flex_speedup_bd3lm",
                                                    "flex_max_abs_diff_bd3lm"), need_s=15))
    for k in TRAINED:
        items.append(Item(f"train_{k}", lambda c, k=k: train_item(c, k),
                          (*_train_results(k), f"train_tflop_per_step_{k}"), need_s=25))
    if {"mdlm", "adlm"} <= set(TRAINED):
        items.append(Item("adlm_over_mdlm", adlm_over_mdlm, ("adlm_over_mdlm_time_ratio",
                                                             "adlm_over_mdlm_time_ratio_compiled",
                                                             "adlm_over_mdlm_flop_ratio"), need_s=0))
    attention_names = tuple(f"attention_train_{k}" for k in TRAINED) + (("attention_kv_step_ar",) if "ar" in KINDS
                                                                      else ())
    items.append(Item("attention", attention_item, attention_names, need_s=10))
    for k, kind in KINDS.items():
        items.append(Item(f"sampler_{k}_cache", lambda c, k=k: sampler_cache(c, k), (f"sampler_equal_{k}_cache",),
                          need_s=3))
        if kind.default_sampler in SAMPLER_OPTIONS:
            items.append(Item(f"sampler_{k}_dual", lambda c, k=k: sampler_dual(c, k), (f"sampler_equal_{k}_dual",),
                              need_s=3))
        if kind.default_sampler == "bd3lm":
            items.append(Item(f"sampler_{k}_kv", lambda c, k=k: sampler_kv(c, k), (f"sampler_equal_{k}_kv",),
                              need_s=3))
    items.append(Item("sample_forward", sample_forward, ("sample_forward_ms_fp32", "sample_forward_ms_bf16")))
    for which, (kind, _, _) in SAMPLE_RUNS.items():
        if kind in KINDS:
            items.append(Item(f"sample_{which}", lambda c, w=which: sample_item(c, w),
                              (f"sample_tokens_per_s_{which}", f"sample_network_calls_{which}",
                               f"sample_ms_per_call_{which}"), need_s=SAMPLE_NEED_S[which]))
    return items


ITEMS: tuple[Item, ...] = tuple(_items())
RESULT_NAMES: tuple[str, ...] = tuple(n for item in ITEMS for n in item.results)
"""Every RESULT name a run prints, on a GPU and with ``--tiny`` alike (``nan`` where an item did not run)."""
assert len(set(RESULT_NAMES)) == len(RESULT_NAMES), "RESULT names must be unique"


# --------------------------------------------------------------------------------------------
# The runner


def fmt(v: Any) -> str:
    if v is None:  # a nan read back from JSON (--resume)
        return "nan"
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no nan: null
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [jsonable(x) for x in v]
    return v


def write_report(path: Path, report: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(jsonable(report), indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)  # never a half-written file, even when the run is killed mid-write


def selected(name: str, only: list[str], skip: list[str]) -> bool:
    if only and not any(fnmatch.fnmatch(name, p) for p in only):
        return False
    return not any(fnmatch.fnmatch(name, p) for p in skip)


def run_item(ctx: Ctx, item: Item) -> dict[str, Any]:
    """Runs one item, guarded: a record with status, seconds, results and detail (or the error)."""
    t, cpu = time.perf_counter(), time.process_time()
    shared_before = dict(ctx.shared)
    rec: dict[str, Any] = {"status": "ok"}
    try:
        if item.name in ctx.args.inject_failure:
            raise RuntimeError(f"failure injected by --inject-failure {item.name}")
        out = item.run(ctx)
        rec["results"], rec["detail"] = out["results"], out.get("detail", {})
    except CheckFailed as e:
        rec["status"] = "check_failed"
        with contextlib.suppress(Exception):
            rec.update(json.loads(str(e)))
    except Exception as e:  # noqa: BLE001 - every failure is recorded and the run goes on
        rec.update(status="oom" if is_oom(e) else "failed", error=f"{type(e).__name__}: {str(e)[:1000]}",
                   trace=traceback.format_exc(limit=-6).splitlines()[-24:])
    rec["seconds"] = round(time.perf_counter() - t, 3)
    rec["cpu_seconds"] = round(time.process_time() - cpu, 3)  # this process's CPU time (all threads)
    # What the item handed on to later ones (batch, FLOPs, step time, peaks): --resume hands it on again.
    rec["shared"] = {k: v for k, v in ctx.shared.items() if k not in shared_before or shared_before[k] != v}
    unknown = set(rec.get("results", {})) - set(item.results)
    if unknown:  # an item printing a name RESULT_NAMES lacks would make the GPU and tiny runs differ
        rec.update(status="failed", error=f"results not declared in the item: {sorted(unknown)}")
    free_memory(ctx)
    return rec


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="On a GPU: timeout 480 python benchmarks/gpu_check.py --out DIR --record DIR "
                                        "(the goals' items first; --resume DIR/gpu_check.json runs the rest). On a "
                                        "CPU: --device cpu --tiny (every code path at toy sizes, seconds).")
    ap.add_argument("--out", default="gpu_check_out",
                    help="folder for gpu_check.json (created; the file is rewritten after every item)")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (only with --tiny)")
    ap.add_argument("--tiny", action="store_true",
                    help="toy sizes: every code path in seconds (module docstring says what it checks)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="seconds after which the items left are skipped (default 420: fits 8 minutes with "
                         "start-up; give the outer `timeout` a minute more). 0: only env runs")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed training steps a configuration (median reported; default 8, tiny 2)")
    ap.add_argument("--only", default="", help="comma-separated item names or fnmatch patterns to run (env always)")
    ap.add_argument("--skip", default="", help="comma-separated item names or patterns to leave out "
                                               "(e.g. a second try: the items the first one finished)")
    ap.add_argument("--resume", default=None, metavar="JSON",
                    help="a gpu_check.json of an earlier run: its ok items are kept (and their RESULT lines "
                         "printed) instead of run again, except those --only names; the rest run (a second try), "
                         "fed with what the kept items measured (the eager batches and FLOPs, the matmul peak)")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend of the compiled items (default inductor; on a CPU eager: dynamo "
                         "alone, which decides the graph breaks and recompiles, in seconds)")
    add_argument(ap)
    ap.add_argument("--profile", choices=("miss", "always", "never"), default="miss",
                    help="a profiler table of the top kernels of a compiled kind: when it misses its goal (default), "
                         "always, or never")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's; the suite's test uses 1 on its shared cores)")
    ap.add_argument("--list", action="store_true", help="print the items and their RESULT names, and exit")
    ap.add_argument("--strict", action="store_true",
                    help="exit 1 unless every selected item has status ok (the suite's test uses it)")
    ap.add_argument("--inject-failure", default="",
                    help="comma-separated item names made to raise at their start (checks the guard; tests)")
    args = ap.parse_args(argv)
    args.only = [s for s in args.only.split(",") if s]
    args.skip = [s for s in args.skip.split(",") if s]
    args.inject_failure = [s for s in args.inject_failure.split(",") if s]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    code = check_args(args)
    if code is not None:
        return code
    with recording("gpu_check", args.record, command=["python", "benchmarks/gpu_check.py", *args.argv]) as rec:
        code = run(args)
        rec.add_raw(Path(args.out) / "gpu_check.json")
        if args.resume:
            rec.note(f"Items kept from {args.resume} are marked resumed_from in the JSON.")
    return code


def check_args(args: argparse.Namespace) -> int | None:
    """Exit code 2 with one line on stderr for arguments that cannot run, before anything is written."""
    if args.list:
        for item in ITEMS:
            print(f"{item.name}: {', '.join(item.results)}")
        return 0
    try:
        device = torch.device(args.device)
    except RuntimeError:
        print(f"error: --device {args.device!r} is not a device: use cuda, cuda:N or cpu", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: CUDA is not available here (torch " f"{torch.__version__}): run with --device cpu --tiny to "
              "check the code paths", file=sys.stderr)
        return 2
    if device.type not in ("cuda", "cpu"):
        print(f"error: --device {args.device!r}: use cuda, cuda:N or cpu", file=sys.stderr)
        return 2
    if device.type == "cpu" and not args.tiny:
        print("error: --device cpu needs --tiny (the papers' sizes take hours on a CPU)", file=sys.stderr)
        return 2
    unknown = [p for p in args.only + args.skip + args.inject_failure
               if not any(fnmatch.fnmatch(i.name, p) for i in ITEMS)]
    if unknown:
        print(f"error: no item matches {', '.join(unknown)}: --list names them", file=sys.stderr)
        return 2
    if args.budget_s < 0:
        print(f"error: --budget-s must be >= 0, got {args.budget_s}", file=sys.stderr)
        return 2
    if args.steps is None:
        args.steps = 2 if args.tiny else 8
    if args.steps < 1:
        print(f"error: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    if args.threads is not None:
        if args.threads < 1:
            print(f"error: --threads must be >= 1, got {args.threads}", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    if args.compile_backend is None:
        args.compile_backend = "eager" if device.type == "cpu" else "inductor"
    args.device_obj = device
    if args.resume:
        try:
            old = json.loads(Path(args.resume).read_text())
            args.previous = {n: r for n, r in old["items"].items() if r.get("status") == "ok" and n != "env"}
        except (OSError, ValueError, KeyError, AttributeError) as e:
            print(f"error: --resume {args.resume}: not a gpu_check.json ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
    else:
        args.previous = {}
    return None


def run(args: argparse.Namespace) -> int:
    """The items, in order, within the budget; the JSON rewritten after each."""
    device: torch.device = args.device_obj
    # Every kind's objective is one more compiled entry of the same forward: room for all of them and the retries.
    config = dynamo_config()
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(config, name):
            setattr(config, name, 64)
    previous: dict[str, Any] = args.previous
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_check.json"

    t0 = time.perf_counter()
    ctx = Ctx(args=args, device=device, sizes=TINY if args.tiny else FULL, t0=t0)
    report: dict[str, Any] = {
        "schema": 1, "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": args.argv, "budget_s": args.budget_s, "finished": False,
        "sizes": dataclasses.asdict(ctx.sizes), "goals": {"train_over_anchor": GOALS, "mfu_measured": MFU_GOAL},
        "items": {},
        # The three facts every figure needs, outside any item (the env item adds the rest).
        "torch": torch.__version__, "cuda": torch.version.cuda, "gpu": None,
    }
    if ctx.cuda:
        with contextlib.suppress(Exception):
            report["gpu"] = torch.cuda.get_device_name(device)
    write_report(path, report)
    printed: set[str] = set()
    for rec in previous.values():  # what the earlier items handed on (batches, FLOPs, peaks), whatever runs now
        ctx.shared.update(rec.get("shared", {}))
    for item in ITEMS:
        chosen = item.name == "env" or selected(item.name, args.only, args.skip)
        elapsed = time.perf_counter() - t0
        need = item.need_s * ctx.sizes.need_scale
        if item.name in previous and not (chosen and args.only):
            # Kept from the earlier run, unless --only asks for it again (a rerun with other settings).
            rec = {**previous[item.name], "resumed_from": args.resume}
        elif not chosen:
            continue
        elif item.name != "env" and args.budget_s - elapsed < max(need, 1e-9):
            rec = {"status": "skipped", "reason": f"budget: {elapsed:.0f} of {args.budget_s:.0f} s spent, "
                                                  f"the item needs about {need:.0f} s"}
        else:
            print(f"# {item.name} ...", flush=True)
            rec = run_item(ctx, item)
            if rec["status"] != "ok":
                print(f"# {item.name}: {rec['status']} {rec.get('error', '')}", flush=True)
        report["items"][item.name] = rec
        if item.name == "env" and "detail" in rec:
            report["env"] = rec["detail"]
        for name in item.results:
            v = rec.get("results", {}).get(name, math.nan)
            print(f"RESULT {name}={fmt(v)}", flush=True)
            printed.add(name)
        report["elapsed_s"] = round(time.perf_counter() - t0, 2)
        write_report(path, report)
    for name in RESULT_NAMES:  # items not selected: their names all the same, so every run prints the whole set
        if name not in printed:
            print(f"RESULT {name}=nan", flush=True)
    report["finished"] = True
    report["elapsed_s"] = round(time.perf_counter() - t0, 2)
    statuses = [r["status"] for r in report["items"].values()]
    report["summary"] = {s: statuses.count(s) for s in sorted(set(statuses))}
    write_report(path, report)
    print(f"# {path}: {report['summary']} in {report['elapsed_s']:.1f} s", flush=True)
    return 1 if args.strict and any(s != "ok" for s in statuses) else 0


if __name__ == "__main__":
    sys.exit(main())
