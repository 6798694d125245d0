"""Attention kernels: flash-attn when importable on CUDA, PyTorch SDPA everywhere else.

Masks: bidirectional (``mask=None, causal=False``), causal, or an arbitrary boolean mask
(True = may attend) broadcastable to (B, H, Lq, Lk); the block-diffusion objective needs the last.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=1)
def _flash_attn_func():
    try:  # optional extra `gpu`; never required
        from flash_attn import flash_attn_func  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return flash_attn_func


def flash_available(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _flash_attn_func() is not None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """q: (B, Lq, H, D), k/v: (B, Lk, H, D) -> (B, Lq, H, D).

    With ``causal`` and Lq < Lk (a KV cache), query i sits at absolute position Lk - Lq + i
    (bottom-right alignment, as flash-attn does).
    """
    lq, lk = q.shape[1], k.shape[1]
    if mask is None and flash_available(q):
        return _flash_attn_func()(q, k, v, causal=causal)
    if causal and lq != lk:
        pos_q = torch.arange(lk - lq, lk, device=q.device)
        mask = pos_q[:, None] >= torch.arange(lk, device=q.device)[None, :]
        causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask, is_causal=causal and mask is None)
    return out.transpose(1, 2)
