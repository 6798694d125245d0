"""Search spaces of the gamma/tau sweeps: the ``tune_spaces/*.yaml`` schema, parsed and validated.

A space names the sweep, its parameters (``gamma`` and ``tau`` mean ``model.gamma`` and ``model.tau``;
any other name is a dotted training-config key), the search algorithm, the scheduler, the trial count
and concurrency, and overrides applied to every trial. Bad spaces fail in one line before Ray starts.
Longer than 500 lines because it is the one schema of a space: the search, the baseline arm and the
confirmation's arms and readings sit together, each field with its check.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field

from adlm_model.config import ConfigError
from pipelines.core.configlib import read_yaml_file, validate
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
class BaselineFile:
    """A second arm searched with the sweep's own budget (its trial count, scheduler and search algorithm), so that
    the winner is compared with a baseline tuned as fairly as itself: e.g. MDLM's learning rate and warm-up."""

    name: str
    """The arm's name (letters, digits, '.', '_', '+', '-'); its search is the sweep ``<sweep>-<name>``."""
    set: dict[str, Any] | None = None
    """``section.key: value`` over the recipe for every run of this arm (``model.kind: mdlm``)."""
    config: str | None = None
    """Its own recipe (``configs/*.yaml``); empty: the sweep's."""
    params: dict[str, ParamFile] | None = None
    """What its search varies (as ``params``); empty: nothing is searched, the arm trains as set."""


@dataclass
class AblationFile:
    """The winner with one change, retrained at the confirmation's seeds and compared with the winner."""

    name: str
    """The arm's name (letters, digits, '.', '_', '+', '-')."""
    set: dict[str, Any]
    """``section.key: value`` over the winner's configuration (``model.anchor_init_std: 0.02``)."""
    steps: int | None = None
    """Its runs' length and the equal-steps reading it is compared at; empty: the confirmation's longest."""
    of: str | None = None
    """The arm the change is made to: empty or ``tuned``, the winner (compared with it: d = ln bound(winner) - ln
    bound(variant)); the baseline arm's name, the baseline's own winner with the change (a larger MDLM at the
    learning rate its search chose), a second comparator of the winner (d = ln bound(variant) - ln bound(winner))."""


@dataclass
class ConfirmFile:
    """After the search: the winner retrained in full at fresh seeds, and a baseline at the same seeds."""

    seeds: int = 0
    """Fresh seeds (never used by the search) each arm is retrained at; 0: no confirmation (``--confirm N`` sets
    it); 2 or more give an interval."""
    against: str | None = None
    """What the winner is compared with: the ``baseline`` arm's name (its own search's winner), ``recipe`` (the
    recipe as it is, untuned) or a recipe file (``configs/*.yaml``, as it is). Empty: the baseline arm if there is
    one, else ``recipe``."""
    steps: list[int] | None = None
    """Equal-steps readings (multiples of run.val_every); every run trains to the largest. Empty: the recipe's own
    run.max_steps (before the space's overrides), the run the search stood in for. Several readings, or any FLOPs
    reading, need optim.schedule: constant (a longer run read part-way)."""
    flops: list[int] | None = None
    """Equal-FLOPs readings: the training FLOPs the winner spends in these many steps; a cheaper arm trains on to
    them (to its nearest validation)."""
    primary: str | None = None
    """The reading that decides, ``steps:<n>`` or ``flops:<n>``; empty: the longest equal-steps reading."""
    ablations: list[AblationFile] | None = None
    """Variants of the winner at the same seeds, each compared with the winner at equal steps."""


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
    config: str | None = None
    """The training recipe (``configs/*.yaml``, relative to the working directory); ``--config`` overrides it."""
    baseline: BaselineFile | None = None
    """A second arm searched with the same trial budget (the winner's fair comparator)."""
    confirm: ConfirmFile | None = None
    """Retrain the winner (and the comparator) at fresh seeds after the search: the paired difference and its 95%
    interval decide, not the search's own best trial."""
    hypothesis: str | None = None
    """The pre-registered hypothesis and decision rule, in words (printed above the confirmation's table)."""


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
        # lazy: keeps ray out of this module's import
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
class BaselineArm:
    """A second arm of the sweep (``BaselineFile``), parsed."""

    name: str
    sets: dict[str, Any] = field(default_factory=dict)
    config: str | None = None
    params: list[ParamSpec] = field(default_factory=list)


@dataclass
class Ablation:
    name: str
    sets: dict[str, Any]
    steps: int | None = None
    of: str = "tuned"
    """``tuned`` (the winner) or the baseline arm's name (``AblationFile.of``)."""


@dataclass
class ConfirmSpec:
    """``ConfirmFile``, parsed: see its fields."""

    seeds: int = 0
    against: str = "recipe"
    steps: list[int] = field(default_factory=list)
    flops: list[int] = field(default_factory=list)
    primary: str | None = None
    ablations: list[Ablation] = field(default_factory=list)

    @property
    def primary_reading(self) -> tuple[str, int] | None:
        """``("steps" | "flops", n)``; None: the longest equal-steps reading (known once the recipe is)."""
        if self.primary is None:
            return None
        budget, _, n = self.primary.partition(":")
        return budget, int(n)


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
    config: str | None = None
    baseline: BaselineArm | None = None
    confirm: ConfirmSpec | None = None
    hypothesis: str | None = None

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
        raw = {"name": self.name, "params": _params_raw(self.params),
               "search": {"algorithm": self.algorithm, "seed": self.seed},
               "scheduler": {"type": self.scheduler, "grace_period": self.grace_period,
                             "reduction_factor": self.reduction_factor, "max_t": self.max_t},
               "num_samples": self.num_samples, "max_concurrent": self.max_concurrent, "metric": self.metric,
               "resources": {"trial_cpu": self.trial_cpu}, "overrides": self.overrides}
        if self.config is not None:
            raw["config"] = self.config
        if self.baseline is not None:
            b = self.baseline
            raw["baseline"] = {"name": b.name, "set": b.sets, "config": b.config, "params": _params_raw(b.params)}
        if self.confirm is not None:
            c = self.confirm
            raw["confirm"] = {"seeds": c.seeds, "against": c.against, "steps": c.steps, "flops": c.flops,
                              "primary": c.primary,
                              "ablations": [{"name": a.name, "set": a.sets, "steps": a.steps, "of": a.of}
                                            for a in c.ablations]}
        if self.hypothesis is not None:
            raw["hypothesis"] = self.hypothesis
        return raw

    def baseline_space(self) -> SearchSpace | None:
        """The baseline arm's own search: this sweep's budget (trials, scheduler, search, resources, overrides) over
        the arm's params, its settings applied as overrides; None without a baseline arm or when it searches
        nothing."""
        b = self.baseline
        if b is None or not b.params:
            return None
        return dataclasses.replace(self, name=f"{self.name}-{b.name}", params=list(b.params),
                                   overrides={**self.overrides, **b.sets}, config=b.config or self.config,
                                   baseline=None, confirm=None, hypothesis=None)


def _params_raw(params: list[ParamSpec]) -> dict[str, Any]:
    out = {}
    for p in params:
        d: dict[str, Any] = {"distribution": p.distribution}
        if p.values is not None:
            d["values"] = p.values
        else:
            d["low"], d["high"] = (int(p.low), int(p.high)) if p.distribution == "randint" else (p.low, p.high)
        out[p.name] = d
    return out


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
    if not f.name or f.name.startswith(".") or any(c in f.name for c in "/\\ "):
        raise ConfigError(f"search space {source}: 'name' must be a sweep name without '/', '\\', spaces or a "
                          f"leading '.' (it names a folder of the sweep's), got {f.name!r}")
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
    space.config, space.hypothesis = f.config, f.hypothesis
    if f.baseline is not None:
        space.baseline = _parse_baseline(f.baseline, source, algo)
    if f.confirm is not None:
        space.confirm = parse_confirm(f.confirm, source, space.baseline)
    return space


ARM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def _sets(v: dict[str, Any] | None, where: str) -> dict[str, Any]:
    if v is None:
        return {}
    bad = [k for k in v if "." not in k or k.split(".")[0] not in TOP_KEYS]
    if bad:
        raise ConfigError(f"{where} must map section.key to a value (e.g. model.kind: mdlm), got {bad[0]!r}")
    return dict(v)


def _parse_baseline(b: BaselineFile, source: str, algorithm: str) -> BaselineArm:
    where = f"search space {source}: baseline"
    if not ARM_NAME.match(b.name) or b.name == "recipe":
        raise ConfigError(f"{where}.name must be letters, digits, '.', '_', '+' or '-' (not 'recipe'), got {b.name!r}")
    params = [parse_param(k, v, f"{where}.params.{k}") for k, v in (b.params or {}).items()]
    if algorithm == "optuna" and any(p.distribution == "grid" for p in params):
        raise ConfigError(f"{where}: grid parameters need search.algorithm random (Optuna samples)")
    return BaselineArm(b.name, _sets(b.set, f"{where}.set"), b.config, params)


def parse_confirm(c: ConfirmFile, source: str, baseline: BaselineArm | None) -> ConfirmSpec:
    """The ``confirm`` section's own rules (the recipe's are checked in ``pipelines.tuning.confirm.plan``)."""
    where = f"search space {source}: confirm"
    if c.seeds < 0 or c.seeds == 1:
        raise ConfigError(f"{where}.seeds must be 0 (no confirmation) or at least 2 (an interval needs two), "
                          f"got {c.seeds}")
    against = c.against or (baseline.name if baseline is not None else "recipe")
    if against not in ("recipe", *([baseline.name] if baseline else [])) and not against.endswith((".yaml", ".yml")):
        names = ", ".join(["recipe", *([baseline.name] if baseline else [])])
        raise ConfigError(f"{where}.against {against!r} is neither an arm ({names}) nor a recipe file (.yaml)")
    for key in ("steps", "flops"):
        v = getattr(c, key) or []
        if any(n < 1 for n in v) or len(set(v)) != len(v):
            raise ConfigError(f"{where}.{key} must be distinct positive step counts, got {v!r}")
    if c.primary is not None:
        budget, _, n = c.primary.partition(":")
        listed = c.steps if budget == "steps" else c.flops if budget == "flops" else None
        if listed is None or not n.isdigit() or int(n) not in (listed or []):
            raise ConfigError(f"{where}.primary must name one of its readings as steps:<n> or flops:<n> "
                              f"(steps {c.steps or []}, flops {c.flops or []}), got {c.primary!r}")
    ablations = []
    for i, a in enumerate(c.ablations or []):
        if not ARM_NAME.match(a.name) or a.name in ("recipe", "tuned", against):
            raise ConfigError(f"{where}.ablations[{i}].name must be letters, digits, '.', '_', '+' or '-' and not "
                              f"another arm's, got {a.name!r}")
        if not a.set:
            raise ConfigError(f"{where}.ablations[{i}].set must change something (section.key: value)")
        if a.steps is not None and a.steps < 1:
            raise ConfigError(f"{where}.ablations[{i}].steps must be a positive step count, got {a.steps}")
        of = a.of or "tuned"
        arms = ["tuned", *([against] if baseline is not None and against == baseline.name else [])]
        if of not in arms:
            raise ConfigError(f"{where}.ablations[{i}].of must be the winner or the baseline arm it is confirmed "
                              f"against ({', '.join(arms)}), got {of!r}")
        ablations.append(Ablation(a.name, _sets(a.set, f"{where}.ablations[{i}].set"), a.steps, of))
    names = [a.name for a in ablations]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}.ablations: arm names must be unique, got {names}")
    return ConfirmSpec(c.seeds, against, sorted(c.steps or []), sorted(c.flops or []), c.primary, ablations)
