"""Training FLOPs of one optimiser step, counted on the real network (for equal-compute comparisons).

Counting beats a formula here: the kinds differ in ways a ``6 N D`` rule misses (ADLM runs an anchor of
``n_blocks`` and a denoiser of ``denoiser_blocks`` with a second vocabulary projection in between, and A2R the
same two causal networks with its projection ``Linear(width -> hidden)``, the AR model's output over the ``L - 1``
next-token targets; BD3-LM trains on ``x_t (+) x_0``, twice the sequence; the AR baseline has no adaLN). ``torch.utils.flop_counter``
counts the matmuls of one forward and backward pass of the training objective, the operations that carry the
cost; elementwise work is left out, as in every published FLOP figure.

Attention: torch's counter knows only the CUDA attention kernels (flash, memory-efficient, cuDNN). On CPU,
``scaled_dot_product_attention`` runs ``_scaled_dot_product_flash_attention_for_cpu`` (and its backward), which
the counter would skip, so that QK^T and AV were missing from every CPU count. ``CPU_ATTENTION`` maps them to
torch's own SDPA formulas: forward QK^T and AV (``4 L^2 d`` a head), backward the recomputed scores and four
gradient matmuls (``10 L^2 d``). Like torch's, the count is of full attention: causal and block masks do not
lower it (the kernels compute whole tiles).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from adlm_model.config import ModelConfig
from adlm_model.kinds import build_model, compute_loss


def _forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


_aten = torch.ops.aten
CPU_ATTENTION = {op: fn for op, fn in (
    (getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None), _forward),
    (getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None), _backward),
) if op is not None}
"""The CPU attention kernels and their FLOP formulas (module docstring)."""


def objective_flops(objective: torch.nn.Module, x: torch.Tensor, noise: object) -> int:
    """FLOPs of one forward and backward pass of a ``train_step.Objective`` (or the same interface) on the rows
    ``x`` with the given noise, CPU attention kernels included; the gradients are left in the parameters."""
    k = torch.zeros((), dtype=torch.float64, device=x.device)
    counter = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION)
    with counter:
        objective(x, None, noise, k, True).loss.backward()
    return int(counter.get_total_flops())


def training_flops_per_row(cfg: ModelConfig, rows: int = 2, count_attention: bool = True) -> int:
    """FLOPs of the forward and backward pass of ``cfg``'s training loss, per row of ``cfg.seq_len`` tokens.

    Counted on ``rows`` rows of random tokens (the count does not depend on their values) and divided by
    ``rows``; multiply by the global batch for one optimiser step. ``count_attention=False`` leaves the CPU
    attention kernels out (what this function counted before they were mapped; for comparisons only).
    """
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    g = torch.Generator().manual_seed(0)
    model = build_model(cfg).train()
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=g)
    x[x == cfg.mask_id] = (cfg.mask_id + 1) % cfg.vocab_size  # data never holds the mask token
    counter = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION if count_attention else None)
    with counter:
        out = compute_loss(model, x, None, cfg, step=1, train=True, generator=g)
        out.loss.backward()
    return int(counter.get_total_flops()) // rows
