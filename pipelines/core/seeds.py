"""Seeds derived from integers: one function for every stream of the pipeline.

Training derives its data-order, noise and dropout seeds per (seed, purpose, epoch, rank); evaluation
its batch and sample seeds per (seed, purpose, batch). ``numpy.random.SeedSequence`` mixes the parts
into independent streams, so the figures do not depend on how work is spread over workers.
"""

from __future__ import annotations

import numpy as np

# Purposes: the second part of every derivation, so that two streams never share a seed.
TRAIN_NOISE, TRAIN_DROPOUT, TRAIN_DATA_ORDER, TRAIN_VALIDATION = 1, 2, 3, 4
EVAL_NELBO, EVAL_SAMPLES, EVAL_MAUVE = 10, 11, 12
EVAL_LONG_SAMPLES = 13
"""The arbitrary-length suite's samples: a stream of their own, apart from ``generate``'s."""


def derive_seed(*parts: int) -> int:
    """A 31-bit seed from integers (accepted by torch, numpy and Ray Data's shuffles)."""
    state = np.random.SeedSequence([int(p) & 0xFFFFFFFFFFFFFFFF for p in parts]).generate_state(1, dtype=np.uint32)
    return int(state[0] >> 1)
