"""Approximate KV caching for the bidirectional networks (Fast-dLLM's prefix and dual cache).

A bidirectional DiT recomputes every position at every step, although between two steps of semi-autoregressive
decoding only the active block changes. ``BlockKV`` keeps, per layer, the keys and values of every position of
the row as the last full pass computed them; a partial pass computes only a contiguous range of positions
(queries, keys and values of those), writes their keys/values over the cached ones and lets them attend to the
whole row. The keys/values of the other positions are then stale (they were computed when the row held other
tokens): that is the approximation, and a full pass (a "refresh") removes it.

- **prefix** cache: the partial pass computes the active block and everything after it; only the positions
  before the block are reused.
- **dual** cache: the partial pass computes the active block alone; positions on both sides are reused.

A full pass through ``BlockKV`` gives exactly the uncached logits (the keys/values it stores are the ones it
attends to), so refreshing at every step is the exact sampler.

``BlockKV`` fits ``DiT.trunk``'s ``cache=`` hook (``ensure``, ``extend``, ``length``, ``n``) with a different
meaning: ``length`` is the first position the pass computes (its rotary offset) and nothing is appended.
ADLM keeps one cache for the anchor network and one for the denoiser: both are bidirectional DiTs, and the
anchor's cost dominates (docs/design/method.md, section 2: the denoiser reads the anchor's output at every position).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..nn.backbone import DiT

KV_MODES = ("off", "prefix", "dual")
"""``off``: no approximate cache (every step a full pass); ``prefix``/``dual``: module docstring."""


@dataclass
class BlockKV:
    """Per-layer keys/values (B, L, H, D) of every position of a row (module docstring)."""

    k: list[torch.Tensor | None] = field(default_factory=list)
    v: list[torch.Tensor | None] = field(default_factory=list)
    start: int = 0
    """First position of the current pass (0: a full pass, which replaces the buffers)."""
    n: int = 0
    """Unused (``DiT.trunk`` adds 0 in read mode); kept for the hook's interface."""
    rows: torch.Tensor | None = None
    """The batch rows the current pass computes (None: every row); the others keep their keys/values."""
    batch: int = 0
    """Rows of the whole batch (the buffers' first dimension when a pass computes some rows only)."""

    @property
    def length(self) -> int:
        return self.start

    def ensure(self, n_layers: int) -> None:
        if len(self.k) < n_layers:
            self.k += [None] * (n_layers - len(self.k))
            self.v += [None] * (n_layers - len(self.v))

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` (B, m, H, D) of positions ``start .. start + m`` (of ``rows``, when set); the keys/values
        of the whole row."""
        full = self.start == 0 and (self.k[layer] is None or k.shape[1] == self.k[layer].shape[1])
        if full and self.rows is None:
            # A full pass: the fresh tensors are the cache (nothing reads them after this call but the cache).
            self.k[layer], self.v[layer] = k, v
            return k, v
        if full and self.k[layer] is None:  # the first full pass computes some rows: room for the whole batch
            self.k[layer] = k.new_zeros((self.batch, *k.shape[1:]))
            self.v[layer] = v.new_zeros((self.batch, *v.shape[1:]))
        buf_k, buf_v = self.k[layer], self.v[layer]
        if buf_k is None:
            raise RuntimeError("a partial pass needs a full pass first (BlockKV is empty)")
        end = self.start + k.shape[1]
        if self.rows is None:
            buf_k[:, self.start:end] = k
            buf_v[:, self.start:end] = v
            return buf_k, buf_v
        if full:  # the rows' fresh keys/values are exactly what they attend to
            buf_k[self.rows], buf_v[self.rows] = k, v
            return k, v
        buf_k[self.rows, self.start:end] = k
        buf_v[self.rows, self.start:end] = v
        return buf_k[self.rows], buf_v[self.rows]


def networks(model: nn.Module) -> list[DiT]:
    """The bidirectional DiTs of a diffusion model, in the order they run: MDLM's backbone; ADLM's anchor and
    denoiser."""
    if hasattr(model, "anchor") and hasattr(model, "denoiser"):
        return [model.anchor, model.denoiser]
    if hasattr(model, "backbone") and isinstance(model.backbone, DiT) and not model.backbone.causal:
        return [model.backbone]
    raise ValueError(f"{type(model).__name__} has no bidirectional DiT to cache (MDLM and ADLM have)")


def new_caches(model: nn.Module) -> list[BlockKV]:
    """One empty ``BlockKV`` per network of ``model``."""
    return [BlockKV() for _ in networks(model)]


def cached_logits(model: nn.Module, z: torch.Tensor, sigma: torch.Tensor, caches: list[BlockKV], start: int = 0,
                  stop: int | None = None, rows: torch.Tensor | None = None, batch: int | None = None) -> torch.Tensor:
    """The denoiser logits (before SUBS) at positions ``start .. stop`` of ``z`` (B, L).

    ``rows``: ``z`` holds only these rows (indices into a batch of ``batch`` rows; pass ``batch`` whenever a pass
    may compute some rows only): the pass reads and writes their keys/values alone.

    ``start = 0, stop = L``: a full pass, exactly ``model.denoiser_logits(z, sigma)`` (ADLM: the fused path),
    which also fills the caches. Otherwise a partial pass on the cached keys/values of the other positions.
    """
    stop = z.shape[1] if stop is None else stop
    nets = networks(model)
    for c in caches:
        c.start, c.rows = start, rows
        c.batch = batch or c.batch or (z.shape[0] if rows is None else int(rows.max()) + 1)
    part = z[:, start:stop]
    if len(nets) == 1:
        net = nets[0]
        return net.output_layer.linear(net.trunk(net.embed(part), sigma, cache=caches[0]))
    anchor, denoiser = nets
    w, b = model.fused_projection()  # anchor output layer and denoiser input layer as one map (models.py)
    h = anchor.trunk(anchor.embed(part), sigma, cache=caches[0])
    hd = denoiser.trunk(F.linear(h, w, b), sigma, cache=caches[1])
    return denoiser.output_layer.linear(hd)


__all__ = ["KV_MODES", "BlockKV", "cached_logits", "networks", "new_caches"]
