"""Every benchmark takes ``--record`` and runs its measurement inside ``recording(...)`` (``benchmarks/_record.py``):
read from each script's syntax tree, so the check costs no import and no run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = {"records_from_raw.py"}
"""Scripts beside the benchmarks that measure nothing (it writes the records of runs older than ``--record``)."""
BENCHMARKS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_") and p.name not in TOOLS)
OWN_CHECKS = {"gpu_check.py", "fast_sampling.py"}
"""Checked by their own tests (tests/repo/test_gpu_check.py, tests/repo/test_fast_sampling_bench.py)."""


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)]


def test_the_benchmarks_are_found() -> None:
    assert len(BENCHMARKS) >= 10 and {"step_cost.py", "suite_cpu.py"} <= {p.name for p in BENCHMARKS}


@pytest.mark.parametrize("path", [p for p in BENCHMARKS if p.name not in OWN_CHECKS], ids=lambda p: p.name)
def test_a_benchmark_takes_record_and_records_its_run(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "_record"
                for a in n.names}
    assert {"add_argument", "recording"} <= imported, f"{path.name}: from _record import add_argument, recording"
    # add_argument(parser): _record's, not argparse's parser.add_argument(...)
    assert any(isinstance(c.func, ast.Name) and len(c.args) == 1 for c in _calls(tree, "add_argument")), \
        f"{path.name} never calls add_argument(parser)"
    withs = [item.context_expr for n in ast.walk(tree) if isinstance(n, ast.With) for item in n.items
             if isinstance(item.context_expr, ast.Call) and getattr(item.context_expr.func, "id", None) == "recording"]
    assert withs, f"{path.name}: its measurement is not inside `with recording(topic, args.record)`"
    for call in withs:
        topic = call.args[0]
        assert isinstance(topic, ast.Constant) and re.fullmatch(r"[a-z0-9][a-z0-9_-]*", topic.value), \
            f"{path.name}: the record's topic is a fixed lower-case name"
        assert isinstance(call.args[1], ast.Attribute) and call.args[1].attr == "record", \
            f"{path.name}: recording(..., args.record): the directory --record gave"
