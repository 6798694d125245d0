"""A sweep's progress on the driver's console: one bar over its trials (Tune's status tables only with ``-v``)."""

from __future__ import annotations

import math
from typing import Any

from ray.tune import Callback

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
