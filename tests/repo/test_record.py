"""benchmarks/_record.py: the dated record a benchmark writes with ``--record``."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[2]


def _record():
    return load_script(ROOT / "benchmarks" / "_record.py", "bench_record", register=True)


def test_a_record_holds_the_command_the_commit_and_exactly_the_printed_results(tmp_path: Path) -> None:
    rec_mod = _record()
    with rec_mod.recording("unit_topic", tmp_path, command=["python", "benchmarks/x.py", "--steps", "3"]) as rec:
        print("warming up")
        print("RESULT speed_ratio=1.25")
        print("RESULT not a result line")
        print("RESULT other=0.5", end="")
        print()
        rec.add_raw(tmp_path / "raw.json")
        rec.note("one note")
    text = rec.path.read_text()
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_cpu\d+_unit_topic\.md", rec.path.name)
    results = text.split("## Results")[1].split("```")[1].strip().splitlines()
    assert results == ["RESULT speed_ratio=1.25", "RESULT other=0.5"]
    assert "python benchmarks/x.py --steps 3" in text and "[raw.json](raw.json)" in text and "one note" in text
    assert re.search(r"\| commit \| `([0-9a-f]{12}(\+dirty)?|unknown)` \|", text)
    assert "| status | completed |" in text

    # A second run the same day gets a counter; latest() finds it; a failing run keeps its record.
    with pytest.raises(RuntimeError), rec_mod.recording("unit_topic", tmp_path, command=["x"]) as second:
        raise RuntimeError("out of memory")
    assert second.path.name.endswith("_unit_topic-2.md")
    assert "| status | failed: RuntimeError: out of memory |" in second.path.read_text()
    assert rec_mod.latest("unit_topic", tmp_path) == second.path
    assert rec_mod.latest("topic", tmp_path) is None


def test_without_a_directory_nothing_is_written_and_the_flag_parses(tmp_path: Path) -> None:
    rec_mod = _record()
    with rec_mod.recording("unit_topic", None) as rec:
        print("RESULT x=1")
    assert rec.path is None and not list(tmp_path.iterdir())
    p = argparse.ArgumentParser()
    rec_mod.add_argument(p)
    assert p.parse_args([]).record is None
    assert Path(p.parse_args(["--record"]).record) == rec_mod.RESULTS_DIR
    assert p.parse_args(["--record", str(tmp_path)]).record == str(tmp_path)
    with pytest.raises(ValueError, match="topic"):
        with rec_mod.recording("Bad Topic", tmp_path):
            pass
