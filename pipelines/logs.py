"""One logging setup for every CLI: a format, ``-v``/``-q``, and third-party loggers at sensible levels.

The project's own messages go through ``logging.getLogger("adlm.<area>")`` so that they can be filtered,
levelled and routed like Ray's and MLflow's. A CLI calls ``add_logging_flags(parser)`` and, once its arguments
are parsed, ``setup_logging(args.verbose - args.quiet)``:

- ``0`` (default): the project's INFO and up; Ray, MLflow and the HTTP/filesystem libraries at WARNING; MLflow's
  artifact download bar off (it printed on every ``generate`` call, even for a cached version);
- ``-v``: the project's DEBUG, third parties at INFO, MLflow's progress bars back on;
- ``-q``: warnings and errors only.

Warnings of the project are ``log.warning`` lines (``WARNING adlm.tracking: ...``), never ``print``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

PROJECT_LOGGER = "adlm"
# Chatty at INFO on every call (connection pools, artifact listings, Ray's start-up banners).
THIRD_PARTY = ("ray", "mlflow", "urllib3", "botocore", "boto3", "s3transfer", "filelock", "fsspec", "httpx",
               "alembic", "datasets", "transformers", "huggingface_hub", "matplotlib", "PIL", "asyncio")
FORMAT = "%(levelname)s %(name)s: %(message)s"


def add_logging_flags(parser: argparse.ArgumentParser) -> None:
    """``-v`` (repeatable: more detail, third-party logs too) and ``-q`` (warnings and errors only)."""
    g = parser.add_argument_group("logging")
    g.add_argument("-v", "--verbose", action="count", default=0,
                   help="more detail: the project's debug lines, Ray's and MLflow's info lines and progress bars")
    g.add_argument("-q", "--quiet", action="count", default=0, help="only warnings and errors")


def setup_logging(verbosity: int = 0, stream=None) -> None:
    """Configure the root handler once per process (a second call re-levels). ``verbosity`` is
    ``verbose - quiet``."""
    ours = logging.DEBUG if verbosity > 0 else logging.WARNING if verbosity < 0 else logging.INFO
    theirs = logging.INFO if verbosity > 0 else logging.WARNING
    root = logging.getLogger()
    handler = next((h for h in root.handlers if getattr(h, "_adlm", False)), None)
    if handler is None:
        handler = logging.StreamHandler(stream or sys.stderr)
        handler._adlm = True  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
    elif stream is not None:
        handler.setStream(stream)
    root.setLevel(min(ours, theirs))
    logging.getLogger(PROJECT_LOGGER).setLevel(ours)
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(theirs)
    if verbosity <= 0:
        # MLflow's tqdm bar on artifact downloads (every registry read) is noise unless asked for.
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def get_logger(area: str) -> logging.Logger:
    """The project's logger of one area (``adlm.tracking``, ``adlm.train``...)."""
    return logging.getLogger(f"{PROJECT_LOGGER}.{area}")
