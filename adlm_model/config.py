"""Typed, validated configuration of the models (docs/design/method.md, sections 1-3, 7).

One dataclass describes every model kind (``mdlm``, ``adlm``, ``ar``, ``a2r``, ``bd3lm``, ...); the fields that
only one kind uses say so in their docstring. Presets: ``tiny`` (CPU tests and the demo),
``small`` (the paper's) and ``medium``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

MODEL_KINDS = ("mdlm", "adlm", "ar", "bd3lm", "sedd", "ssdlm", "a2r")


ANCHOR_TARGETS = ("next_anchor", "next_token")
"""A2R's anchor targets (``ModelConfig.anchor_target``)."""


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the field and the fix."""


@dataclass
class ModelConfig:
    """Architecture and objective of one model."""

    kind: str = "adlm"
    """Model kind: ``mdlm``, ``adlm`` (anchor + denoiser), ``ar`` (causal), ``bd3lm`` (blocks), ``sedd`` (score
    entropy, docs/design/method.md, section 8's baseline), ``ssdlm`` (SSD-LM's released network, imported to sample
    only) or ``a2r`` (anchored autoregressive: a causal anchor network + a lightweight AR model)."""
    vocab_size: int = 50257
    """Tokenizer vocabulary size (GPT-2: 50257, bert-base-uncased: 30522)."""
    mask_id: int = 50257
    """Absorbing mask id. GPT-2 appends one (50257); BERT uses its own ``[MASK]`` = 103."""
    seq_len: int = 1024
    """Training sequence length L (rows of the shards)."""
    hidden: int = 768
    """Hidden size of every DiT block."""
    heads: int = 12
    """Attention heads."""
    n_blocks: int = 12
    """Blocks of the backbone; for ADLM and A2R, of the anchor network."""
    denoiser_blocks: int = 6
    """ADLM: blocks of the denoiser (the paper uses ``n_blocks // 2``); A2R: blocks of the lightweight AR model
    (half the anchor's by default, as ADLM's denoiser)."""
    cond_dim: int = 128
    """Width of the timestep (sigma) conditioning vector that drives adaLN."""
    mlp_ratio: int = 4
    """MLP hidden size as a multiple of ``hidden``."""
    dropout: float = 0.1
    """Dropout after attention and MLP (reference 0.1)."""
    time_conditioning: bool | None = None
    """Feed sigma(t) to adaLN. Off (the ADLM reference) feeds sigma = 0: a learned constant. None: the kind's
    reference (SEDD: on, its DiT is time-conditioned; the others: off)."""
    gamma: float = 3e-3
    """ADLM and A2R: the anchor loss weight gamma (docs/design/method.md, sections 2 and 3)."""
    tau: int = 5
    """ADLM and A2R: a token is an anchor when it occurs at most tau times in its own sequence."""
    gamma_beta: float = 1.0
    """ADLM and A2R: beta of the ramp gamma_k = min(gamma, beta k / K) (reference 1): the anchor weight reaches gamma
    after gamma / beta * K steps, so a larger gamma ramps longer (docs/design/method.md, section 2)."""
    gamma_horizon: int = 0
    """ADLM and A2R: K of the ramp. 0: the training run's max_steps (the reference); training fills it in. Set
    explicitly it keeps a ramp fixed across runs of different lengths."""
    anchor_init_std: float = 0.0
    """ADLM and A2R: standard deviation of the anchor network's output-layer weights at initialisation. 0 (the
    paper's, the DiT convention for a final layer): zero, so the anchor logits start at 0 everywhere and the denoiser
    sees the same input at every position until that layer learns; > 0 (e.g. 0.02): N(0, std) weights, zero bias."""
    anchor_target: str = "next_anchor"
    """A2R only: what the anchor network predicts at position l (docs/design/method.md, section 3). ``next_anchor``:
    the next anchor token after l, x^j at the first j > l with a^j = 1 (no anchor loss at l when none follows);
    ``next_token``: x^{l+1}, only where it is an anchor."""
    ar_token_embedding: bool = True
    """A2R only: the AR model embeds its own input tokens and adds the projected anchor logits to them. False:
    its input is the projected anchor logits alone, as ADLM's denoiser's (it still sees the context, through the
    anchor logits)."""
    block_size: int = 4
    """BD3-LM only: block size b (divides ``seq_len``)."""
    noise_eps: float = 1e-3
    """eps of the log-linear schedule alpha_t = 1 - (1 - eps) t."""
    sampling_eps: float = 1e-3
    """Lower bound of training/eval times: t = (1 - sampling_eps) u + sampling_eps."""
    clip_low: float = 0.0
    """BD3-LM clipped schedule: lower bound beta of the masking rate (0 = not clipped)."""
    clip_high: float = 1.0
    """BD3-LM clipped schedule: upper bound omega of the masking rate (1 = not clipped)."""
    adaln: bool | None = None
    """adaLN conditioning of the blocks. None: the kind's reference (the diffusion models: yes; the AR baseline
    of the MDLM/BD3-LM references: no, plain pre-LayerNorm blocks with no time embedding)."""
    ignore_bos: bool | None = None
    """Leave the first position (BOS) out of the loss and the bound, in training and evaluation. None: the
    kind's reference (BD3-LM: yes; MDLM/ADLM: no, the BOS position is scored like any other; AR never scores
    position 0, which is no next-token target)."""

    @property
    def uses_adaln(self) -> bool:
        return self.adaln if self.adaln is not None else _kind(self.kind).adaln

    @property
    def skips_bos(self) -> bool:
        return self.ignore_bos if self.ignore_bos is not None else _kind(self.kind).skips_bos

    @property
    def conditions_on_time(self) -> bool:
        """Whether the network sees sigma(t) (``time_conditioning``, or the kind's reference when None)."""
        return self.time_conditioning if self.time_conditioning is not None else _kind(self.kind).time_conditioned

    @property
    def width(self) -> int:
        """Output width: the vocabulary plus the mask id when it lies outside it."""
        return max(self.vocab_size, self.mask_id + 1)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def validate(self) -> ModelConfig:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(self.kind in MODEL_KINDS, f"unknown model kind {self.kind!r}: use one of {', '.join(MODEL_KINDS)}")
        need(self.vocab_size > 1, f"vocab_size must be > 1, got {self.vocab_size}")
        need(0 <= self.mask_id <= self.vocab_size, f"mask_id {self.mask_id} must lie in [0, vocab_size={self.vocab_size}]")
        need(self.seq_len >= 4, f"seq_len must be >= 4, got {self.seq_len}")
        need(self.hidden > 0 and self.heads > 0, "hidden and heads must be positive")
        need(self.hidden % self.heads == 0, f"hidden {self.hidden} must be divisible by heads {self.heads}")
        need(self.head_dim % 2 == 0, f"head_dim {self.head_dim} must be even for rotary embeddings")
        need(self.n_blocks >= 1, f"n_blocks must be >= 1, got {self.n_blocks}")
        need(not _kind(self.kind).anchored or self.denoiser_blocks >= 1,
             f"{self.kind.upper()} needs denoiser_blocks >= 1 (the second network's blocks)")
        need(self.anchor_target in ANCHOR_TARGETS,
             f"anchor_target must be one of {', '.join(ANCHOR_TARGETS)}, got {self.anchor_target!r}")
        need(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        need(self.gamma >= 0, f"gamma must be >= 0, got {self.gamma}")
        need(self.tau >= 0, f"tau must be >= 0, got {self.tau}")
        need(self.gamma_beta > 0, f"gamma_beta must be > 0, got {self.gamma_beta}")
        need(math.isfinite(self.anchor_init_std) and self.anchor_init_std >= 0,
             f"anchor_init_std must be >= 0 (0: zero, the paper's), got {self.anchor_init_std}")
        need(self.gamma_horizon >= 0, f"gamma_horizon must be >= 0 (0: the run's max_steps), got {self.gamma_horizon}")
        need(0 < self.noise_eps < 1, f"noise_eps must be in (0, 1), got {self.noise_eps}")
        need(0 <= self.sampling_eps < 1, f"sampling_eps must be in [0, 1), got {self.sampling_eps}")
        need(0 <= self.clip_low < self.clip_high <= 1, "need 0 <= clip_low < clip_high <= 1")
        if _kind(self.kind).block_diffusion:
            need(self.block_size >= 1 and self.seq_len % self.block_size == 0,
                 f"block_size {self.block_size} must divide seq_len {self.seq_len}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        return cls(**check_keys(cls, d, "model")).validate()

    def replace(self, **kw: Any) -> ModelConfig:
        check_keys(type(self), kw, "model")
        return dataclasses.replace(self, **kw).validate()


KIND_TABLE: dict[str, Any] = {}
"""The kinds table (``kinds.KINDS``: name -> ``ModelKind``), registered by ``kinds`` when it is imported (the package
imports it). The per-kind defaults (``uses_adaln``, ``skips_bos``, ``conditions_on_time``) are its fields, read here
without this module importing ``kinds`` (which imports this one) and without kind names compared here."""


def _kind(name: str) -> Any:
    if name not in KIND_TABLE:
        raise ConfigError(f"unknown model kind {name!r}: use one of {', '.join(MODEL_KINDS)}")
    return KIND_TABLE[name]


def check_keys(cls: type, d: dict[str, Any], where: str) -> dict[str, Any]:
    """``d`` if every key is a field of dataclass ``cls``; else :func:`refuse_unknown`'s one-line error."""
    refuse_unknown(d, [f.name for f in dataclasses.fields(cls)], where)
    return dict(d)


def refuse_unknown(keys: Iterable[Any], known: Sequence[str], where: str) -> None:
    """The one check of unknown keys (recipes, ``--set``, search spaces, studies, settings): a ConfigError of one
    line naming the unknown key(s), the closest known ones (a likely typo) and every known key."""
    bad = [str(k) for k in keys if k not in known]
    if not bad:
        return
    close = [m for k in bad for m in difflib.get_close_matches(k, known, n=1)]
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    raise ConfigError(f"{where}: unknown key(s) {', '.join(bad)}{hint}; known: {', '.join(known)}")


PRESETS: dict[str, dict[str, Any]] = {
    # CPU-sized: a few million parameters with an 8,192-entry vocabulary (on a CPU the projection over the
    # vocabulary dominates a step: GPT-2's 50,257 entries make one about 2.5x slower).
    "tiny": dict(hidden=256, heads=4, n_blocks=4, denoiser_blocks=2, cond_dim=64,
                 vocab_size=8192, mask_id=8192, seq_len=128),
    # The paper's (docs/design/method.md, section 2): 12 + 6 blocks of 768 with 12 heads, GPT-2 vocabulary.
    "small": dict(hidden=768, heads=12, n_blocks=12, denoiser_blocks=6, cond_dim=128,
                  vocab_size=50257, mask_id=50257, seq_len=1024),
    "medium": dict(hidden=1024, heads=16, n_blocks=24, denoiser_blocks=12, cond_dim=128,
                   vocab_size=50257, mask_id=50257, seq_len=1024),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A preset by name with overrides, validated."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}: use one of {', '.join(PRESETS)}")
    d = {**PRESETS[name], **overrides}
    return ModelConfig.from_dict(d)

