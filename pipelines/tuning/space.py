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
from typing import Annotated, Any

from pydantic import Field

from adlm_model.config import ConfigError
from pipelines.configlib import read_yaml_file, validate
from pipelines.training.config import TOP_KEYS

DISTRIBUTIONS = ("loguniform", "uniform", "choice", "randint", "grid")
ALGORITHMS = ("random", "optuna")
SCHEDULERS = ("asha", "fifo")
SHORT_NAMES = {"gamma": "model.gamma", "tau": "model.tau"}
"""Parameter names users write for the paper's knobs; any other name is a dotted train-config key."""
METRIC = "val_ppl"
"""The validation NELBO perplexity bound that ``train_loop_per_worker`` reports (minimised)."""
TIME_ATTR = "step"




def _one_of(choices: tuple[str, ...]) -> Any:
    """A text field whose schema lists ``choices`` (editors complete them); the parser names the fix itself."""
    return Field(json_schema_extra={"enum": list(choices)})


# The YAML's shape (keys, types, descriptions: the schema tune_spaces/*.yaml is validated against); the rules
# between the keys are parse_space's.


@dataclass
class ParamFile:
    """One searched parameter: ``loguniform``/``uniform``/``randint`` take ``low`` and ``high``; ``choice`` and
    ``grid`` take ``values``."""

    distribution: Annotated[str, _one_of(DISTRIBUTIONS)]
    """``loguniform`` / ``uniform`` (low, high), ``randint`` (integers, low inclusive, high exclusive), ``choice``
    (values, sampled) or ``grid`` (every value, crossed with the other grids)."""
    low: float | None = None
    """Lower bound (loguniform: > 0)."""
    high: float | None = None
    """Upper bound (above ``low``)."""
    values: list[Any] | None = None
    """The values of a ``choice`` or ``grid``."""


@dataclass
class SearchFile:
    """The search algorithm."""

    algorithm: Annotated[str, _one_of(ALGORITHMS)] = "random"
    """``random`` or ``optuna`` (grid parameters need random)."""
    seed: int = 0
    """Seed of the search algorithm."""


@dataclass
class SchedulerFile:
    """The trial scheduler, in optimiser steps."""

    type: Annotated[str, _one_of(SCHEDULERS)] = "asha"
    """``asha`` (stops poor trials early) or ``fifo`` (runs every trial to the end)."""
    grace_period: int = 10
    """ASHA: steps every trial runs before it can be stopped (>= 1, below max_t)."""
    reduction_factor: float = 2.0
    """ASHA: the fraction 1/reduction_factor of trials kept at each rung (> 1)."""
    max_t: int | None = None
    """Steps of the longest trial; empty: the recipe's run.max_steps."""


@dataclass
class ResourcesFile:
    """What each trial asks Ray for."""

    trial_cpu: float = 0.01
    """CPUs of each trial's driver function; the trainer's workers take what ``scaling`` says."""


@dataclass
class SpaceFile:
    """A ``tune_spaces/*.yaml`` file as written (``parse_space`` turns it into a ``SearchSpace``)."""

    name: str
    """The sweep: Tune experiment and MLflow parent run name (no '/' or spaces); rerun it to resume."""
    params: dict[str, ParamFile]
    """Parameter name -> distribution; ``gamma`` and ``tau`` mean ``model.gamma`` and ``model.tau``, other names are
    dotted train-config keys (``optim.lr``)."""
    search: SearchFile = field(default_factory=SearchFile)
    """The search algorithm and its seed."""
    scheduler: SchedulerFile = field(default_factory=SchedulerFile)
    """The trial scheduler."""
    num_samples: int = 4
    """Trials (with grid parameters: repeats of the whole grid)."""
    max_concurrent: int = 2
    """Trials at once."""
    metric: Annotated[str, _one_of((METRIC,))] = METRIC
    """Only ``val_ppl`` (the validation NELBO perplexity bound, minimised)."""
    resources: ResourcesFile = field(default_factory=ResourcesFile)
    """Ray resources of each trial."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Train-config assignments applied to every trial (``run.max_steps: 60``)."""


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


_TOP = tuple(f.name for f in dataclasses.fields(SpaceFile))


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


def parse_param(name: str, d: ParamFile, where: str) -> ParamSpec:
    """One searched parameter from its typed entry (``ParamFile``): the rules between its keys."""
    dist = d.distribution
    if dist not in DISTRIBUTIONS:
        raise ConfigError(f"{where}: unknown distribution {dist!r}; use one of {', '.join(DISTRIBUTIONS)}")
    key = SHORT_NAMES.get(name, name)
    if key.split(".")[0] not in TOP_KEYS or "." not in key:
        raise ConfigError(f"{where}: {name!r} is neither gamma/tau nor a dotted train-config key such as optim.lr")
    takes = ("values",) if dist in ("choice", "grid") else ("low", "high")
    extra = [k for k in ("low", "high", "values") if k not in takes and getattr(d, k) is not None]
    if extra:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(extra)} for {dist}; known: distribution, "
                          f"{', '.join(takes)}")
    if dist in ("choice", "grid"):
        if not d.values:
            raise ConfigError(f"{where}: {dist} needs a non-empty list 'values'")
        return ParamSpec(name, key, dist, values=list(d.values))
    if d.low is None or d.high is None:
        raise ConfigError(f"{where}: {dist} needs 'low' and 'high'")
    integer = dist == "randint"
    low, high = _num(d.low, f"{where}.low", integer), _num(d.high, f"{where}.high", integer)
    if not low < high:
        raise ConfigError(f"{where}: low ({low:g}) must be below high ({high:g})")
    if dist == "loguniform" and low <= 0:
        raise ConfigError(f"{where}: loguniform needs low > 0, got {low:g}")
    return ParamSpec(name, key, dist, low=low, high=high)


def load_space(path: str | os.PathLike) -> SearchSpace:
    """Read and validate a search-space YAML (its own rules; the recipe is checked in :func:`plan_sweep`)."""
    return parse_space(read_yaml_file(path, "search space", "tune_spaces/*.yaml"), str(path))


def parse_space(raw: Any, source: str = "<space>") -> SearchSpace:
    """A SearchSpace from the YAML's mapping. The library parses the file once into ``SpaceFile`` (keys, types);
    the rules between the keys are checked here on that typed object."""
    if not isinstance(raw, dict):
        raise ConfigError(f"search space {source} must be a mapping with keys {', '.join(_TOP)}")
    f: SpaceFile = validate(SpaceFile, raw, f"search space {source}", ": ")
    if not f.name or "/" in f.name or " " in f.name:
        raise ConfigError(f"search space {source}: 'name' must be a sweep name without '/' or spaces, got {f.name!r}")
    if not f.params:
        raise ConfigError(f"search space {source}: 'params' must map parameter names to distributions")
    params = [parse_param(k, v, f"{source}: params.{k}") for k, v in f.params.items()]
    keys = [p.key for p in params]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"search space {source}: a parameter is given twice ({', '.join(keys)})")
    algo, stype = f.search.algorithm, f.scheduler.type
    if algo not in ALGORITHMS:
        raise ConfigError(f"search space {source}: search.algorithm {algo!r} unknown; use one of {', '.join(ALGORITHMS)}")
    if stype not in SCHEDULERS:
        raise ConfigError(f"search space {source}: scheduler.type {stype!r} unknown; use one of {', '.join(SCHEDULERS)}")
    if f.metric != METRIC:
        raise ConfigError(f"search space {source}: metric {f.metric!r} is not reported by training; use {METRIC} "
                          "(the validation NELBO perplexity bound, minimised)")
    space = SearchSpace(
        name=f.name, params=params, algorithm=algo, seed=f.search.seed, scheduler=stype,
        grace_period=f.scheduler.grace_period, reduction_factor=_num(f.scheduler.reduction_factor,
                                                                     "scheduler.reduction_factor"),
        max_t=f.scheduler.max_t, num_samples=f.num_samples, max_concurrent=f.max_concurrent,
        trial_cpu=_num(f.resources.trial_cpu, "resources.trial_cpu"), overrides=dict(f.overrides), metric=f.metric,
        source=source)
    if space.num_samples < 1 or space.max_concurrent < 1:
        raise ConfigError(f"search space {source}: num_samples and max_concurrent must be >= 1")
    if space.grace_period < 1 or space.reduction_factor <= 1:
        raise ConfigError(f"search space {source}: scheduler.grace_period must be >= 1 and reduction_factor > 1")
    if not 0 < space.trial_cpu <= 64:
        raise ConfigError(f"search space {source}: resources.trial_cpu must be in (0, 64], got {space.trial_cpu:g}")
    if algo == "optuna" and any(p.distribution == "grid" for p in params):
        raise ConfigError(f"search space {source}: grid parameters need search.algorithm random (Optuna samples)")
    return space
