"""pipelines/orchestration/summary.py's main: the README's demo summary is the demo's own, rewritten from a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.core.runtime import PROJECT_ROOT
from pipelines.orchestration.summary import BEGIN, END, main, summary_markdown

SUMMARY = {
    "profile": "demo", "model_name": "adlm", "champion": "2", "vocab_size": 8192, "comparable": False,
    "rows": [{"model": "ADLM", "version": "1", "kind": "adlm", "gamma": "0.003", "tau": "5", "val_ppl": 1650.44,
              "entropy": 4.2, "gen_ppl": 2628.3, "gen_ppl_definition": "token-pooled NLL under smollm2",
              "mauve": None, "mauve_note": None, "families": {}, "status": "promoted", "reasons": "",
              "champion": False},
             {"model": "AR", "version": "2", "kind": "ar", "gamma": None, "tau": None, "val_ppl": 280.2,
              "entropy": 4.3, "gen_ppl": 1347.9, "gen_ppl_definition": "token-pooled NLL under smollm2",
              "mauve": None, "mauve_note": None, "families": {}, "status": "promoted", "reasons": "",
              "champion": True}],
    "samples": ["a sample", "another"], "sweep": {"name": "demo-gamma-tau", "trials": 4, "stopped": ["x_00002"]},
    "timings_s": {"prepare": 28.0, "total": 473.0},
    "goals": [{"goal": "2 samples of the champion", "measured": "1", "met": False}],
    "tracking_uri": f"sqlite:///{PROJECT_ROOT}/work/mlflow.db",
}


def _readme(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "README.md"
    p.write_text(f"# Project\n\nThe demo prints:\n\n{body}\n\n## Next\n", encoding="utf-8")
    return p


def test_the_block_is_the_printed_summary_table_and_lines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    wd = tmp_path / "work"
    wd.mkdir()
    printed = summary_markdown(SUMMARY)  # what the demo prints under its summary banner and writes to summary.md
    (wd / "summary.md").write_text(printed)
    readme = _readme(tmp_path, f"{BEGIN}\nan old, typed table\n{END}")
    for _ in range(2):  # a second run replaces the block it wrote
        assert main(["--workdir", str(wd), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# Project\n\nThe demo prints:\n\n") and text.endswith(f"{END}\n\n## Next\n")
    assert "typed table" not in text and text.count(BEGIN) == 1
    inside = text.split(BEGIN)[1].split(END)[0]
    shown = [line for line in inside.splitlines() if line.strip() and not line.startswith(("<!--", "```"))]
    expected = [line.replace(f"{PROJECT_ROOT}/", "") for line in printed.splitlines() if line.strip()]
    assert shown == expected  # every printed line, in order, nothing added
    assert "sqlite:///work/mlflow.db" in inside and "`make demo` of " in inside
    assert inside.index("| AR | ar | 2 |") < inside.index("```text") < inside.index("Demo goal: 2 samples")


def test_no_summary_or_no_markers_fail_in_one_line_and_leave_the_readme(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    readme = _readme(tmp_path, f"{BEGIN}\nkept\n{END}")
    before = readme.read_text()
    assert main(["--workdir", str(tmp_path / "empty"), "--readme", str(readme)]) == 2
    assert readme.read_text() == before
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no ") and "make demo" in err and "\n" not in err
    no_markers = _readme(tmp_path, "no block here")
    assert main(["--workdir", str(tmp_path / "empty"), "--readme", str(no_markers)]) == 2
    assert BEGIN in capsys.readouterr().err
    assert no_markers.read_text().endswith("no block here\n\n## Next\n")
