"""The check's settings and the run's context: the kinds it trains, the goals and tolerances, the sizes
(full and ``--tiny``), ``Ctx`` (device, sizes, autocast, figures handed between items) and the helpers
every item family uses."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from adlm_model import preset
from adlm_model.config import ModelConfig
from adlm_model.kinds import KINDS

KINDS = {k: v for k, v in KINDS.items() if not v.sample_only}  # the trained kinds (SSD-LM is sample-only)
TRAINED = tuple(k for k, v in KINDS.items() if v.train_objective is not None)
"""The kinds that train (a kind of ``adlm_model.kinds.KINDS`` added later is covered without touching this file)."""
GOALS = {"mdlm": 1.0, "ar": 1.0, "adlm": 0.95, "sedd": 0.95, "bd3lm": 0.85, "a2r": 0.95}
"""The least ``train_over_anchor_<kind>`` each kind should reach (a kind not named: 1.0)."""
MFU_GOAL = {"mdlm": 0.55}
"""The least MFU of the measured matmul peak."""

DATASHEET_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0), ("A100", 312.0))
"""Dense bf16 tensor-core peaks by GPU name (first match wins; the SXM parts where no form factor is named)."""

LOSS_REL_TOL = 0.01
GRAD_COSINE_MIN = 0.995
COMPILED_LOSS_REL_TOL = 1e-5
COMPILED_GRAD_COSINE_MIN = 0.9999
COMPILED_GRAD_MAX_REL_TOL = 1e-3
"""The compiled BD3-LM objective against the eager one, both float32 without TF32 (``correct_compiled``): the
difference is rounding (inductor on a CPU: at most 2.3e-7 of the loss, 7e-7 of the largest gradient); a
miscompiled FlexAttention (its inputs' layout, torch 2.13 on a CPU) put the loss 5.7e-5 to 4.5e-4 off."""
SAMPLER_OPTIONS = {"mdlm", "remdm-loop"}
"""Default samplers whose networks the confidence sampler's dual cache applies to (MDLM-style bidirectional DiTs)."""

ATTENTION_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "cpu",
    "flash_attn::_flash_attn_forward": "flash-attn",
}
"""Profiler operator names of the attention kernels and the name this script reports them by."""


# --------------------------------------------------------------------------------------------
# Sizes


@dataclass(frozen=True)
class Sizes:
    """What each item runs at: the papers' sizes on a GPU, toy sizes with ``--tiny``."""

    train: dict[str, Any]
    """Preset overrides of the training / correctness configurations (on the ``small`` preset)."""
    micro: dict[str, Any]
    """The sampler equalities' two-block model (tests/support/models.py's ``micro``)."""
    correct_rows: int
    train_batch: int
    """The compiled items' and the anchor's batch (halved on out-of-memory)."""
    batch_start: int
    batch_cap: int
    warmup_steps: int
    sample_len: int
    sample_batch: int
    sample_steps: int
    confidence_block: int
    matmul_n: int
    need_scale: float
    """Multiplies each item's ``need_s`` (1 at the papers' sizes; 0 with ``--tiny``: a budget left starts any)."""


FULL = Sizes(train={}, micro=dict(hidden=32, heads=2, n_blocks=2, denoiser_blocks=1, cond_dim=16, vocab_size=48,
                                  mask_id=48, seq_len=24, block_size=4, dropout=0.0),
             correct_rows=2, train_batch=64, batch_start=8, batch_cap=512, warmup_steps=2, sample_len=1024, sample_batch=16,
             sample_steps=1024, confidence_block=32, matmul_n=8192, need_scale=1.0)
TINY = dataclasses.replace(
    FULL, train=dict(hidden=32, heads=2, n_blocks=2, denoiser_blocks=1, cond_dim=16, vocab_size=64, mask_id=64,
                     seq_len=32),
    correct_rows=2, train_batch=2, batch_start=1, batch_cap=2, warmup_steps=1, sample_len=16, sample_batch=2, sample_steps=16,
    confidence_block=8, matmul_n=128, need_scale=0.0)


# --------------------------------------------------------------------------------------------
# The run's context


class CheckFailed(Exception):
    """A correctness check that did not hold (the item's figures are kept)."""


@dataclass
class Ctx:
    args: argparse.Namespace
    device: torch.device
    sizes: Sizes
    t0: float
    shared: dict[str, Any] = field(default_factory=dict)
    """Figures items hand on (the anchor's figures to the kinds, step times to the ratios, the peaks to MFU)."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def gen(self, seed: int) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(seed)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """bf16: the training loop's on CUDA; on a CPU only at ``--tiny``'s toy sizes, where it costs little and
        runs the bf16 code paths (at a real size a bf16 step is ~19x slower than float32 there)."""
        return torch.bfloat16 if self.cuda or self.args.tiny else None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def train_config(self, kind: str, **kw: Any) -> ModelConfig:
        return preset("small", kind=kind, **{**self.sizes.train, **kw})

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float:
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else math.nan


@contextlib.contextmanager
def matmul_precision(p: str) -> Iterator[None]:
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(p)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def randomize(model: nn.Module, std: float, seed: int = 0) -> nn.Module:
    """Every parameter drawn N(0, std^2) from a CPU generator (the same weights on every device): the
    zero-initialised output and adaLN layers would otherwise make every loss log V."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def random_rows(cfg: ModelConfig, rows: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=g)
    x[x == cfg.mask_id] = (cfg.mask_id + 1) % cfg.vocab_size  # data never holds the mask token
    return x.to(device)


def is_oom(e: BaseException) -> bool:
    """Out of device memory, also where a kernel reports it as a plain RuntimeError (cuBLAS, cuDNN workspaces)."""
    msg = str(e)
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in msg or "ALLOC_FAILED" in msg


def free_memory(ctx: Ctx) -> None:
    """Give the device's cached memory back between items (an item's reference cycles first). Not on a CPU:
    nothing to give back, and a full collection with torch loaded costs tenths of a second."""
    if ctx.cuda:
        gc.collect()
        torch.cuda.empty_cache()
