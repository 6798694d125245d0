"""The fast-sampling benchmark's training rows (``benchmarks/fast_sampling.py``): step ``s`` trains on
``Testbed.sample(batch, seed=1000 + s)``, drawn in this process or, with ``workers``, ahead of time in DataLoader
worker processes. The rows are the same either way (each step's are a function of its seed alone, and the loader
keeps the order), so the number of workers is not part of a model's recipe: it only moves the row sampler off the
training loop, which is what holds a large batch back on a GPU machine (the natural preset's sampler is numpy on
the CPU: tens of milliseconds for a few hundred rows, against a step of about 15 ms on the card)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from adlm_model.testbed.language import Testbed

SEED_BASE = 1000
"""Step ``s``'s rows are ``sample(batch, seed=SEED_BASE + s)``: every earlier model was trained on these."""
ROWS_TIMEOUT_S = 300.0
"""Seconds a step waits for its rows from the loader processes (a batch takes well under one)."""


class _StepRows(Dataset):
    def __init__(self, tb: Testbed, batch: int, start: int, steps: int) -> None:
        self.tb, self.batch, self.start, self.steps = tb, batch, start, steps

    def __len__(self) -> int:
        return self.steps - self.start

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tb.sample(self.batch, seed=SEED_BASE + self.start + i)


def step_rows(tb: Testbed, batch: int, start: int, steps: int, workers: int = 0) -> Iterator[torch.Tensor]:
    """The rows of steps ``start .. steps - 1`` in order, each ``(batch, L)``."""
    rows = _StepRows(tb, batch, start, steps)
    if workers <= 0:
        return (rows[i] for i in range(len(rows)))
    # A loader process that dies or hangs raises after ROWS_TIMEOUT_S instead of stalling the run (a killed run
    # resumes from its last checkpoint).
    return iter(DataLoader(rows, batch_size=None, num_workers=workers, prefetch_factor=4, timeout=ROWS_TIMEOUT_S))
