"""The CLIs' one logging setup: levels by -v/-q, the project's warnings as log lines, third parties quiet."""

from __future__ import annotations

import argparse
import io
import logging

import pytest

from pipelines.core.logs import add_logging_flags, get_logger, setup_logging


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

    code = ("from pipelines.core.logs import get_logger; log = get_logger('pipelines.training.loop'); "
            "log.info('progress line'); log.warning('warn line')")
    root = str(Path(__file__).resolve().parents[2])
    for verbosity, shown in (("0", ["INFO adlm.training.loop: progress line", "WARNING adlm.training.loop: warn line"]),
                             ("-1", ["WARNING adlm.training.loop: warn line"])):
        env = {**os.environ, "PYTHONPATH": root, "ADLM_VERBOSITY": verbosity}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0 and r.stderr.splitlines() == shown, r.stderr


# ---- What the driver's console shows of Ray's workers (pipelines.core.logs.WorkerOutput) ----

RAY_NOISE = [
    "[2026-11-28 15:46:32,402 E 23055 23252] core_worker.cc:2465: Actor with class name: 'PreemptionWatcher' and "
    "ID: '695b' has constructor arguments in the object store and max_restarts > 0.",
    "Started training worker group of size 2: ",
    "This method is only available when the process is a worker. Current mode: 0",
    "Checkpoint successfully created at: Checkpoint(filesystem=local, path=/tmp/x/checkpoint_00000020)",
    "│ run_trial_a7725_00000   RUNNING    0.00872709       5 │",
    "Traceback (most recent call last):",
    "INFO adlm.training.trainer: an info line of a worker",
]


def test_the_console_keeps_of_ray_workers_only_the_projects_warnings_and_a_tracked_runs_bar() -> None:
    from pipelines.core.logs import WorkerOutput

    out = io.StringIO()
    printer = WorkerOutput(out)
    with printer.track("demo-adlm", total=40):
        bar = printer.bars["demo-adlm"]
        printer({"pid": 23458, "actor_name": "RayTrainWorker", "is_err": True, "lines": [
            *RAY_NOISE, "INFO adlm.training.loop: [demo-adlm] step 20 validation PPL <= 1963.572 (EMA)",
            "INFO adlm.training.loop: [demo-adlm] step 30/40 loss 6.1122 nll 5.9988 tok/s 1,176 ETA 00:00:20",
            "INFO adlm.training.loop: [other-run] step 3/8 loss 9.0 nll 9.0 tok/s 1 ETA 00:00:01",  # not tracked
            "WARNING adlm.tracking: MLflow at http://x is unreachable: the metrics wait in the spool"]})
        assert bar.n == 30 and "loss 6.1122, validation <= 1963.6" in str(bar)
    printer({"pid": "raylet", "is_err": False, "lines": [
        "WARNING: 8 PYTHON worker processes have been started on node: 45f8 with address: 192.0.2.2",
        "A worker died or was killed while running a task: the node ran out of memory"]})
    shown = [line.split("\r")[-1] for line in out.getvalue().splitlines() if "it/s" not in line and "step" not in line]
    assert [s for s in shown if s.strip()] == [
        "WARNING adlm.tracking: MLflow at http://x is unreachable: the metrics wait in the spool",
        "WARNING ray (raylet): A worker died or was killed while running a task: the node ran out of memory"], shown
    assert "other-run" not in out.getvalue() and "core_worker" not in out.getvalue()


def test_a_ray_workers_noise_stays_off_the_drivers_console_but_its_warning_arrives_once(ray_session, capsys) -> None:
    """Through a real worker of the session's Ray: the driver prints the project's warning (in the project's format,
    once, although the worker's root logger prints through Ray's plain handler, as a Ray Train worker's does) and
    none of the Ray-like lines the worker wrote. With -v Ray's own printer is back."""
    import time

    import ray

    from pipelines.core.logs import route_worker_output

    assert route_worker_output(1) is None  # -v: Ray's printer is kept
    assert route_worker_output(0) is not None

    @ray.remote(num_cpus=0.1)
    def noisy(lines: list[str]) -> None:
        import logging
        import sys

        # private: the handler Ray installs on its loggers, checked for what it prints
        from ray._private.log import PlainRayHandler

        from pipelines.core.logs import get_logger, worker_console

        root = logging.getLogger()
        plain = PlainRayHandler()
        root.addHandler(plain)  # as Ray Train sets up its workers
        try:
            worker_console()
            for line in lines:
                print(line, file=sys.stderr, flush=True)
            get_logger("tests.console").warning("a warning that needs action")
            get_logger("tests.console").info("an info line")
            sys.stderr.flush()
        finally:
            root.removeHandler(plain)
            ours = logging.getLogger("adlm")
            for h in [h for h in ours.handlers if getattr(h, "_adlm", False)]:
                ours.removeHandler(h)

    capsys.readouterr()
    ray.get(noisy.remote(RAY_NOISE))
    err = ""
    deadline = time.monotonic() + 30
    while "a warning that needs action" not in err and time.monotonic() < deadline:
        time.sleep(0.2)
        err += capsys.readouterr().err
    time.sleep(1.0)  # Ray's log monitor forwards a process's lines in batches: let the rest of them arrive
    err += capsys.readouterr().err
    assert err.count("WARNING adlm.tests.console: a warning that needs action") == 1, err
    assert "an info line" not in err and not any(n[:40] in err for n in RAY_NOISE), err


def test_the_sweeps_trial_bar_pickles_without_its_bar() -> None:
    """Tune keeps a sweep's callbacks with its state (a resumed sweep restores them): the bar is made again."""
    import pickle

    from pipelines.tuning.progress import TrialBar

    cb = TrialBar("demo-gamma-tau", 4)
    cb.setup()
    try:
        again = pickle.loads(pickle.dumps(cb))
    finally:
        cb.bar.close()
    assert again.bar is None and (again.name, again.total) == ("demo-gamma-tau", 4)


def test_prepares_progress_gives_rates_only_over_a_meaningful_interval() -> None:
    """One unit a millisecond after the start is no rate (it read 7,882,149 rows/s); from RATE_AFTER_S on, the rate
    is over the whole time since the pipeline started."""
    import re
    import time
    from types import SimpleNamespace

    from pipelines.data.prepare import RATE_AFTER_S, SplitRun

    run = SplitRun.__new__(SplitRun)  # the counters alone: what the progress line reads
    run.sp = SimpleNamespace(split="train")
    run.units_done, run.units_total, run.new_rows, run.new_tokens = 1, 18, 3_813, 480_450
    run.t0 = time.time() - 0.001
    assert run.progress_line() == "train: units 1/18, rows 3,813, tokens 480,450"
    run.t0 = time.time() - 2 * RATE_AFTER_S
    rows_per_s = float(re.search(r"\(([\d,]+) rows/s", run.progress_line()).group(1).replace(",", ""))
    assert rows_per_s == pytest.approx(3_813 / (2 * RATE_AFTER_S), rel=0.05)
