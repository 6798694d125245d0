"""A sweep's confirmation: the winner retrained in full at fresh seeds against a baseline, and what decides.

The best of N noisy trials, selected and reported on the same runs, overstates itself: its bound is the
luckiest of N draws. The confirmation (``confirm:`` in the space, or ``python -m pipelines.tune ... --confirm N``)
retrains, after the search, at N seeds that no trial used:

- ``tuned``: the best trial's configuration, trained in full (``confirm.steps``, by default the recipe's own
  ``run.max_steps``, the run the search's shortened trials stood in for);
- the comparator (``confirm.against``): the baseline arm's own winner (a second search with the same trial budget),
  the recipe as it is, or another recipe file;
- ``confirm.ablations``: the winner with one change each, or (``of: <baseline>``) the baseline's winner with one
  change, a second comparator of the winner (a larger model at the learning rate the baseline's search chose).

Every arm trains at the same seeds (one seed: the same data order and initialisation stream) and is validated
on the same rows with the same noise draw (``pipelines.training.loop.VALIDATION_NOISE_SEED``), so the arms are
compared seed by seed: ``d = ln bound(against) - ln bound(tuned)`` in nats per token, positive when the winner is
lower, with the Student-t 95% interval of its mean over the seeds (``pipelines.studies.stats``). The interval is
computed from the confirmation's runs only; the search's numbers never enter it. Its verdict: entirely above 0
-> the winner beats the comparator; entirely below -> it trails; straddling 0 -> they tie at this resolution.

The runs are a grid of training runs (``pipelines.studies.grid``): a rerun skips the finished ones and resumes the
rest. Results go to the sweep's MLflow parent run (metrics, tags, the table and the plots under ``sweep/``) and
beside the sweep's report (``<workdir>/sweeps/<name>/confirm.*``); the winner's and the comparator's runs are
registered as versions tagged with the interval (``mlflow.register`` of the recipe), no alias moved.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adlm_model.config import ConfigError
from adlm_model.kinds import model_kind, parameter_count
from adlm_model.train.flops import training_flops_per_row
from pipelines.core.logs import get_logger
from pipelines.studies.comparisons import nats
from pipelines.studies.grid import RunPlan, TrialContext, fit_grid, history, trained
from pipelines.studies.stats import Summary, summarise
from pipelines.tracking.runs import (
    best_effort,
    ensure_experiment,
    find_or_create_run,
    log_params_once,
    require_tracking,
)
from pipelines.training.config import TrainConfig, apply_override, load_raw
from pipelines.tuning.report import TrialRow
from pipelines.tuning.space import SearchSpace

log = get_logger(__name__)

WINNER = "tuned"
"""The confirmation's name for the search's winner."""


@dataclass
class ConfirmArm:
    name: str
    role: str
    """``winner``, ``against`` or ``ablation``."""
    raw: dict[str, Any]
    """The arm's recipe before the run's seed, name and length."""
    label: str
    """How the report names it: its kind and what its search chose."""
    steps: int = 0
    """What its runs train to."""
    flops_per_step: int = 0
    params: int = 0

    @property
    def config(self) -> TrainConfig:
        return TrainConfig.from_dict(json.loads(json.dumps(self.raw)))


@dataclass
class Reading:
    """One budget the arms are read at: ``key`` ``steps:<n>`` or ``flops:<n>`` (the winner's FLOPs in n steps)."""

    key: str
    step: dict[str, int]
    """The validation step read, by arm."""

    @property
    def text(self) -> str:
        budget, _, n = self.key.partition(":")
        return f"equal {budget}, {int(n):,}" + (" of the winner's steps" if budget == "flops" else "")


@dataclass
class Contrast:
    """``arm`` against ``against`` at ``reading``: d = ln bound(against) - ln bound(arm), paired by seed."""

    arm: str
    against: str
    reading: str
    primary: bool = False
    difference: Summary | None = None

    @property
    def verdict(self) -> str:
        d = self.difference
        if d is None or d.n < 2 or math.isnan(d.lo):
            return "no interval"
        return "beats" if d.lo > 0 else "trails" if d.hi < 0 else "ties"


@dataclass
class ConfirmPlan:
    space: SearchSpace
    workdir: str
    tracking_uri: str
    seeds: list[int]
    arms: list[ConfirmArm]
    readings: list[Reading]
    contrasts: list[Contrast]
    runs: list[RunPlan] = field(default_factory=list)
    budgets: dict[str, str] = field(default_factory=dict)
    """Arm -> the search budget it had, in words (filled in after the searches)."""

    def arm(self, name: str) -> ConfirmArm:
        return next(a for a in self.arms if a.name == name)

    @property
    def against(self) -> ConfirmArm:
        return next(a for a in self.arms if a.role == "against")

    @property
    def primary(self) -> Contrast:
        return next(c for c in self.contrasts if c.primary)


def fresh_seeds(n: int, used: set[int]) -> list[int]:
    """``n`` seeds above every seed the search used."""
    start = max(used) + 1 if used else 0
    return list(range(start, start + n))


def _label(cfg: TrainConfig, params: dict[str, Any] | None, what: str = "") -> str:
    kind = cfg.model.kind.upper()
    if params:
        inner = ", ".join(f"{k.removeprefix('optim.').removeprefix('model.')}={_fmt(v)}" for k, v in params.items())
        return f"{kind} ({inner})"
    return f"{kind} ({what})" if what else kind


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _arm_raw(config: str | os.PathLike, cli_sets: list[str] | tuple[str, ...], overrides: dict[str, Any],
             params: dict[str, Any] | None = None, keys: dict[str, str] | None = None) -> dict[str, Any]:
    """A recipe with ``--set``, the space's overrides and (``keys``: param name -> config key) the params applied."""
    raw = load_raw(config)
    for a in cli_sets:
        apply_override(raw, a)
    for k, v in overrides.items():
        apply_override(raw, f"{k}={json.dumps(v)}")
    for name, v in (params or {}).items():
        apply_override(raw, f"{(keys or {}).get(name, name)}={json.dumps(v)}")
    return raw


def plan_confirmation(space: SearchSpace, config: str | os.PathLike, cli_sets: list[str] | tuple[str, ...], *,
                      workdir: str, tracking_uri: str, winner: dict[str, Any] | None = None,
                      baseline: dict[str, Any] | None = None, used_seeds: set[int] | None = None) -> ConfirmPlan:
    """Every confirmation run, checked before any trains (ConfigError naming the fix). ``winner`` / ``baseline``: the
    searches' chosen params (None before the searches: ``--check`` sizes the recipe's own settings)."""
    spec = space.confirm
    assert spec is not None and spec.seeds >= 2
    keys = {p.name: p.key for p in space.params}
    trial_raw = _arm_raw(config, cli_sets, space.overrides, winner, keys)
    arms = [ConfirmArm(WINNER, "winner", trial_raw, _label(TrainConfig.from_dict(json.loads(json.dumps(trial_raw))),
                                                           winner, "tuned"))]
    b = space.baseline
    if b is not None and spec.against == b.name:
        bkeys = {p.name: p.key for p in b.params}
        raw = _arm_raw(b.config or config, cli_sets, {**space.overrides, **b.sets}, baseline, bkeys)
        arms.append(ConfirmArm(b.name, "against", raw, _label(TrainConfig.from_dict(json.loads(json.dumps(raw))),
                                                              baseline, "as set" if not b.params else "tuned")))
    elif spec.against == "recipe":
        raw = _arm_raw(config, cli_sets, space.overrides)
        arms.append(ConfirmArm("recipe", "against", raw,
                               _label(TrainConfig.from_dict(json.loads(json.dumps(raw))), None, "the recipe's settings")))
    else:
        if not Path(spec.against).is_file():
            raise ConfigError(f"search space {space.source}: confirm.against {spec.against} does not exist; name a "
                              "recipe file (configs/*.yaml), the baseline arm or 'recipe'")
        raw = _arm_raw(spec.against, cli_sets, space.overrides)
        arms.append(ConfirmArm(Path(spec.against).stem, "against", raw,
                               _label(TrainConfig.from_dict(json.loads(json.dumps(raw))), None, Path(spec.against).name)))
    for a in spec.ablations:
        of = arms[0] if a.of == WINNER else arms[1]  # the winner, or the baseline arm's winner (space.py checks)
        raw = json.loads(json.dumps(of.raw))
        for k, v in a.sets.items():
            apply_override(raw, f"{k}={json.dumps(v)}")
        arms.append(ConfirmArm(a.name, "ablation", raw, f"{of.label} with " +
                               ", ".join(f"{k}={_fmt(v)}" for k, v in a.sets.items())))

    # The run the search stood in for: the recipe's own length, before the space shortened the trials.
    full = TrainConfig.from_dict(json.loads(json.dumps(_arm_raw(config, cli_sets, {}))))
    steps = spec.steps or [full.run.max_steps]
    trial_cfg = arms[0].config
    horizon = trial_cfg.model.gamma_horizon  # the ramp the trials trained with (their K, filled in from max_steps)
    for arm in arms:
        arm.raw.setdefault("model", {})
        if model_kind(arm.raw["model"].get("kind", trial_cfg.model.kind)).anchored and \
                not arm.raw["model"].get("gamma_horizon"):
            arm.raw["model"]["gamma_horizon"] = horizon
        arm.raw.setdefault("mlflow", {})["register"] = False  # registered after the interval is known
        try:
            cfg = arm.config
        except ConfigError as e:
            raise ConfigError(f"search space {space.source}: confirmation arm {arm.name!r}: {e}") from None
        arm.flops_per_step = training_flops_per_row(cfg.model) * cfg.batch.global_batch
        arm.params = parameter_count(cfg.model)
    win, against = arms[0], arms[1]
    readings: list[Reading] = [Reading(f"steps:{s}", {win.name: s, against.name: s}) for s in steps]
    for f in spec.flops:
        budget = win.flops_per_step * f
        every = against.config.run.val_every
        readings.append(Reading(f"flops:{f}", {win.name: f, against.name: max(
            every, round(budget / against.flops_per_step / every) * every)}))
    primary = spec.primary or f"steps:{max(steps)}"
    contrasts = [Contrast(WINNER, against.name, r.key, r.key == primary) for r in readings]
    for a in spec.ablations:
        n = a.steps or max(steps)
        key = f"steps:{n}"
        r = next((r for r in readings if r.key == key), None)
        if r is None:
            r = Reading(key, {win.name: n})
            readings.append(r)
        r.step[a.name] = n
        # A variant of the winner against the winner; a variant of the baseline is a comparator of the winner.
        contrasts.append(Contrast(a.name, WINNER, key) if a.of == WINNER else Contrast(WINNER, a.name, key))
    for arm in arms:
        read = sorted({r.step[arm.name] for r in readings if arm.name in r.step})
        arm.steps = max(read)
        cfg = arm.config
        bad = [s for s in read if s % cfg.run.val_every]
        if bad:
            raise ConfigError(f"search space {space.source}: confirmation arm {arm.name!r} would be read at step "
                              f"{bad[0]}, not a multiple of its run.val_every ({cfg.run.val_every}): choose readings "
                              "that are")
        if read[0] < arm.steps and cfg.optim.schedule != "constant":
            raise ConfigError(f"search space {space.source}: confirmation arm {arm.name!r} is read part-way (steps "
                              f"{read}), which needs optim.schedule: constant (got {cfg.optim.schedule!r})")

    seeds = fresh_seeds(spec.seeds, used_seeds if used_seeds is not None else {win.config.run.seed,
                                                                                 against.config.run.seed})
    plan = ConfirmPlan(space, workdir, tracking_uri, seeds, arms, readings, contrasts)
    for arm in arms:
        for seed in seeds:
            raw = json.loads(json.dumps(arm.raw))
            name = f"{space.name}-confirm-{arm.name}-s{seed}"
            raw.setdefault("run", {}).update(name=name, seed=seed, max_steps=arm.steps)
            try:
                TrainConfig.from_dict(json.loads(json.dumps(raw)))
            except ConfigError as e:
                raise ConfigError(f"search space {space.source}: confirmation run {name!r}: {e}") from None
            plan.runs.append(RunPlan(arm.name, seed, name, arm.steps, raw))
    return plan


def search_steps(space: SearchSpace, max_t: int) -> tuple[int, int]:
    """(at most, at least): a search's optimiser steps over its trials, FIFO's bound, and synchronous halving's (a
    1/rf share of the trials continues at each rung k = grace * rf^k). Ray's ASHA is asynchronous: a rung's first
    trials, with nothing to compare with, go on, so a search lands between the two."""
    n = space.total_trials
    if space.scheduler != "asha":
        return n * max_t, n * max_t
    total, prev, k = 0.0, 0, 0
    while True:
        rung = min(max_t, int(space.grace_period * space.reduction_factor ** k))
        total += n / space.reduction_factor ** k * (rung - prev)
        if rung >= max_t:
            break
        prev, k = rung, k + 1
    return n * max_t, int(total)


def budget_text(rows: list[TrialRow]) -> str:
    """What a search spent: its trials, how many ASHA stopped, the steps trained in all."""
    steps = sum(r.step or 0 for r in rows)
    stopped = sum(r.status == "stopped" for r in rows)
    return f"{len(rows)} trials ({stopped} stopped by ASHA), {steps:,} steps trained"


# ----------------------------------------------------------------------------------------------------
# Running it


@dataclass
class ConfirmResult:
    plan: ConfirmPlan
    bounds: dict[str, dict[str, dict[int, float]]]
    """reading key -> arm -> seed -> validation bound (PPL)."""
    contrasts: list[Contrast]
    summary: str
    """The one line a user acts on."""
    markdown: str
    """The report (``confirm_report.confirm_markdown``), once written."""
    winner_params: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, str] = field(default_factory=dict)
    versions: list[str] = field(default_factory=list)


def summary_line(plan: ConfirmPlan, c: Contrast, n: int) -> str:
    """"<winner> beats / trails <against> by X nats/token [lo, hi] at N fresh seeds (<reading>)", X > 0 (how much
    lower, or higher); a tie gives the signed difference and its interval, which holds 0."""
    a, b = (plan.arm(c.arm).label, plan.arm(c.against).label)
    reading = next(r for r in plan.readings if r.key == c.reading).text
    d = c.difference
    if d is None or c.verdict == "no interval":
        return f"{a} against {b}: no interval ({0 if d is None else d.n} seed(s) read, {reading})"
    if c.verdict == "ties":
        return (f"{a} ties {b}: difference {d.mean:+.3f} nats/token [{d.lo:+.3f}, {d.hi:+.3f}] (> 0: "
                f"{plan.arm(c.arm).config.model.kind.upper()}'s bound lower) at {n} fresh seeds ({reading})")
    x, lo, hi = (-d.mean, -d.hi, -d.lo) if c.verdict == "trails" else (d.mean, d.lo, d.hi)
    return f"{a} {c.verdict} {b} by {x:.3f} nats/token [{lo:.3f}, {hi:.3f}] at {n} fresh seeds ({reading})"


def _arm_runs(plan: ConfirmPlan, parent: str | None) -> dict[str, str | None]:
    """An MLflow run per arm, ``confirm/<arm>`` under the sweep's parent (created, or found on a rerun)."""
    out: dict[str, str | None] = {a.name: None for a in plan.arms}
    if parent is None:
        return out
    with best_effort(plan.tracking_uri, "the confirmation runs without its arm runs"):
        require_tracking(plan.tracking_uri)
        for arm in plan.arms:
            cfg = arm.config
            exp = ensure_experiment(cfg.mlflow.experiment, plan.tracking_uri, plan.workdir)
            rid, _ = find_or_create_run(plan.tracking_uri, exp, f"sweep-{plan.space.name}/confirm/{arm.name}",
                                        parent_run_id=parent, tags={"sweep": plan.space.name, "confirm.arm": arm.name,
                                                                    "confirm.role": arm.role})
            log_params_once(plan.tracking_uri, rid, {
                "arm": arm.name, "role": arm.role, "label": arm.label[:500], "model.kind": cfg.model.kind,
                "seeds": json.dumps(plan.seeds), "max_steps": arm.steps, "parameters": arm.params,
                "flops_per_step": arm.flops_per_step})
            out[arm.name] = rid
    return out


def run_confirmation(plan: ConfirmPlan, parent: str | None, *, max_concurrent: int, resources: dict[str, float],
                     winner: dict[str, Any] | None = None) -> ConfirmResult:
    """Train what is not trained yet, read every run and compare (module docstring); what it leaves behind is
    ``pipelines.tuning.confirm_report.report``'s."""
    space = plan.space
    arm_runs = _arm_runs(plan, parent)
    todo = [rp for rp in plan.runs if not trained(plan.workdir, rp)]
    log.info(f"[sweep {space.name}] confirmation: {len(plan.arms)} arms x seeds {plan.seeds}, "
             f"{len(plan.runs) - len(todo)} of {len(plan.runs)} runs already trained")
    if todo:
        ctx = TrialContext({rp.run_name: rp for rp in todo}, plan.workdir, plan.tracking_uri, arm_runs,
                           tags={"sweep": space.name}, prefix="confirm")
        fit_grid(f"{space.name}-confirm", todo, ctx, max_concurrent=max_concurrent, resources=resources,
                 cost={a.name: float(a.flops_per_step) for a in plan.arms}, what=f"sweep {space.name}'s confirmation")
    curves = {rp.run_name: history(plan.tracking_uri, rp) for rp in plan.runs}
    bounds: dict[str, dict[str, dict[int, float]]] = {}
    for r in plan.readings:
        bounds[r.key] = {}
        for arm, step in r.step.items():
            got = {rp.seed: curves[rp.run_name][step] for rp in plan.runs
                   if rp.arm == arm and step in curves[rp.run_name]}
            bounds[r.key][arm] = got
    missing = [rp.run_name for rp in plan.runs if not curves[rp.run_name]]
    if missing:
        log.warning(f"[sweep {space.name}] no validation curve in MLflow for {', '.join(missing)} (the tracking "
                    "store was out?): the comparison uses the seeds that have one; rerun once it is back")
    for c in plan.contrasts:
        a, b = bounds[c.reading].get(c.arm, {}), bounds[c.reading].get(c.against, {})
        seeds = sorted(set(a) & set(b))
        c.difference = summarise([nats(b[s]) - nats(a[s]) for s in seeds]) if seeds else None
    primary = plan.primary
    n = primary.difference.n if primary.difference else 0
    line = summary_line(plan, primary, n)
    return ConfirmResult(plan, bounds, plan.contrasts, line, "", dict(winner or {}))
