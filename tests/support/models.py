"""Tiny models for the model-core, sampler and BD3-LM tests: a micro config and a randomised network (the
zero-initialised output layers would otherwise give uniform distributions and hide every difference)."""

from __future__ import annotations

import torch
import torch.nn as nn

from adlm_model import ModelConfig, build_model, preset

V, M, L = 48, 48, 24


def micro(kind: str, **kw) -> ModelConfig:
    """A two-block model of ``kind`` over a 48-token vocabulary (mask appended: 48), rows of 24."""
    base = dict(hidden=32, heads=2, n_blocks=2, denoiser_blocks=1, cond_dim=16, vocab_size=V, mask_id=M, seq_len=L,
                block_size=4, dropout=0.0)
    return preset("tiny", kind=kind, **{**base, **kw})


def randomized(cfg: ModelConfig, seed: int = 0, std: float = 0.3) -> nn.Module:
    """``build_model(cfg)`` with every weight drawn N(0, std^2), in eval mode."""
    model = build_model(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.eval()


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
