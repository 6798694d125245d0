"""The row format of the reasoning tasks: Coconut's JSON, ``{"question": str, "steps": [str, ...], "answer": str}``
plus optional keys of a task (ProsQA's ``idx_to_symbol``, ``edges``, ``root``, ``target``, ``neg_target``).

Local files in that format are a JSON list of rows (Coconut's released files) or JSONL (one row a line). A
malformed file is a ``ReasoningError`` (a ``SourceError``: one ``error:`` line, exit 2) that names the file, the
row and what is wrong, before any work.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipelines.data.sources import SourceError

Row = dict[str, Any]
"""One problem: ``question``, ``steps`` (the reasoning trace, one string a step), ``answer`` and optional extras."""

REQUIRED = ("question", "steps", "answer")


class ReasoningError(SourceError):
    """A reasoning source that cannot be used (a malformed row, an unknown task, a bad option); says the fix."""


def check_row(row: Any, where: str) -> Row:
    """``row`` when it has the three fields with the right types; ReasoningError naming ``where`` otherwise."""
    if not isinstance(row, dict):
        raise ReasoningError(f"{where}: a row must be a JSON object with question, steps and answer, "
                             f"not {type(row).__name__}")
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise ReasoningError(f"{where}: no {', '.join(missing)} (fields: {', '.join(row) or 'none'}); rows need "
                             "question (text), steps (a list of texts) and answer (text)")
    if not isinstance(row["question"], str) or not isinstance(row["answer"], str):
        raise ReasoningError(f"{where}: question and answer must be texts")
    steps = row["steps"]
    if not isinstance(steps, list) or not all(isinstance(s, str) for s in steps):
        raise ReasoningError(f"{where}: steps must be a list of texts, got {type(steps).__name__}")
    return row


def parse_rows(text: str, name: str) -> list[Row]:
    """Rows of a file's text: a JSON list (``.json``), else one JSON object a line (JSONL)."""
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ReasoningError(f"{name}: not valid JSON ({e.msg} at line {e.lineno}); pass a JSON list of rows or "
                                 "JSONL, one row a line") from None
        return [check_row(r, f"{name}: row {i}") for i, r in enumerate(data)]
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReasoningError(f"{name}: line {i} is not valid JSON ({e.msg}); pass a JSON list of rows or JSONL, "
                                 "one row a line") from None
        rows.append(check_row(rec, f"{name}: line {i}"))
    return rows


def read_rows(path: str | Path) -> list[Row]:
    """Rows of a local JSON / JSONL file in Coconut's format; ReasoningError when it is missing or malformed."""
    p = Path(path)
    if not p.is_file():
        raise ReasoningError(f"{path}: no such file; pass a JSON or JSONL file of question/steps/answer rows")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ReasoningError(f"{path}: not UTF-8 text; pass a JSON or JSONL file") from None
    rows = parse_rows(text, str(path))
    if not rows:
        raise ReasoningError(f"{path}: no rows; pass a file with at least one question/steps/answer row")
    return rows
