"""benchmarks/suite_cpu.py, the suite's CPU meter: its RESULT lines, and the host reference measured around the
command in the same run (what makes two runs' wall times comparable on this host, whose speed moves)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


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
