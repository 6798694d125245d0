"""One runner for every command's ``main()``: parse the arguments, set up logging (``-v``/``-q``) and the
environment, run the command, and turn a failure into one ``error:`` line and an exit code.

    def main(argv: Sequence[str] | None = None) -> int:
        return run_command(build_parser(), _run, argv, bad_input=(ConfigError, RegistryError))

``_run(args)`` does the work and returns the exit code (results alone on stdout). Exit codes, the same for every
command:

- 0: done;
- 1: the work failed after it started (``failed``: ``RuntimeError``s such as ``TrainError``, ``TuneError``);
- 2: bad input, found before any work (``bad_input``: ``ValueError``s such as ``ConfigError``,
  ``RegistryError``, ``CheckpointError``);
- an error class may carry its own ``exit_code`` (``CommandError`` and its subclasses, ``run_all.Unregistered``:
  3, ``JobDeadlineError`` and ``PlacementError``: 1), which wins over the tuples.

Every command's work runs under ``pipelines.core.placement.placement_deadline``: whichever of them starts or joins a
Ray, a wait Ray cannot satisfy (work no node can take, for ``ADLM_PLACEMENT_TIMEOUT_S``) ends in that one line
instead of waiting for ever. Written here once, not in each command.

A bad ``ADLM_*`` setting of the environment (``pipelines.core.settings``) is refused the same way before anything runs.

An exception that is none of these is a bug: it keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from pipelines.core.logs import setup_logging
from pipelines.core.placement import placement_deadline
from pipelines.core.runtime import quiet_environment
from pipelines.core.settings import SettingError, check_environment

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class CommandError(Exception):
    """A failure a command reports in one line; ``exit_code`` says which (default 2: bad input)."""

    exit_code: int = EXIT_BAD_INPUT


def exit_code_of(error: BaseException, bad_input: tuple[type[BaseException], ...] = (),
                 failed: tuple[type[BaseException], ...] = ()) -> int | None:
    """The exit code of ``error`` (module docstring), or None: not an error the command reports in one line."""
    code = getattr(type(error), "exit_code", None)
    if isinstance(code, int):
        return code
    if isinstance(error, bad_input):
        return EXIT_BAD_INPUT
    if isinstance(error, failed):
        return EXIT_FAILED
    return None


def run_command(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], int],
                argv: Sequence[str] | None = None, *, bad_input: tuple[type[BaseException], ...] = (),
                failed: tuple[type[BaseException], ...] = (), environment: bool = True,
                label: str = "error") -> int:
    """Parse ``argv``, set up logging and (``environment``) the environment defaults, run ``run(args)``; a failure
    of the kinds given becomes ``{label}: <message>`` on stderr and its exit code (module docstring)."""
    args = parser.parse_args(argv)
    try:
        check_environment()  # before set-up: a bad ADLM_* setting is one line, before any work
    except SettingError as e:
        print(f"{label}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    setup_logging(getattr(args, "verbose", 0) - getattr(args, "quiet", 0))
    if environment:
        quiet_environment()
    try:
        with placement_deadline():
            return run(args)
    except Exception as e:
        code = exit_code_of(e, bad_input, failed)
        if code is None:
            raise
        print(f"{label}: {e}", file=sys.stderr)
        return code


__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_OK", "CommandError", "exit_code_of", "run_command"]
