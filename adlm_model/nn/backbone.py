"""The DiT backbone (docs/design/method.md, sections 1-2; the SEDD/MDLM "DDiT").

Rotary embeddings (half rotation, base 10000), adaLN modulation with zero-initialised
projections, float32 LayerNorm, GELU-tanh MLP, dropout, and a zero-initialised output layer.
Time conditioning on or off: off feeds sigma = 0, a learned constant condition.

The input is either token ids (an embedding) or, for the ADLM denoiser, a dense vector per
position (``Linear(width -> hidden)`` of the anchor's logits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import attention


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class LayerNorm(nn.Module):
    """LayerNorm computed in float32 (weight only, as in the DDiT), cast back to the input dtype."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            with torch.autocast(device_type=x.device.type, enabled=False):
                y = F.layer_norm(x.float(), [self.dim])
        else:  # no autocast to leave (inference, float32 training): the context alone cost a KV decoding step 4%
            y = F.layer_norm(x.float(), [self.dim])
        return (y * self.weight.float()).to(x.dtype) if x.dtype != torch.float32 else y * self.weight


class Rotary(nn.Module):
    """Rotary position embeddings, rotate-half convention, base 10000."""

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, length: int, offset: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():  # in a graph: computed there (a cache hit or miss would be a guard)
            return self._table(length, offset, device)
        key = (length, offset, str(device))
        if key not in self._cache:
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[key] = self._table(length, offset, device)
        return self._cache[key]

    def _table(self, length: int, offset: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(offset, offset + length, device=device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.to(device))
        emb = torch.cat([freqs, freqs], dim=-1)
        # (1, L, 1, D) broadcasts over batch and heads of (B, L, H, D)
        return emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin at explicit positions (1-D); BD3-LM training gives x_t and x_0 the same positions."""
        freqs = torch.outer(positions.to(torch.float32), self.inv_freq.to(positions.device))
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos.to(x.dtype)) + (rotate_half(x) * sin.to(x.dtype))


class TimestepEmbedder(nn.Module):
    """Sinusoidal embedding of sigma followed by an MLP (DiT)."""

    def __init__(self, cond_dim: int, freq_dim: int = 256) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, cond_dim), nn.SiLU(), nn.Linear(cond_dim, cond_dim))

    def forward(self, sigma: torch.Tensor, max_period: float = 10000.0) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=sigma.device, dtype=torch.float32) / half)
        args = sigma.float()[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        # The embedding is computed in float32; a network whose weights were cast (e.g. to bf16 by a
        # transformers load) takes it in their dtype. float32 weights: unchanged.
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


@dataclass
class KVCache:
    """Per-layer keys and values of a clean prefix (AR and BD3-LM sampling).

    ``mode='read'`` attends to the cached prefix plus the current tokens without storing them;
    ``mode='append'`` also appends the current tokens' keys/values. Each layer keeps a (B, capacity,
    H, D) buffer that grows by doubling: a call writes its keys/values after the cached ``n``
    positions and attends to a view of the first ``n + new`` (no concatenation of the whole prefix
    per layer and call); appending only moves ``n``.
    """

    k: list[torch.Tensor | None] = field(default_factory=list)
    v: list[torch.Tensor | None] = field(default_factory=list)
    n: int = 0

    @property
    def length(self) -> int:
        return self.n

    def ensure(self, n_layers: int) -> None:
        if len(self.k) < n_layers:
            self.k += [None] * (n_layers - len(self.k))
            self.v += [None] * (n_layers - len(self.v))

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``/``v`` (B, m, H, D) after the cached positions; views of the first ``n + m``."""
        end = self.n + k.shape[1]
        buf_k, buf_v = self.k[layer], self.v[layer]
        if buf_k is None or buf_k.shape[1] < end or buf_k.shape[0] != k.shape[0]:
            cap = max(end, 2 * (0 if buf_k is None else buf_k.shape[1]), 64)
            new_k = k.new_empty((k.shape[0], cap, *k.shape[2:]))
            new_v = v.new_empty((v.shape[0], cap, *v.shape[2:]))
            if buf_k is not None and self.n:
                new_k[:, :self.n], new_v[:, :self.n] = buf_k[:, :self.n], buf_v[:, :self.n]
            self.k[layer], self.v[layer] = buf_k, buf_v = new_k, new_v
        buf_k[:, self.n:end] = k
        buf_v[:, self.n:end] = v
        return buf_k[:, :end], buf_v[:, :end]

    def select(self, rows: torch.Tensor) -> KVCache:
        """A copy holding only the batch ``rows``."""
        return KVCache(k=[None if k is None else k[rows, :self.n] for k in self.k],
                       v=[None if v is None else v[rows, :self.n] for v in self.v], n=self.n)

    def keep_last(self, n: int) -> None:
        """Drop all but the last ``n`` cached positions (a sliding window for generation beyond the
        training length). Rotary keys carry absolute positions and attention scores depend only on
        relative ones, so callers keep passing absolute ``position_offset`` values."""
        if self.n <= n:
            return
        for buf in (*self.k, *self.v):
            if buf is not None and n:
                buf[:, :n] = buf[:, self.n - n:self.n].clone()
        self.n = n


class DiTBlock(nn.Module):
    """A transformer block: attention and MLP, each pre-LayerNorm with a residual. With ``adaln`` (the
    diffusion models) the norms are modulated and the branches gated by the conditioning vector (zero-init:
    the block starts as the identity); without it (the AR baseline of the references) it is a plain
    pre-LayerNorm block."""

    def __init__(self, hidden: int, heads: int, cond_dim: int, mlp_ratio: int = 4, dropout: float = 0.1,
                 adaln: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = LayerNorm(hidden)
        self.attn_qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.attn_out = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, mlp_ratio * hidden), nn.GELU(approximate="tanh"),
                                 nn.Linear(mlp_ratio * hidden, hidden))
        self.dropout = nn.Dropout(dropout)
        self.adaLN_modulation = nn.Linear(cond_dim, 6 * hidden) if adaln else None
        if adaln:
            nn.init.zeros_(self.adaLN_modulation.weight)
            nn.init.zeros_(self.adaLN_modulation.bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor], *,
                causal: bool = False, mask: torch.Tensor | None = None,
                cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        b, n, d = x.shape
        if self.adaLN_modulation is None:
            h = self.norm1(x)
        else:
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = \
                self.adaLN_modulation(c)[:, None].chunk(6, dim=2)
            h = modulate(self.norm1(x), shift_msa, scale_msa)
        q, k, v = self.attn_qkv(h).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:  # the trunk moves the cache's length once every layer has written
            k, v = cache.extend(layer, k, v)
        a = attention(q, k, v, causal=causal, mask=mask).reshape(b, n, d)
        if self.adaLN_modulation is None:
            x = x + self.dropout(self.attn_out(a))
            return x + self.dropout(self.mlp(self.norm2(x)))
        x = x + gate_msa * self.dropout(self.attn_out(a))
        x = x + gate_mlp * self.dropout(self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp)))
        return x


class FinalLayer(nn.Module):
    """LayerNorm (adaLN-modulated with ``adaln``) (``modulated``) then a zero-initialised Linear(hidden -> width)
    (``linear``).

    Callers apply the two parts themselves: the fused ADLM path and BD3-LM's block logits need the
    hidden state in between."""

    def __init__(self, hidden: int, width: int, cond_dim: int, adaln: bool = True) -> None:
        super().__init__()
        self.norm_final = LayerNorm(hidden)
        self.linear = nn.Linear(hidden, width)
        self.adaLN_modulation = nn.Linear(cond_dim, 2 * hidden) if adaln else None
        for m in (self.linear, self.adaLN_modulation):
            if m is not None:
                nn.init.zeros_(m.weight)
                nn.init.zeros_(m.bias)

    def modulated(self, x: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
        """The final hidden state the output layer is affine in (used by the fused ADLM path)."""
        if self.adaLN_modulation is None:
            return self.norm_final(x)
        shift, scale = self.adaLN_modulation(c)[:, None].chunk(2, dim=2)
        return modulate(self.norm_final(x), shift, scale)


class DiT(nn.Module):
    """A stack of DiT blocks with an embedding (``input_mode='tokens'``) or a dense input layer.

    ``forward(inp, sigma)`` -> logits (B, L, width). ``causal`` selects causal attention (AR);
    ``mask`` an arbitrary boolean attention mask.
    """

    def __init__(self, *, width: int, hidden: int, heads: int, n_blocks: int, cond_dim: int,
                 mlp_ratio: int = 4, dropout: float = 0.1, input_mode: str = "tokens",
                 input_width: int | None = None, causal: bool = False, adaln: bool = True) -> None:
        super().__init__()
        self.input_mode = input_mode
        self.causal = causal
        if input_mode == "tokens":
            self.vocab_embed = nn.Embedding(width, hidden)
            nn.init.kaiming_uniform_(self.vocab_embed.weight, a=math.sqrt(5))
        elif input_mode == "dense":
            self.dense_in = nn.Linear(input_width or width, hidden)
        else:
            raise ValueError(f"input_mode must be 'tokens' or 'dense', got {input_mode!r}")
        # No adaLN (the AR baseline): no conditioning at all, so no timestep embedder either.
        self.sigma_map = TimestepEmbedder(cond_dim) if adaln else None
        self.rotary = Rotary(hidden // heads)
        self.blocks = nn.ModuleList(DiTBlock(hidden, heads, cond_dim, mlp_ratio, dropout, adaln) for _ in range(n_blocks))
        self.output_layer = FinalLayer(hidden, width, cond_dim, adaln)

    def embed(self, inp: torch.Tensor) -> torch.Tensor:
        return self.vocab_embed(inp) if self.input_mode == "tokens" else self.dense_in(inp)

    def trunk(self, x: torch.Tensor, sigma: torch.Tensor, *, mask: torch.Tensor | None = None,
              cache: KVCache | None = None, cache_mode: str = "read", position_offset: int | None = None,
              causal: bool | None = None, position_ids: torch.Tensor | None = None,
              cache_append: int | None = None, cache_layer: int = 0) -> torch.Tensor:
        """Embedded input -> the final modulated hidden state (the output layer is affine in it).

        Rotary positions: ``position_ids`` (1-D, one per input position) when given, else
        ``position_offset + arange(L)`` with the offset defaulting to the cache length. With a
        ``cache``, ``cache_append`` leading positions join it (default: all with ``cache_mode='append'``,
        none with ``'read'``); every position attends to the cache and, per ``mask``, to the others.
        ``cache_layer``: the cache's layer of this network's first block (the networks of a composed model, A2R's
        anchor and AR model, keep their keys and values in one cache, one after the other).
        """
        c = F.silu(self.sigma_map(sigma)) if self.sigma_map is not None else None
        if position_ids is not None:
            rope = self.rotary.at(position_ids)
        else:
            if position_offset is None:
                position_offset = cache.length if cache is not None else 0
            rope = self.rotary(x.shape[1], position_offset, x.device)
        if cache is not None:
            cache.ensure(cache_layer + len(self.blocks))
        causal = self.causal if causal is None else causal
        for i, block in enumerate(self.blocks):
            x = block(x, c, rope, causal=causal, mask=mask, cache=cache, layer=cache_layer + i)
        if cache is not None:
            cache.n += x.shape[1] if cache_append is None and cache_mode == "append" else (cache_append or 0)
        return self.output_layer.modulated(x, c)

    def head(self, inp: torch.Tensor, sigma: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The final hidden state and the output projection's weight and bias: the logits are their affine map,
        which the training losses fuse with the log-softmax (``vocab_loss``) instead of materialising."""
        lin = self.output_layer.linear
        return self.trunk(self.embed(inp), sigma, **kw), lin.weight, lin.bias

    def forward(self, inp: torch.Tensor, sigma: torch.Tensor, **kw) -> torch.Tensor:
        h = self.trunk(self.embed(inp), sigma, **kw)
        return self.output_layer.linear(h)
