"""Sampling speed: the network's forward pass and each sampler's tokens a second and network calls."""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from adlm_model import build_model, sample
from adlm_model.config import ModelConfig

from .context import (
    CheckFailed,
    Ctx,
    random_rows,
)
from .hardware import timed

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
