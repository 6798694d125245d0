"""Exponential moving average of the weights (docs/design/method.md, section 7: decay 0.9999, used for evaluation and
sampling), with the references' warm-up.

The MDLM / BD3-LM / ADLM references count optimiser updates ``n`` and use ``decay_n = min(decay, (1 + n) /
(10 + n))`` at update ``n`` (``n`` counted from 1, incremented before the decay is computed): 0.18 at the
first update, 0.55 at the tenth, 0.99 after about 900. Without it a 0.9999 average would still be 61% the
random initialisation after 5,000 updates. ``num_updates`` is part of the training state: checkpoints store
it and a resumed run continues the same sequence of decays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn

from ..compat.torch import foreach_lerp_


def warmup_decay(decay: float, n: int) -> float:
    """The decay applied at update ``n`` (1-based): ``min(decay, (1 + n) / (10 + n))``."""
    return min(decay, (1.0 + n) / (10.0 + n))


class EMA:
    """Shadow copies of a model's floating-point parameters, updated after each optimiser step."""

    def __init__(self, model: nn.Module, decay: float = 0.9999, warmup: bool = True) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.warmup = warmup
        """Use the references' warm-up (``warmup_decay``); False: ``decay`` from the first update."""
        self.num_updates = 0
        self.shadow: dict[str, torch.Tensor] = {
            name: p.detach().clone() for name, p in model.named_parameters() if p.dtype.is_floating_point
        }

    def current_decay(self) -> float:
        """The decay the next update will use."""
        return warmup_decay(self.decay, self.num_updates + 1) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        d = self.current_decay()
        self.num_updates += 1
        pairs = [(self.shadow[name], p.detach()) for name, p in model.named_parameters() if name in self.shadow]
        shadows, params = [s for s, _ in pairs], [p for _, p in pairs]
        if all(type(s) is torch.Tensor for s in shadows):  # one fused update (plain tensors; not FSDP's DTensors)
            foreach_lerp_(shadows, params, 1.0 - d)
            return
        for s, p in pairs:
            s.lerp_(p, 1.0 - d)

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            if name in self.shadow:
                p.copy_(self.shadow[name])

    @contextlib.contextmanager
    def applied(self, model: nn.Module) -> Iterator[nn.Module]:
        """Temporarily swap the EMA weights into ``model`` (evaluation, sampling)."""
        backup = {name: p.detach().clone() for name, p in model.named_parameters() if name in self.shadow}
        self.copy_to(model)
        try:
            yield model
        finally:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name in backup:
                        p.copy_(backup[name])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The shadow weights (what ``ema.safetensors`` holds; ``num_updates`` travels in the trainer state)."""
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, torch.Tensor], num_updates: int | None = None) -> None:
        missing = set(self.shadow) - set(state)
        if missing:
            raise ValueError(f"EMA state lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
        for name in self.shadow:
            self.shadow[name].copy_(state[name])
        if num_updates is not None:
            self.num_updates = int(num_updates)
