"""Attention kernels: flash-attn when importable on CUDA, PyTorch SDPA everywhere else.

Masks: bidirectional (``mask=None, causal=False``), causal, an arbitrary boolean mask (True = may attend)
broadcastable to (B, H, Lq, Lk), or a FlexAttention ``BlockMask`` (the block-diffusion objective's, compiled on
CUDA: ``block_attention``).
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention


def _load_flash_attn():
    if importlib.util.find_spec("flash_attn") is None:  # the common case, without importing anything
        return None
    try:  # optional extra `gpu`; never required
        from flash_attn import flash_attn_func  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return flash_attn_func


FLASH_ATTN = _load_flash_attn()
"""flash-attn's ``flash_attn_func`` or None, resolved once at import. Not at the first call: under
``torch.compile`` that call is traced, and the failed import inside it breaks the graph (dynamo on torch 2.13:
"Import failure"), so every compiled block on CUDA would be split in two wherever flash-attn is not installed."""


CACHED_STEP_BACKENDS: list | None = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""SDPA's kernels for a cached decoding step (fewer queries than keys: AR's KV cache, BD3-LM's block cache); None
leaves the choice to SDPA. cuDNN is left out: it builds a graph for every new shape (tens to hundreds of ms,
reported by MLX's and SGLang's cuDNN attention work), and each decoding step's key length is new. On the first
H100 run, with cuDNN chosen, AR's and BD3-LM's cached steps cost 74 and 65 ms a call at batch 16, more than a
whole uncached MDLM forward at L = 1024 (36 ms). benchmarks/gpu_check.py times both ways (``..._with_cudnn``)."""


def flash_available(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and FLASH_ATTN is not None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """q: (B, Lq, H, D), k/v: (B, Lk, H, D) -> (B, Lq, H, D).

    With ``causal`` and Lq < Lk (a KV cache), query i sits at absolute position Lk - Lq + i
    (bottom-right alignment, as flash-attn does).
    """
    if mask is not None and not isinstance(mask, torch.Tensor):  # a FlexAttention BlockMask (block_attention)
        # Contiguous (B, H, L, D): fed the transposed views of the rotary output, the kernel inductor compiles on a
        # CPU (torch 2.13) read them wrongly (a block's output 0.35 off, the loss 4.5e-4 relative).
        return flex_attention(*(t.transpose(1, 2).contiguous() for t in (q, k, v)), block_mask=mask).transpose(1, 2)
    lq, lk = q.shape[1], k.shape[1]
    if causal and lq == 1:
        # One query (a KV-cached decoding step) sits at the last position and sees every key: no mask to build
        # each step, which also leaves SDPA's flash kernel eligible (a boolean mask rules it out).
        causal = False
    if mask is None and flash_available(q):
        return FLASH_ATTN(q, k, v, causal=causal)
    if causal and lq != lk:
        pos_q = torch.arange(lk - lq, lk, device=q.device)
        mask = pos_q[:, None] >= torch.arange(lk, device=q.device)[None, :]
        causal = False
    # On CUDA only: a CPU has no cuDNN kernel, and the context costs a decoding step about 35 Python calls a layer
    # (BD3-LM's KV-cached block sampler on a CPU spent 6% of its time there).
    kernels = (sdpa_kernel(CACHED_STEP_BACKENDS) if lq != lk and CACHED_STEP_BACKENDS and q.is_cuda
               else contextlib.nullcontext())
    with kernels:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask, is_causal=causal and mask is None)
    return out.transpose(1, 2)
