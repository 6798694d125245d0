"""Anchors of a reasoning trace: the tokens the outputs at the ``[ANT]`` positions are trained to predict.

- GSM8K: the numbers of the trace in order, operators and punctuation dropped (``<<16-3-4=9>> <<9*2=18>>``:
  16, 3, 4, 9, 9, 2, 18; two ``[ANT]`` get 16 and 3).
- ProsQA / ProntoQA: the trace's valid nodes (entities and concepts) in order of first appearance, articles,
  connectives, negation and adjectives dropped (``Tom is a terpus. Every terpus is a brimpus.``: Tom, terpus,
  brimpus).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from pipelines.data.reasoning.prontoqa import ADJECTIVES
from pipelines.data.reasoning.rows import ReasoningError, Row

NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
WORD = re.compile(r"[A-Za-z]+")
FUNCTION_WORDS = frozenset({"a", "an", "the", "every", "each", "is", "are", "not", "and", "or", "true", "false"})
"""Words of a trace that are no node (articles, connectives, negation, the truth values)."""


def number_anchors(steps: list[str]) -> list[str]:
    """The numbers of the steps in order (thousands separators dropped)."""
    return [m.replace(",", "") for s in steps for m in NUMBER.findall(s)]


def node_anchors(steps: list[str], drop: frozenset[str] = FUNCTION_WORDS | frozenset(ADJECTIVES)) -> list[str]:
    """The nodes the steps name, each once, in order of first appearance."""
    seen: dict[str, None] = {}
    for s in steps:
        for w in WORD.findall(s):
            if w.lower() not in drop:
                seen.setdefault(w, None)
    return list(seen)


ANCHORS: dict[str, Callable[[list[str]], list[str]]] = {
    "gsm8k": number_anchors, "prosqa": node_anchors, "prontoqa": node_anchors}
"""Each task's anchor rule."""


def anchors_of(task: str, row: Row) -> list[str]:
    """The anchors of a row's steps under ``task``'s rule."""
    if task not in ANCHORS:
        raise ReasoningError(f"unknown reasoning task {task!r}; known: {', '.join(ANCHORS)}")
    return ANCHORS[task](row["steps"])
