"""What one request to the served model may cost, checked before any network runs.

A request whose cost has no bound ties up a worker: ``steps: 100000000`` kept a served worker at a full core
and 4.3 GB for minutes after the HTTP layer had given up (504 after 60 s). ``RequestLimits`` bounds

- ``max_steps``: diffusion steps ``T`` of a row;
- ``max_length``: tokens generated in a row (default: the model's context; 4x for ``bd3lm``, which generates
  beyond it);
- ``max_rows``: rows of one request;
- ``max_work``: the FLOPs of the whole request, estimated by ``TextGenerator.cost`` as
  ``2 x parameters x rows x row length x network calls`` (default ``1e12``: seconds to tens of seconds of one
  CPU core, well inside the scoring server's 60 s timeout).
- ``max_chars``: characters of a row's prompt and suffix together (default ``CHARS_PER_TOKEN`` x
  ``max_length``), checked before the text is tokenized: a megabyte of prompt is refused at once instead of
  being encoded first and then found too long.

They are settings of the served model, read from the environment of ``mlflow models serve``
(``ADLM_MAX_STEPS``, ``ADLM_MAX_LENGTH``, ``ADLM_MAX_ROWS``, ``ADLM_MAX_WORK``, ``ADLM_MAX_CHARS``); a request
over one is refused
with the limit named, the value asked and the setting that raises it. ``python -m pipelines.generate`` runs
under the same limits (its samples count as rows) unless ``--no-limits`` lifts them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_STEPS = 4096
"""The paper profile's T (docs/design/method.md, section 4): nothing the references run is refused by it."""
DEFAULT_MAX_ROWS = 16
DEFAULT_MAX_WORK = 1e12
CHARS_PER_TOKEN = 32
"""Characters a token may stand for, on average over a whole prompt, before the prompt is refused untokenized
(English BPE averages about 4)."""
ENV = {"max_steps": "ADLM_MAX_STEPS", "max_length": "ADLM_MAX_LENGTH", "max_rows": "ADLM_MAX_ROWS",
       "max_work": "ADLM_MAX_WORK", "max_chars": "ADLM_MAX_CHARS"}


class LimitError(ValueError):
    """A request over a limit; the message names the limit, the value and the setting."""


@dataclass(frozen=True)
class RequestLimits:
    max_steps: int = DEFAULT_MAX_STEPS
    max_length: int = 1024
    max_rows: int = DEFAULT_MAX_ROWS
    max_work: float = DEFAULT_MAX_WORK
    max_chars: int = CHARS_PER_TOKEN * 1024

    @classmethod
    def for_model(cls, seq_len: int, any_length: bool = False,
                  environ: Mapping[str, str] | None = None) -> RequestLimits:
        """The defaults for a model of context ``seq_len``, overridden by ``ADLM_MAX_*`` (module docstring)."""
        env = os.environ if environ is None else environ
        length = seq_len * (4 if any_length else 1)
        values: dict[str, Any] = {"max_steps": DEFAULT_MAX_STEPS, "max_length": length,
                                  "max_rows": DEFAULT_MAX_ROWS, "max_work": DEFAULT_MAX_WORK,
                                  "max_chars": CHARS_PER_TOKEN * max(length, seq_len)}
        for field, var in ENV.items():
            raw = env.get(var, "").strip()
            if raw:
                # The same rules and words as the commands' settings (pipelines.core.settings): a NaN or an infinity
                # would turn the limit off (every comparison with NaN is false).
                kind = "a finite number" if field == "max_work" else "a whole number"
                try:
                    values[field] = float(raw) if field == "max_work" else int(raw)
                except ValueError:
                    values[field] = math.nan
                if not math.isfinite(values[field]):
                    raise LimitError(f"{var}={raw[:40]!r} is not {kind}: it sets the limit {field}; unset it or "
                                     f"give {kind}")
                if values[field] <= 0:
                    raise LimitError(f"{var}={raw[:40]!r} must be above 0: it sets the limit {field}")
        return cls(**values)

    def check_row(self, i: int | None, steps: int, length: int) -> None:
        """Row ``i`` of a served request (None: the one request of ``pipelines.generate``)."""
        where = "" if i is None else f"request row {i}: "
        if steps > self.max_steps:
            raise LimitError(f"{where}steps {steps} exceeds the limit max_steps={self.max_steps} "
                             f"({ENV['max_steps']}): ask for fewer steps")
        if length > self.max_length:
            raise LimitError(f"{where}length {length} exceeds the limit max_length={self.max_length} "
                             f"({ENV['max_length']}): ask for fewer tokens")

    def check_text(self, i: int | None, chars: int) -> None:
        """The prompt and suffix of row ``i`` (None: ``pipelines.generate``'s), ``chars`` characters together,
        before they are tokenized."""
        if chars > self.max_chars:
            where = "" if i is None else f"request row {i}: "
            raise LimitError(f"{where}prompt and suffix of {chars:,} characters exceed the limit "
                             f"max_chars={self.max_chars:,} ({ENV['max_chars']}): send a shorter text")

    def check_request(self, rows: int, work: float, what: str = "rows") -> None:
        """``rows`` rows of a served request (``what``: ``samples``, those ``pipelines.generate`` draws)."""
        if rows > self.max_rows:
            raise LimitError(f"{rows} {what} exceed the limit max_rows={self.max_rows} ({ENV['max_rows']}): "
                             "split the request")
        if work > self.max_work:
            raise LimitError(f"the request's work {work:.3g} FLOPs exceeds the limit max_work={self.max_work:.3g} "
                             f"({ENV['max_work']}): ask for fewer steps, tokens or rows")


__all__ = ["ENV", "LimitError", "RequestLimits"]
