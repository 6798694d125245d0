"""AR sampling: left to right with nucleus, with a KV cache, and past the model's context in a sliding window.

The entry point ``sample`` and the table of samplers live in ``kinds.py``; the draws (float64 Gumbel from the
caller's generator, the nucleus rule) are those of ``samplers.py``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..config import ModelConfig
from ..nn.backbone import KVCache
from ..objectives.losses import suppress_mask
from .samplers import Progress, SamplerError, nucleus, sample_categorical


def ar_sample(model: nn.Module, cfg: ModelConfig, tokens: torch.Tensor, keep: torch.Tensor, *, nucleus_p: float,
              generator: torch.Generator, progress: Progress | None, cache: bool,
              bos_id: int | None = None, stats: dict | None = None) -> torch.Tensor:
    """Left to right with nucleus; ``cache`` uses a KV cache (one token per step after the prompt)
    and gives the same tokens as recomputing the whole prefix every step. ``stats['network_calls']``: the
    forward passes (one per generated token either way: with the cache, the prompt's pass yields the first)."""
    tokens, keep = tokens.clone(), keep.clone()
    if not bool(keep[:, 0].all()):
        if bos_id is None:
            raise SamplerError("AR sampling needs a first token: pass prefix=... or bos_id=...")
        tokens[:, 0] = torch.where(keep[:, 0], tokens[:, 0], torch.full_like(tokens[:, 0], bos_id))
        keep[:, 0] = True
    b, length = tokens.shape
    x = tokens.clone()
    lead = int(keep.all(0).long().cumprod(0).sum())  # leading positions given in every row
    total = length - lead

    def draw(logits: torch.Tensor) -> torch.Tensor:
        probs = nucleus(torch.softmax(suppress_mask(logits, cfg.mask_id), dim=-1), nucleus_p)
        return sample_categorical(probs, generator)

    kv = KVCache() if cache else None
    calls = 0
    if lead < length:
        logits = model(x[:, :lead], cache=kv, cache_mode="append")[:, -1] if cache else None
        calls += int(cache)
        for i in range(lead, length):
            if not cache:
                logits = model(x[:, :i])[:, -1]
                calls += 1
            x[:, i] = torch.where(keep[:, i], tokens[:, i], draw(logits))
            if cache and i + 1 < length:
                logits = model(x[:, i:i + 1], cache=kv, cache_mode="append")[:, -1]
                calls += 1
            if progress is not None:
                progress(i - lead + 1, total)
    if stats is not None:
        stats["network_calls"] = calls
    return x


def ar_window_sample(model: nn.Module, cfg: ModelConfig, tokens: torch.Tensor, keep: torch.Tensor, *,
                     nucleus_p: float, generator: torch.Generator, progress: Progress | None, cache: bool,
                     bos_id: int | None = None, context: int = 0, stats: dict | None = None) -> torch.Tensor:
    """``ar_sample`` past the model's context: each token after the last ``context`` tokens (0: ``cfg.seq_len``), as
    the BD3-LM reference samples its AR baseline beyond its training length (positions restart at each window). Within
    the first window it is ``ar_sample`` itself (the same tokens, its KV cache); past it every step recomputes the
    window. ``stats['network_calls']``: one per generated token."""
    window = context or cfg.seq_len
    if not 1 <= window <= cfg.seq_len:
        raise SamplerError(f"context must lie in [1, {cfg.seq_len}] (the model's positions; 0: all of them), got {context}")
    length = tokens.shape[1]
    head = min(length, window)
    inner: dict = {}
    x = ar_sample(model, cfg, tokens[:, :head], keep[:, :head], nucleus_p=nucleus_p, generator=generator,
                  progress=None if length > head else progress, cache=cache, bos_id=bos_id, stats=inner)
    calls = int(inner.get("network_calls", 0))
    if length > head:
        out = torch.cat([x, tokens[:, head:].clone()], dim=1)
        for i in range(head, length):
            logits = model(out[:, i - window:i])[:, -1]
            probs = nucleus(torch.softmax(suppress_mask(logits, cfg.mask_id), dim=-1), nucleus_p)
            out[:, i] = torch.where(keep[:, i], tokens[:, i], sample_categorical(probs, generator))
            calls += 1
            if progress is not None:
                progress(i - head + 1, length - head)
        x = out
    if stats is not None:
        stats["network_calls"] = calls
    return x


__all__ = ["ar_sample", "ar_window_sample"]
