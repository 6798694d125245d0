"""What ``python -m pipelines.tune`` runs: the search, the baseline arm's search with the same budget, and the
confirmation at fresh seeds (``pipelines.tuning.confirm``), each checked and sized before any of them starts.

``--check`` prints the plan's size: each search's trials and steps (at most, and about with ASHA's promotions),
each confirmation arm's runs, and, for a CPU recipe, what one optimiser step of each arm costs on this machine
(timed here, one torch thread, as a trial trains) turned into CPU-seconds and a wall-clock estimate.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from adlm_model.config import ConfigError
from adlm_model.kinds import build_model
from adlm_model.train.flops import training_flops_per_row
from adlm_model.train.train_step import Objective, TrainStep
from pipelines.core.logs import get_logger
from pipelines.core.runtime import driver_resources
from pipelines.training.config import TrainConfig
from pipelines.training.optim import build_optimizer
from pipelines.tuning.confirm import (
    ConfirmPlan,
    ConfirmResult,
    budget_text,
    plan_confirmation,
    run_confirmation,
    search_steps,
)
from pipelines.tuning.confirm_report import report
from pipelines.tuning.space import ConfirmFile, ConfirmSpec, SearchSpace, parse_confirm
from pipelines.tuning.sweep import SweepPlan, SweepResult, plan_sweep, sweep

log = get_logger(__name__)

START_S = 12.0
"""Start-up seconds a trial or run costs before its first step (a Tune trial's process, the data, MLflow; measured
on a 2-core machine): added per run to ``--check``'s estimate."""


@dataclass
class TunePlan:
    space: SearchSpace
    config: str
    sets: list[str]
    main: SweepPlan
    baseline_space: SearchSpace | None
    baseline: SweepPlan | None
    confirm: ConfirmPlan | None


def with_confirm(space: SearchSpace, seeds: int) -> SearchSpace:
    """The space with ``confirm.seeds = seeds`` (``--confirm N``), its other confirm settings kept (or defaults)."""
    base = space.confirm or parse_confirm(ConfirmFile(), space.source, space.baseline)
    if seeds == 1 or seeds < 0:
        raise ConfigError(f"--confirm {seeds}: give 0 (no confirmation) or at least 2 seeds (an interval needs two)")
    return dataclasses.replace(space, confirm=dataclasses.replace(base, seeds=seeds))


def plan_tune(space: SearchSpace, config: str | None, sets: list[str] | tuple[str, ...], *,
              workdir: str | os.PathLike | None = None, tracking_uri: str | None = None,
              check_data: bool = True) -> TunePlan:
    """Every part checked before Ray starts (ConfigError / ValueError, one line)."""
    config = config or space.config
    if not config:
        raise ConfigError(f"search space {space.source} names no config: pass --config configs/<recipe>.yaml")
    main = plan_sweep(space, config, sets, workdir=workdir, tracking_uri=tracking_uri, check_data=check_data)
    bspace = space.baseline_space()
    bplan = None
    if bspace is not None:
        bplan = plan_sweep(bspace, bspace.config or config, sets, workdir=main.workdir, tracking_uri=main.tracking_uri,
                           check_data=check_data)
    cplan = None
    if space.confirm is not None and space.confirm.seeds:
        cplan = plan_confirmation(space, config, list(sets), workdir=main.workdir, tracking_uri=main.tracking_uri)
    return TunePlan(space, str(config), list(sets), main, bspace, bplan, cplan)


# ----------------------------------------------------------------------------------------------------
# --check


def step_seconds(raw: dict[str, Any], repeats: int = 3) -> float | None:
    """Seconds of one optimiser step of this recipe here (CPU, one torch thread, random tokens), or None for a GPU
    recipe or one too large to time on this machine in a few seconds."""
    cfg = TrainConfig.from_dict(json.loads(json.dumps(raw)))
    if cfg.scaling.use_gpu or training_flops_per_row(cfg.model) * cfg.batch.global_batch > 2e11:
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = build_model(cfg.model)
        step = TrainStep(Objective(model, cfg.model), model, build_optimizer(model.parameters(), cfg.optim),
                         clip=cfg.optim.clip)
        g = torch.Generator().manual_seed(0)
        m = cfg.batch.micro_batch
        batches = [(torch.randint(0, cfg.model.vocab_size, (m, cfg.model.seq_len), generator=g), None)
                   for _ in range(max(1, cfg.batch.global_batch // m))]
        step(batches, step=0, generator=g)  # warm-up: allocations, first-call costs
        t0 = time.perf_counter()
        for k in range(repeats):
            step(batches, step=k + 1, generator=g)
        return (time.perf_counter() - t0) / repeats
    finally:
        torch.set_num_threads(threads)


def _validation_s(raw: dict[str, Any], per_step: float) -> float:
    """A validation's seconds: ``val_batches`` forward passes of a micro-batch, a third of a step's cost each."""
    r, b = raw.get("run", {}), raw.get("batch", {})
    micro, glob = b.get("micro_batch", 1), b.get("global_batch", 1)
    return r.get("val_batches", 1) * per_step / 3 * micro / max(glob, 1)


def check_lines(tp: TunePlan, timed: bool = True) -> list[str]:
    """What ``--check`` prints: the searches' and the confirmation's sizes and, timed here, their cost."""
    lines = []
    total_cpu = 0.0
    concurrency = tp.space.max_concurrent
    searches = [("search", tp.space, tp.main)]
    if tp.baseline is not None and tp.baseline_space is not None:
        searches.append((f"baseline {tp.space.baseline.name}", tp.baseline_space, tp.baseline))
    for what, space, plan in searches:
        most, about = search_steps(space, plan.max_t)
        cfg = plan.base
        gf = training_flops_per_row(cfg.model) * cfg.batch.global_batch / 1e9
        asha = f", at least {about:,} if ASHA keeps 1/{space.reduction_factor:g} at each rung" if about < most else ""
        line = (f"{what} {space.name}: {space.total_trials} trials over {', '.join(p.name for p in space.params)}; "
                f"max_t {plan.max_t} steps; at most {most:,} steps{asha}; {gf:.2f} GFLOP/step")
        s = step_seconds(plan.base_raw) if timed else None
        if s is not None:  # at most: asynchronous ASHA promotes the first trials of a rung without competitors
            vals = most // max(cfg.run.val_every, 1)
            cpu = most * s + vals * _validation_s(plan.base_raw, s) + space.total_trials * START_S
            total_cpu += cpu
            line += f"; {s:.3f} s/step here -> about {cpu / 60:.0f} CPU-minutes"
        lines.append(line)
    c = tp.confirm
    if c is not None:
        runs = len(c.runs)
        lines.append(f"confirm: {len(c.arms)} arms x fresh seeds {c.seeds} = {runs} runs; readings "
                     f"{', '.join(r.key for r in c.readings)}; primary {c.primary.reading} "
                     f"({c.primary.arm} vs {c.primary.against})")
        for a in c.arms:
            line = (f"  {a.name:<14} {a.role:<8} {a.label}: {a.params / 1e6:.2f} M params, "
                    f"{a.flops_per_step / 1e9:.2f} GFLOP/step, {len(c.seeds)} runs to {a.steps:,} steps")
            s = step_seconds(a.raw) if timed else None
            if s is not None:
                every = a.config.run.val_every
                cpu = len(c.seeds) * (a.steps * s + a.steps // every * _validation_s(a.raw, s) + START_S)
                total_cpu += cpu
                line += f"; {s:.3f} s/step here -> about {cpu / 60:.0f} CPU-minutes"
            lines.append(line)
    if total_cpu:
        cores = os.cpu_count() or 1
        lines.append(f"estimate: about {total_cpu / 3600:.1f} CPU-hours; about {total_cpu / min(concurrency, cores) / 3600:.1f} "
                     f"hours of wall time at {min(concurrency, cores)} runs at once on this machine "
                     "(one torch thread a run; a loaded machine takes longer)")
    return lines


# ----------------------------------------------------------------------------------------------------
# Running it


@dataclass
class TuneOutcome:
    main: SweepResult
    baseline: SweepResult | None = None
    confirm: ConfirmResult | None = None


def _used_seeds(tp: TunePlan, results: list[SweepResult]) -> set[int]:
    """Seeds any search trial trained with: the recipes' own, and any a space searched."""
    used = {tp.main.base.run.seed}
    if tp.baseline is not None:
        used.add(tp.baseline.base.run.seed)
    for res in results:
        for r in res.trials:
            if "run.seed" in r.params and r.params["run.seed"] is not None:
                used.add(int(r.params["run.seed"]))
    return used


def run_tune(space: SearchSpace, config: str | None, sets: list[str] | tuple[str, ...], *,
             workdir: str | os.PathLike | None = None, tracking_uri: str | None = None) -> TuneOutcome:
    """The search, then the baseline arm's search, then the confirmation; an interrupted or undecided search stops
    what follows (its rerun resumes)."""
    tp = plan_tune(space, config, sets, workdir=workdir, tracking_uri=tracking_uri)
    main = sweep(space, tp.config, tp.sets, workdir=tp.main.workdir, tracking_uri=tp.main.tracking_uri)
    out = TuneOutcome(main)
    if main.interrupted or tp.confirm is None and tp.baseline is None:
        return out
    if tp.baseline_space is not None:
        out.baseline = sweep(tp.baseline_space, tp.baseline_space.config or tp.config, tp.sets,
                             workdir=tp.main.workdir, tracking_uri=tp.main.tracking_uri, register=False)
        if out.baseline.interrupted:
            return out
    if tp.confirm is None:
        return out
    if main.best is None:
        raise RuntimeError(f"sweep {space.name!r} has no trial that reached max_t: nothing to confirm")
    bparams = None
    if out.baseline is not None:
        if out.baseline.best is None:
            raise RuntimeError(f"the baseline arm's sweep {tp.baseline_space.name!r} has no trial that reached max_t: "
                               "nothing to confirm against")
        bparams = dict(out.baseline.best.params)
    used = _used_seeds(tp, [r for r in (main, out.baseline) if r is not None])
    cplan = plan_confirmation(space, tp.config, tp.sets, workdir=tp.main.workdir, tracking_uri=tp.main.tracking_uri,
                              winner=dict(main.best.params), baseline=bparams, used_seeds=used)
    cplan.budgets[cplan.arms[0].name] = budget_text(main.trials)
    if out.baseline is not None:
        cplan.budgets[cplan.against.name] = budget_text(out.baseline.trials)
    log.info(f"[sweep {space.name}] confirming {cplan.arms[0].label} against {cplan.against.label} at fresh seeds "
             f"{cplan.seeds}")
    out.confirm = run_confirmation(cplan, main.parent_run_id, max_concurrent=space.max_concurrent,
                                   resources=driver_resources(space.trial_cpu), winner=dict(main.best.params))
    report(out.confirm, main.parent_run_id, tp.main.base.mlflow.register, main.trials)
    return out


__all__ = ["ConfirmSpec", "TunePlan", "TuneOutcome", "check_lines", "plan_tune", "run_tune", "step_seconds",
           "with_confirm"]
