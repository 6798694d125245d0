"""Exponential moving average of the weights (METHOD.md section 7: decay 0.9999, used for
evaluation and sampling)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn


class EMA:
    """Shadow copies of a model's floating-point parameters, updated after each optimiser step."""

    def __init__(self, model: nn.Module, decay: float = 0.9999) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.shadow: dict[str, torch.Tensor] = {
            name: p.detach().clone() for name, p in model.named_parameters() if p.dtype.is_floating_point
        }

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            if name in self.shadow:
                self.shadow[name].lerp_(p.detach(), 1.0 - self.decay)

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
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self.shadow) - set(state)
        if missing:
            raise ValueError(f"EMA state lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
        for name in self.shadow:
            self.shadow[name].copy_(state[name])
