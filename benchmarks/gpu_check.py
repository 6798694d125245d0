"""The GPU check: the training step of every kind measured against a plain transformer in the same run, with the
correctness of the bf16 step, of BD3-LM's compiled step (FlexAttention) against its eager one (the dense mask), of
the samplers' cached paths, and the sampling speed; ``RESULT name=value`` lines and
``DIR/gpu_check.json``. ``--help`` lists the options, ``--list`` the items and their RESULT names.

The kinds train through the pipeline's own step (``adlm_model.train.train_step.TrainStep``: the objective compiled with
the noise drawn outside it, bf16 autocast, fused AdamW, clipping, EMA). The anchor is a GPT-2-small-shaped
transformer written here (pre-LN, fused qkv, SDPA, tied embeddings, bidirectional, the whole model compiled) at
each kind's length and batch; ``train_over_anchor_<kind>`` is the kind's achieved FLOP/s over the anchor's, both
counted by ``torch.utils.flop_counter``. Goals (``GOALS``): at least 1.0 for MDLM and AR, 0.95 for ADLM and SEDD,
0.85 for BD3-LM, and MDLM at 55% of the measured matmul peak; a kind that misses gets a profiler table of its top
kernels in the JSON.

Imports only the standard library, torch, ``adlm_model`` and ``benchmarks/_record.py`` (standard library), so it
runs on a machine that has nothing but torch. Every item is guarded (a failure or an out-of-memory error is
recorded and the run goes on), ``--budget-s`` skips what no longer fits, ``--resume`` keeps an earlier run's
finished items, and every RESULT name is printed on every run (``nan`` where an item did not run).

Longer than 500 lines because it is the one file to copy to a GPU machine beside ``adlm_model/``: the items, the
anchor, the guarded runner and the report stay together.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import fnmatch
import gc
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _record import add_argument, recording  # noqa: E402

from adlm_model import EMA, build_model, compute_loss, preset, sample  # noqa: E402
from adlm_model.config import ModelConfig  # noqa: E402
from adlm_model.kinds import KINDS, count_parameters  # noqa: E402
from adlm_model.nn import block_attention as flex  # noqa: E402
from adlm_model.nn.attention import flash_available  # noqa: E402
from adlm_model.objectives.losses import LossOutput  # noqa: E402
from adlm_model.train.flops import objective_flops  # noqa: E402
from adlm_model.train.train_step import Objective, TrainStep, draw_noise, fused_adamw, lr_schedule  # noqa: E402

KINDS = {k: v for k, v in KINDS.items() if not v.sample_only}  # the trained kinds (SSD-LM is sample-only)
TRAINED = tuple(k for k, v in KINDS.items() if v.train_objective is not None)
"""The kinds that train (a kind of ``adlm_model.kinds.KINDS`` added later is covered without touching this file)."""
GOALS = {"mdlm": 1.0, "ar": 1.0, "adlm": 0.95, "sedd": 0.95, "bd3lm": 0.85}
"""The least ``train_over_anchor_<kind>`` each kind should reach (a kind not named: 1.0)."""
MFU_GOAL = {"mdlm": 0.55}
"""The least MFU of the measured matmul peak."""

DATASHEET_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0), ("A100", 312.0))
"""Dense bf16 tensor-core peaks by GPU name (first match wins; the SXM parts where no form factor is named)."""

LOSS_REL_TOL = 0.01
GRAD_COSINE_MIN = 0.995
COMPILED_LOSS_REL_TOL = 1e-5
COMPILED_GRAD_COSINE_MIN = 0.9999
COMPILED_GRAD_MAX_REL_TOL = 1e-3
"""The compiled BD3-LM objective against the eager one, both float32 without TF32 (``correct_compiled``): the
difference is rounding (inductor on a CPU: at most 2.3e-7 of the loss, 7e-7 of the largest gradient); a
miscompiled FlexAttention (its inputs' layout, torch 2.13 on a CPU) put the loss 5.7e-5 to 4.5e-4 off."""
SAMPLER_OPTIONS = {"mdlm", "remdm-loop"}
"""Default samplers whose networks the confidence sampler's dual cache applies to (MDLM-style bidirectional DiTs)."""

ATTENTION_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "cpu",
    "flash_attn::_flash_attn_forward": "flash-attn",
}
"""Profiler operator names of the attention kernels and the name this script reports them by."""


# --------------------------------------------------------------------------------------------
# Sizes


@dataclass(frozen=True)
class Sizes:
    """What each item runs at: the papers' sizes on a GPU, toy sizes with ``--tiny``."""

    train: dict[str, Any]
    """Preset overrides of the training / correctness configurations (on the ``small`` preset)."""
    micro: dict[str, Any]
    """The sampler equalities' two-block model (tests/support_models.py's ``micro``)."""
    correct_rows: int
    train_batch: int
    """The compiled items' and the anchor's batch (halved on out-of-memory)."""
    batch_start: int
    batch_cap: int
    warmup_steps: int
    sample_len: int
    sample_batch: int
    sample_steps: int
    confidence_block: int
    matmul_n: int
    need_scale: float
    """Multiplies each item's ``need_s`` (1 at the papers' sizes; 0 with ``--tiny``: a budget left starts any)."""


FULL = Sizes(train={}, micro=dict(hidden=32, heads=2, n_blocks=2, denoiser_blocks=1, cond_dim=16, vocab_size=48,
                                  mask_id=48, seq_len=24, block_size=4, dropout=0.0),
             correct_rows=2, train_batch=64, batch_start=8, batch_cap=512, warmup_steps=2, sample_len=1024, sample_batch=16,
             sample_steps=1024, confidence_block=32, matmul_n=8192, need_scale=1.0)
TINY = dataclasses.replace(
    FULL, train=dict(hidden=32, heads=2, n_blocks=2, denoiser_blocks=1, cond_dim=16, vocab_size=64, mask_id=64,
                     seq_len=32),
    correct_rows=2, train_batch=2, batch_start=1, batch_cap=2, warmup_steps=1, sample_len=16, sample_batch=2, sample_steps=16,
    confidence_block=8, matmul_n=128, need_scale=0.0)


# --------------------------------------------------------------------------------------------
# The run's context


class CheckFailed(Exception):
    """A correctness check that did not hold (the item's figures are kept)."""


@dataclass
class Ctx:
    args: argparse.Namespace
    device: torch.device
    sizes: Sizes
    t0: float
    shared: dict[str, Any] = field(default_factory=dict)
    """Figures items hand on (the anchor's figures to the kinds, step times to the ratios, the peaks to MFU)."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def gen(self, seed: int) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(seed)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """bf16: the training loop's on CUDA; on a CPU only at ``--tiny``'s toy sizes, where it costs little and
        runs the bf16 code paths (at a real size a bf16 step is ~19x slower than float32 there)."""
        return torch.bfloat16 if self.cuda or self.args.tiny else None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def train_config(self, kind: str, **kw: Any) -> ModelConfig:
        return preset("small", kind=kind, **{**self.sizes.train, **kw})

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float:
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else math.nan


@contextlib.contextmanager
def matmul_precision(p: str) -> Iterator[None]:
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(p)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def randomize(model: nn.Module, std: float, seed: int = 0) -> nn.Module:
    """Every parameter drawn N(0, std^2) from a CPU generator (the same weights on every device): the
    zero-initialised output and adaLN layers would otherwise make every loss log V."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def random_rows(cfg: ModelConfig, rows: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=g)
    x[x == cfg.mask_id] = (cfg.mask_id + 1) % cfg.vocab_size  # data never holds the mask token
    return x.to(device)


def is_oom(e: BaseException) -> bool:
    """Out of device memory, also where a kernel reports it as a plain RuntimeError (cuBLAS, cuDNN workspaces)."""
    msg = str(e)
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in msg or "ALLOC_FAILED" in msg


def free_memory(ctx: Ctx) -> None:
    """Give the device's cached memory back between items (an item's reference cycles first). Not on a CPU:
    nothing to give back, and a full collection with torch loaded costs tenths of a second."""
    if ctx.cuda:
        gc.collect()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# Correctness


def correctness_network(ctx: Ctx, kind: str) -> tuple[ModelConfig, nn.Module]:
    """The correctness items' network (``--tiny``: the micro one, on the CPU) with random weights, std 0.02, the
    zero-initialised layers included; LayerNorm weights 1 (drawn around 0 they would scale the residual stream
    down to nothing)."""
    cfg = ctx.train_config(kind, dropout=0.0)
    if ctx.args.tiny:
        cfg = cfg.replace(**{k: v for k, v in ctx.sizes.micro.items() if k != "dropout"})
    torch.manual_seed(0)
    base = randomize(build_model(cfg), std=0.02)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("norm_final.weight"):
                p.fill_(1.0)
    return cfg, base


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])


def correct_bf16(ctx: Ctx, kind: str) -> dict[str, Any]:
    """The training step (``TrainStep``, eager) under bf16 autocast against float32 on one fixed batch and noise
    draw, on a network with random weights (std 0.02, the zero-initialised layers included; LayerNorm weights 1):
    loss and gradients finite, ``|loss_bf16 / loss_fp32 - 1| <= LOSS_REL_TOL``, their cosine
    ``>= GRAD_COSINE_MIN``, the parameters and a second loss finite after the step. Float32 without TF32."""
    cfg, base = correctness_network(ctx, kind)
    x = random_rows(cfg, ctx.sizes.correct_rows, ctx.device)
    grads: dict[str, torch.Tensor] = {}
    losses: dict[str, float] = {}
    for dtype in ("fp32", "bf16"):
        model = copy.deepcopy(base).to(ctx.device).train()
        # On a CPU the bf16 step is autocast too: at these micro sizes it costs milliseconds.
        opt = fused_adamw(model.parameters(), lr=3e-4, fused=False)
        step = TrainStep(Objective(model, cfg), model, opt, clip=1.0,
                         autocast=torch.bfloat16 if dtype == "bf16" else None)
        with matmul_precision("highest"):
            out = step([(x, None)], step=1, generator=ctx.gen(1))
        losses[dtype] = float(out.loss)
        # The gradients as clipped (one factor for every parameter: their cosine is that of the raw ones).
        grads[dtype] = flat_grads(model)
        if dtype == "bf16":
            params_finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
            with torch.no_grad(), step.autocast(ctx.device):
                second = float(compute_loss(model, x, None, cfg, step=2, generator=ctx.gen(1)).loss)
        del model, step, opt
    rel = abs(losses["bf16"] / losses["fp32"] - 1.0)
    cos = float(torch.nn.functional.cosine_similarity(grads["bf16"], grads["fp32"], dim=0))  # float64: no 1.001
    finite = all(math.isfinite(v) for v in losses.values()) and all(bool(torch.isfinite(g).all())
                                                                       for g in grads.values())
    ok = finite and params_finite and math.isfinite(second) and rel <= LOSS_REL_TOL and cos >= GRAD_COSINE_MIN
    res = {f"correct_bf16_ok_{kind}": int(ok), f"correct_bf16_loss_rel_diff_{kind}": rel,
           f"correct_bf16_grad_cosine_{kind}": cos}
    detail = {"loss_fp32": losses["fp32"], "loss_bf16": losses["bf16"], "loss_after_step_bf16": second,
              "finite": finite, "params_finite_after_step": params_finite, "rows": ctx.sizes.correct_rows,
              "seq_len": cfg.seq_len, "parameters": count_parameters(base),
              "tolerances": {"loss_rel": LOSS_REL_TOL, "grad_cosine_min": GRAD_COSINE_MIN}}
    if not ok:
        raise CheckFailed(json.dumps({"results": res, "detail": detail}))
    return {"results": res, "detail": detail}


@contextlib.contextmanager
def flex_attention(mode: str) -> Iterator[None]:
    """BD3-LM's training pass through FlexAttention (``on``) or the dense mask (``off``) for the block."""
    old, flex.FLEX_ATTENTION = flex.FLEX_ATTENTION, mode
    try:
        yield
    finally:
        flex.FLEX_ATTENTION = old


def compiled_figures(loss_c: float, loss_e: float, g_c: torch.Tensor, g_e: torch.Tensor, kind: str
                     ) -> tuple[bool, dict[str, Any]]:
    """The pass rule of ``correct_compiled``: the loss's relative difference, the gradients' cosine and their largest
    difference over the largest eager gradient entry, each within its tolerance, everything finite."""
    rel = abs(loss_c / loss_e - 1.0)
    cos = float(F.cosine_similarity(g_c.double(), g_e.double(), dim=0))
    max_rel = float((g_c - g_e).abs().max() / g_e.abs().max())
    ok = (all(math.isfinite(v) for v in (loss_c, loss_e, rel, cos, max_rel)) and rel <= COMPILED_LOSS_REL_TOL
          and cos >= COMPILED_GRAD_COSINE_MIN and max_rel <= COMPILED_GRAD_MAX_REL_TOL)
    return ok, {f"correct_compiled_ok_{kind}": int(ok), f"correct_compiled_loss_rel_diff_{kind}": rel,
                f"correct_compiled_grad_cosine_{kind}": cos, f"correct_compiled_grad_max_rel_diff_{kind}": max_rel}


def correct_compiled(ctx: Ctx, kind: str = "bd3lm") -> dict[str, Any]:
    """The compiled training step against the eager one on one batch and noise draw (``correct_bf16``'s network),
    both float32 without TF32, the gradients unclipped: BD3-LM's attention through FlexAttention compiled (what
    ``scaling.compile: auto`` trains with on CUDA) against the dense mask eager. Pass rule: ``compiled_figures``.
    On a CPU (``--tiny``), where FlexAttention has no backward, the loss goes through FlexAttention compiled
    forward only and the gradients through the dense mask compiled."""
    cfg, base = correctness_network(ctx, kind)
    x = random_rows(cfg, ctx.sizes.correct_rows, ctx.device)

    def step(compiled: bool, mode: str) -> tuple[float, torch.Tensor]:
        model = copy.deepcopy(base).to(ctx.device).train()
        st = TrainStep(Objective(model, cfg), model, fused_adamw(model.parameters(), lr=0.0, fused=False), clip=0.0,
                       compile=compiled, backend=ctx.args.compile_backend)
        with flex_attention(mode), matmul_precision("highest"):
            loss = float(st([(x, None)], step=1, generator=ctx.gen(1)).loss)
        return loss, flat_grads(model)

    loss_e, g_e = step(False, "off")
    if ctx.cuda:
        loss_c, g_c = step(True, "on")
        paths = "FlexAttention compiled, forward and backward"
    else:
        _, g_c = step(True, "off")
        objective = Objective(copy.deepcopy(base).to(ctx.device).train(), cfg)
        noise = draw_noise(cfg, x, ctx.gen(1))  # TrainStep's own draw from the same seed
        with flex_attention("on"), matmul_precision("highest"), torch.no_grad():
            flex.prepare_block_mask(cfg.seq_len, cfg.block_size, ctx.device)
            fn = torch.compile(objective, backend=ctx.args.compile_backend, dynamic=False)
            loss_c = float(fn(x, None, noise, torch.ones((), dtype=torch.int64, device=ctx.device), True).loss)
        paths = "loss: FlexAttention compiled, forward; gradients: the dense mask compiled"
    ok, res = compiled_figures(loss_c, loss_e, g_c, g_e, kind)
    detail = {"loss_compiled": loss_c, "loss_eager": loss_e, "compiled": paths, "eager": "the dense mask",
              "compile_backend": ctx.args.compile_backend, "rows": ctx.sizes.correct_rows, "seq_len": cfg.seq_len,
              "block_size": cfg.block_size, "parameters": count_parameters(base),
              "tolerances": {"loss_rel": COMPILED_LOSS_REL_TOL, "grad_cosine_min": COMPILED_GRAD_COSINE_MIN,
                             "grad_max_rel": COMPILED_GRAD_MAX_REL_TOL}}
    if not ok:
        raise CheckFailed(json.dumps({"results": res, "detail": detail}))
    return {"results": res, "detail": detail}


def _equal_runs(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    return bool(torch.equal(a, b)), float((a != b).float().mean())


def _micro(ctx: Ctx, kind: str) -> tuple[ModelConfig, nn.Module]:
    cfg = preset("tiny", kind=kind, **ctx.sizes.micro)
    return cfg, randomize(build_model(cfg), std=0.3).to(ctx.device).eval()


def sampler_cache(ctx: Ctx, kind: str) -> dict[str, Any]:
    """The default sampler, cached against uncached (the AR sampler: KV cache against recomputation)."""
    cfg, model = _micro(ctx, kind)
    name = KINDS[kind].default_sampler
    prefix = random_rows(cfg, 1, ctx.device, seed=5)[0, :2]  # AR needs a first token; the others keep it
    steps = 8 if name == "bd3lm" else 64  # the CPU tests' T (per block for BD3-LM)
    runs = {}
    with matmul_precision("highest"):
        for cache in (True, False):
            stats: dict = {}
            runs[cache] = sample(model, cfg, batch_size=2, length=cfg.seq_len, steps=steps, sampler=name,
                                 nucleus_p=0.9, generator=ctx.gen(3), cache=cache, prefix=prefix, stats=stats), stats
    equal, frac = _equal_runs(runs[True][0], runs[False][0])
    calls = {str(c): runs[c][1].get("network_calls") for c in runs}
    res = {f"sampler_equal_{kind}_cache": int(equal)}
    detail = {"sampler": name, "differing_token_share": frac, "network_calls": calls, "steps": steps}
    if not equal:
        raise CheckFailed(json.dumps({"results": res, "detail": detail}))
    return {"results": res, "detail": detail}


def sampler_dual(ctx: Ctx, kind: str) -> dict[str, Any]:
    """The confidence sampler with the dual cache refreshed every step against no cache (test_fast_sampling)."""
    cfg, model = _micro(ctx, kind)
    n = cfg.seq_len
    tokens = random_rows(cfg, 1, ctx.device, seed=5)
    keep = torch.zeros(1, n, dtype=torch.bool, device=ctx.device)
    keep[0, :4] = keep[0, -2:] = True  # a prompt and a suffix: the span is the 18 positions between
    detail: dict[str, Any] = {}
    equal_all = True
    with matmul_precision("highest"):
        for threshold in (0.05, 1.0):
            runs = {}
            for kv in ("off", "dual"):
                stats: dict = {}
                opts = {"refresh": 1, "kv_cache": kv} if kv != "off" else {}
                runs[kv] = sample(model, cfg, batch_size=3, length=n, steps=1, sampler="confidence", nucleus_p=0.9,
                                  generator=ctx.gen(1), stats=stats, prefix=(tokens, keep), threshold=threshold,
                                  block=6, **opts), stats["network_calls"]
            equal, frac = _equal_runs(runs["off"][0], runs["dual"][0])
            equal = equal and runs["off"][1] == runs["dual"][1]
            equal_all &= equal
            detail[f"threshold_{threshold}"] = {"equal": equal, "differing_token_share": frac,
                                                "network_calls": {k: v[1] for k, v in runs.items()}}
    res = {f"sampler_equal_{kind}_dual": int(equal_all)}
    if not equal_all:
        raise CheckFailed(json.dumps({"results": res, "detail": detail}))
    return {"results": res, "detail": detail}


def sampler_kv(ctx: Ctx, kind: str) -> dict[str, Any]:
    """BD3-LM's block sampler with the KV cache against recomputing the prefix (test_bd3lm)."""
    cfg, model = _micro(ctx, kind)
    runs = {}
    with matmul_precision("highest"):
        for kv in (True, False):
            stats: dict = {}
            runs[kv] = sample(model, cfg, batch_size=2, length=cfg.seq_len, steps=8, sampler="bd3lm", nucleus_p=0.9,
                              generator=ctx.gen(7), kv_cache=kv, stats=stats)
    equal, frac = _equal_runs(runs[True], runs[False])
    res = {f"sampler_equal_{kind}_kv": int(equal)}
    detail = {"differing_token_share": frac, "steps_per_block": 8, "block_size": cfg.block_size}
    if not equal:
        raise CheckFailed(json.dumps({"results": res, "detail": detail}))
    return {"results": res, "detail": detail}


# --------------------------------------------------------------------------------------------
# Attention kernels


def attention_ops(fn: Callable[[], object]) -> list[str]:
    """The attention kernels ``fn`` runs, by the profiler's operator names (``ATTENTION_OPS``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.key for e in prof.key_averages()}
    seen = sorted({v for k, v in ATTENTION_OPS.items() if k in names})
    other = sorted(n for n in names if ("attention" in n.lower() or "flash" in n.lower()) and n not in ATTENTION_OPS
                   and not n.startswith("aten::scaled_dot_product_attention"))
    return seen + [f"other:{n}" for n in other]


def attention_item(ctx: Ctx) -> dict[str, Any]:
    res: dict[str, Any] = {}
    detail: dict[str, Any] = {}
    for kind in TRAINED:
        cfg = ctx.train_config(kind)
        model = build_model(cfg).to(ctx.device).train()
        x = random_rows(cfg, 1, ctx.device)

        def fwd(model: nn.Module = model, x: torch.Tensor = x, cfg: ModelConfig = cfg) -> None:
            with ctx.autocast():
                compute_loss(model, x, None, cfg, step=1, generator=ctx.gen(0))

        fwd()  # warm (lazy initialisation stays out of the profile)
        ops = attention_ops(fwd)
        res[f"attention_train_{kind}"] = "+".join(o for o in ops if not o.startswith("other:")) or "none"
        detail[f"train_{kind}"] = ops
        del model
    if "ar" in KINDS:
        from adlm_model.nn.backbone import KVCache

        cfg = ctx.train_config("ar")
        model = build_model(cfg).to(ctx.device).eval()
        x = random_rows(cfg, 1, ctx.device)[:, :16]
        with torch.no_grad(), ctx.autocast():
            kv = KVCache()
            model(x[:, :15], cache=kv, cache_mode="append")
            ops = attention_ops(lambda: model(x[:, 15:16], cache=kv, cache_mode="append"))
        res["attention_kv_step_ar"] = "+".join(o for o in ops if not o.startswith("other:")) or "none"
        detail["kv_step_ar"] = ops
    q = torch.zeros(1, 4, 2, 32, device=ctx.device, dtype=torch.bfloat16)
    detail["flash_attn_used_for_unmasked_bf16"] = flash_available(q)
    detail["dtype"] = "bf16 autocast"
    return {"results": res, "detail": detail}


# --------------------------------------------------------------------------------------------
# Matmul peak


def datasheet_tflops(name: str) -> float | None:
    for key, tflops in DATASHEET_BF16_TFLOPS:
        if key.lower() in name.lower():
            return tflops
    return None


def timed(ctx: Ctx, fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Wall seconds of each of ``repeats`` calls (synchronised on CUDA)."""
    for _ in range(warmup):
        fn()
    ctx.sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ctx.sync()
        times.append(time.perf_counter() - t)
    return times


def matmul_peak(ctx: Ctx) -> dict[str, Any]:
    n = ctx.sizes.matmul_n
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    a = torch.randn(n, n, device=ctx.device, dtype=dtype)
    b = torch.randn(n, n, device=ctx.device, dtype=dtype)
    inner = 10 if ctx.cuda else 3

    def run() -> None:
        for _ in range(inner):
            torch.mm(a, b)

    best = min(timed(ctx, run, repeats=5, warmup=2)) / inner
    measured = 2 * n**3 / best / 1e12
    name = torch.cuda.get_device_name(ctx.device) if ctx.cuda else platform.processor() or "cpu"
    sheet = datasheet_tflops(name) if ctx.cuda else None
    ctx.shared["peak_measured"] = measured
    ctx.shared["peak_datasheet"] = sheet
    return {"results": {"matmul_peak_tflops": measured,
                        "datasheet_peak_tflops": sheet if sheet is not None else math.nan},
            "detail": {"n": n, "dtype": str(dtype).removeprefix("torch."), "best_of": 5, "products_per_timing": inner,
                       "device_name": name}}


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
# The anchor: a plain transformer


@dataclass(frozen=True)
class AnchorConfig:
    vocab_size: int
    seq_len: int
    hidden: int
    heads: int
    n_blocks: int
    mask_id: int = -1
    """No mask token (``random_rows`` replaces none)."""


class AnchorBlock(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class AnchorTransformer(nn.Module):
    """GPT-2-small-shaped (at the kinds' hidden size, heads and blocks), bidirectional, tied embeddings."""

    def __init__(self, cfg: AnchorConfig) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(cfg.vocab_size, cfg.hidden), nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(AnchorBlock(cfg.hidden, cfg.heads) for _ in range(cfg.n_blocks))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for blk in self.blocks:
            h = blk(h)
        return F.linear(self.ln_f(h), self.wte.weight)


class AnchorObjective(nn.Module):
    """The anchor's loss as ``TrainStep`` runs it: full-vocabulary cross-entropy of the next token, float32."""

    def __init__(self, cfg: AnchorConfig) -> None:
        super().__init__()
        self.cfg, self.seq_len = cfg, cfg.seq_len
        self.model = AnchorTransformer(cfg)

    def draw(self, x: torch.Tensor, attention_mask: torch.Tensor | None, generator: torch.Generator | None,
             train: bool) -> None:
        return None

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None, noise: None, step: torch.Tensor,
                train: bool) -> LossOutput:
        logits = self.model(x).float()
        nll = F.cross_entropy(logits.view(-1, logits.shape[-1]), x.roll(-1, 1).reshape(-1), reduction="sum")
        n = torch.tensor(x.numel(), device=x.device)
        return LossOutput(loss=nll / n, nll_sum=nll.detach().double(), n_tokens=n)


def anchor_config(ctx: Ctx, cfg: ModelConfig) -> AnchorConfig:
    """The anchor at a kind's length, width, heads and depth (the paper's ``small``: 12 x 768), GPT-2's vocabulary."""
    return AnchorConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, hidden=cfg.hidden, heads=cfg.heads,
                        n_blocks=cfg.n_blocks)


# --------------------------------------------------------------------------------------------
# Timing the steps


def graph_breaks() -> tuple[int, dict[str, int]]:
    """Dynamo's graph breaks so far, in all and by reason (its counters: a private API, so -1 when absent)."""
    try:
        from torch._dynamo.utils import counters

        reasons = dict(counters["graph_break"])
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


# --------------------------------------------------------------------------------------------
# Sampling


def _sample_model(ctx: Ctx, kind: str) -> tuple[ModelConfig, nn.Module]:
    cfg = ctx.train_config(kind, seq_len=ctx.sizes.sample_len, dropout=0.0)
    torch.manual_seed(0)
    return cfg, build_model(cfg).to(ctx.device).eval()


def sample_forward(ctx: Ctx) -> dict[str, Any]:
    cfg, model = _sample_model(ctx, "mdlm")
    x = random_rows(cfg, ctx.sizes.sample_batch, ctx.device)
    sigma = torch.zeros(x.shape[0], device=ctx.device)
    out: dict[str, float] = {}
    for name, cast in (("fp32", contextlib.nullcontext()), ("bf16", ctx.autocast())):
        with torch.no_grad(), cast:
            out[name] = statistics.median(timed(ctx, lambda: model.denoiser_logits(x, sigma), repeats=5, warmup=2))
    return {"results": {"sample_forward_ms_fp32": out["fp32"] * 1e3, "sample_forward_ms_bf16": out["bf16"] * 1e3},
            "detail": {"batch": x.shape[0], "seq_len": cfg.seq_len}}


SAMPLE_NEED_S = {"exact": 30, "cached": 30, "confidence": 15, "bd3lm_kv": 15, "ar_kv": 10, "ar_kv_with_cudnn": 15,
                 "bd3lm_kv_with_cudnn": 15}
"""Estimated seconds of each sampling item on an H200 (``Item.need_s``)."""
SAMPLE_RUNS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # item: (kind, sampler, options; "T" stands for --tiny's or the full T)
    "exact": ("mdlm", "mdlm", {"cache": False}),
    "cached": ("mdlm", "mdlm", {"cache": True}),
    "confidence": ("mdlm", "confidence", {"threshold": 0.9, "kv_cache": "dual"}),
    "bd3lm_kv": ("bd3lm", "bd3lm", {"kv_cache": True}),
    "ar_kv": ("ar", "ar", {"cache": True}),
    # The KV-cached steps again with SDPA free to choose cuDNN (adlm_model.nn.attention.CACHED_STEP_BACKENDS = None),
    # which builds a graph for every new key length.
    "ar_kv_with_cudnn": ("ar", "ar", {"cache": True}),
    "bd3lm_kv_with_cudnn": ("bd3lm", "bd3lm", {"kv_cache": True}),
}


def sample_item(ctx: Ctx, which: str) -> dict[str, Any]:
    kind, sampler, opts = SAMPLE_RUNS[which]
    cfg, model = _sample_model(ctx, kind)
    sz = ctx.sizes
    opts = dict(opts)
    steps = sz.sample_steps
    if sampler == "confidence":
        opts["block"] = sz.confidence_block
    if sampler == "bd3lm":
        steps = cfg.block_size  # T = b a block: one token a step on average
    if sampler == "ar":
        opts["bos_id"] = 0
    @contextlib.contextmanager
    def backends() -> Iterator[None]:  # a fresh one each time: generator-based managers are single-use
        from adlm_model.nn import attention

        saved = attention.CACHED_STEP_BACKENDS
        if which.endswith("_with_cudnn"):
            attention.CACHED_STEP_BACKENDS = None
        try:
            yield
        finally:
            attention.CACHED_STEP_BACKENDS = saved

    with backends(), ctx.autocast():  # warm-up: a short run (64 positions, 2 steps) takes the lazy initialisations
        sample(model, cfg, batch_size=sz.sample_batch, length=min(sz.sample_len, 64), steps=2, sampler=sampler,
               nucleus_p=1.0, generator=ctx.gen(1), **opts)
    stats: dict = {}
    ctx.reset_peak()
    ctx.sync()
    t = time.perf_counter()
    with backends(), ctx.autocast():
        x = sample(model, cfg, batch_size=sz.sample_batch, length=sz.sample_len, steps=steps, sampler=sampler,
                   nucleus_p=1.0, generator=ctx.gen(0), stats=stats, **opts)
    ctx.sync()
    wall = time.perf_counter() - t
    if bool((x == cfg.mask_id).any()):
        raise CheckFailed(json.dumps({"error": "masks left in the sample"}))
    calls = stats.get("network_calls", sz.sample_len - 1 if sampler == "ar" else math.nan)
    tokens = sz.sample_batch * sz.sample_len
    return {"results": {f"sample_tokens_per_s_{which}": tokens / wall, f"sample_network_calls_{which}": calls,
                        f"sample_ms_per_call_{which}": wall / calls * 1e3 if calls else math.nan},
            "detail": {"kind": kind, "sampler": sampler, "options": {k: v for k, v in opts.items()}, "steps": steps,
                       "batch": sz.sample_batch, "length": sz.sample_len, "wall_s": wall,
                       "peak_mem_gib": ctx.peak_gib(), "dtype": "bf16 autocast", "nucleus_p": 1.0,
                       "calls_note": "AR: one call a token after the first (the KV cache)" if sampler == "ar" else ""}}


# --------------------------------------------------------------------------------------------
# Environment


def env_item(ctx: Ctx) -> dict[str, Any]:
    d: dict[str, Any] = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "platform": platform.platform(), "cpu_count": os.cpu_count(), "device": str(ctx.device),
        "tiny": ctx.args.tiny, "compile_backend": ctx.args.compile_backend,
    }
    if ctx.cuda:
        p = torch.cuda.get_device_properties(ctx.device)
        d.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gib=p.total_memory / 2**30,
                 multiprocessors=p.multi_processor_count, cudnn=torch.backends.cudnn.version(),
                 sdpa_enabled={"flash": torch.backends.cuda.flash_sdp_enabled(),
                               "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                               "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                               "math": torch.backends.cuda.math_sdp_enabled()})
        with contextlib.suppress(Exception):
            d["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=10).stdout.strip()
    spec = importlib.util.find_spec("flash_attn")
    d["flash_attn"] = None
    if spec is not None:
        from importlib.metadata import version

        d["flash_attn"] = {"path": spec.origin, "version": None}
        with contextlib.suppress(Exception):
            d["flash_attn"]["version"] = version("flash_attn")
    with contextlib.suppress(Exception):
        d["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                     timeout=10).stdout.strip() or None
    name = d.get("gpu", "cpu")
    return {"results": {"env_gpu": name.replace(" ", "_"), "env_torch": torch.__version__,
                        "env_cuda": torch.version.cuda or "none", "env_flash_attn": int(spec is not None)},
            "detail": d}


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
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
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
