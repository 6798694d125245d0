"""Training throughput: the kinds' steps through ``adlm_model.train.train_step.TrainStep``, the largest
batch that fits, the timed steps, the compiled runs, FlexAttention against the dense mask, and each
kind's achieved FLOP/s over the anchor's."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from adlm_model import EMA, build_model
from adlm_model.compat.torch import dynamo_counters
from adlm_model.config import ModelConfig
from adlm_model.kinds import count_parameters
from adlm_model.nn import block_attention as flex
from adlm_model.train.flops import objective_flops
from adlm_model.train.train_step import Objective, TrainStep, fused_adamw, lr_schedule

from .anchor import AnchorObjective, anchor_config
from .context import (
    GOALS,
    KINDS,
    MFU_GOAL,
    Ctx,
    free_memory,
    is_oom,
    random_rows,
)
from .hardware import timed

# --------------------------------------------------------------------------------------------
# Training throughput


def largest_batch(fits: Callable[[int], bool], start: int, cap: int) -> tuple[int, list[int]]:
    """The largest batch for which ``fits`` holds, searched by doubling from ``start`` up to ``cap``; after the
    first failure the midpoint between the last fit and it is tried once. Returns ``(batch, tried)``; batch 0
    when ``start`` does not fit."""
    tried: list[int] = []
    good, b = 0, start
    while b <= cap:
        tried.append(b)
        if not fits(b):
            mid = (good + b) // 2
            if good and good < mid < b and mid % 2 == 0:
                tried.append(mid)
                if fits(mid):
                    good = mid
            break
        good, b = b, b * 2
    return good, tried


@dataclass
class Trainer:
    """One training configuration on the device, stepped by the pipeline's ``TrainStep`` (a constant learning
    rate: the schedule's value does not change the cost). ``objective``: the anchor's (default: ``cfg``'s kind)."""

    ctx: Ctx
    cfg: ModelConfig | None
    compiled: bool = False
    objective: nn.Module | None = None
    step_fn: TrainStep = field(init=False)

    def __post_init__(self) -> None:
        torch.manual_seed(0)
        if self.objective is None:
            self.objective = Objective(build_model(self.cfg), self.cfg)
        self.objective = self.objective.to(self.ctx.device).train()
        model = self.objective.model
        opt = fused_adamw(model.parameters(), lr=3e-4, fused=self.ctx.cuda)
        self.step_fn = TrainStep(self.objective, model, opt, sched=lr_schedule(opt), ema=EMA(model), clip=1.0,
                                 autocast=self.ctx.autocast_dtype, compile=self.compiled,
                                 backend=self.ctx.args.compile_backend)
        self.gen = self.ctx.gen(0)
        self.n = 0

    @property
    def model(self) -> nn.Module:
        return self.objective.model

    @property
    def seq_len(self) -> int:
        return self.cfg.seq_len if self.cfg is not None else self.objective.seq_len

    def rows(self, batch: int) -> torch.Tensor:
        return random_rows(self.cfg or self.objective.cfg, batch, self.ctx.device)

    def step(self, x: torch.Tensor) -> None:
        self.step_fn([(x, None)], step=self.n, generator=self.gen)
        self.n += 1

    def fits(self, batch: int) -> bool:
        """Two steps at ``batch`` (the first allocates the optimiser's state); False on out-of-memory."""
        oom = False
        try:
            x = self.rows(batch)
            for _ in range(2):
                self.step(x)
            self.ctx.sync()
        except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
            if not is_oom(e):
                raise
            oom = True
        if oom:  # out of the except block: the traceback's frames (and their tensors) are gone
            self.step_fn.opt.zero_grad(set_to_none=True)
            free_memory(self.ctx)
        return not oom

    def flops_per_row(self) -> int:
        """FLOPs of one row's forward and backward pass of the objective (eager, attention counted as full), by
        ``torch.utils.flop_counter``: the same count for the kinds and the anchor."""
        x = self.rows(1)
        with self.ctx.autocast():
            flops = objective_flops(self.objective, x, self.objective.draw(x, None, self.ctx.gen(0), True))
        self.step_fn.opt.zero_grad(set_to_none=True)
        return flops




# --------------------------------------------------------------------------------------------
# Timing the steps


def graph_breaks() -> tuple[int, dict[str, int]]:
    """Dynamo's graph breaks so far, in all and by reason (its counters: a private API, so -1 when absent)."""
    try:
        reasons = dict(dynamo_counters()["graph_break"])
    except Exception:  # noqa: BLE001 - diagnostics only
        return -1, {}
    return sum(reasons.values()), reasons


def timed_steps(ctx: Ctx, tr: Trainer, x: torch.Tensor, tried: list[int]) -> tuple[int, list[float], list[int]]:
    """The timed steps on the rows ``x``; where they run out of memory, the same at the next smaller batch the
    search found to fit (else half the batch) until one runs: two steps fitting in the search does not make the
    longer timed run fit (the allocator's cache fragments). Returns (batch, step times, the batches that ran
    out)."""
    ooms: list[int] = []
    while True:
        batch = x.shape[0]
        try:
            ctx.reset_peak()
            return batch, timed(ctx, lambda rows=x: tr.step(rows), repeats=ctx.args.steps,
                                warmup=ctx.sizes.warmup_steps), ooms
        except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
            if not is_oom(e) or batch <= 1:
                raise
        # out of the except block, as in Trainer.fits: the traceback's frames (and their tensors) are gone
        ooms.append(batch)
        below = [b for b in tried if b < batch]
        x = x[: max(below) if below else batch // 2].clone()
        tr.step_fn.opt.zero_grad(set_to_none=True)
        free_memory(ctx)


def figures(ctx: Ctx, tag: str, batch: int, seq_len: int, times: list[float], flops_row: int | None
            ) -> dict[str, Any]:
    """Step time, tokens/s, peak memory and MFU of one timed configuration (RESULT names ``train_*_<tag>``)."""
    step_s = statistics.median(times)
    res: dict[str, Any] = {f"train_batch_{tag}": batch, f"train_step_s_{tag}": step_s,
                           f"train_tokens_per_s_{tag}": batch * seq_len / step_s,
                           f"train_peak_mem_gib_{tag}": ctx.peak_gib()}
    flops_step = flops_row * batch if flops_row else None
    for which in ("measured", "datasheet"):
        peak = ctx.shared.get(f"peak_{which}")
        res[f"train_mfu_{which}_{tag}"] = flops_step / step_s / (peak * 1e12) if flops_step and peak else math.nan
    return res


def train_item(ctx: Ctx, kind: str) -> dict[str, Any]:
    """The eager step (``scaling.compile: off``) at the largest batch that fits (doubling search)."""
    cfg = ctx.train_config(kind)
    tr = Trainer(ctx, cfg)
    detail: dict[str, Any] = {"seq_len": cfg.seq_len, "parameters": count_parameters(tr.model),
                              "dtype": "bf16 autocast" if ctx.autocast_dtype else "float32"}
    batch, tried = largest_batch(tr.fits, ctx.sizes.batch_start, ctx.sizes.batch_cap)
    detail["batches_tried"] = tried
    if batch == 0:
        raise torch.cuda.OutOfMemoryError(f"batch {ctx.sizes.batch_start} does not fit")
    flops_row = tr.flops_per_row()
    ctx.shared[f"flops_row_{kind}"] = flops_row
    batch, times, ooms = timed_steps(ctx, tr, tr.rows(batch), tried)
    if ooms:
        detail["timed_oom_at"] = ooms
    ctx.shared[f"batch_{kind}"] = batch
    res = figures(ctx, kind, batch, cfg.seq_len, times, flops_row)
    ctx.shared[f"step_s_{kind}"] = res[f"train_step_s_{kind}"]
    res[f"train_tflop_per_step_{kind}"] = flops_row * batch / 1e12
    detail.update(step_times_s=times, flops_per_row=flops_row)
    return {"results": res, "detail": detail}


def compiled_run(ctx: Ctx, make: Callable[[], Trainer], tag: str) -> tuple[Trainer, dict[str, Any], dict[str, Any]]:
    """A compiled configuration at ``Sizes.train_batch`` (halved, with a fresh compilation, while it runs out of
    memory): its first step's time (compilation), graph breaks, timed steps and figures."""
    batch = ctx.sizes.train_batch
    ooms: list[int] = []
    while True:
        tr = make()
        x = tr.rows(batch)
        before = graph_breaks()
        try:
            tr.step(x)  # traces and compiles the objective, forward and backward
            ctx.sync()
            ctx.reset_peak()  # the steady steps' peak, not the compilation's
            times = timed(ctx, lambda tr=tr, x=x: tr.step(x), repeats=ctx.args.steps, warmup=ctx.sizes.warmup_steps)
            break
        except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
            if not is_oom(e) or batch <= 1:
                raise
        ooms.append(batch)
        del tr, x
        free_memory(ctx)
        batch //= 2
    after = graph_breaks()
    new = {k: n - before[1].get(k, 0) for k, n in after[1].items() if n > before[1].get(k, 0)}
    flops_row = tr.flops_per_row()
    res = figures(ctx, tag, batch, tr.seq_len, times, flops_row)
    res[f"train_graph_breaks_{tag}"] = after[0] - before[0] if after[0] >= 0 else math.nan
    res[f"train_compile_s_{tag}"] = tr.step_fn.compile_s
    detail = {"seq_len": tr.seq_len, "parameters": count_parameters(tr.model), "compile_backend":
              ctx.args.compile_backend, "graph_break_reasons": {k[:300]: n for k, n in new.items()},
              "step_times_s": times, "flops_per_row": flops_row, "eager_micro_batches":
              tr.step_fn.eager_micro_batches, **({"oom_at": ooms} if ooms else {})}
    return tr, res, detail


def anchor_at(ctx: Ctx, cfg: ModelConfig, batch: int) -> dict[str, Any]:
    """The anchor's figures at ``cfg``'s length and ``batch`` (measured once per (length, batch), kept in
    ``ctx.shared`` so that a resumed run reuses them)."""
    key = f"anchor_{cfg.seq_len}x{batch}"
    if key not in ctx.shared:
        acfg = anchor_config(ctx, cfg)
        sizes = ctx.sizes
        ctx.sizes = dataclasses.replace(sizes, train_batch=batch)
        try:
            tr, res, detail = compiled_run(ctx, lambda: Trainer(ctx, None, True, AnchorObjective(acfg)), "anchor")
        finally:
            ctx.sizes = sizes
        ctx.shared[key] = {"batch": res["train_batch_anchor"], "step_s": res["train_step_s_anchor"],
                           "flops_row": detail["flops_per_row"], "compile_s": res["train_compile_s_anchor"],
                           "graph_breaks": res["train_graph_breaks_anchor"], "mfu": res["train_mfu_measured_anchor"],
                           "peak_mem_gib": res["train_peak_mem_gib_anchor"],
                           "tokens_per_s": res["train_tokens_per_s_anchor"], "parameters": detail["parameters"]}
        del tr
        free_memory(ctx)
    return ctx.shared[key]


def anchor_item(ctx: Ctx) -> dict[str, Any]:
    """The anchor at the kinds' length and ``Sizes.train_batch``."""
    a = anchor_at(ctx, ctx.train_config("mdlm" if "mdlm" in KINDS else next(iter(KINDS))), ctx.sizes.train_batch)
    return {"results": {"anchor_batch": a["batch"], "anchor_step_s": a["step_s"],
                        "anchor_tokens_per_s": a["tokens_per_s"], "anchor_mfu_measured": a["mfu"],
                        "anchor_compile_s": a["compile_s"], "anchor_graph_breaks": a["graph_breaks"]},
            "detail": {**a, "model": "pre-LN, fused qkv, SDPA (bidirectional), tied embeddings, whole-model "
                                     "torch.compile, next-token cross-entropy in float32"}}


def top_kernels(ctx: Ctx, fn: Callable[[], object], steps: int = 2, n: int = 15) -> list[dict[str, Any]]:
    """The ``n`` kernels (operators on a CPU) of most device time over ``steps`` calls of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    fn()
    ctx.sync()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        ctx.sync()

    def device_us(e: Any) -> float:
        if ctx.cuda:
            return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))
        return float(e.self_cpu_time_total)

    events = [e for e in prof.key_averages() if device_us(e) > 0]
    total = sum(device_us(e) for e in events) or 1.0
    events.sort(key=device_us, reverse=True)
    return [{"name": e.key[:160], "ms_per_step": device_us(e) / 1e3 / steps, "share": device_us(e) / total,
             "calls_per_step": e.count / steps} for e in events[:n]]


def compiled_item(ctx: Ctx, kind: str) -> dict[str, Any]:
    """The pipeline's step compiled (``scaling.compile: auto`` on CUDA) and its ratio to the anchor's at the
    same length and batch: ``train_over_anchor_<kind>``, the goal met or not; a miss keeps a profile."""
    cfg = ctx.train_config(kind)
    tag = f"compiled_{kind}"
    tr, res, detail = compiled_run(ctx, lambda: Trainer(ctx, cfg, True), tag)
    batch = res[f"train_batch_{tag}"]
    ctx.shared[f"batch_{tag}"] = batch
    ctx.shared[f"step_s_{tag}"] = res[f"train_step_s_{tag}"]
    ctx.shared.setdefault(f"flops_row_{kind}", detail["flops_per_row"])
    kind_rate = detail["flops_per_row"] * batch / res[f"train_step_s_{tag}"]
    x = tr.rows(batch)
    if f"anchor_{cfg.seq_len}x{batch}" not in ctx.shared:  # the anchor compiles next: the kind's memory goes first
        del tr
        free_memory(ctx)
        tr = None
    a = anchor_at(ctx, cfg, batch)
    ratio = kind_rate / (a["flops_row"] * a["batch"] / a["step_s"])
    goal = GOALS.get(kind, 1.0)
    mfu_goal = MFU_GOAL.get(kind)
    mfu = res[f"train_mfu_measured_{tag}"]
    met = ratio >= goal and (mfu_goal is None or (math.isfinite(mfu) and mfu >= mfu_goal))
    res[f"train_over_anchor_{kind}"] = ratio
    res[f"train_goal_met_{kind}"] = int(met)
    detail["anchor"] = a
    detail["goal"] = {"train_over_anchor": goal, **({"mfu_measured": mfu_goal} if mfu_goal else {})}
    if ctx.args.profile == "always" or (not met and ctx.args.profile == "miss"):
        if tr is None:
            tr = Trainer(ctx, cfg, True)
        detail["top_kernels"] = top_kernels(ctx, lambda: tr.step(x))
    return {"results": res, "detail": detail}


def flex_item(ctx: Ctx) -> dict[str, Any]:
    """BD3-LM's attention over ``[x_t ; x_0]`` (2L positions) at the compiled items' batch: FlexAttention with its
    block mask against SDPA with the dense mask, compiled forward and backward on CUDA (forward only on a CPU,
    where FlexAttention has no backward); the two outputs compared."""
    cfg = ctx.train_config("bd3lm")
    n, b, heads, dim = 2 * cfg.seq_len, ctx.sizes.train_batch, cfg.heads, cfg.hidden // cfg.heads
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    g = torch.Generator(ctx.device).manual_seed(0)
    q, k, v = (torch.randn(b, heads, n, dim, generator=g, device=ctx.device, dtype=dtype).requires_grad_(ctx.cuda)
               for _ in range(3))
    block = flex.flex_block_mask(cfg.seq_len, cfg.block_size, ctx.device)
    dense = flex.block_diff_mask(cfg.seq_len, cfg.block_size, ctx.device)
    from torch.nn.attention.flex_attention import flex_attention

    fns = {"flex": torch.compile(lambda: flex_attention(q, k, v, block_mask=block), backend=ctx.args.compile_backend),
           "dense": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)}
    outs, ms = {}, {}
    for name, fn in fns.items():
        def run(fn: Callable[[], torch.Tensor] = fn) -> torch.Tensor:
            o = fn()
            if ctx.cuda:
                o.sum().backward()
            return o.detach()

        outs[name] = run()
        ms[name] = statistics.median(timed(ctx, run, repeats=5, warmup=1)) * 1e3
    diff = float((outs["flex"].float() - outs["dense"].float()).abs().max())
    return {"results": {"flex_ms_bd3lm": ms["flex"], "dense_ms_bd3lm": ms["dense"],
                        "flex_speedup_bd3lm": ms["dense"] / ms["flex"], "flex_max_abs_diff_bd3lm": diff},
            "detail": {"batch": b, "positions": n, "heads": heads, "head_dim": dim, "dtype": str(dtype),
                       "backward": ctx.cuda, "block_size": cfg.block_size}}


def adlm_over_mdlm(ctx: Ctx) -> dict[str, Any]:
    s = ctx.shared
    need = ("flops_row_adlm", "flops_row_mdlm", "step_s_adlm", "step_s_mdlm", "batch_adlm", "batch_mdlm")
    if not all(k in s for k in need):
        raise RuntimeError("needs train_mdlm and train_adlm to have run: " + ", ".join(k for k in need if k not in s))

    def per_row(tag: str, kind: str) -> float | None:
        return s[f"step_s_{tag}"] / s[f"batch_{kind}"] if f"step_s_{tag}" in s and f"batch_{kind}" in s else None

    flop_ratio = s["flops_row_adlm"] / s["flops_row_mdlm"]
    eager = per_row("adlm", "adlm") / per_row("mdlm", "mdlm")
    comp_a, comp_m = per_row("compiled_adlm", "compiled_adlm"), per_row("compiled_mdlm", "compiled_mdlm")
    comp = comp_a / comp_m if comp_a and comp_m else math.nan
    return {"results": {"adlm_over_mdlm_time_ratio": eager, "adlm_over_mdlm_time_ratio_compiled": comp,
                        "adlm_over_mdlm_flop_ratio": flop_ratio},
            "detail": {"per_row": "time per row (step time / batch); each kind at its own largest batch"}}
