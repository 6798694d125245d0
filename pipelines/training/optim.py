"""The optimiser and the learning-rate schedule of the reference recipe (METHOD.md section 7)."""

from __future__ import annotations

import math
from typing import Any

from pipelines.training.config import OptimSection


def build_optimizer(params: Any, o: OptimSection) -> Any:
    """AdamW from the ``optim`` section (fused kernel unless ``optim.fused`` is off)."""
    import torch

    kw = {"fused": True} if o.fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, **kw)


def lr_factor(step: int, warmup: int, schedule: str, max_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then constant (reference) or cosine down to ``min_ratio``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, max_steps - warmup)
    prog = min(1.0, (step - warmup) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))
