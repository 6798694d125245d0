"""Infilling at the token level: a prompt, an optional suffix and a number of new tokens in between, sampled
with any sampler of ``kinds.SAMPLERS`` (docs/design/method.md, sections 1, 2 and 4). Pure PyTorch.

One row is laid out as::

    [BOS] prompt  <new tokens: the mask id>  suffix

and sampled with ``sample(..., prefix=(tokens, keep))``, ``keep`` marking BOS, prompt and suffix, so that
those tokens are given and never changed (``samplers`` module docstring). What each sampler makes of it:

- the diffusion samplers (``mdlm``, ``remdm-loop``; ADLM through its composed network) see both sides at
  every step: true infilling;
- the block sampler (``bd3lm``) goes left to right block by block, each block seeing the clean blocks
  before it: a block sees the suffix only when it holds part of it ("block-wise" infilling), and the row
  may be longer than the training length (a sliding window of ``seq_len`` tokens);
- the AR sampler cannot look ahead: it continues a prompt, and a suffix is an error.

BOS (when the tokenizer has one) opens the row as every training row does (docs/design/method.md, section 5). The row
must fit the training length ``seq_len`` unless the sampler generates any length (``Sampler.any_length``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..config import KIND_TABLE, ModelConfig
from ..kinds import check_sampler_kind, check_sampler_options, model_kind, sample
from ..sampling.samplers import Progress, SamplerError


@dataclass(frozen=True)
class InfillLayout:
    """Where the parts of one infilling row lie."""

    bos: bool
    """The row opens with the BOS token."""
    prompt: int
    """Tokens of the prompt (after BOS)."""
    new: int
    """Tokens to generate between prompt and suffix."""
    suffix: int
    """Tokens of the suffix (at the end of the row)."""

    @property
    def start(self) -> int:
        """First position of the new tokens."""
        return int(self.bos) + self.prompt

    @property
    def total(self) -> int:
        """Length of the whole row."""
        return self.start + self.new + self.suffix


def plan_infill(cfg: ModelConfig, sampler: str, prompt_len: int, new_tokens: int, suffix_len: int,
                bos_id: int | None, options: dict | None = None) -> InfillLayout:
    """The row's layout, or SamplerError (one line, naming the fix) before any network runs: unknown
    sampler or option, a sampler that does not fit the model kind, a suffix for AR, a row beyond the
    training length without a sampler that generates any length."""
    s = check_sampler_options(sampler, dict(options or {}), length=new_tokens)
    check_sampler_kind(sampler, cfg.kind)
    if new_tokens < 1:
        raise SamplerError(f"length (new tokens) must be >= 1, got {new_tokens}")
    if suffix_len and not s.diffusion:
        raise SamplerError(f"sampler {sampler!r} generates left to right and cannot infill: drop the suffix "
                           "(an AR model continues a prompt) or use a diffusion model")
    # BOS opens the row before a prompt, unless the kind's reference conditions on the prompt alone (SSD-LM)
    bos = bos_id is not None and (KIND_TABLE[cfg.kind].bos_before_prompt or prompt_len == 0)
    layout = InfillLayout(bos=bos, prompt=prompt_len, new=new_tokens, suffix=suffix_len)
    if layout.start == 0 and not s.diffusion:
        raise SamplerError(f"sampler {sampler!r} needs a first token: give a prompt (the tokenizer has no BOS)")
    if layout.total > cfg.seq_len and not s.any_length:
        room = cfg.seq_len - layout.start - layout.suffix
        # No room left for one new token: only a shorter prompt/suffix helps, and the limit is on their tokens.
        fix = (f"ask for length <= {room} (or a shorter prompt/suffix)" if room >= 1 else
               f"the prompt and suffix take {layout.prompt} + {layout.suffix} tokens and leave no room for new ones: "
               f"shorten them (together at most {cfg.seq_len - int(layout.bos) - 1} tokens for length 1)")
        raise SamplerError(
            f"BOS + prompt + length + suffix = {layout.total} tokens exceeds the model's context of {cfg.seq_len} "
            f"for sampler {sampler!r}: {fix}"
            + ("; the bd3lm sampler generates any length" if KIND_TABLE[cfg.kind].block_diffusion else ""))
    return layout


def infill(model: nn.Module, cfg: ModelConfig, prompt_ids: Sequence[int], suffix_ids: Sequence[int] = (), *,
           new_tokens: int, steps: int, sampler: str | None = None, nucleus_p: float = 1.0,
           generator: torch.Generator, num_samples: int = 1, bos_id: int | None = None,
           progress: Progress | None = None, stats: dict | None = None, **options) -> torch.Tensor:
    """The ``new_tokens`` ids between ``prompt_ids`` and ``suffix_ids``: LongTensor ``(num_samples, new_tokens)``.

    ``sampler``: a name of ``kinds.SAMPLERS`` (default: the model kind's ``default_sampler``); ``steps``,
    ``nucleus_p``, ``generator``, ``progress`` and ``options`` as in ``kinds.sample``. ``bos_id``: the
    tokenizer's BOS, put first as in training (None: no BOS; a kind whose reference conditions on the prompt alone,
    ``ModelKind.bos_before_prompt``, puts it first only given no prompt). ``stats`` (a dict) receives the sampler's counters
    (``network_calls``). The same generator state gives the same ids.
    """
    name = sampler or model_kind(cfg.kind).default_sampler
    prompt, suffix = [int(i) for i in prompt_ids], [int(i) for i in suffix_ids]
    layout = plan_infill(cfg, name, len(prompt), new_tokens, len(suffix), bos_id, options)
    tokens = torch.full((1, layout.total), cfg.mask_id, dtype=torch.long)
    keep = torch.zeros((1, layout.total), dtype=torch.bool)
    given = ([bos_id] if layout.bos else []) + prompt
    tokens[0, :layout.start] = torch.tensor(given, dtype=torch.long)
    keep[0, :layout.start] = True
    if suffix:
        tokens[0, layout.total - len(suffix):] = torch.tensor(suffix, dtype=torch.long)
        keep[0, layout.total - len(suffix):] = True
    device = next(model.parameters()).device
    out = sample(model, cfg, batch_size=num_samples, length=layout.total, steps=steps, sampler=name,
                 nucleus_p=nucleus_p, generator=generator, prefix=(tokens.to(device), keep.to(device)),
                 progress=progress, stats=stats, **options)
    return out[:, layout.start:layout.start + layout.new]


__all__ = ["InfillLayout", "infill", "plan_infill"]
