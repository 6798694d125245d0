"""Training FLOPs of one optimiser step, counted on the real network (for equal-compute comparisons).

Counting beats a formula here: the kinds differ in ways a ``6 N D`` rule misses (ADLM runs an anchor of
``n_blocks`` and a denoiser of ``denoiser_blocks`` with a second vocabulary projection in between; BD3-LM
trains on ``x_t (+) x_0``, twice the sequence; the AR baseline has no adaLN). ``torch.utils.flop_counter``
counts the matmuls and attention of one forward and backward pass of the training objective, the operations
that carry the cost; elementwise work is left out, as in every published FLOP figure.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from adlm_model.config import ModelConfig
from adlm_model.kinds import build_model, compute_loss


def training_flops_per_row(cfg: ModelConfig, rows: int = 2) -> int:
    """FLOPs of the forward and backward pass of ``cfg``'s training loss, per row of ``cfg.seq_len`` tokens.

    Counted on ``rows`` rows of random tokens (the count does not depend on their values) and divided by
    ``rows``; multiply by the global batch for one optimiser step.
    """
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    g = torch.Generator().manual_seed(0)
    model = build_model(cfg).train()
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=g)
    x[x == cfg.mask_id] = (cfg.mask_id + 1) % cfg.vocab_size  # data never holds the mask token
    counter = FlopCounterMode(display=False)
    with counter:
        out = compute_loss(model, x, None, cfg, step=1, train=True, generator=g)
        out.loss.backward()
    return int(counter.get_total_flops()) // rows
