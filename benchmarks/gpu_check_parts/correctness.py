"""Correctness items: the bf16 step against float32, BD3-LM's compiled step against its eager one, the
samplers' cached paths against their exact ones, and which attention kernels run."""

from __future__ import annotations

import contextlib
import copy
import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from adlm_model import build_model, compute_loss, preset, sample
from adlm_model.config import ModelConfig
from adlm_model.kinds import count_parameters
from adlm_model.nn import block_attention as flex
from adlm_model.nn.attention import flash_available
from adlm_model.train.train_step import Objective, TrainStep, draw_noise, fused_adamw

from .context import (
    ATTENTION_OPS,
    COMPILED_GRAD_COSINE_MIN,
    COMPILED_GRAD_MAX_REL_TOL,
    COMPILED_LOSS_REL_TOL,
    GRAD_COSINE_MIN,
    KINDS,
    LOSS_REL_TOL,
    TRAINED,
    CheckFailed,
    Ctx,
    matmul_precision,
    random_rows,
    randomize,
)

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
