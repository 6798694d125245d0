"""One logging setup for every CLI: a format, ``-v``/``-q``, and third-party loggers at sensible levels.

The project's own messages go through ``logging.getLogger("adlm.<area>")`` so that they can be filtered,
levelled and routed like Ray's and MLflow's. A CLI calls ``add_logging_flags(parser)``; its runner
(``pipelines.cli.run_command``), once the arguments are parsed, ``setup_logging(args.verbose - args.quiet)``:

- ``0`` (default): the project's INFO and up; Ray, MLflow and the HTTP/filesystem libraries at WARNING; MLflow's
  artifact download bar off (it printed on every ``generate`` call, even for a cached version);
- ``-v``: the project's DEBUG, third parties at INFO, MLflow's progress bars back on;
- ``-q``: warnings and errors only.

Warnings of the project are ``log.warning`` lines (``WARNING adlm.tracking: ...``), never ``print``; a module
takes its logger with ``log = get_logger(__name__)``. A process that never ran ``setup_logging`` (a Ray worker, a
test, a library caller) gets the same handler and levels on its first ``get_logger`` call, at the verbosity the
driver set (``ADLM_VERBOSITY``, which Ray's workers inherit): progress lines of the training workers stay visible.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

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
