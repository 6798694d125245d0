"""The machine: its environment (GPU, torch, CUDA, flash-attn) and the measured bf16 matmul peak against
its datasheet's."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .context import (
    DATASHEET_BF16_TFLOPS,
    Ctx,
)

ROOT = Path(__file__).resolve().parents[2]
"""The repository (its commit goes into the environment item)."""

# --------------------------------------------------------------------------------------------
# Matmul peak


def datasheet_tflops(name: str) -> float | None:
    for key, tflops in DATASHEET_BF16_TFLOPS:
        if key.lower() in name.lower():
            return tflops
    return None


def timed(ctx: Ctx, fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Wall seconds of each of ``repeats`` calls (synchronised on CUDA)."""
    for _ in range(warmup):
        fn()
    ctx.sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ctx.sync()
        times.append(time.perf_counter() - t)
    return times


def matmul_peak(ctx: Ctx) -> dict[str, Any]:
    n = ctx.sizes.matmul_n
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    a = torch.randn(n, n, device=ctx.device, dtype=dtype)
    b = torch.randn(n, n, device=ctx.device, dtype=dtype)
    inner = 10 if ctx.cuda else 3

    def run() -> None:
        for _ in range(inner):
            torch.mm(a, b)

    best = min(timed(ctx, run, repeats=5, warmup=2)) / inner
    measured = 2 * n**3 / best / 1e12
    name = torch.cuda.get_device_name(ctx.device) if ctx.cuda else platform.processor() or "cpu"
    sheet = datasheet_tflops(name) if ctx.cuda else None
    ctx.shared["peak_measured"] = measured
    ctx.shared["peak_datasheet"] = sheet
    return {"results": {"matmul_peak_tflops": measured,
                        "datasheet_peak_tflops": sheet if sheet is not None else math.nan},
            "detail": {"n": n, "dtype": str(dtype).removeprefix("torch."), "best_of": 5, "products_per_timing": inner,
                       "device_name": name}}




# --------------------------------------------------------------------------------------------
# Environment


def env_item(ctx: Ctx) -> dict[str, Any]:
    d: dict[str, Any] = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "platform": platform.platform(), "cpu_count": os.cpu_count(), "device": str(ctx.device),
        "tiny": ctx.args.tiny, "compile_backend": ctx.args.compile_backend,
    }
    if ctx.cuda:
        p = torch.cuda.get_device_properties(ctx.device)
        d.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gib=p.total_memory / 2**30,
                 multiprocessors=p.multi_processor_count, cudnn=torch.backends.cudnn.version(),
                 sdpa_enabled={"flash": torch.backends.cuda.flash_sdp_enabled(),
                               "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                               "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                               "math": torch.backends.cuda.math_sdp_enabled()})
        with contextlib.suppress(Exception):
            d["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=10).stdout.strip()
    spec = importlib.util.find_spec("flash_attn")
    d["flash_attn"] = None
    if spec is not None:
        from importlib.metadata import version

        d["flash_attn"] = {"path": spec.origin, "version": None}
        with contextlib.suppress(Exception):
            d["flash_attn"]["version"] = version("flash_attn")
    with contextlib.suppress(Exception):
        d["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                     timeout=10).stdout.strip() or None
    name = d.get("gpu", "cpu")
    return {"results": {"env_gpu": name.replace(" ", "_"), "env_torch": torch.__version__,
                        "env_cuda": torch.version.cuda or "none", "env_flash_attn": int(spec is not None)},
            "detail": d}
