"""BD3-LM's attention masks and its one network pass over ``[x_t ; x_0]`` (docs/design/method.md, section 3).

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


FLEX_ATTENTION = "auto"
"""How the training pass over ``[x_t ; x_0]`` attends: ``auto`` through FlexAttention on CUDA under
``torch.compile`` (where it is a fused kernel that skips the masked tiles, about half of the 2L x 2L scores) and
through SDPA with the dense mask elsewhere (FlexAttention unfused is slower, and has no backward on a CPU);
``on`` / ``off`` force it (tests, timings)."""

_BLOCK_MASKS: dict[tuple[int, int, str], object] = {}
_DENSE_MASKS: dict[tuple[int, int, str], torch.Tensor] = {}


def block_diff_mask_mod(length: int, block_size: int):
    """``block_diff_mask`` as FlexAttention's ``mask_mod(b, h, q, kv)``."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        x0q, x0k = q >= length, kv >= length
        bq = torch.where(x0q, q - length, q) // block_size
        bk = torch.where(x0k, kv - length, kv) // block_size
        return ((bq == bk) & (x0q == x0k)) | ((bq > bk) & x0k & ~x0q) | ((bq >= bk) & x0k & x0q)

    return mask_mod


def dense_block_mask(length: int, block_size: int, device: torch.device | str) -> torch.Tensor:
    """``block_diff_mask``, built once per (length, block size, device) and reused by every pass. Built outside a
    compiled region before the first compiled pass (``prepare_block_mask``): a compiled pass only reads it (built
    inside the graph, inductor on a CPU fails on its index arithmetic: "A Boolean argument can only be used in Eq
    and Ne", torch 2.13)."""
    key = (length, block_size, str(torch.device(device)))
    if key not in _DENSE_MASKS:
        if len(_DENSE_MASKS) >= 16:
            _DENSE_MASKS.clear()
        _DENSE_MASKS[key] = block_diff_mask(length, block_size, device)
    return _DENSE_MASKS[key]


def flex_block_mask(length: int, block_size: int, device: torch.device | str):
    """FlexAttention's ``BlockMask`` of ``block_diff_mask``, built once per (length, block size, device). Called
    outside a compiled region before the first compiled pass (``prepare_block_mask``), so that the compiled pass
    only reads it."""
    key = (length, block_size, str(torch.device(device)))
    if key not in _BLOCK_MASKS:
        from torch.nn.attention.flex_attention import create_block_mask

        _BLOCK_MASKS[key] = create_block_mask(block_diff_mask_mod(length, block_size), None, None, 2 * length,
                                              2 * length, device=device)
    return _BLOCK_MASKS[key]


def uses_flex(device: torch.device) -> bool:
    if FLEX_ATTENTION == "auto":
        return device.type == "cuda" and torch.compiler.is_compiling()
    return FLEX_ATTENTION == "on"


def prepare_block_mask(length: int, block_size: int, device: torch.device) -> None:
    """Build the mask a compiled pass on ``device`` will read: FlexAttention's where it attends through it (on
    CUDA under ``auto``), else the dense one."""
    if FLEX_ATTENTION == "on" or (FLEX_ATTENTION == "auto" and device.type == "cuda"):
        flex_block_mask(length, block_size, device)
    else:
        dense_block_mask(length, block_size, device)


def block_diffusion_head(net: DiT, z_t: torch.Tensor, x0: torch.Tensor, sigma: torch.Tensor, block_size: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``x_t`` half's final hidden state (B, L, hidden) of one pass of ``net`` over ``[x_t ; x_0]`` under
    ``block_diff_mask`` (both halves at rotary positions ``0..L-1``), and the output projection."""
    length = z_t.shape[1]
    if uses_flex(z_t.device):
        mask = flex_block_mask(length, block_size, z_t.device)
    else:
        mask = dense_block_mask(length, block_size, z_t.device)
    pos = torch.arange(length, device=z_t.device).repeat(2)
    h = net.trunk(net.embed(torch.cat([z_t, x0], dim=1)), sigma, mask=mask, position_ids=pos)
    lin = net.output_layer.linear
    return h[:, :length], lin.weight, lin.bias


def block_diffusion_pass(net: DiT, z_t: torch.Tensor, x0: torch.Tensor, sigma: torch.Tensor,
                         block_size: int) -> torch.Tensor:
    """Logits (B, L, width) for the ``x_t`` half of one pass of ``net`` over ``[x_t ; x_0]`` under
    ``block_diff_mask``; both halves at rotary positions ``0..L-1``."""
    h, w, b = block_diffusion_head(net, z_t, x0, sigma, block_size)
    return torch.nn.functional.linear(h, w, b)


__all__ = ["FLEX_ATTENTION", "block_causal_mask", "block_diff_mask", "block_diff_mask_mod", "block_diffusion_head",
           "block_diffusion_pass", "dense_block_mask", "flex_block_mask", "prepare_block_mask"]
