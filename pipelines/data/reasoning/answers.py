"""Reading an answer off generated text and scoring it, as Coconut does: the answer is the text after the last
``#``, compared by exact match (surrounding space and thousands separators dropped)."""

from __future__ import annotations


def extract_answer(text: str) -> str:
    """The text after the last ``#`` (the whole text when there is none), stripped, commas dropped."""
    return text.rsplit("#", 1)[-1].replace(",", "").strip()


def exact_match(generated: str, gold: str) -> bool:
    """Whether the answer read off ``generated`` equals ``gold`` (read the same way)."""
    return extract_answer(generated) == extract_answer(gold)
