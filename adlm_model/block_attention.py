"""BD3-LM's attention masks and its one network pass over ``[x_t ; x_0]`` (METHOD.md section 3).

Torch only (beside ``backbone``): this module travels, with ``config``, ``attention``, ``backbone`` and
``models``, into an exported folder as the network code ``transformers`` loads (``pretrained``), so the
objective (``bd3lm``) and the exported model compute the same pass from the same lines.
"""

from __future__ import annotations

import torch

from .backbone import DiT


def block_diff_mask(length: int, block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The training mask over ``[x_t ; x_0]`` (2L x 2L, True = may attend).

    Block-diagonal inside ``x_t`` and inside ``x_0``; ``x_t`` -> strictly earlier blocks of
    ``x_0`` (offset block-causal); ``x_0`` -> earlier-or-same blocks of ``x_0`` (block-causal).
    """
    idx = torch.arange(2 * length, device=device)
    is_x0 = idx >= length
    blk = torch.where(is_x0, idx - length, idx) // block_size
    bq, bk = blk[:, None], blk[None, :]
    x0q, x0k = is_x0[:, None], is_x0[None, :]
    diagonal = (bq == bk) & (x0q == x0k)
    offset_causal = (bq > bk) & x0k & ~x0q
    causal = (bq >= bk) & x0k & x0q
    return diagonal | offset_causal | causal


def block_causal_mask(length: int, block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(L x L) block-causal mask: position i may attend j when block(i) >= block(j)."""
    blk = torch.arange(length, device=device) // block_size
    return blk[:, None] >= blk[None, :]


def block_diffusion_pass(net: DiT, z_t: torch.Tensor, x0: torch.Tensor, sigma: torch.Tensor,
                         block_size: int) -> torch.Tensor:
    """Logits (B, L, width) for the ``x_t`` half of one pass of ``net`` over ``[x_t ; x_0]`` under
    ``block_diff_mask``; both halves at rotary positions ``0..L-1``."""
    length = z_t.shape[1]
    mask = block_diff_mask(length, block_size, z_t.device)
    pos = torch.arange(length, device=z_t.device).repeat(2)
    h = net.trunk(net.embed(torch.cat([z_t, x0], dim=1)), sigma, mask=mask, position_ids=pos)
    return net.output_layer.linear(h[:, :length])


__all__ = ["block_causal_mask", "block_diff_mask", "block_diffusion_pass"]
