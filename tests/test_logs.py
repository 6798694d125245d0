"""The CLIs' one logging setup: levels by -v/-q, the project's warnings as log lines, third parties quiet."""

from __future__ import annotations

import argparse
import io
import logging

from pipelines.logs import add_logging_flags, get_logger, setup_logging


def _run(verbosity: int) -> str:
    import mlflow  # noqa: F401  (imported first, as in a CLI: MLflow configures its logger on import)
    import ray  # noqa: F401

    out = io.StringIO()
    setup_logging(verbosity, stream=out)
    log = get_logger("test")
    log.debug("dbg line")
    log.info("info line")
    log.warning("warn line")
    return out.getvalue()


def _retry_line(verbosity: int) -> str:
    out = io.StringIO()
    setup_logging(verbosity, stream=out)
    logging.getLogger("urllib3.connectionpool").warning("Retrying (Retry(total=3)) after connection broken")
    return out.getvalue()


def test_levels_follow_verbose_and_quiet() -> None:
    default = _run(0)
    assert "INFO adlm.test: info line" in default and "WARNING adlm.test: warn line" in default
    assert "dbg line" not in default
    # Ray and MLflow keep their own handlers (propagate=False once imported): their levels are what we set.
    assert all(logging.getLogger(n).getEffectiveLevel() == logging.WARNING for n in ("ray", "mlflow", "urllib3"))
    # An HTTP client's retried connection is not the command's line (a run's tracker may still be retrying a server
    # gone for good while the process does something else); the failure itself is said by the project.
    assert "Retrying" not in _retry_line(0) and "Retrying" in _retry_line(1)
    verbose = _run(1)
    assert "DEBUG adlm.test: dbg line" in verbose
    assert all(logging.getLogger(n).getEffectiveLevel() == logging.INFO for n in ("ray", "mlflow"))
    quiet = _run(-1)
    assert "info line" not in quiet and "warn line" in quiet
    setup_logging(0)


def test_a_later_setup_without_a_stream_writes_to_stderr_again(capfd) -> None:
    """A set-up with a stream (a test, an embedding caller) must not keep every later command's lines in it."""
    setup_logging(0, stream=io.StringIO())
    setup_logging(0)
    get_logger("test").warning("back on stderr")
    assert "WARNING adlm.test: back on stderr" in capfd.readouterr().err


def test_flags_parse_to_a_verbosity() -> None:
    p = argparse.ArgumentParser()
    add_logging_flags(p)
    a = p.parse_args(["-vv"])
    assert a.verbose - a.quiet == 2
    a = p.parse_args(["-q"])
    assert a.verbose - a.quiet == -1


def test_a_process_that_never_set_up_logging_still_shows_the_projects_lines() -> None:
    """A Ray worker (or any process a driver starts) never runs setup_logging: its first get_logger gives the
    project's handler at the driver's verbosity (inherited through ADLM_VERBOSITY), so the training loop's
    progress and the metric sender's warnings reach its stderr, which Ray forwards to the driver."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("from pipelines.logs import get_logger; log = get_logger('pipelines.training.loop'); "
            "log.info('progress line'); log.warning('warn line')")
    root = str(Path(__file__).resolve().parents[1])
    for verbosity, shown in (("0", ["INFO adlm.training.loop: progress line", "WARNING adlm.training.loop: warn line"]),
                             ("-1", ["WARNING adlm.training.loop: warn line"])):
        env = {**os.environ, "PYTHONPATH": root, "ADLM_VERBOSITY": verbosity}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0 and r.stderr.splitlines() == shown, r.stderr
