"""benchmarks/suite_cpu.py, the suite's CPU meter: its RESULT lines, and the host reference measured around the
command in the same run (what makes two runs' wall times comparable on this host, whose speed moves)."""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[2]


def _suite_cpu():
    return load_script(ROOT / "benchmarks" / "suite_cpu.py", "suite_cpu")


def test_the_wall_time_is_read_against_the_limit_and_the_host_reference(capsys: pytest.CaptureFixture) -> None:
    # A reference that burns a known amount of CPU, so the median is neither zero nor an interpreter's start alone.
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    code = _suite_cpu().main(["--proxy", burn, "--proxy-runs", "1", "--limit-s", "2", "--interval", "0.05", "--",
                              sys.executable, "-c", "import time; time.sleep(1.0)"])
    assert code == 0
    results = dict(re.findall(r"^RESULT (\w+)=([\d.]+)$", capsys.readouterr().out, re.M))
    wall, before, after = (float(results[k]) for k in ("wall_s", "proxy_cpu_s_before", "proxy_cpu_s_after"))
    assert 1.0 <= wall < 6 and 0.3 <= before < 2 and 0.3 <= after < 2, results
    # wall_s is printed to 0.1 s, the ratios from the unrounded time.
    assert float(results["wall_over_limit"]) == pytest.approx(wall / 2, abs=0.05 / 2 + 1e-3)
    assert float(results["wall_per_proxy_cpu_s"]) == pytest.approx(wall / ((before + after) / 2), rel=0.1)


def test_bad_arguments_fail_in_one_line_before_the_command_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    marker = tmp_path / "ran"
    for bad in (["--proxy-runs", "-1"], ["--limit-s", "0"], ["--proxy", "import no_such_module", "--proxy-runs", "1"]):
        assert _suite_cpu().main([*bad, "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err
    assert not marker.exists()


def test_record_appends_one_row_a_run_with_pytest_counts_and_writes_a_dated_record(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # The command stands in for pytest: its last summary line carries the counts, and a RESULT line of its own
    # passes through to the console without becoming one of this run's results.
    fake = ("print('RESULT not_this_runs=1'); print('=== 3 passed, 1 failed, 2 skipped, 1 error in 0.50s ===');"
            "raise SystemExit(1)")
    for _ in range(2):
        code = _suite_cpu().main(["--proxy-runs", "0", "--interval", "0.05", "--record", str(tmp_path), "--",
                                  sys.executable, "-c", fake])
        assert code == 1
    out = capsys.readouterr().out
    assert "RESULT not_this_runs=1" in out and "3 passed, 1 failed" in out
    rows = list(csv.DictReader((tmp_path / "suite_timings.csv").open()))
    assert len(rows) == 2, rows  # appended, one header
    row = rows[-1]
    assert (row["passed"], row["failed"], row["skipped"], row["errors"], row["exit_code"]) == ("3", "1", "2", "1", "1")
    assert float(row["wall_s"]) > 0 and row["source"] == "suite_cpu.py" and row["command"].endswith("raise SystemExit(1)'")
    assert row["proxy_cpu_s_before"] == "" and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", row["date"])
    records = sorted(tmp_path.glob("*_suite_cpu*.md"))
    assert len(records) == 2
    text = records[0].read_text()
    assert "RESULT wall_s=" in text and "not_this_runs" not in text and "suite_timings.csv" in text


def test_pytest_counts_read_the_last_summary_line_only() -> None:
    counts = _suite_cpu().pytest_counts
    assert counts("collected 9 items\n....\n599 passed, 13 skipped in 951.20s (0:15:51)\n") == {
        "passed": 599, "failed": 0, "skipped": 13, "errors": 0}
    assert counts("1 failed, 2 passed, 3 errors in 1.0s\n") == {"passed": 2, "failed": 1, "skipped": 0, "errors": 3}
    assert counts("no summary here\n") == {}


def test_the_suite_timings_csv_has_the_columns_and_no_gaps_in_its_readme_rows() -> None:
    mod = _suite_cpu()
    with (ROOT / "benchmarks" / "results" / mod.TIMINGS_FILE).open() as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == mod.TIMINGS_COLUMNS
        rows = list(reader)
    old = [r for r in rows if r["source"] == "README table"]
    assert len(old) == 62 and all(re.fullmatch(r"\d{4}-\d\d-\d\d", r["date"]) and r["note"] for r in old)
    assert sum(1 for r in old if r["wall_s"]) == 61 and all(int(r["passed"]) > 400 for r in old if r["passed"])
