"""The study file (``studies/*.yaml``): which arms, seeds and budgets; parsed and checked before Ray starts.

Schema (every key but ``name``, ``config``, ``steps`` and ``arms`` has a default)::

    name: laptop                      # MLflow parent run study-<name>; training runs <name>-<arm>-s<seed>
    config: configs/study.yaml        # the base recipe every arm starts from
    data: {source: embedded, out: data/study-bpe1024, train_tokenizer: 1024}   # prepared once (optional)
    seeds: [0, 1, 2]
    steps: 200                        # the equal-steps budget (a multiple of run.val_every)
    flops_reference: adlm             # equal-FLOPs budget: what this arm spends in `steps` steps
    baseline: mdlm                    # relative gains are against this arm, paired by seed
    max_concurrent: 2                 # runs at once
    trial_cpu: 0.75                   # CPUs each run reserves (it trains in its trial's process; leave some to reads)
    overrides: {run.val_every: 20}    # applied to every run
    arms:
      - {name: adlm}
      - {name: mdlm, set: {model.kind: mdlm}}
      - {name: adlm-gamma0, set: {model.gamma: 0.0}, equal_flops: false}
    grid:                             # optional: arms expanded from a product of values (equal steps only)
      name: adlm-g{model.gamma}-t{model.tau}
      seeds: [0]
      params: {model.gamma: [3.0e-4, 3.0e-2], model.tau: [2, 10]}
    hypothesis: |                     # optional: the pre-registered hypothesis and analysis, in words
      ...
    comparisons:                      # optional: pre-registered contrasts (pipelines/studies/comparisons.py)
      - {arm: adlm, against: adlm-gamma0, budget: steps, primary: true}
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adlm_model.config import ConfigError
from pipelines.core.configlib import read_yaml_file, validate
from pipelines.data.plan import PrepareConfig
from pipelines.studies.comparisons import Comparison, check_comparisons
from pipelines.training.config import TOP_KEYS, TrainConfig, apply_override, load_raw

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


# The YAML's shape (keys, types, descriptions: the schema studies/*.yaml is validated against); the rules
# between the keys are parse_study's.


@dataclass
class ArmFile:
    """One arm: a setting of the recipe, trained once per seed."""

    name: str
    """Arm name (letters, digits, '.', '_', '+', '-'); its runs are <study>-<arm>-s<seed>."""
    set: dict[str, Any] | None = None
    """``section.key: value`` applied after the study's ``overrides`` (``model.kind: mdlm``)."""
    seeds: list[int] | None = None
    """This arm's seeds; empty: the study's."""
    equal_flops: bool = True
    """Also compared at equal training FLOPs (its runs go on to the FLOP budget when it is cheaper per step)."""


@dataclass
class GridFile:
    """Arms expanded from a product of values (compared at equal steps only)."""

    name: str
    """Arm name pattern using the params' keys, e.g. ``adlm-g{model.gamma}-t{model.tau}``."""
    params: dict[str, list[Any]]
    """``section.key`` -> the values it takes; every combination is an arm."""
    set: dict[str, Any] | None = None
    """``section.key: value`` applied to every grid arm."""
    seeds: list[int] | None = None
    """The grid arms' seeds; empty: the study's."""


@dataclass
class DataFile:
    """Data prepared once before the runs (``pipelines.prepare_data``'s options)."""

    out: str
    """Prepared data folder, under the work directory."""
    source: str | list[str] | None = None
    """Named source(s) (``prepare_data --source``); empty: embedded."""
    train_tokenizer: int | None = None
    """Train a byte-level BPE of this many entries on the train split."""
    length: int | None = None
    """Row length in tokens."""
    testbed: Any = None
    """Options of the testbed source (``--testbed``)."""


@dataclass
class StudyFile:
    """A ``studies/*.yaml`` file as written (``parse_study`` turns it into a ``StudySpec``)."""

    name: str
    """The study: MLflow parent run study-<name>; training runs <name>-<arm>-s<seed>."""
    config: str
    """The base recipe every arm starts from (``configs/*.yaml``, relative to the project)."""
    steps: int
    """The equal-steps budget (a multiple of run.val_every)."""
    arms: list[ArmFile]
    """The arms (at least one)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Seeds of every arm that names none (distinct, >= 0)."""
    data: DataFile | None = None
    """Data to prepare once before the runs."""
    flops_reference: str | None = None
    """Equal-FLOPs budget: what this arm spends in ``steps`` steps."""
    baseline: str | None = None
    """Relative gains are against this arm, paired by seed."""
    max_concurrent: int = 2
    """Runs at once."""
    trial_cpu: float = 0.75
    """CPUs each run reserves: it trains in its Tune trial's own process, one torch thread (leave some of the
    machine to Ray Data's read tasks)."""
    overrides: dict[str, Any] | None = None
    """``section.key: value`` applied to every run."""
    grid: GridFile | None = None
    """Arms expanded from a product of values."""
    hypothesis: str | None = None
    """The pre-registered hypothesis and analysis, in words."""
    comparisons: list[Comparison] | None = None
    """Pre-registered contrasts (``pipelines/studies/comparisons.py``)."""


TOP = tuple(f.name for f in dataclasses.fields(StudyFile))


@dataclass
class Arm:
    """One setting of the recipe, trained once per seed."""

    name: str
    sets: dict[str, Any] = field(default_factory=dict)
    """``section.key: value`` applied after the study's ``overrides``."""
    seeds: list[int] = field(default_factory=list)
    equal_flops: bool = True
    """Also compared at equal training FLOPs (its runs go on to the FLOP budget when it is cheaper per step)."""


@dataclass
class StudySpec:
    name: str
    config: str
    steps: int
    arms: list[Arm]
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    data: PrepareConfig | None = None
    """Data prepared once before the runs (``out`` under the work directory)."""
    flops_reference: str | None = None
    baseline: str | None = None
    max_concurrent: int = 2
    trial_cpu: float = 0.75
    overrides: dict[str, Any] = field(default_factory=dict)
    source: str = "<study>"
    hypothesis: str | None = None
    """The pre-registered hypothesis and analysis plan, in words (printed above the comparisons' table)."""
    comparisons: list[Comparison] = field(default_factory=list)
    """Pre-registered contrasts (``pipelines.studies.comparisons``)."""

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms if a.name == name)

    def raw_config(self, arm: Arm, root: Path) -> dict[str, Any]:
        """The base recipe with the study's overrides and then the arm's settings applied (no seed yet)."""
        raw = load_raw(root / self.config)
        for k, v in {**self.overrides, **arm.sets}.items():
            apply_override(raw, f"{k}={json.dumps(v)}")
        # Every run trains in its Tune trial's process (local mode: no Ray Train worker group to start, the same
        # numbers as one worker), on one torch thread: `max_concurrent` trials of `trial_cpu` CPUs share the machine.
        raw.setdefault("scaling", {}).update(num_workers=0, threads=1)
        return raw


def _fail(source: str, msg: str) -> None:
    raise ConfigError(f"{source}: {msg}")


def _seeds(v: list[int], where: str, source: str) -> list[int]:
    if not v or any(isinstance(s, bool) or s < 0 for s in v) or len(set(v)) != len(v):
        _fail(source, f"{where} must be a non-empty list of distinct non-negative integers, got {v!r}")
    return list(v)


def _sets(v: dict[str, Any] | None, where: str, source: str) -> dict[str, Any]:
    if v is None:
        return {}
    if not all("." in k or k in TOP_KEYS for k in v):
        _fail(source, f"{where} must map section.key to a value (e.g. model.kind: mdlm), got {v!r}")
    return dict(v)


def _grid_arms(grid: GridFile, seeds: list[int], source: str) -> list[Arm]:
    """The arms of ``grid``: one a combination of its params' values."""
    params = grid.params
    if not params or not all(params.values()):
        _fail(source, f"grid.params must map section.key to a non-empty list of values, got {params!r}")
    _sets(params, "grid.params", source)
    base = _sets(grid.set, "grid.set", source)
    gseeds = _seeds(grid.seeds, "grid.seeds", source) if grid.seeds is not None else list(seeds)
    keys, arms = list(params), []
    for combo in itertools.product(*(params[k] for k in keys)):
        values = dict(zip(keys, combo, strict=True))
        arm_name = grid.name
        for k, v in values.items():
            arm_name = arm_name.replace("{" + k + "}", f"{v:g}" if isinstance(v, float) else str(v))
        if "{" in arm_name:
            _fail(source, f"grid.name {grid.name!r} may use only {{{'}, {'.join(keys)}}}")
        arms.append(Arm(arm_name, {**base, **values}, list(gseeds), False))
    return arms


def parse_study(raw: Any, source: str = "<study>") -> StudySpec:
    """A StudySpec from the YAML's mapping; a ConfigError naming the key and the fix otherwise. The library parses
    the file once into ``StudyFile`` (keys, types, required keys); the rules between the keys are checked here on
    that typed object."""
    if not isinstance(raw, dict):
        _fail(source, f"a study file must be a mapping, got {type(raw).__name__}")
    f: StudyFile = validate(StudyFile, raw, source, ": ")
    if not NAME.match(f.name):
        _fail(source, f"name must be letters, digits, '.', '_', '+' or '-', got {f.name!r}")
    if f.steps < 1:
        _fail(source, f"steps must be a positive integer, got {f.steps!r}")
    seeds = _seeds(f.seeds, "seeds", source)
    if not f.arms:
        _fail(source, "arms must be a non-empty list of {name, set, seeds, equal_flops}")
    arms = [Arm(a.name, _sets(a.set, f"arms[{i}].set", source),
                _seeds(a.seeds, f"arms[{i}].seeds", source) if a.seeds is not None else list(seeds), a.equal_flops)
            for i, a in enumerate(f.arms)]
    if f.grid is not None:
        arms += _grid_arms(f.grid, seeds, source)
    names = [a.name for a in arms]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        _fail(source, f"arm name(s) {', '.join(dup)} appear more than once; arm names must be unique")
    for n in names:
        if not NAME.match(n):
            _fail(source, f"arm name {n!r} must be letters, digits, '.', '_', '+' or '-'")
    data = None
    if f.data is not None:  # prepare_data's own config, checked by it (an unknown option is one line)
        try:
            data = PrepareConfig.from_dict({k: v for k, v in dataclasses.asdict(f.data).items() if v is not None})
        except ValueError as e:
            _fail(source, f"data: {e}")
    spec = StudySpec(name=f.name, config=f.config, steps=f.steps, arms=arms, seeds=seeds, data=data,
                     flops_reference=f.flops_reference, baseline=f.baseline, max_concurrent=f.max_concurrent,
                     trial_cpu=f.trial_cpu, overrides=_sets(f.overrides, "overrides", source), source=source,
                     hypothesis=f.hypothesis)
    for key in ("flops_reference", "baseline"):
        ref = getattr(spec, key)
        if ref is not None and ref not in names:
            _fail(source, f"{key} {ref!r} is not an arm; arms: {', '.join(names)}")
    if spec.flops_reference is not None and not spec.arm(spec.flops_reference).equal_flops:
        _fail(source, f"flops_reference {spec.flops_reference!r} must be an arm with equal_flops: true")
    if spec.max_concurrent < 1:
        _fail(source, f"max_concurrent must be a positive integer, got {spec.max_concurrent!r}")
    if spec.trial_cpu <= 0:
        _fail(source, f"trial_cpu must be > 0, got {spec.trial_cpu!r}")
    spec.comparisons = check_comparisons(f.comparisons, {a.name: a.equal_flops for a in arms},
                                         lambda msg: _fail(source, msg))
    return spec


def load_study(path: str | Path) -> StudySpec:
    return parse_study(read_yaml_file(path, "study file", "studies/*.yaml"), str(path))


def validate_arms(spec: StudySpec, root: Path) -> dict[str, TrainConfig]:
    """Every arm's recipe (with a seed) validated; a ConfigError naming the arm otherwise."""
    if not (root / spec.config).is_file():
        _fail(spec.source, f"config {spec.config} does not exist; pass a recipe under configs/")
    out = {}
    for arm in spec.arms:
        try:
            cfg = TrainConfig.from_dict(spec.raw_config(arm, root))
        except ConfigError as e:
            _fail(spec.source, f"arm {arm.name!r}: {e}")
        if spec.steps % cfg.run.val_every:
            _fail(spec.source, f"steps {spec.steps} must be a multiple of run.val_every ({cfg.run.val_every}, arm "
                               f"{arm.name!r}) so that every arm is validated at exactly that step")
        out[arm.name] = cfg
    return out
