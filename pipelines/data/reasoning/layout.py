"""The anchored chain-of-thought layout: a row's token ids laid out for one stage of the schedule, with what
the supervised loss scores and where the anchor loss reads.

    BOS question [BoA] [ANT] x k [EoA] steps[removed:] ### answer EOS

``k`` ``[ANT]`` slots sit between the markers (stage ``k``; stage 0 is plain chain of thought with empty
markers); ProsQA's schedule also removes the first ``removed`` steps (one a new ``[ANT]``). The prompt a model
is given at inference is everything up to ``[EoA]``; what follows is generated and scored.

- ``sft_labels[p]``: the next token ``input_ids[p + 1]`` where that token is generated (the steps left, ``###``,
  the answer, EOS), else ``IGNORE``: the question, the markers and the ``[ANT]`` slots are inputs, never scored.
- ``anchor_labels[p]``: the anchor the output at ``p`` is trained to predict through the LM head, else
  ``IGNORE``. ``anchor_position="at"`` (default): the output at the i-th ``[ANT]`` predicts anchor i;
  ``"before"``: the output at the position before it does. ``[ANT]`` slots beyond the anchors get no label.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

IGNORE = -100
"""The label of a position no loss reads (PyTorch's ``ignore_index``)."""
ANCHOR_POSITIONS = ("at", "before")


@dataclass(frozen=True)
class Markers:
    """The ids the layout frames a row with (a reasoning manifest's ids and ``options.markers``)."""

    bos: int
    eos: int
    pad: int
    boa: int
    eoa: int
    ant: int
    answer: tuple[int, ...]
    """The answer marker ``###`` (one or more ids)."""


@dataclass
class Laid:
    """One row laid out: ids, the two label rows (same length) and the prompt's length (through ``[EoA]``)."""

    input_ids: list[int]
    sft_labels: list[int]
    anchor_labels: list[int]
    prompt_len: int


def lay_out(question: Sequence[int], steps: Sequence[Sequence[int]], answer: Sequence[int], anchors: Sequence[int],
            markers: Markers, n_ant: int = 0, *, removed_steps: int = 0, cot: bool = True,
            anchor_position: str = "at") -> Laid:
    """The layout of one row (module docstring); ``cot=False``: no steps at all (the No-CoT arm)."""
    if anchor_position not in ANCHOR_POSITIONS:
        raise ValueError(f"anchor_position {anchor_position!r}: use one of {', '.join(ANCHOR_POSITIONS)}")
    if n_ant < 0 or removed_steps < 0:
        raise ValueError("n_ant and removed_steps must be at least 0")
    prompt = [markers.bos, *question, markers.boa, *([markers.ant] * n_ant), markers.eoa]
    kept = [t for s in steps[removed_steps:] for t in s] if cot else []
    ids = prompt + kept + list(markers.answer) + list(answer) + [markers.eos]
    n = len(ids)
    sft = [IGNORE] * n
    for p in range(len(prompt) - 1, n - 1):
        sft[p] = ids[p + 1]
    anchor = [IGNORE] * n
    first_ant = len(question) + 2
    for i in range(min(n_ant, len(anchors))):
        p = first_ant + i - (1 if anchor_position == "before" else 0)
        anchor[p] = int(anchors[i])
    return Laid(ids, sft, anchor, len(prompt))


def collate(rows: Sequence[Laid], pad: int) -> dict[str, np.ndarray]:
    """A batch of laid rows, right-padded to the longest: ``input_ids`` (``pad``), ``sft_labels`` and
    ``anchor_labels`` (``IGNORE``), ``attention_mask`` (1 on real tokens), all int64."""
    width = max(len(r.input_ids) for r in rows)
    out = {"input_ids": np.full((len(rows), width), pad, np.int64),
           "sft_labels": np.full((len(rows), width), IGNORE, np.int64),
           "anchor_labels": np.full((len(rows), width), IGNORE, np.int64),
           "attention_mask": np.zeros((len(rows), width), np.int64)}
    for b, r in enumerate(rows):
        n = len(r.input_ids)
        out["input_ids"][b, :n] = r.input_ids
        out["sft_labels"][b, :n] = r.sft_labels
        out["anchor_labels"][b, :n] = r.anchor_labels
        out["attention_mask"][b, :n] = 1
    return out
