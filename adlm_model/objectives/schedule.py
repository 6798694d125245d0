"""Noise schedules and the sampling of diffusion times (docs/design/method.md, section 1).

The log-linear schedule alpha_t = 1 - (1 - eps) t is the reference; the masking ("move")
probability of the forward process is 1 - alpha_t and the NELBO weight
w(t) = -alpha'_t / (1 - alpha_t) is exactly 1/t for it.
"""

from __future__ import annotations

import torch


class LogLinearSchedule:
    """alpha_t = 1 - (1 - eps) t, sigma(t) = -log1p(-(1 - eps) t) (docs/design/method.md, section 1)."""

    def __init__(self, eps: float = 1e-3) -> None:
        self.eps = eps

    def alpha(self, t: torch.Tensor) -> torch.Tensor:
        return 1 - (1 - self.eps) * t

    def sigma(self, t: torch.Tensor) -> torch.Tensor:
        """Total noise sigma(t); alpha_t = exp(-sigma). Fed to adaLN when time conditioning is on."""
        return -torch.log1p(-(1 - self.eps) * t)

    def move_chance(self, t: torch.Tensor) -> torch.Tensor:
        """Probability that a token is masked at time t: 1 - alpha_t."""
        return (1 - self.eps) * t

    def loss_weight(self, t: torch.Tensor) -> torch.Tensor:
        """w(t) = -alpha'_t / (1 - alpha_t) = (1 - eps) / ((1 - eps) t) = 1/t."""
        return 1.0 / t


def antithetic_times(batch: int, generator: torch.Generator | None = None, sampling_eps: float = 1e-3,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """Stratified times in a batch: t_i = (u/B + i/B) mod 1, then t = (1 - eps) t + eps."""
    u = torch.rand(1, generator=generator, device=device, dtype=torch.float64)
    i = torch.arange(batch, device=device, dtype=torch.float64)
    t = (u / batch + i / batch) % 1.0
    return ((1 - sampling_eps) * t + sampling_eps).float()


def mask_tokens(x: torch.Tensor, move_chance: torch.Tensor, mask_id: int,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward process: each token independently becomes ``mask_id`` with ``move_chance``.

    ``move_chance`` broadcasts against ``x`` (shape (B, 1) for one t per sequence, (B, L) per token).
    Returns ``(z_t, is_masked)``.
    """
    u = torch.rand(x.shape, generator=generator, device=x.device)
    masked = u < move_chance
    return torch.where(masked, torch.full_like(x, mask_id), x), masked
