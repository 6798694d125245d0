"""The CLIs' one logging setup: levels by -v/-q, the project's warnings as log lines, third parties quiet."""

from __future__ import annotations

import argparse
import io
import logging

from pipelines.logs import add_logging_flags, get_logger, setup_logging


def _run(verbosity: int) -> str:
    out = io.StringIO()
    setup_logging(verbosity, stream=out)
    log = get_logger("test")
    log.debug("dbg line")
    log.info("info line")
    log.warning("warn line")
    logging.getLogger("mlflow.store").info("mlflow info line")
    logging.getLogger("ray.data").warning("ray warn line")
    return out.getvalue()


def test_levels_follow_verbose_and_quiet() -> None:
    default = _run(0)
    assert "INFO adlm.test: info line" in default and "WARNING adlm.test: warn line" in default
    assert "dbg line" not in default and "mlflow info line" not in default and "ray warn line" in default
    verbose = _run(1)
    assert "DEBUG adlm.test: dbg line" in verbose and "mlflow info line" in verbose
    quiet = _run(-1)
    assert "info line" not in quiet and "warn line" in quiet
    setup_logging(0)


def test_flags_parse_to_a_verbosity() -> None:
    p = argparse.ArgumentParser()
    add_logging_flags(p)
    a = p.parse_args(["-vv"])
    assert a.verbose - a.quiet == 2
    a = p.parse_args(["-q"])
    assert a.verbose - a.quiet == -1
