"""A sweep's progress on the driver's console: one bar over its trials (Tune's status tables only with ``-v``), and
Tune's own output settings at each verbosity."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

from ray.tune import Callback

from pipelines.core.logs import verbosity
from pipelines.tuning.space import METRIC


class TrialBar(Callback):
    """Trials ended out of all of them, and the best validation bound reported so far. Tune keeps its callbacks with
    the sweep's state (a resumed sweep restores them): the bar itself is never pickled, only made again."""

    def __init__(self, name: str, total: int) -> None:
        self.name, self.total = name, total
        self.best = math.inf
        self.bar: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "bar": None}

    def _bar(self) -> Any:
        if self.bar is None:
            # lazy: keeps tqdm out of this module's import
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=f"sweep {self.name}", unit="trial", dynamic_ncols=True)
        return self.bar

    def setup(self, **info: Any) -> None:
        self._bar()

    def _ended(self, trials: list[Any]) -> None:
        bar = self._bar()
        bar.n = sum(t.status in ("TERMINATED", "ERROR") for t in trials)
        if math.isfinite(self.best):
            bar.set_postfix_str(f"best validation <= {self.best:.1f}", refresh=False)
        bar.refresh()

    def on_trial_result(self, iteration: int, trials: list[Any], trial: Any, result: dict, **info: Any) -> None:
        value = result.get(METRIC)
        if isinstance(value, int | float) and math.isfinite(value):
            self.best = min(self.best, float(value))

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._ended(trials)

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._ended(trials)

    def on_experiment_end(self, trials: list[Any], **info: Any) -> None:
        self._ended(trials)
        self.bar.close()
        self.bar = None


def tune_verbosity() -> int:
    """Tune's own output: its status tables and each trial's results with ``-v`` (2); none otherwise (0), where
    one bar over the trials (``TrialBar``) is the sweep's progress, and none at all with ``-q``."""
    return 2 if verbosity() > 0 else 0


@contextlib.contextmanager
def tune_output() -> Iterator[None]:
    """Tune's output engine while a sweep runs: at default verbosity the older one, which ``verbose=0`` silences
    (Ray 2.60's newer engine prints its configuration table and the results folder even then); as set otherwise."""
    if verbosity() != 0 or "RAY_AIR_NEW_OUTPUT" in os.environ:
        yield
        return
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    try:
        yield
    finally:
        os.environ.pop("RAY_AIR_NEW_OUTPUT", None)


def progress_callbacks(name: str, total: int) -> list:
    """The callbacks that show a sweep's progress at this verbosity: ``TrialBar`` by default, none with ``-v``
    (Tune's tables) or ``-q``."""
    if verbosity() != 0:
        return []
    return [TrialBar(name, total)]
