"""Greedy decoding of a causal network after given prompts, with its KV cache: the answer decoding of the
reasoning tasks (Coconut decodes greedily and reads the answer off the text).

Each prompt is given whole as input, ``[ANT]`` slots included: their outputs are never read, and decoding
starts at the output of the prompt's last position. Ids in ``suppress`` (the ``[ANT]`` id, the markers, the
mask id) are never emitted, so no anchor output or marker can become answer text. A row stops at its first
``eos_id`` (kept as its last token) or after ``max_new`` tokens. Rows of one prompt length decode together in
one batch with one KV cache (the positions of a batch advance together); other lengths form other batches, so
no padding enters the attention and each row decodes as it would alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from ..nn.backbone import KVCache


@torch.no_grad()
def greedy_decode(model: nn.Module, prompts: Sequence[Sequence[int]], *, eos_id: int, max_new: int,
                  suppress: Sequence[int] = (), batch_size: int = 64) -> list[list[int]]:
    """The greedy continuation of every prompt (module docstring), in the prompts' order."""
    if max_new < 1:
        raise ValueError(f"max_new must be at least 1, got {max_new}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (BOS)")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[list[int]] = [[] for _ in prompts]
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    try:
        for rows in by_length.values():
            for lo in range(0, len(rows), batch_size):
                chunk = rows[lo:lo + batch_size]
                x = torch.tensor([list(prompts[i]) for i in chunk], dtype=torch.long, device=device)
                for i, seq in zip(chunk, _decode_batch(model, x, eos_id, max_new, suppress), strict=True):
                    out[i] = seq
    finally:
        model.train(was_training)
    return out


def _decode_batch(model: nn.Module, x: torch.Tensor, eos_id: int, max_new: int,
                  suppress: Sequence[int]) -> list[list[int]]:
    """Greedy continuations of a batch of prompts of one length, one token a step through the KV cache."""
    kv = KVCache()
    logits = model(x, cache=kv, cache_mode="append")[:, -1].float()
    banned = torch.tensor(sorted(set(suppress)), dtype=torch.long, device=x.device)
    done = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    tokens: list[torch.Tensor] = []
    for step in range(max_new):
        if banned.numel():
            logits = logits.index_fill(-1, banned, float("-inf"))
        nxt = logits.argmax(-1)
        tokens.append(torch.where(done, torch.full_like(nxt, eos_id), nxt))
        done = done | (nxt == eos_id)
        if bool(done.all()) or step + 1 == max_new:
            break
        logits = model(nxt[:, None], cache=kv, cache_mode="append")[:, -1].float()
    seqs = torch.stack(tokens, 1).tolist()
    out = []
    for s in seqs:
        out.append(s[:s.index(eos_id) + 1] if eos_id in s else s)
    return out


__all__ = ["greedy_decode"]
