"""One logging setup for every CLI: a format, ``-v``/``-q``, and third-party loggers at sensible levels.

The project's own messages go through ``logging.getLogger("adlm.<area>")`` so that they can be filtered,
levelled and routed like Ray's and MLflow's. A CLI calls ``add_logging_flags(parser)``; its runner
(``pipelines.core.cli.run_command``), once the arguments are parsed, ``setup_logging(args.verbose - args.quiet)``:

- ``0`` (default): the project's INFO and up; Ray, MLflow and the HTTP/filesystem libraries at WARNING; MLflow's
  artifact download bar off (it printed on every ``generate`` call, even for a cached version); of what Ray's worker
  processes print, only the project's warnings and errors, a training run's progress as one bar and what Ray says
  of killed workers (``WorkerOutput``);
- ``-v``: the project's DEBUG, third parties at INFO, MLflow's progress bars back on, every line of Ray's workers;
- ``-q``: warnings and errors only.

Warnings of the project are ``log.warning`` lines (``WARNING adlm.tracking: ...``), never ``print``; a module
takes its logger with ``log = get_logger(__name__)``. A process that never ran ``setup_logging`` (a Ray worker, a
test, a library caller) gets the same handler and levels on its first ``get_logger`` call, at the verbosity the
driver set (``ADLM_VERBOSITY``, which Ray's workers inherit): progress lines of the training workers stay visible.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

from pipelines.compat import ray as compat_ray

PROJECT_LOGGER = "adlm"
# Chatty at INFO on every call (connection pools, artifact listings, Ray's start-up banners).
THIRD_PARTY = ("ray", "mlflow", "urllib3", "botocore", "boto3", "s3transfer", "filelock", "fsspec", "httpx",
               "alembic", "datasets", "transformers", "huggingface_hub", "matplotlib", "PIL", "asyncio", "werkzeug",
               "moto")
FORMAT = "%(levelname)s %(name)s: %(message)s"
VERBOSITY_ENV = "ADLM_VERBOSITY"
"""The driver's verbosity, for the processes it starts (Ray workers and tasks inherit the environment)."""


class _StderrHandler(logging.StreamHandler):
    """A stream handler that writes to the ``sys.stderr`` of the moment (not the one at set-up): pytest's capture
    and a redirect after start-up see the lines; an explicit ``stream`` is kept as given."""

    def __init__(self, stream=None) -> None:
        super().__init__(stream)
        self._fixed = stream

    @property
    def stream(self):  # type: ignore[override]
        return self._fixed if self._fixed is not None else sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        self._fixed = value

    def emit(self, record: logging.LogRecord) -> None:
        tqdm = sys.modules.get("tqdm")
        if tqdm is None:  # no progress bar can be on the console
            super().emit(record)
            return
        with tqdm.tqdm.external_write_mode(file=self.stream):  # a line between bars, not through one
            super().emit(record)


def add_logging_flags(parser: argparse.ArgumentParser) -> None:
    """``-v`` (repeatable: more detail, third-party logs too) and ``-q`` (warnings and errors only)."""
    g = parser.add_argument_group("logging")
    g.add_argument("-v", "--verbose", action="count", default=0,
                   help="more detail: the project's debug lines, Ray's and MLflow's info lines and progress bars")
    g.add_argument("-q", "--quiet", action="count", default=0, help="only warnings and errors")


def _handler(stream=None) -> logging.Handler:
    """The one handler of the project on the root logger (added once per process)."""
    root = logging.getLogger()
    handler = next((h for h in root.handlers if getattr(h, "_adlm", False)), None)
    if handler is None:
        handler = _StderrHandler(stream)
        handler._adlm = True  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
    else:  # each set-up says where the lines go: a stream given, or the stderr of the moment (None)
        handler.flush()
        handler.stream = stream
    return handler


def _level(verbosity: int) -> int:
    return logging.DEBUG if verbosity > 0 else logging.WARNING if verbosity < 0 else logging.INFO


def setup_logging(verbosity: int = 0, stream=None) -> None:
    """Configure the root handler once per process (a second call re-levels). ``verbosity`` is
    ``verbose - quiet``."""
    ours = _level(verbosity)
    theirs = logging.INFO if verbosity > 0 else logging.WARNING
    _handler(stream)
    # The root at the third parties' level: a library not named below (werkzeug, moto, ...) stays at WARNING by
    # default; the project's own INFO lines still reach the root's handler (the "adlm" logger's level decides).
    logging.getLogger().setLevel(theirs)
    logging.getLogger(PROJECT_LOGGER).setLevel(ours)
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(theirs)
    # A connection retried by an HTTP client (MLflow's, boto's: they retry on their own) is no line of the command's:
    # what fails in the end is said once, by the project (the tracker's outage warning, the command's error). A
    # tracker's call still retrying after its run ended (a server gone for good) would otherwise print into
    # whatever this process does next. Shown from -v.
    logging.getLogger("urllib3.connectionpool").setLevel(theirs if verbosity > 0 else logging.ERROR)
    os.environ[VERBOSITY_ENV] = str(verbosity)
    if verbosity <= 0:
        # MLflow's tqdm bar on artifact downloads (every registry read) is noise unless asked for.
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        # MLflow sets its loggers' level on import ("Creating initial MLflow database tables..." at INFO): the same
        # level as set above for an MLflow imported later, and for the processes this one starts.
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")


def verbosity() -> int:
    """This process's verbosity (``verbose - quiet`` of the command that started it; 0 when none said): what
    third-party progress output (Ray Data's bars, Tune's status tables) follows."""
    try:
        return int(os.environ.get(VERBOSITY_ENV, "0"))
    except ValueError:
        return 0


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first line of an error's message (at most ``limit`` characters; its class name when it has none): what a
    one-line message or a warning quotes of an error from a library (MLflow's and boto's run to many lines)."""
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else type(e).__name__


def get_logger(area: str) -> logging.Logger:
    """The project's logger of one area: ``get_logger(__name__)`` in ``pipelines.training.trainer`` is
    ``adlm.training.trainer`` (``get_logger("tracking")`` is ``adlm.tracking``). Sets up logging at the
    inherited verbosity in a process that has not (a Ray worker, a library caller), so its lines are not lost."""
    root = logging.getLogger()
    if not any(getattr(h, "_adlm", False) for h in root.handlers):
        # Only the handler and the project's level: the root's and the third parties' levels are the CLI's call.
        # A Ray Train worker's root already prints to the console through Ray's handler (Ray Train configures it):
        # a second handler would print every line twice.
        if not any(type(h).__name__ == "PlainRayHandler" for h in root.handlers):
            _handler()
        ours = logging.getLogger(PROJECT_LOGGER)
        if ours.level == logging.NOTSET:
            try:
                ours.setLevel(_level(int(os.environ.get(VERBOSITY_ENV, "0"))))
            except ValueError:
                ours.setLevel(logging.INFO)
    for prefix in ("pipelines.", "adlm_model."):
        if area.startswith(prefix):
            area = area[len(prefix):]
            break
    return logging.getLogger(f"{PROJECT_LOGGER}.{area}")


# ---- What the driver's console shows of its Ray workers' output --------------------------------------------------

PROJECT_LINE = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) adlm\.\S+: (?P<msg>.*)$")
"""A line of the project's logger in ``FORMAT``, as a worker prints it."""
STEP_LINE = re.compile(r"^\[(?P<run>[^\]]+)\] step (?P<step>\d+)/\d+ loss (?P<loss>\S+)")
VALIDATION_LINE = re.compile(r"^\[(?P<run>[^\]]+)\] step \d+ validation PPL <= (?P<ppl>\S+)")
"""The training loop's progress and validation lines (``pipelines.training.loop``): a tracked run's bar."""
NODE_ALERT = re.compile(r"(?i)out of memory|\boom\b|\bkill(ed|ing)\b|memory pressure")
"""What Ray's node processes (the raylet, the autoscaler) say that a user must act on: workers killed, memory."""


class WorkerOutput:
    """The driver's printer of its Ray workers' stdout and stderr at default verbosity (``route_worker_output``).

    Ray prints every line its workers write, prefixed with the process (``(RayTrainWorker pid=...)``): Ray Train's
    and Ray Data's start-up lines, C++ ``core_worker.cc ... E`` lines that read as errors and are not, third-party
    progress bars, tracebacks of Ray's own helper threads. Kept here: the project's warnings and errors (as the
    driver's own lines), the progress of a training run the driver tracks (``run_progress``: one bar), what Ray's
    node processes say of killed workers and memory, and Ray's distributed tqdm. A failing task or run still reaches
    the user: its error comes back to the driver, which ends the command with it. ``-v`` prints everything (Ray's
    own printer), and the worker logs under Ray's session folder keep every line either way.
    """

    def __init__(self, stream: Any = None) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self.bars: dict[str, Any] = {}  # run name -> tqdm bar
        self._validation: dict[str, str] = {}  # run name -> its last validation bound, for the bar's postfix

    @property
    def stream(self) -> Any:
        return self._stream if self._stream is not None else sys.stderr

    def _print(self, line: str) -> None:
        tqdm = sys.modules.get("tqdm")
        if tqdm is not None:
            tqdm.tqdm.write(line, file=self.stream)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def _progress(self, msg: str) -> None:
        if (m := STEP_LINE.match(msg)) and (bar := self.bars.get(m["run"])) is not None:
            bar.n = int(m["step"])
            bar.set_postfix_str(f"loss {m['loss']}{self._validation.get(m['run'], '')}", refresh=False)
            bar.refresh()
        elif (m := VALIDATION_LINE.match(msg)) and m["run"] in self.bars:
            self._validation[m["run"]] = f", validation <= {float(m['ppl']):.1f}"

    def __call__(self, data: dict[str, Any]) -> None:
        """One batch of a worker's lines (Ray's ``{"lines": [...], "pid": ..., ...}``)."""
        # lazy: keeps ray out of this module's import
        from ray.experimental.tqdm_ray import RAY_TQDM_MAGIC

        node = data.get("pid") in ("raylet", "autoscaler")
        ray_bars = []
        with self._lock:
            for line in data.get("lines") or []:
                if RAY_TQDM_MAGIC in line:
                    ray_bars.append(line)
                elif m := PROJECT_LINE.match(line):
                    if m["level"] in ("WARNING", "ERROR", "CRITICAL"):
                        self._print(line)
                    else:
                        self._progress(m["msg"])
                elif node and NODE_ALERT.search(line):
                    self._print(f"WARNING ray ({data['pid']}): {line.strip()}")
        if ray_bars:
            compat_ray.print_worker_logs({**data, "lines": ray_bars}, self.stream)

    @contextlib.contextmanager
    def track(self, run: str, total: int, start: int = 0) -> Iterator[None]:
        """A bar of ``run``'s optimiser steps, moved by its workers' progress lines while the block runs."""
        # lazy: keeps tqdm out of this module's import
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, desc=run, unit="step", file=self.stream, dynamic_ncols=True)
        with self._lock:
            self.bars[run] = bar
        try:
            yield
        finally:
            with self._lock:
                self.bars.pop(run, None)
                self._validation.pop(run, None)
                bar.close()


_ROUTED: WorkerOutput | None = None


def route_worker_output(verbosity_: int | None = None, stream: Any = None) -> WorkerOutput | None:
    """In a driver connected to Ray: print its workers' output through ``WorkerOutput`` instead of Ray's printer,
    unless ``-v`` (``verbosity_`` above 0, by default this process's). Replaces the handler Ray registers under
    its own name, so ``ray.shutdown`` removes it as it would Ray's; a later ``ray.init`` (with Ray's printer
    again) is routed by calling this again. Returns the printer, or None where Ray's own is kept."""
    global _ROUTED
    ray_worker = compat_ray.worker_module()

    if (verbosity() if verbosity_ is None else verbosity_) > 0 or not compat_ray.driver_is_script():
        return None
    dispatcher = ray_worker.global_worker_stdstream_dispatcher
    _ROUTED = WorkerOutput(stream)
    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", _ROUTED)
    if not getattr(ray_worker.print_to_stdstream, "_adlm", False):
        ray_worker.print_to_stdstream = _ray_messages(ray_worker.print_to_stdstream)
    return _ROUTED


RAY_NOTICE_NOISE = re.compile(r"worker processes have been started on node")
"""Ray's messages to the driver that ask nothing of the user: the raylet's count of worker processes starting at
once (a pipeline of fractional-CPU tasks and actors on a small machine starts many, by design)."""


def _ray_messages(print_: Any) -> Any:
    """Ray's printer of its own messages to this driver (the error listener's: killed workers, unschedulable work,
    failed actors), without ``RAY_NOTICE_NOISE`` while the workers' output is routed."""

    def printer(data: dict[str, Any], ignore_prefix: bool) -> None:
        if routed() is not None:
            lines = [line for line in data.get("lines") or [] if not RAY_NOTICE_NOISE.search(line)]
            if not lines:
                return
            data = {**data, "lines": lines}
        print_(data, ignore_prefix)

    printer._adlm = True  # type: ignore[attr-defined]
    return printer


def routed() -> WorkerOutput | None:
    """This driver's ``WorkerOutput`` while Ray's workers print through it, else None."""
    handlers = list(compat_ray.worker_module().global_worker_stdstream_dispatcher.handlers)
    return _ROUTED if _ROUTED is not None and any(h is _ROUTED for _, h in handlers) else None


@contextlib.contextmanager
def run_progress(run: str, total: int, start: int = 0) -> Iterator[None]:
    """A progress bar for the training run ``run`` while the block runs, in a driver whose workers' output is routed
    (``route_worker_output``); nothing otherwise (``-v``: the workers' progress lines print; ``-q``: none)."""
    printer = routed() if verbosity() == 0 and "ray" in sys.modules else None
    if printer is None:
        yield
        return
    with printer.track(run, total, start):
        yield


def worker_console() -> None:
    """In a Ray Train worker, the project's lines keep ``FORMAT`` on the console: Ray Train's console handler (on the
    root logger) prints bare messages, so the driver could not tell a warning from a progress line. The project's
    handler on the ``adlm`` logger prints them; Ray's console handler leaves them out; Ray's file handler still
    records them. A process without Ray's handler is left as it is."""
    root = logging.getLogger()
    plain = [h for h in root.handlers if type(h).__name__ == "PlainRayHandler"]
    if not plain:
        return
    for h in plain:
        if not any(isinstance(f, _NotProject) for f in h.filters):
            h.addFilter(_NotProject())
    ours = logging.getLogger(PROJECT_LOGGER)
    # The project's handler on the root (``setup_logging`` ran in this worker process before) prints them already.
    if not any(getattr(h, "_adlm", False) for h in (*root.handlers, *ours.handlers)):
        handler = _StderrHandler()
        handler._adlm = True  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter(FORMAT))
        ours.addHandler(handler)


class _NotProject(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith(PROJECT_LOGGER + ".") and record.name != PROJECT_LOGGER


def quiet_ray_data() -> None:
    """Ray Data's console lines at this process's verbosity: its INFO lines (each dataset's plan and finish) only
    with ``-v``; its warning that progress bars are off never (the project turns them off on purpose: its own
    progress is shown). Ray Data's log file keeps everything. Call after ``import ray.data`` (which configures its
    logger)."""
    # lazy: keeps ray out of this module's import
    from ray.util.debug import log_once

    level = logging.INFO if verbosity() > 0 else logging.WARNING
    for h in logging.getLogger("ray.data").handlers:
        if type(h).__name__ == "PlainRayHandler":
            h.setLevel(level)
    log_once("ray_data_progress_manager_disabled")  # Ray Data says it once a process: said now, to no one
