"""Shared helpers of the benchmarks: timing medians and the machine's fp32 matmul speed."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_flops(n: int = 2048, repeats: int = 5) -> float:
    """Achievable fp32 matmul FLOP/s of this machine on all its threads (2 n^3 per product)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / median_time(lambda: a @ b, repeats=repeats, warmup=2)


def result(name: str, value: float) -> None:
    print(f"RESULT {name}={value:.4g}", flush=True)
