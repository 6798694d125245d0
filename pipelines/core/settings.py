"""The ``ADLM_*`` settings a command reads from its environment: one parser, and one ``error:`` line for a bad one.

A number is read by ``env_number`` (whole or not, finite, within its bounds); ``check_environment`` reads every
number setting below, and ``$ADLM_FAULT``, before a command does any work (``pipelines.core.cli.run_command``), so that
``ADLM_PLACEMENT_TIMEOUT_S=abc`` is refused at once instead of in a traceback, or after minutes of work, and
``ADLM_MAX_WORK=nan`` cannot turn a limit off (every comparison with NaN is false).

The served model reads its ``ADLM_MAX_*`` limits itself (``adlm_model.inference.limits``: the model's code imports nothing of
``pipelines``), with the same rules and the same wording.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from pipelines.core.faults import faults


class SettingError(ValueError):
    """A setting of the environment that cannot be used; the message names it, its value and what it takes."""

    exit_code = 2  # bad input, found before any work (pipelines.core.cli)


@dataclass(frozen=True)
class NumberSetting:
    """An ``ADLM_*`` number: whole or not, and its least value (``strict``: the value must exceed it)."""

    name: str
    whole: bool
    least: float | None
    strict: bool
    means: str
    """What it sets, for the error line."""


NUMBERS = (
    NumberSetting("ADLM_PLACEMENT_TIMEOUT_S", False, 0, False,
                  "seconds Ray may wait for work no node can take (0 turns the deadline off)"),
    NumberSetting("ADLM_VERBOSITY", True, None, False, "the verbosity a command passes to its workers (-v / -q set it)"),
    NumberSetting("ADLM_MAX_STEPS", True, 0, True, "the most diffusion steps a generation request may take"),
    NumberSetting("ADLM_MAX_LENGTH", True, 0, True, "the most tokens a generation request may ask for"),
    NumberSetting("ADLM_MAX_ROWS", True, 0, True, "the most rows a generation request may hold"),
    NumberSetting("ADLM_MAX_CHARS", True, 0, True, "the most characters of a request's prompt and suffix"),
    NumberSetting("ADLM_MAX_WORK", False, 0, True, "the most FLOPs a generation request may cost"),
    NumberSetting("ADLM_MAX_BODY_BYTES", True, 0, True, "the largest request body the server reads"),
)
BY_NAME = {s.name: s for s in NUMBERS}


def env_number(name: str, default: float | int, environ: Mapping[str, str] | None = None) -> float | int:
    """The value of the number setting ``name`` (one of ``NUMBERS``), ``default`` when it is unset or empty; a
    ``SettingError`` (one line) when it is not a finite number of its kind within its bounds."""
    s = BY_NAME[name]
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return default
    kind = "a whole number" if s.whole else "a finite number"
    try:
        value: float | int = int(raw) if s.whole else float(raw)
    except ValueError:
        value = math.nan
    if isinstance(value, float) and not math.isfinite(value):
        raise SettingError(f"{name}={raw[:40]!r} is not {kind}: it sets {s.means}; unset it or give {kind}")
    if s.least is not None and (value <= s.least if s.strict else value < s.least):
        bound = f"above {s.least:g}" if s.strict else f"at least {s.least:g}"
        raise SettingError(f"{name}={raw[:40]!r} must be {bound}: it sets {s.means}")
    return value


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Refuse, in one line, any ``ADLM_*`` number setting or ``$ADLM_FAULT`` entry that cannot be used."""
    for s in NUMBERS:
        env_number(s.name, 0, environ)
    try:
        faults(environ)
    except ValueError as e:
        raise SettingError(str(e)) from None


__all__ = ["NUMBERS", "NumberSetting", "SettingError", "check_environment", "env_number"]
