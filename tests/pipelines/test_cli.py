"""The one CLI runner (pipelines/core/cli.py): every command's parse / logging / error block is written once."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from pipelines.core.cli import CommandError, run_command
from pipelines.core.logs import add_logging_flags

ROOT = Path(__file__).resolve().parents[2]


class _Failed(RuntimeError):
    pass


class _Unfinished(RuntimeError):
    exit_code = 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--raise", dest="error", default="")
    add_logging_flags(p)
    return p


def _run(args: argparse.Namespace) -> int:
    errors = {"bad": ValueError("bad value"), "failed": _Failed("it broke"), "unfinished": _Unfinished("rerun it"),
              "own": CommandError("one line"), "bug": KeyError("bug")}
    if args.error:
        raise errors[args.error]
    print("result")
    return 0


@pytest.mark.parametrize(("error", "code", "line"), [
    ("", 0, None), ("bad", 2, "error: bad value"), ("failed", 1, "error: it broke"),
    ("unfinished", 3, "error: rerun it"), ("own", 2, "error: one line")])
def test_the_runner_turns_each_kind_of_failure_into_one_line_and_its_exit_code(capsys, error, code, line) -> None:
    assert run_command(_parser(), _run, ["--raise", error] if error else [], bad_input=(ValueError,),
                       failed=(_Failed,), environment=False) == code
    out = capsys.readouterr()
    assert out.out == ("result\n" if code == 0 else "")  # results alone on stdout
    assert [x for x in out.err.splitlines() if x.startswith("error: ")] == ([line] if line else [])


def test_an_unexpected_exception_keeps_its_traceback() -> None:
    with pytest.raises(KeyError):
        run_command(_parser(), _run, ["--raise", "bug"], bad_input=(ValueError,), environment=False)


def test_no_command_repeats_the_parse_logging_error_block() -> None:
    """Only the runner sets up logging from the flags and prints the error line (logs.py defines the set-up;
    lm_eval_cli hands its flags to the harness, which parses them)."""
    repeated = re.compile(r"setup_logging\(args\.verbose|print\(f\"error: \{e\}\"")
    offenders = [str(f.relative_to(ROOT)) for f in sorted((ROOT / "pipelines").rglob("*.py"))
                 if f.name not in ("cli.py", "logs.py", "lm_eval_cli.py") and repeated.search(f.read_text())]
    assert offenders == []


def test_every_command_runs_under_the_placement_deadline(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner, not each command, puts the work under ``placement_deadline``: the watch is up while ``run``
    runs (and gone after), and a wait that the watch ends is the command's one ``error:`` line, exit 1, whatever
    the command's own error tuples say."""
    from pipelines.core import placement

    monkeypatch.setenv(placement.TIMEOUT_ENV, "600")
    seen = []

    def run(args: argparse.Namespace) -> int:
        seen.append(list(placement._active))
        if args.error == "stuck":
            raise placement.PlacementError("the demand {'CPU': 32} fits no node: lower it")
        return 0

    assert run_command(_parser(), run, []) == 0 and len(seen[0]) == 1 and not placement._active
    assert run_command(_parser(), run, ["--raise", "stuck"]) == 1
    assert capsys.readouterr().err.strip() == "error: the demand {'CPU': 32} fits no node: lower it"
