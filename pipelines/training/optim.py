"""The optimiser and the learning-rate schedule of the reference recipe (docs/design/method.md, section 7), from the recipe's
``optim`` section; the step that uses them is ``adlm_model.train.train_step``."""

from __future__ import annotations

from typing import Any

from adlm_model.train.train_step import fused_adamw, lr_factor, lr_schedule
from pipelines.training.config import OptimSection


def build_optimizer(params: Any, o: OptimSection) -> Any:
    """AdamW from the ``optim`` section (fused kernel unless ``optim.fused`` is off)."""
    return fused_adamw(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, fused=o.fused)


def build_schedule(opt: Any, o: OptimSection, max_steps: int) -> Any:
    """Linear warm-up, then constant (reference) or cosine (``lr_factor``)."""
    return lr_schedule(opt, warmup=o.warmup_steps, schedule=o.schedule, max_steps=max_steps, min_ratio=o.min_lr_ratio)


__all__ = ["build_optimizer", "build_schedule", "lr_factor"]
