"""Fault injection for the tests of crash recovery: one documented switch, off unless set.

``ADLM_FAULT`` holds comma-separated ``name=value`` entries; the product reads them only here:

- ``train.crash_at_step=N``: the last training worker kills its own process (``os._exit``) at optimiser
  step N, once per run (a marker file in the run folder remembers it), to test Ray Train's restart and
  resume from the latest checkpoint.
- ``train.crash_writing_best=N``: rank 0 kills its own process (``os._exit``) after the first file of the
  best checkpoint of step N is uploaded, once per run, to test that a best cut short is never registered.
- ``train.step_pause_ms=N``: every optimiser step then waits N milliseconds (a step on an accelerator leaves the
  CPU idle), so that a test of a tracking outage can size its runs in seconds without keeping a core busy.
- ``prepare.fail_after_shards=N``: data preparation raises after committing N shards in this process, to
  test that a rerun resumes byte-identically.

Nothing else reads test switches from the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV = "ADLM_FAULT"
KNOWN = ("train.crash_at_step", "prepare.fail_after_shards", "train.crash_writing_best", "train.step_pause_ms")


def faults(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The switches set in ``$ADLM_FAULT`` (unknown names, and values that are not whole numbers, are refused, so
    a typo cannot silently pass)."""
    out: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in (os.environ if environ is None else environ).get(ENV, "").split(","))):
        name, _, value = entry.partition("=")
        if name not in KNOWN:
            raise ValueError(f"{ENV}: unknown fault {name!r}; known: {', '.join(KNOWN)}")
        if value and not value.strip().lstrip("-").isdigit():
            raise ValueError(f"{ENV}: {name}={value!r} is not a whole number")
        out[name] = value
    return out


def fault(name: str) -> int | None:
    """The integer value of switch ``name``, or None when it is not set."""
    value = faults().get(name)
    return int(value) if value else None
