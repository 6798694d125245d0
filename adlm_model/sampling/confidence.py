"""Confidence-threshold parallel decoding (Fast-dLLM) for MDLM and ADLM, with the approximate KV cache.

Instead of the ancestral schedule of docs/design/method.md, section 4 (``T`` steps, each position unmasking with
probability ``(t - s) / t``), every step unmasks each masked position whose **top probability** under the
network's ``p_x0`` (SUBS, before nucleus) exceeds ``threshold``, and at least the most confident one per row,
so the number of network calls follows the model's confidence: ``threshold = 1`` unmasks exactly one token a
step (``L`` calls for ``L`` tokens: the low-confidence-remasking order of LLaDA), ``threshold = 0`` all of
them in one call. The token of an unmasked position is drawn as everywhere else: nucleus on ``p_x0`` and the
float64 Gumbel draw (``samplers.sample_categorical``) from the caller's generator. ``steps`` plays no part:
the schedule is the model's confidence.

**Blocks** (semi-autoregressive): the generated span (the positions not given, from the first to the last)
is cut into blocks of ``block`` tokens, decoded left to right; a block's positions unmask only while it is
the active one. ``block`` must divide the span (default: one block, the whole span).

**Approximate KV cache** (``block_cache``): ``kv_cache = 'prefix'`` or ``'dual'`` reuses the keys/values of
positions outside the active block; a full pass refreshes them when the block changes and every ``refresh``
steps. ``refresh = 1`` refreshes at every step: exactly the uncached sampler (same tokens for the same seed).

**Cost per call**: a pass runs on the rows that still have a mask in the active block (a finished row needs
no logits; the draws are those of the whole batch, in the same order), and the step's selection is a handful
of batched tensor operations (top probability, threshold, the most confident one of a lagging row, one
Gumbel draw for all chosen positions): no Python loop over rows, two host syncs a step (is any row
live, are all).

With time conditioning on, a row's time is its fraction of still-masked generated positions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..config import ModelConfig
from ..objectives.losses import conditioning_sigma, suppress_mask
from ..objectives.schedule import LogLinearSchedule
from .block_cache import KV_MODES, cached_logits, networks, new_caches
from .samplers import T_MIN, Progress, SamplerError, denoiser_fn, nucleus, sample_categorical

DEFAULT_THRESHOLD = 0.9
"""Fast-dLLM's reference threshold."""
OPTIONS = ("threshold", "block", "refresh", "kv_cache")
"""The options of the ``confidence`` sampler (``kinds.SAMPLERS``)."""


def _int_setting(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise SamplerError(f"{name} must be an integer, got {value!r}")
    return int(value)


def check_options(threshold: Any = DEFAULT_THRESHOLD, block: Any = None, refresh: Any = None,
                  kv_cache: Any = None, span: int | None = None) -> dict[str, Any]:
    """The validated settings ``{threshold, block, refresh, kv_cache}`` or one SamplerError line naming the fix.

    ``kv_cache`` None: ``dual`` when a ``refresh`` is given, else ``off``. ``span``: the number of generated
    positions, which ``block`` must divide (checked when known)."""
    if threshold is None:
        threshold = DEFAULT_THRESHOLD
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0.0 <= float(threshold) <= 1.0:
        raise SamplerError(f"threshold must be a number in [0, 1], got {threshold!r}")
    if block is not None:
        block = _int_setting("block", block)
        if block < 1:
            raise SamplerError(f"block must be >= 1, got {block}")
        if span is not None and span % block:
            raise SamplerError(f"block {block} does not divide the length {span}: use a divisor of {span} "
                               "(or leave block out: one block)")
    if refresh is not None:
        refresh = _int_setting("refresh", refresh)
        if refresh < 1:
            raise SamplerError(f"refresh must be >= 1 (steps between full passes; 1 = exact), got {refresh}")
    if kv_cache is None:
        kv_cache = "off" if refresh is None else "dual"
    if kv_cache not in KV_MODES:
        raise SamplerError(f"kv_cache must be one of {', '.join(KV_MODES)}, got {kv_cache!r}")
    if kv_cache != "off" and refresh is None:
        refresh = 1 << 30  # refreshed only when the block changes
    return {"threshold": float(threshold), "block": block, "refresh": refresh, "kv_cache": kv_cache}


def generated_span(keep: torch.Tensor) -> tuple[int, int]:
    """``(first, stop)``: the positions from the first to the last one not given in any row (``(0, 0)``: none)."""
    free = (~keep).any(0).nonzero()
    if not free.numel():
        return 0, 0
    return int(free[0]), int(free[-1]) + 1


def confidence_sample(model: nn.Module, cfg: ModelConfig, tokens: torch.Tensor, keep: torch.Tensor, *, steps: int,
                      nucleus_p: float, generator: torch.Generator, progress: Progress | None, cache: bool = True,
                      stats: dict | None = None, threshold: float = DEFAULT_THRESHOLD, block: int | None = None,
                      refresh: int | None = None, kv_cache: str | None = None) -> torch.Tensor:
    """Confidence-threshold decoding of ``(B, L)`` (module docstring); ``stats['network_calls']`` counts the
    forward passes (each of the whole batch; a partial pass counts as one)."""
    m = cfg.mask_id
    first, stop = generated_span(keep)
    o = check_options(threshold, block, refresh, kv_cache, span=stop - first)
    x = torch.where(keep, tokens, torch.full_like(tokens, m))
    b, length = x.shape
    block = o["block"] or max(stop - first, 1)
    kv = o["kv_cache"]
    if kv != "off":
        networks(model)  # a model without a bidirectional DiT fails here, before any work
    fn = denoiser_fn(model)
    caches = new_caches(model) if kv != "off" else None
    schedule = LogLinearSchedule(cfg.noise_eps)
    n_free = (~keep).sum(-1).clamp(min=1)
    total = int((~keep).sum(-1).max()) if b else 0
    calls = 0
    for s in range(first, stop, block):
        e = s + block
        since = None  # steps since the last full pass; None: the block just changed
        while True:
            live = (x[:, s:e] == m).any(-1)  # rows with a mask left in the active block
            if not bool(live.any()):
                break
            # A row done with the block needs no logits: the pass runs on the live rows alone (their logits do not
            # depend on the other rows), as the exact sampler's row cache skips the unchanged rows.
            rows = None if bool(live.all()) else live.nonzero(as_tuple=True)[0]
            xr = x if rows is None else x[rows]
            t = ((xr == m).sum(-1) / (n_free if rows is None else n_free[rows])).clamp(T_MIN, 1.0).to(torch.float32)
            sigma = conditioning_sigma(cfg, schedule, t)
            if kv == "off":
                logits = fn(xr, sigma)[:, s:e]
            elif since is None or since >= o["refresh"]:
                logits, since = cached_logits(model, xr, sigma, caches, rows=rows, batch=b)[:, s:e], 1
            else:
                hi = length if kv == "prefix" else e
                logits, since = cached_logits(model, xr, sigma, caches, s, hi, rows=rows,
                                                batch=b)[:, :block], since + 1
            calls += 1
            masked = xr[:, s:e] == m
            probs = torch.softmax(suppress_mask(logits, m), dim=-1)
            conf = probs.max(-1).values.masked_fill(~masked, -1.0)
            chosen = masked & (conf > o["threshold"])
            # At least one per row, the most confident (every live row has a masked position): no sync, no loop.
            lagging = ~chosen.any(-1, keepdim=True)
            chosen |= torch.zeros_like(chosen).scatter_(-1, conf.argmax(-1, keepdim=True), lagging)
            r, c = chosen.nonzero(as_tuple=True)  # row-major: the draws come in the order of the whole batch
            p = probs[r, c]
            if nucleus_p < 1.0:
                p = nucleus(p, nucleus_p)
            x[r if rows is None else rows[r], s + c] = sample_categorical(p, generator)
            if progress is not None:
                progress(total - int((x == m).sum(-1).max()), total)
    if stats is not None:
        stats["network_calls"] = calls
    return x


__all__ = ["DEFAULT_THRESHOLD", "OPTIONS", "check_options", "confidence_sample", "generated_span"]
