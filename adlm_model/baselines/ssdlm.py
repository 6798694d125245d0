"""SSD-LM (Han et al. 2023, arXiv 2210.17432): semi-autoregressive simplex diffusion, for sampling only.

**The network** is the released one (Hub ``xhan77/ssdlm``): a RoBERTa masked LM (RoBERTa-large there) whose
input, for the positions of the block being generated, is not a token embedding but a point of the vocabulary
simplex projected by a dense layer (``embed_sum_layer``, ``V -> H``, no bias) plus a timestep embedding
(``timestep_layer``, ``1 -> H``, fed ``t / T``); the context (the prompt and the blocks already generated) enters
through RoBERTa's own word embeddings. Everything else is RoBERTa as ``transformers`` defines it: absolute
position embeddings numbered from ``padding_idx + 1 = 2``, one token type, post-LayerNorm blocks (eps 1e-5),
exact GELU, and the LM head (dense, GELU, LayerNorm, the decoder tied to the word embeddings, a bias). The
parameter names are ``transformers``' own (``roberta.encoder.layer.N...``), so the released weights load by
name. Pure torch: no ``transformers`` import.

**The sampler** (``ssd_sample``) is the reference's decoding loop (``ssd_model_decode.py`` of xhan77/ssd-lm;
``generate_text.py`` in the ``ssd-lm/`` folder of kuleshov-group/bd3lms, which the BD3-LM paper's tables ran):
blocks of ``B`` tokens, left to right; within a block ``T`` steps ``t = T, ..., 1`` of diffusion on the logit
simplex: start from ``x = K N(0, I)`` (``K`` the almost-one-hot scale, 5 in the references); at each step draw
``z = K N(0, I)``, run the network on ``softmax(x)`` at ``t / T`` after the context, project its logits onto an
almost-one-hot point (``projection``), and set ``x = sqrt(abar_{t-1}) proj + sqrt(1 - abar_{t-1}) z`` with the
cosine schedule ``abar_t = f(t) / f(0)``, ``f(t) = cos(((t / T + s) / (1 + s)) pi / 2)^2``, ``s = 1e-4``. The
block's tokens are the argmax of the last step's logits. Projections:

- ``sampling`` (BD3-LM's runs, and ``ssd_model_decode_alt.py``): a token drawn from the logits filtered to their
  top-p nucleus, written as ``2K e_token - K``;
- ``multihot`` (``ssd_model_decode.py``): ``K`` on every token of the top-p nucleus, ``-K`` elsewhere.

The nucleus is the references' rule: sorted probabilities kept while their cumulative sum is ``< p``, plus the
one that crosses ``p`` (never empty). The draws follow the references' order (the block's start ``x``, then per
step ``z`` before the network call and the categorical after it), each from the generator passed (the references
draw the Gaussians on the CPU's global generator: on a CPU the same seed gives the same draws).

Conventions against the references: a length that is no multiple of ``B`` generates whole blocks and keeps the
first ``length`` tokens (the references generate whole blocks only); the context a block sees is the last
``context`` tokens before it (BD3-LM's runs: ``context = B``, the previous block, or BOS for the first; the
original decoder: every token before it, here bounded by the position table, ``0``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from ..sampling.samplers import SamplerError

LAYER_NORM_EPS = 1e-5
"""RoBERTa's LayerNorm epsilon (``layer_norm_eps``)."""
POSITION_OFFSET = 2
"""RoBERTa numbers positions from ``padding_idx + 1`` (its pad id is 1)."""
SCHEDULE_S = 1e-4
"""The offset ``s`` of the cosine schedule (Nichol and Dhariwal 2021), as the references set it."""
PROJECTIONS = ("sampling", "multihot")
OPTIONS = ("block_size", "one_hot", "projection", "context", "bos_id")
"""The sampler's options (``kinds.SAMPLERS``)."""
DEFAULT_BLOCK = 25
DEFAULT_ONE_HOT = 5.0
"""The references' block size ``B`` and almost-one-hot scale ``K``."""


class SSDLMError(SamplerError):
    """Bad SSD-LM sampler settings; one line naming the fix."""


# --------------------------------------------------------------------------------------------------
# The network


class _SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, n, d = h.shape

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.query(h)), split(self.key(h)), split(self.value(h)))
        return out.transpose(1, 2).reshape(b, n, d)


class _DenseNorm(nn.Module):
    """``LayerNorm(dropout(dense(x)) + residual)``: RoBERTa's ``SelfOutput`` and ``Output``."""

    def __init__(self, d_in: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS)  # transformers' parameter name
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.add_module("self", _SelfAttention(hidden, heads))  # transformers' name: attention.self.query...
        self.output = _DenseNorm(hidden, hidden, dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self._modules["self"](h), h)


class _Intermediate(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, inner)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(h))


class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inner = cfg.mlp_ratio * cfg.hidden
        self.attention = _Attention(cfg.hidden, cfg.heads, cfg.dropout)
        self.intermediate = _Intermediate(cfg.hidden, inner)
        self.output = _DenseNorm(inner, cfg.hidden, cfg.dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a = self.attention(h)
        return self.output(self.intermediate(a), a)


class _Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.width, cfg.hidden)
        self.position_embeddings = nn.Embedding(cfg.seq_len + POSITION_OFFSET, cfg.hidden)
        self.token_type_embeddings = nn.Embedding(1, cfg.hidden)
        self.LayerNorm = nn.LayerNorm(cfg.hidden, eps=LAYER_NORM_EPS)  # transformers' parameter name
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        n = inputs_embeds.shape[1]
        pos = torch.arange(POSITION_OFFSET, n + POSITION_OFFSET, device=inputs_embeds.device)
        h = inputs_embeds + self.token_type_embeddings.weight[0]
        h = h + self.position_embeddings(pos)
        return self.dropout(self.LayerNorm(h))


class _Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(cfg) for _ in range(cfg.n_blocks))


class _Roberta(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Encoder(cfg)


class _LMHead(nn.Module):
    """dense, GELU, LayerNorm, then the decoder: the word embeddings (tied) and ``bias``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden, cfg.hidden)
        self.layer_norm = nn.LayerNorm(cfg.hidden, eps=LAYER_NORM_EPS)
        self.bias = nn.Parameter(torch.zeros(cfg.width))

    def forward(self, h: torch.Tensor, decoder: torch.Tensor) -> torch.Tensor:
        return F.linear(self.layer_norm(F.gelu(self.dense(h))), decoder, self.bias)


class SSDLM(nn.Module):
    """The released SSD-LM network (module docstring); ``cfg.seq_len`` is the longest input it numbers (RoBERTa's
    ``max_position_embeddings - 2``: context and block together)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.roberta = _Roberta(cfg)
        self.lm_head = _LMHead(cfg)
        self.embed_sum_layer = nn.Linear(cfg.width, cfg.hidden, bias=False)
        self.timestep_layer = nn.Linear(1, cfg.hidden)
        with torch.no_grad():  # the reference starts the simplex projection as the word embeddings, transposed
            self.embed_sum_layer.weight.copy_(self.roberta.embeddings.word_embeddings.weight.t())

    def logits_from_embeds(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """The masked LM's logits ``(B, n, V)`` of input embeddings ``(B, n, H)`` (RoBERTa's ``inputs_embeds``)."""
        h = self.roberta.embeddings(inputs_embeds)
        for layer in self.roberta.encoder.layer:
            h = layer(h)
        return self.lm_head(h, self.roberta.embeddings.word_embeddings.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The masked LM on token ids (what RoBERTa itself reads)."""
        return self.logits_from_embeds(self.roberta.embeddings.word_embeddings(input_ids))

    def block_logits(self, context: torch.Tensor | None, simplex: torch.Tensor, t_frac: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, n, V)`` of the block: ``simplex`` ``(B, n, V)`` at ``t / T`` = ``t_frac`` ``(B,)`` after the
        context ids ``(B, C)`` (None: no context)."""
        b, n, _ = simplex.shape
        x = self.embed_sum_layer(simplex) + self.timestep_layer(t_frac.view(b, 1, 1).expand(b, n, 1))
        c = 0
        if context is not None and context.shape[1]:
            c = context.shape[1]
            x = torch.cat((self.roberta.embeddings.word_embeddings(context), x), dim=1)
        return self.logits_from_embeds(x)[:, c:]


# --------------------------------------------------------------------------------------------------
# The sampler


class Noise(Protocol):
    """Where a decode's randomness comes from: the Gaussians and the categorical draws of the projection."""

    def gaussian(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor: ...

    def categorical(self, probs: torch.Tensor) -> torch.Tensor: ...


@dataclass
class GeneratorNoise:
    """Draws from one ``torch.Generator`` as the references draw from the global one: ``torch.normal(0, 1)`` and
    ``torch.multinomial`` with replacement (``Categorical.sample``)."""

    generator: torch.Generator

    def gaussian(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        return torch.normal(0.0, 1.0, size=shape, generator=self.generator, device=self.generator.device).to(device)

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, 1, True, generator=self.generator).T.reshape(probs.shape[:-1])


def cosine_alpha_bar(t: torch.Tensor, total: int) -> torch.Tensor:
    """``abar_t = f(t) / f(0)``, float32, as the references compute it (``get_time_variables``)."""
    def f(small_t: torch.Tensor) -> torch.Tensor:
        return torch.cos((small_t / total + SCHEDULE_S) / (1 + SCHEDULE_S) * math.pi / 2) ** 2

    return f(t) / f(torch.zeros(t.shape, device=t.device))


def top_p_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The references' nucleus of ``logits`` ``(..., V)``: bool, True on the kept tokens."""
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, indices = torch.sort(probs, dim=-1, descending=True)
    nucleus = torch.cumsum(sorted_probs, dim=-1) < top_p
    nucleus = torch.cat([nucleus.new_ones(nucleus.shape[:-1] + (1,)), nucleus[..., :-1]], dim=-1)
    return nucleus.scatter(-1, indices, nucleus)


def project(logits: torch.Tensor, top_p: float, one_hot: float, projection: str, noise: Noise) -> torch.Tensor:
    """The almost-one-hot point the step moves towards (module docstring): ``sampling`` or ``multihot``."""
    valid = top_p_mask(logits, top_p)
    if projection == "multihot":
        return torch.where(valid, torch.full_like(logits, one_hot), torch.full_like(logits, -one_hot))
    filtered = logits.masked_fill(~valid, -math.inf)
    probs = torch.softmax(filtered - filtered.logsumexp(dim=-1, keepdim=True), dim=-1)  # Categorical(logits=...)
    chosen = noise.categorical(probs)
    return 2 * one_hot * F.one_hot(chosen, logits.shape[-1]).to(logits.dtype) - one_hot


def decode_block(model: SSDLM, context: torch.Tensor | None, *, batch: int, block: int, steps: int, top_p: float,
                 one_hot: float, projection: str, noise: Noise,
                 on_step: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """One block of ``block`` token ids ``(batch, block)`` after ``context`` ``(batch, C)`` by ``steps`` steps of
    simplex diffusion (module docstring). ``on_step(t, logits)`` sees each step's logits."""
    device = next(model.parameters()).device
    width = model.cfg.width
    shape = (batch, block, width)
    x = one_hot * noise.gaussian(shape, device)
    logits = None
    for t in range(steps, 0, -1):
        t_now = torch.full((batch,), float(t), device=device)
        abar_prev = cosine_alpha_bar(t_now - 1, steps).view(-1, 1, 1)
        z = one_hot * noise.gaussian(shape, device)
        logits = model.block_logits(context, torch.softmax(x, dim=-1), t_now / steps)
        proj = project(logits, top_p, one_hot, projection, noise)
        x = torch.sqrt(abar_prev) * proj + torch.sqrt(1 - abar_prev) * z
        if on_step is not None:
            on_step(t, logits)
    assert logits is not None
    return logits.argmax(dim=-1)


def check_options(cfg: ModelConfig, *, block_size: int = DEFAULT_BLOCK, one_hot: float = DEFAULT_ONE_HOT,
                  projection: str = "sampling", context: int = 0) -> int:
    """The context window (tokens) a block sees, or SSDLMError naming the bad option."""
    if block_size < 1:
        raise SSDLMError(f"block_size must be >= 1 (the references: 25), got {block_size}")
    if not one_hot > 0:
        raise SSDLMError(f"one_hot (the almost-one-hot scale K) must be > 0 (the references: 5), got {one_hot}")
    if projection not in PROJECTIONS:
        raise SSDLMError(f"projection must be one of {', '.join(PROJECTIONS)}, got {projection!r}")
    room = cfg.seq_len - block_size
    if room < 1:
        raise SSDLMError(f"block_size {block_size} leaves no room for context in the model's {cfg.seq_len} "
                         "positions: use a smaller block")
    if context < 0 or context > room:
        raise SSDLMError(f"context must lie in [0, {room}] tokens (0: as many as fit beside a block of {block_size} "
                         f"in {cfg.seq_len} positions), got {context}")
    return context or room


def network_calls(length: int, steps: int, options: dict) -> int:
    """The forward passes of ``ssd_sample`` for ``length`` new tokens: ``steps`` per block."""
    return steps * math.ceil(length / options.get("block_size", DEFAULT_BLOCK))


def ssd_sample(model: SSDLM, cfg: ModelConfig, tokens: torch.Tensor, keep: torch.Tensor, *, steps: int,
               nucleus_p: float, generator: torch.Generator, progress: Callable[[int, int], None] | None = None,
               cache: bool = True, stats: dict | None = None, block_size: int = DEFAULT_BLOCK,
               one_hot: float = DEFAULT_ONE_HOT, projection: str = "sampling", context: int = 0,
               bos_id: int | None = None) -> torch.Tensor:
    """SSD-LM's semi-autoregressive decoding of the positions after the given leading ones (the table's
    ``sample`` contract): whole blocks of ``block_size``, ``steps`` per block, top-p ``nucleus_p``, each block after
    the last ``context`` tokens (0: as many as fit). ``bos_id`` opens a row given no token. ``stats['network_calls']``:
    ``steps`` per block."""
    window = check_options(cfg, block_size=block_size, one_hot=one_hot, projection=projection, context=context)
    b, length = tokens.shape
    lead = int(keep.all(0).long().cumprod(0).sum())  # leading positions given in every row
    if bool(keep[:, lead:].any()):
        raise SSDLMError("the ssdlm sampler generates left to right after the given leading tokens: it cannot "
                         "infill (drop the suffix, give the prompt only)")
    x = tokens.clone()
    given = x[:, :lead]
    if lead == 0:
        if bos_id is None:
            raise SSDLMError("the ssdlm sampler needs a first token: pass a prompt or bos_id (the reference starts "
                             "from <s>)")
        given = torch.full((b, 1), bos_id, dtype=torch.long, device=x.device)
    new = length - lead
    blocks = math.ceil(new / block_size)
    noise = GeneratorNoise(generator)
    out = given
    for i in range(blocks):
        ctx = out[:, -window:]
        ids = decode_block(model, ctx, batch=b, block=block_size, steps=steps, top_p=nucleus_p, one_hot=one_hot,
                           projection=projection, noise=noise)
        out = torch.cat([out, ids], dim=1)
        if progress is not None:
            progress(i + 1, blocks)
    if stats is not None:
        stats["network_calls"] = blocks * steps
    x[:, lead:] = out[:, given.shape[1]:given.shape[1] + new]
    return x


__all__ = ["DEFAULT_BLOCK", "DEFAULT_ONE_HOT", "OPTIONS", "PROJECTIONS", "SSDLM", "GeneratorNoise", "Noise",
           "SSDLMError", "check_options", "cosine_alpha_bar", "decode_block", "network_calls", "project", "ssd_sample",
           "top_p_mask"]
