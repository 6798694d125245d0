"""Ray Tune searches ADLM's anchor-loss knobs, gamma and tau (METHOD.md section 2).

    python -m pipelines.tune --space tune_spaces/gamma_tau.yaml --config configs/owt_adlm_small.yaml
    python -m pipelines.tune --space tune_spaces/demo.yaml --config configs/demo.yaml   # the CPU demo

What happens, in order:

1. The search space (``tune_spaces/*.yaml``, schema in :class:`SearchSpace`) and the training recipe
   are loaded and validated; every corner of the space is applied to the recipe and validated too
   (a negative gamma, an unknown key), and the data must fit the model: all before Ray starts.
2. One MLflow *parent* run for the sweep (its name is the sweep name; reopened on a rerun).
3. A Tune driver function per trial builds and fits a ``TorchTrainer`` through
   :func:`pipelines.train.train` (the current Ray pattern; ``Tuner(trainer)`` is deprecated). The
   trainer's ``TuneReportCallback`` forwards every validation report to Tune, so ASHA can stop bad
   trials early on the validation NELBO perplexity (minimised) with ``step`` as its time unit.
   Each trial is an MLflow *child* run (nested under the parent, tagged with the trial id, params
   ``gamma`` and ``tau``), and a training run named ``<sweep>-<trial id>`` with its own checkpoints.
4. The parent logs the trial table (CSV and Markdown) and a picture of the search (gamma against tau,
   coloured by validation PPL, stopped trials marked), and the best trial that reached ``max_t`` is
   registered (alias ``candidate``, tags naming the sweep and the trial).

Resume: rerun the same command (same sweep name and work directory). Tune restores the experiment
from ``<workdir>/ray_results/tune/<sweep>``: finished and stopped trials are not rerun; unfinished ones
are rerun, and their training runs continue from their own latest checkpoints.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from adlm_model.config import ConfigError

from .common import ensure_experiment, quiet_environment, resolve_tracking_uri, resolve_workdir
from .train_config import TOP_KEYS, TrainConfig, apply_override, load_raw

DISTRIBUTIONS = ("loguniform", "uniform", "choice", "randint", "grid")
ALGORITHMS = ("random", "optuna")
SCHEDULERS = ("asha", "fifo")
SHORT_NAMES = {"gamma": "model.gamma", "tau": "model.tau"}
"""Parameter names users write for the paper's knobs; any other name is a dotted train-config key."""
METRIC = "val_ppl"
"""The validation NELBO perplexity bound that ``train_loop_per_worker`` reports (minimised)."""
TIME_ATTR = "step"
TRIAL_LOG = ".adlm_trials.log"
"""Per-sweep log of trial starts and ends (``start <id>`` / ``end <id>``): the resume test reads it."""


class TuneError(RuntimeError):
    """A sweep that failed while running (bad input is a ConfigError, raised before Ray starts)."""


# ----------------------------------------------------------------------------------------------------
# The search-space schema


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
        from ray import tune  # noqa: PLC0415

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
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"search space {p} does not exist; pass one of tune_spaces/*.yaml")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"search space {p} is not valid YAML: {str(e).splitlines()[0]}") from None
    return parse_space(raw, str(p))


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


# ----------------------------------------------------------------------------------------------------
# Planning: the recipe + the space, everything checked before Ray


@dataclass
class SweepPlan:
    space: SearchSpace
    base_raw: dict[str, Any]
    """The recipe with ``--set`` and the space's overrides applied (the trials add their params)."""
    base: TrainConfig
    workdir: Path
    tracking_uri: str
    storage: Path
    max_t: int


def _with_params(base_raw: dict[str, Any], params: dict[str, Any], space: SearchSpace) -> dict[str, Any]:
    raw = json.loads(json.dumps(base_raw))
    for p in space.params:
        if p.name in params:
            apply_override(raw, f"{p.key}={json.dumps(params[p.name])}")
    return raw


def plan_sweep(space: SearchSpace, config: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (), *,
               workdir: str | os.PathLike | None = None, tracking_uri: str | None = None,
               check_data: bool = True) -> SweepPlan:
    """Apply the space to the recipe and check every corner; check the data. Raises ConfigError /
    ValueError with one line, before any Ray or MLflow work."""
    from .train import plan_data  # noqa: PLC0415

    raw = load_raw(config)
    for a in overrides:
        apply_override(raw, a)
    for k, v in space.overrides.items():
        apply_override(raw, f"{k}={json.dumps(v)}")
    base = TrainConfig.from_dict(json.loads(json.dumps(raw)))
    if base.model.kind != "adlm" and any(p.key in ("model.gamma", "model.tau") for p in space.params):
        raise ConfigError(f"the space searches gamma/tau but the recipe's model.kind is {base.model.kind!r}; "
                          "gamma and tau only act on ADLM (set model.kind=adlm)")
    for p in space.params:  # every corner must make a valid recipe (e.g. gamma >= 0, tau >= 0)
        for v in p.corners():
            try:
                TrainConfig.from_dict(_with_params(raw, {p.name: v}, space))
            except ConfigError as e:
                raise ConfigError(f"search space {space.source}: params.{p.name} value {v!r} is invalid for the "
                                  f"recipe: {e}") from None
    r = base.run
    if r.ckpt_every % r.val_every:
        raise ConfigError(f"run.ckpt_every ({r.ckpt_every}) must be a multiple of run.val_every ({r.val_every}) in "
                          "a sweep: every report to Tune must carry a fresh validation PPL")
    max_t = space.max_t or r.max_steps
    if max_t > r.max_steps:
        raise ConfigError(f"scheduler.max_t ({max_t}) exceeds run.max_steps ({r.max_steps})")
    if space.scheduler == "asha" and space.grace_period >= max_t:
        raise ConfigError(f"scheduler.grace_period ({space.grace_period}) must be below max_t ({max_t}) for ASHA to "
                          "stop anything")
    if space.scheduler == "asha" and space.grace_period < r.val_every:
        raise ConfigError(f"scheduler.grace_period ({space.grace_period}) is below run.val_every ({r.val_every}): "
                          "ASHA would decide before the first validation")
    if space.algorithm == "optuna":
        try:
            import optuna  # noqa: F401, PLC0415
        except ImportError:
            raise ConfigError("search.algorithm optuna needs the optuna extra: pip install -e '.[optuna]'") from None
    wd = resolve_workdir(workdir)
    if check_data:
        plan_data(base, wd)  # the data must exist and fit the model
    return SweepPlan(space=space, base_raw=raw, base=base, workdir=wd,
                     tracking_uri=tracking_uri or resolve_tracking_uri(wd),
                     storage=wd / "ray_results" / "tune", max_t=max_t)


# ----------------------------------------------------------------------------------------------------
# The trial: a Tune driver function that fits a TorchTrainer


def run_trial(config: dict[str, Any], *, plan: dict[str, Any]) -> None:
    """One trial, in its Tune actor: the recipe plus this trial's params, trained by ``pipelines.train``."""
    from ray import tune  # noqa: PLC0415
    from ray.tune.integration.ray_train import TuneReportCallback  # noqa: PLC0415

    from .train import train  # noqa: PLC0415
    from .train_config import TrainConfig as TC  # noqa: PLC0415

    space = parse_space(plan["space_raw"], plan["space_source"])
    trial_id = tune.get_context().get_trial_id()
    raw = _with_params(plan["base_raw"], config, space)
    cfg = TC.from_dict(raw)
    cfg.run.name = f"{space.name}-{trial_id}"
    log = Path(plan["trial_log"])
    with log.open("a") as f:
        f.write(f"start {trial_id}\n")
    tags = {"sweep": space.name, "tune.trial_id": trial_id, "tune.params": json.dumps(config, sort_keys=True)}
    res = train(cfg, workdir=plan["workdir"], tracking_uri=plan["tracking_uri"], callbacks=[TuneReportCallback()],
                parent_run_id=plan["parent_run_id"], extra_tags=tags, register=False, quiet=True)
    tune.report({TIME_ATTR: res.step, METRIC: res.val_ppl, "mlflow_run_id": res.run_id,
                 "checkpoint_dir": str(res.checkpoint_dir), "finished": True})
    with log.open("a") as f:
        f.write(f"end {trial_id}\n")


# ----------------------------------------------------------------------------------------------------
# The sweep


@dataclass
class TrialRow:
    trial_id: str
    params: dict[str, Any]
    status: str
    """``finished`` (reached max_t), ``stopped`` (by ASHA), ``error`` or ``unfinished``."""
    step: int | None
    val_ppl: float | None
    mlflow_run_id: str | None


@dataclass
class SweepResult:
    name: str
    parent_run_id: str | None
    trials: list[TrialRow]
    best: TrialRow | None
    registered_version: str | None
    interrupted: bool
    artifacts: dict[str, Path] = field(default_factory=dict)


def _parent_run(plan: SweepPlan) -> str | None:
    from .tracking import find_or_create_run, log_params_once  # noqa: PLC0415

    try:
        exp = ensure_experiment(plan.base.mlflow.experiment, plan.tracking_uri, plan.workdir)
        rid, _ = find_or_create_run(plan.tracking_uri, exp, f"sweep-{plan.space.name}",
                                    tags={"sweep": plan.space.name, "adlm.sweep_parent": "true"})
        params = {"sweep": plan.space.name, "algorithm": plan.space.algorithm, "scheduler": plan.space.scheduler,
                  "grace_period": plan.space.grace_period, "reduction_factor": plan.space.reduction_factor,
                  "max_t": plan.max_t, "num_samples": plan.space.num_samples, "total_trials": plan.space.total_trials,
                  "max_concurrent": plan.space.max_concurrent, "metric": f"{METRIC} (min)",
                  "space": json.dumps({p.name: {k: v for k, v in dataclasses.asdict(p).items() if v is not None}
                                       for p in plan.space.params})[:6000],
                  "model.kind": plan.base.model.kind, "base.max_steps": plan.base.run.max_steps}
        log_params_once(plan.tracking_uri, rid, params)
        return rid
    except Exception as e:  # noqa: BLE001 - a tracking outage must not stop the sweep
        print(f"WARNING: MLflow unavailable ({type(e).__name__}: {str(e)[:200]}); sweeping without a parent run",
              flush=True)
        return None


def _search_alg(space: SearchSpace) -> Any:
    # The concurrency limit lives in the searcher: Tune ignores max_concurrent_trials for a
    # BasicVariantGenerator, and on 2 cores unlimited trials starve each other's worker groups.
    if space.algorithm == "optuna":
        from ray.tune.search import ConcurrencyLimiter  # noqa: PLC0415
        from ray.tune.search.optuna import OptunaSearch  # noqa: PLC0415

        return ConcurrencyLimiter(OptunaSearch(seed=space.seed), max_concurrent=space.max_concurrent)
    from ray.tune.search.basic_variant import BasicVariantGenerator  # noqa: PLC0415

    return BasicVariantGenerator(random_state=space.seed, max_concurrent=space.max_concurrent)


def _scheduler(space: SearchSpace, max_t: int) -> Any:
    if space.scheduler == "fifo":
        from ray.tune.schedulers import FIFOScheduler  # noqa: PLC0415

        return FIFOScheduler()
    from ray.tune.schedulers import ASHAScheduler  # noqa: PLC0415

    # ASHA (Li et al.): rungs at grace_period * rf^k optimiser steps; a trial is stopped at a rung
    # when its validation PPL is worse than the top 1/rf of the trials recorded there.
    # stop_last_trials=False: a trial that reaches max_t is left to finish on its own, so that its
    # training run exports, logs and can be registered (ASHA would otherwise kill it at its last report).
    return ASHAScheduler(time_attr=TIME_ATTR, max_t=max_t, grace_period=space.grace_period,
                         reduction_factor=space.reduction_factor, stop_last_trials=False)


def _rows(grid: Any, space: SearchSpace, max_t: int) -> list[TrialRow]:
    df = grid.get_dataframe()
    rows = []
    names = [p.name for p in space.params]
    for _, rec in df.iterrows():
        params = {n: rec.get(f"config/{n}") for n in names}
        params = {k: (v.item() if hasattr(v, "item") else v) for k, v in params.items()}
        step = rec.get(TIME_ATTR)
        step = int(step) if step is not None and not (isinstance(step, float) and math.isnan(step)) else None
        ppl = rec.get(METRIC)
        ppl = float(ppl) if ppl is not None and not (isinstance(ppl, float) and math.isnan(ppl)) else None
        rid = rec.get("mlflow_run_id")
        rid = rid if isinstance(rid, str) and rid else None
        status = "finished" if step is not None and step >= max_t else "stopped"
        rows.append(TrialRow(trial_id=str(rec["trial_id"]), params=params, status=status, step=step, val_ppl=ppl,
                             mlflow_run_id=rid))
    errored = {str(r.metrics.get("trial_id")) for r in grid if r.error is not None and r.metrics}
    for r in rows:
        if r.trial_id in errored:
            r.status = "error"
    return sorted(rows, key=lambda r: r.trial_id)


def _child_runs(plan: SweepPlan, parent: str) -> dict[str, Any]:
    import mlflow  # noqa: PLC0415

    client = mlflow.MlflowClient(plan.tracking_uri)
    exp = client.get_experiment_by_name(plan.base.mlflow.experiment)
    runs = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'", max_results=1000)
    return {r.data.tags.get("tune.trial_id"): r for r in runs}


def table_markdown(rows: list[TrialRow], best: TrialRow | None) -> str:
    names = list(rows[0].params) if rows else []
    head = "| trial | " + " | ".join(names) + " | status | step | val PPL |"
    out = [head, "|" + "---|" * (len(names) + 4)]
    for r in rows:
        vals = " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.params.values())
        ppl = f"{r.val_ppl:.3f}" if r.val_ppl is not None else "-"
        mark = " (best)" if best is not None and r.trial_id == best.trial_id else ""
        out.append(f"| {r.trial_id}{mark} | {vals} | {r.status} | {r.step if r.step is not None else '-'} | {ppl} |")
    return "\n".join(out) + "\n"


def plot_search(rows: list[TrialRow], out: Path, title: str) -> Path | None:
    """Gamma (log scale) against tau, coloured by validation PPL; stopped trials as crosses."""
    pts = [r for r in rows if r.val_ppl is not None and "gamma" in r.params and "tau" in r.params]
    if not pts:
        return None
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    ppl = [r.val_ppl for r in pts]
    lo, hi = min(ppl), max(ppl)
    norm = matplotlib.colors.Normalize(vmin=lo, vmax=hi if hi > lo else lo + 1)
    for status, marker, label in (("finished", "o", "reached max_t"), ("stopped", "X", "stopped by ASHA"),
                                  ("error", "s", "error")):
        sel = [r for r in pts if r.status == status]
        if sel:
            sc = ax.scatter([float(r.params["gamma"]) for r in sel], [float(r.params["tau"]) for r in sel],
                            c=[r.val_ppl for r in sel], cmap="viridis_r", norm=norm, marker=marker, s=110,
                            edgecolors="black", label=label)
    best = min((r for r in pts if r.status == "finished"), key=lambda r: r.val_ppl, default=None)
    if best is not None:
        ax.scatter([float(best.params["gamma"])], [float(best.params["tau"])], s=380, facecolors="none",
                   edgecolors="red", linewidths=2, label="best")
    fig.colorbar(sc, ax=ax, label="validation PPL bound (last report)")
    ax.set_xscale("log")
    ax.set_xlabel("gamma (anchor loss weight)")
    ax.set_ylabel("tau (anchor count threshold)")
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _finalise(plan: SweepPlan, parent: str | None, rows: list[TrialRow], best: TrialRow | None,
              interrupted: bool) -> tuple[str | None, dict[str, Path]]:
    """Child-run bookkeeping, parent artifacts, registration of the best trial."""
    space = plan.space
    arts: dict[str, Path] = {}
    out = plan.workdir / "sweeps" / space.name
    out.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    w = csv.writer(buf)
    names = [p.name for p in space.params]
    w.writerow(["trial_id", *names, "status", "step", METRIC, "mlflow_run_id"])
    for r in rows:
        w.writerow([r.trial_id, *[r.params.get(n) for n in names], r.status, r.step, r.val_ppl, r.mlflow_run_id])
    (out / "trials.csv").write_text(buf.getvalue())
    (out / "trials.md").write_text(table_markdown(rows, best))
    arts["trials.csv"], arts["trials.md"] = out / "trials.csv", out / "trials.md"
    png = plot_search(rows, out / "search.png", f"sweep {space.name}: {len(rows)} trials")
    if png is not None:
        arts["search.png"] = png
    if parent is None:
        return None, arts

    import mlflow  # noqa: PLC0415

    from .registry import register_checkpoint  # noqa: PLC0415
    from .tracking import log_artifact_safely  # noqa: PLC0415

    client = mlflow.MlflowClient(plan.tracking_uri)
    version = None
    try:
        children = _child_runs(plan, parent)
        for r in rows:
            run = children.get(r.trial_id)
            if run is None:
                continue
            r.mlflow_run_id = r.mlflow_run_id or run.info.run_id
            client.set_tag(run.info.run_id, "tune.status", r.status)
            if r.status == "stopped" and run.info.status == "RUNNING":
                client.set_terminated(run.info.run_id, "KILLED")  # ASHA killed the trial's actor mid-run
        for p in arts.values():
            log_artifact_safely(plan.tracking_uri, parent, p, "sweep")
        client.log_text(parent, yaml.safe_dump(space.to_dict(), sort_keys=False), "sweep/space.yaml")
        stamp = int(time.time() * 1000)
        metrics = [mlflow.entities.Metric("trials", len(rows), stamp, 0),
                   mlflow.entities.Metric("trials_stopped", sum(r.status == "stopped" for r in rows), stamp, 0)]
        if best is not None:
            metrics.append(mlflow.entities.Metric("best_val_ppl", best.val_ppl, stamp, 0))
        client.log_batch(parent, metrics=metrics)
        if best is not None:
            client.set_tag(parent, "best_trial", best.trial_id)
            existing = [v for v in client.search_model_versions(f"name='{plan.base.mlflow.registered_model}'")
                        if (v.tags or {}).get("sweep") == space.name
                        and (v.tags or {}).get("tune.trial_id") == best.trial_id]
            if existing:
                version = str(existing[0].version)
            elif plan.base.mlflow.register and best.mlflow_run_id:
                mc = plan.base.model
                params = dict(best.params)
                mv = register_checkpoint(best.mlflow_run_id, plan.base.mlflow.registered_model, {
                    "kind": mc.kind, "gamma": params.get("gamma", mc.gamma), "tau": params.get("tau", mc.tau),
                    "val_ppl": best.val_ppl, "run_name": f"{space.name}-{best.trial_id}", "step": best.step,
                    "sweep": space.name, "sweep_parent_run_id": parent, "tune.trial_id": best.trial_id,
                    "data_manifest_hash": client.get_run(best.mlflow_run_id).data.params.get("data_manifest_hash", ""),
                }, tracking_uri=plan.tracking_uri)
                version = str(mv.version)
            if version is not None:
                client.set_tag(parent, "registered_version", version)
        if not interrupted:
            client.set_terminated(parent, "FINISHED")
    except Exception as e:  # noqa: BLE001 - the sweep's results are on disk; say what failed
        print(f"WARNING: MLflow bookkeeping of the sweep failed ({type(e).__name__}: {str(e)[:300]})", flush=True)
    return version, arts


def sweep(space: SearchSpace, config: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (), *,
          workdir: str | os.PathLike | None = None, tracking_uri: str | None = None, quiet: bool = False) -> SweepResult:
    """Run (or resume) the sweep ``space.name``; see the module docstring."""
    quiet_environment()
    plan = plan_sweep(space, config, overrides, workdir=workdir, tracking_uri=tracking_uri)
    parent = _parent_run(plan)

    from ray import tune  # noqa: PLC0415

    from .common import init_ray  # noqa: PLC0415

    init_ray()
    exp_dir = plan.storage / space.name
    exp_dir.mkdir(parents=True, exist_ok=True)
    trial_plan = {"space_raw": _space_raw(space), "space_source": space.source, "base_raw": plan.base_raw,
                  "workdir": str(plan.workdir), "tracking_uri": plan.tracking_uri, "parent_run_id": parent,
                  "trial_log": str(exp_dir / TRIAL_LOG)}
    trainable = tune.with_resources(tune.with_parameters(run_trial, plan=trial_plan), {"CPU": space.trial_cpu})
    from ray.tune import RunConfig, TuneConfig, Tuner  # noqa: PLC0415

    if Tuner.can_restore(str(exp_dir)):
        if not quiet:
            print(f"[sweep {space.name}] resuming from {exp_dir}: finished trials are not rerun", flush=True)
        tuner = Tuner.restore(str(exp_dir), trainable=trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = Tuner(
            trainable,
            param_space={p.name: p.to_tune() for p in space.params},
            tune_config=TuneConfig(metric=METRIC, mode="min", search_alg=_search_alg(space),
                                   scheduler=_scheduler(space, plan.max_t), num_samples=space.num_samples),
            run_config=RunConfig(name=space.name, storage_path=str(plan.storage), verbose=0 if quiet else 1),
        )
    if not quiet:
        print(f"[sweep {space.name}] {space.total_trials} trials ({space.algorithm} search, {space.scheduler} "
              f"scheduler, max_t {plan.max_t} steps), {space.max_concurrent} at a time; MLflow parent run {parent} "
              f"at {plan.tracking_uri}", flush=True)
    try:
        grid = tuner.fit()
    except Exception as e:  # noqa: BLE001
        raise TuneError(f"sweep {space.name!r} failed: {type(e).__name__}: {str(e).strip().splitlines()[-1:]}; "
                        f"rerun the same command to resume from {exp_dir}") from e
    rows = _rows(grid, space, plan.max_t)
    interrupted = grid.num_terminated + grid.num_errors < space.total_trials
    finished = [r for r in rows if r.status == "finished" and r.val_ppl is not None]
    best = min(finished, key=lambda r: r.val_ppl) if finished and not interrupted else None
    version, arts = _finalise(plan, parent, rows, best, interrupted)
    if not quiet:
        print(table_markdown(rows, best), flush=True)
        if interrupted:
            print(f"[sweep {space.name}] interrupted with {grid.num_terminated} of {space.total_trials} trials done; "
                  "rerun the same command to resume", flush=True)
        elif best is not None:
            print(f"[sweep {space.name}] best trial {best.trial_id}: {best.params}, validation PPL <= "
                  f"{best.val_ppl:.3f}" + (f"; registered {plan.base.mlflow.registered_model} v{version} @candidate"
                                           if version else ""), flush=True)
    return SweepResult(name=space.name, parent_run_id=parent, trials=rows, best=best, registered_version=version,
                       interrupted=interrupted, artifacts=arts)


def _space_raw(space: SearchSpace) -> dict[str, Any]:
    """The space back in its YAML form (the trial actors re-parse it)."""
    params = {}
    for p in space.params:
        d: dict[str, Any] = {"distribution": p.distribution}
        if p.values is not None:
            d["values"] = p.values
        else:
            d["low"], d["high"] = (int(p.low), int(p.high)) if p.distribution == "randint" else (p.low, p.high)
        params[p.name] = d
    return {"name": space.name, "params": params, "search": {"algorithm": space.algorithm, "seed": space.seed},
            "scheduler": {"type": space.scheduler, "grace_period": space.grace_period,
                          "reduction_factor": space.reduction_factor, "max_t": space.max_t},
            "num_samples": space.num_samples, "max_concurrent": space.max_concurrent, "metric": space.metric,
            "resources": {"trial_cpu": space.trial_cpu}, "overrides": space.overrides}


# ----------------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.tune",
        description="Search ADLM's gamma and tau (or any train-config key) with Ray Tune and ASHA on the "
                    "validation NELBO perplexity; one MLflow parent run with a child run per trial; the best "
                    "trial is registered @candidate. Rerun the same command to resume an interrupted sweep.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Search-space YAML keys: name, params (gamma/tau/<section.key>: {distribution: loguniform|uniform|"
               "choice|randint|grid, low, high | values}), search {algorithm: random|optuna, seed}, scheduler "
               "{type: asha|fifo, grace_period, reduction_factor, max_t}, num_samples, max_concurrent, metric "
               "(val_ppl), resources {trial_cpu}, overrides {section.key: value}.\n\nExample:\n  python -m "
               "pipelines.tune --space tune_spaces/demo.yaml --config configs/demo.yaml")
    p.add_argument("--space", required=True, help="search-space YAML (tune_spaces/*.yaml)")
    p.add_argument("--config", required=True, help="training recipe YAML (configs/*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one training-config value for every trial (repeatable), e.g. run.max_steps=60")
    p.add_argument("--name", default=None, help="sweep name (default: the space's 'name'); rerun a name to resume it")
    p.add_argument("--num-samples", type=int, default=None, help="override the space's num_samples")
    p.add_argument("--workdir", default=None, help="work directory (default: $ADLM_WORKDIR or ./work)")
    p.add_argument("--check", action="store_true", help="validate the space against the recipe and the data, then exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        space = load_space(args.space)
        if args.name:
            space = dataclasses.replace(space, name=args.name)
            parse_space(_space_raw(space), space.source)
        if args.num_samples is not None:
            space = dataclasses.replace(space, num_samples=args.num_samples)
            parse_space(_space_raw(space), space.source)
        if args.check:
            plan = plan_sweep(space, args.config, args.overrides, workdir=args.workdir)
            print(f"ok: sweep {space.name}: {space.total_trials} trials over {', '.join(p.name for p in space.params)}"
                  f"; max_t {plan.max_t} steps")
            return 0
        res = sweep(space, args.config, args.overrides, workdir=args.workdir)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TuneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"sweep": res.name, "parent_run_id": res.parent_run_id, "interrupted": res.interrupted,
                      "best_trial": res.best.trial_id if res.best else None,
                      "best_val_ppl": res.best.val_ppl if res.best else None,
                      "registered_version": res.registered_version}))
    return 130 if res.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
