"""Search spaces of the gamma/tau sweeps: the ``tune_spaces/*.yaml`` schema, parsed and validated.

A space names the sweep, its parameters (``gamma`` and ``tau`` mean ``model.gamma`` and ``model.tau``;
any other name is a dotted training-config key), the search algorithm, the scheduler, the trial count
and concurrency, and overrides applied to every trial. Bad spaces fail in one line before Ray starts.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from adlm_model.config import ConfigError
from pipelines.overrides import read_yaml_file
from pipelines.training.config import TOP_KEYS

DISTRIBUTIONS = ("loguniform", "uniform", "choice", "randint", "grid")
ALGORITHMS = ("random", "optuna")
SCHEDULERS = ("asha", "fifo")
SHORT_NAMES = {"gamma": "model.gamma", "tau": "model.tau"}
"""Parameter names users write for the paper's knobs; any other name is a dotted train-config key."""
METRIC = "val_ppl"
"""The validation NELBO perplexity bound that ``train_loop_per_worker`` reports (minimised)."""
TIME_ATTR = "step"




@dataclass
class ParamSpec:
    """One searched parameter.

    ``distribution``: ``loguniform`` / ``uniform`` (``low``, ``high``), ``randint`` (``low`` inclusive,
    ``high`` exclusive, integers), ``choice`` (``values``: sampled), ``grid`` (``values``: every value,
    crossed with the other grids; ``num_samples`` then repeats the whole grid).
    """

    name: str
    key: str
    distribution: str
    low: float | None = None
    high: float | None = None
    values: list[Any] | None = None

    def corners(self) -> list[Any]:
        """Values that bound what the distribution can produce (validated against the recipe)."""
        if self.distribution in ("choice", "grid"):
            return list(self.values or [])
        if self.distribution == "randint":
            return [int(self.low), int(self.high) - 1]
        return [self.low, self.high]

    def to_tune(self) -> Any:
        from ray import tune

        d = self.distribution
        if d == "loguniform":
            return tune.loguniform(self.low, self.high)
        if d == "uniform":
            return tune.uniform(self.low, self.high)
        if d == "randint":
            return tune.randint(int(self.low), int(self.high))
        if d == "choice":
            return tune.choice(list(self.values))
        return tune.grid_search(list(self.values))


@dataclass
class SearchSpace:
    """A ``tune_spaces/*.yaml`` file.

    Keys: ``name`` (the sweep: Tune experiment and MLflow parent run name; rerun it to resume),
    ``params`` (name -> {distribution, low/high or values}; ``gamma`` and ``tau`` mean ``model.gamma``
    and ``model.tau``, other names are dotted train-config keys), ``search`` ({algorithm: random |
    optuna, seed}), ``scheduler`` ({type: asha | fifo, grace_period, reduction_factor, max_t; in
    optimiser steps; max_t defaults to run.max_steps}), ``num_samples``, ``max_concurrent``,
    ``metric`` (only ``val_ppl``, minimised), ``resources`` ({trial_cpu: the CPU of each trial's
    driver function; the trainer's workers take what ``scaling`` says}), and ``overrides`` (train-config
    assignments applied to every trial, e.g. ``run.max_steps: 60``).
    """

    name: str
    params: list[ParamSpec]
    algorithm: str = "random"
    seed: int = 0
    scheduler: str = "asha"
    grace_period: int = 10
    reduction_factor: float = 2.0
    max_t: int | None = None
    num_samples: int = 4
    max_concurrent: int = 2
    metric: str = METRIC
    trial_cpu: float = 0.01
    overrides: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def grid_size(self) -> int:
        n = 1
        for p in self.params:
            if p.distribution == "grid":
                n *= len(p.values or [])
        return n

    @property
    def total_trials(self) -> int:
        return self.num_samples * self.grid_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_raw(self) -> dict[str, Any]:
        """The space back in its YAML form (the trial actors re-parse it)."""
        params = {}
        for p in self.params:
            d: dict[str, Any] = {"distribution": p.distribution}
            if p.values is not None:
                d["values"] = p.values
            else:
                d["low"], d["high"] = (int(p.low), int(p.high)) if p.distribution == "randint" else (p.low, p.high)
            params[p.name] = d
        return {"name": self.name, "params": params, "search": {"algorithm": self.algorithm, "seed": self.seed},
                "scheduler": {"type": self.scheduler, "grace_period": self.grace_period,
                              "reduction_factor": self.reduction_factor, "max_t": self.max_t},
                "num_samples": self.num_samples, "max_concurrent": self.max_concurrent, "metric": self.metric,
                "resources": {"trial_cpu": self.trial_cpu}, "overrides": self.overrides}


_TOP = ("name", "params", "search", "scheduler", "num_samples", "max_concurrent", "metric", "resources",
        "overrides")


def _unknown(d: dict[str, Any], known: tuple[str, ...] | set[str], where: str) -> None:
    bad = sorted(set(d) - set(known))
    if bad:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(str, bad))}; known: {', '.join(sorted(known))}")


def _num(v: Any, where: str, integer: bool = False) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} must be a number, got {v!r}") from None
    if integer and not x.is_integer():
        raise ConfigError(f"{where} must be an integer, got {v!r}")
    if not math.isfinite(x):
        raise ConfigError(f"{where} must be finite, got {v!r}")
    return x


def parse_param(name: str, d: Any, where: str) -> ParamSpec:
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping like {{distribution: loguniform, low: 1e-3, high: 1e-2}}, "
                          f"got {d!r}")
    _unknown(d, ("distribution", "low", "high", "values"), where)
    dist = d.get("distribution")
    if dist not in DISTRIBUTIONS:
        raise ConfigError(f"{where}: unknown distribution {dist!r}; use one of {', '.join(DISTRIBUTIONS)}")
    key = SHORT_NAMES.get(name, name)
    if key.split(".")[0] not in TOP_KEYS or "." not in key:
        raise ConfigError(f"{where}: {name!r} is neither gamma/tau nor a dotted train-config key such as optim.lr")
    if dist in ("choice", "grid"):
        _unknown(d, ("distribution", "values"), where)
        vals = d.get("values")
        if not isinstance(vals, list) or not vals:
            raise ConfigError(f"{where}: {dist} needs a non-empty list 'values'")
        return ParamSpec(name, key, dist, values=vals)
    _unknown(d, ("distribution", "low", "high"), where)
    if "low" not in d or "high" not in d:
        raise ConfigError(f"{where}: {dist} needs 'low' and 'high'")
    integer = dist == "randint"
    low, high = _num(d["low"], f"{where}.low", integer), _num(d["high"], f"{where}.high", integer)
    if not low < high:
        raise ConfigError(f"{where}: low ({low:g}) must be below high ({high:g})")
    if dist == "loguniform" and low <= 0:
        raise ConfigError(f"{where}: loguniform needs low > 0, got {low:g}")
    return ParamSpec(name, key, dist, low=low, high=high)


def load_space(path: str | os.PathLike) -> SearchSpace:
    """Read and validate a search-space YAML (its own rules; the recipe is checked in :func:`plan_sweep`)."""
    return parse_space(read_yaml_file(path, "search space", "tune_spaces/*.yaml"), str(path))


def parse_space(raw: Any, source: str = "<space>") -> SearchSpace:
    if not isinstance(raw, dict):
        raise ConfigError(f"search space {source} must be a mapping with keys {', '.join(_TOP)}")
    _unknown(raw, _TOP, f"search space {source}")
    name = raw.get("name")
    if not isinstance(name, str) or not name or "/" in name or " " in name:
        raise ConfigError(f"search space {source}: 'name' must be a sweep name without '/' or spaces, got {name!r}")
    params_raw = raw.get("params")
    if not isinstance(params_raw, dict) or not params_raw:
        raise ConfigError(f"search space {source}: 'params' must map parameter names to distributions")
    params = [parse_param(str(k), v, f"{source}: params.{k}") for k, v in params_raw.items()]
    keys = [p.key for p in params]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"search space {source}: a parameter is given twice ({', '.join(keys)})")
    search = raw.get("search") or {}
    sched = raw.get("scheduler") or {}
    res = raw.get("resources") or {}
    for sec, d, known in (("search", search, ("algorithm", "seed")),
                          ("scheduler", sched, ("type", "grace_period", "reduction_factor", "max_t")),
                          ("resources", res, ("trial_cpu",))):
        if not isinstance(d, dict):
            raise ConfigError(f"search space {source}: '{sec}' must be a mapping")
        _unknown(d, known, f"search space {source}: {sec}")
    algo = search.get("algorithm", "random")
    if algo not in ALGORITHMS:
        raise ConfigError(f"search space {source}: search.algorithm {algo!r} unknown; use one of {', '.join(ALGORITHMS)}")
    stype = sched.get("type", "asha")
    if stype not in SCHEDULERS:
        raise ConfigError(f"search space {source}: scheduler.type {stype!r} unknown; use one of {', '.join(SCHEDULERS)}")
    metric = raw.get("metric", METRIC)
    if metric != METRIC:
        raise ConfigError(f"search space {source}: metric {metric!r} is not reported by training; use {METRIC} "
                          "(the validation NELBO perplexity bound, minimised)")
    overrides = raw.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise ConfigError(f"search space {source}: 'overrides' must map train-config keys to values")
    space = SearchSpace(
        name=name, params=params, algorithm=algo, seed=int(_num(search.get("seed", 0), "search.seed", True)),
        scheduler=stype, grace_period=int(_num(sched.get("grace_period", 10), "scheduler.grace_period", True)),
        reduction_factor=_num(sched.get("reduction_factor", 2), "scheduler.reduction_factor"),
        max_t=int(_num(sched["max_t"], "scheduler.max_t", True)) if sched.get("max_t") is not None else None,
        num_samples=int(_num(raw.get("num_samples", 4), "num_samples", True)),
        max_concurrent=int(_num(raw.get("max_concurrent", 2), "max_concurrent", True)),
        trial_cpu=_num(res.get("trial_cpu", 0.01), "resources.trial_cpu"),
        overrides={str(k): v for k, v in overrides.items()}, metric=metric, source=source)
    if space.num_samples < 1 or space.max_concurrent < 1:
        raise ConfigError(f"search space {source}: num_samples and max_concurrent must be >= 1")
    if space.grace_period < 1 or space.reduction_factor <= 1:
        raise ConfigError(f"search space {source}: scheduler.grace_period must be >= 1 and reduction_factor > 1")
    if not 0 < space.trial_cpu <= 64:
        raise ConfigError(f"search space {source}: resources.trial_cpu must be in (0, 64], got {space.trial_cpu:g}")
    if algo == "optuna" and any(p.distribution == "grid" for p in params):
        raise ConfigError(f"search space {source}: grid parameters need search.algorithm random (Optuna samples)")
    return space
