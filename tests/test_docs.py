"""The documentation: README.md as the front door, the mkdocs site under ``docs/`` built strictly (a dead link, a
missing page or anchor fails), every figure-bearing record the docs name present, and no tracked file narrating
how the project was built (who worked on it, in which session or round, first-person remarks)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# ---- the project speaks of itself only ----------------------------------------------------------------------

_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
             "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|last|previous|next")
NARRATION: dict[str, re.Pattern[str]] = {
    "a numbered or dated session": re.compile(r"\b(sessions?|session's) ([0-9]+|of this|before)\b", re.I),
    "this round / this session": re.compile(r"\bthis (round|session|turn)\b", re.I),
    "an issue or stop number": re.compile(r"\b(issues?|stops?) #?[0-9]{1,3}\b", re.I),
    "whoever": re.compile(r"\bwhoever\b", re.I),
    "an ordinal session": re.compile(rf"\b(the|a|an|its|this) ({_ORDINALS}) (session|turn)s?\b", re.I),
    "a session or round of this round": re.compile(r"\b(session|round)s? of this\b", re.I),
    "a session in time": re.compile(r"\bsessions? (ago|earlier|later)\b", re.I),
    "first person": re.compile(r"\bI (did|chose|measured|left|ran|found|changed|added|fixed|used|kept|think|tried|"
                               r"saw|wrote|removed|made|decided|believe|noticed)\b"),
    "first-person possessive": re.compile(r"\b[Mm]y [a-z]\w*"),
}
"""What narration looks like. Each pattern names a slip found in this repository's history, not a style rule."""

ALLOWED: tuple[tuple[str, re.Pattern[str]], ...] = (
    # Ray's and pytest's own session notions, named as their APIs name them.
    ("*", re.compile(r"scope=\"session\"|ray session|session Ray|Ray session")),
    # SDTT's rounds are the method's own (distillation rounds), as is ``rounds x steps_per_round``.
    ("*", re.compile(r"SDTT rounds?|distillation rounds?|rounds x steps_per_round")),
)
"""(file glob, line pattern): a line of a file matching both is not narration."""

BINARY = {".json", ".csv", ".parquet", ".png", ".safetensors", ".ckpt", ".pt", ".jsonl", ".bin", ".log", ".gz",
          ".tgz", ".zip", ".gguf", ".pkl", ".npy", ".npz", ".jpg", ".svg", ".ico"}
"""Data and binary files: measured output, not the project's prose."""


def _text_files() -> list[Path]:
    """Every file git tracks or would track (untracked but not ignored), minus data and binaries, and minus this
    file, whose examples of narration are the check's own fixtures."""
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         capture_output=True, text=True, check=True).stdout
    files = []
    for name in sorted(set(filter(None, out.split("\0")))):
        path = ROOT / name
        if path.suffix.lower() in BINARY or not path.is_file() or path == Path(__file__).resolve():
            continue
        files.append(path)
    return files


def narration(path: Path, text: str) -> list[str]:
    """``path:line: what -- the line`` for each line of ``text`` that narrates."""
    from fnmatch import fnmatch

    rel = path.relative_to(ROOT).as_posix() if path.is_absolute() else path.as_posix()
    allowed = [pattern for glob, pattern in ALLOWED if fnmatch(rel, glob)]
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in NARRATION.items():
            m = pattern.search(line)
            if m and not any(a.search(line) for a in allowed):
                found.append(f"{rel}:{n}: {what} ({m.group(0)!r}) -- {line.strip()[:140]}")
                break
    return found


def test_no_tracked_file_narrates_the_project_s_history() -> None:
    """Code, comments, docstrings, tests, configs, scripts and docs say what a thing is and why, never who built it
    when: no session or round numbers, no issue or stop numbers, no "whoever", no first-person remarks."""
    found = []
    for path in _text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += narration(path, text)
    assert not found, f"{len(found)} line(s) narrate the project's history; say what the thing is instead:\n" + \
        "\n".join(found)


@pytest.mark.parametrize("line", [
    "Measured at the eleventh session (load 20).",
    "Since session 13 a model whose bound is farther ...",
    "Before this round the demo read 4,914.",
    "a question for the issue's owner; I did not change it",
    "after my deletion of old clones",
    "a choice for whoever files the issues",
    "the sweep waited until killed (issue 38)",
    "CI for the final code (stop 46)",
])
def test_the_narration_check_sees_each_known_slip(line: str) -> None:
    assert narration(Path("x.py"), line), line


@pytest.mark.parametrize("line", [
    '@pytest.fixture(scope="session")',
    "each of distill.rounds SDTT rounds is rounds x steps_per_round optimiser steps",
    "steps = int(round((1.0 - w) / delta))",
    "the Ray session logs",
    "Issues and pull requests are welcome.",
])
def test_the_narration_check_leaves_plain_words_alone(line: str) -> None:
    assert not narration(Path("x.py"), line), line
