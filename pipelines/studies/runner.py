"""Run a study: every (arm, seed) one training run, the trials of one Ray Tune grid (FIFO).

What happens, in order:

1. The study file and every arm's recipe are checked (one-line errors) and each arm's training FLOPs per
   optimiser step are counted on its real network (``adlm_model.train.flops``), all before Ray starts.
2. The budgets. *Equal steps*: every arm's validation bound at ``steps``. *Equal FLOPs*: the budget is what
   ``flops_reference`` spends in ``steps`` steps; an arm that is cheaper per step trains on to that budget
   (rounded to its nearest validation), and its bound is read there. One run per (arm, seed) gives both
   readings because a run's first ``s`` steps *are* a run of ``s`` steps: the learning rate is constant after
   warm-up (required, checked), the gamma ramp's horizon is fixed (``model.gamma_horizon``, default
   ``steps``), and data order, validation rows and noise do not depend on ``run.max_steps``
   (``tests/pipelines/test_study.py`` checks the bounds match).
3. The data (``data:``) is prepared once (resumable) and the runs go to Ray Tune as a grid, ``max_concurrent``
   at a time, each a ``pipelines.train`` run of one Ray Train worker with one torch thread. A run already trained to its
   steps is skipped; an interrupted one resumes from its checkpoint: rerun the same command.
4. MLflow: a parent run ``study-<name>``, a child per arm (the arm's settings, FLOPs, steps and, at the end,
   its statistics), and under each arm its training runs (one per seed, with their curves).
5. The table (mean +- sd and a 95% t interval over seeds; the gain over ``baseline`` paired by seed) and the
   curves (bound against steps and against FLOPs) are written to ``<workdir>/studies/<name>/`` and logged to
   the parent run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adlm_model.config import ConfigError
from adlm_model.kinds import parameter_count
from adlm_model.train.flops import training_flops_per_row
from pipelines.core.logs import get_logger
from pipelines.core.runtime import init_ray, quiet_environment
from pipelines.core.storage import (
    is_uri,
    join,
    resolve_workdir,
    temp_dir,
    warn_if_node_local,
    write_bytes_atomic,
    write_text,
)
from pipelines.data.prepare import prepare
from pipelines.evaluation.truth import exact_entropy, skips_first, truth_of
from pipelines.studies.comparisons import compare, comparisons_markdown, excess_curves, truth_markdown
from pipelines.studies.grid import RunPlan, TrialContext, fit_grid, history, trained
from pipelines.studies.report import ArmResult, plot_curves, results_csv, table_markdown
from pipelines.studies.spec import StudySpec, validate_arms
from pipelines.studies.stats import relative_gain, summarise
from pipelines.tracking.runs import (
    RUN_NAME_TAG,
    best_effort,
    client,
    ensure_experiment,
    find_or_create_run,
    log_artifact_safely,
    log_params_once,
    require_tracking,
    resolve_tracking_uri,
    tracking_reachable,
)
from pipelines.training.config import TrainConfig

log = get_logger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class StudyPlan:
    spec: StudySpec
    workdir: str
    tracking_uri: str
    configs: dict[str, TrainConfig]
    params: dict[str, int]
    """Parameters of each arm's network."""
    flops_per_step: dict[str, int]
    """Training FLOPs of one optimiser step (global batch), per arm."""
    flops_step: dict[str, int]
    """Equal-FLOPs arms: the step whose validation is read at the FLOP budget."""
    budget_flops: float | None
    runs: list[RunPlan] = field(default_factory=list)


def plan_study(spec: StudySpec, *, workdir: str | os.PathLike | None = None, tracking_uri: str | None = None,
               root: Path = PROJECT_ROOT) -> StudyPlan:
    """Everything checked and sized before Ray starts (ConfigError on bad input)."""
    wd = resolve_workdir(workdir)
    uri = tracking_uri or resolve_tracking_uri(wd)
    configs = validate_arms(spec, root)
    fps, params = {}, {}
    for arm in spec.arms:
        cfg = configs[arm.name]
        if arm.equal_flops and cfg.optim.schedule != "constant":
            raise ConfigError(f"{spec.source}: arm {arm.name!r} is compared at equal FLOPs, which reads a longer "
                              f"run part-way: it needs optim.schedule: constant (got {cfg.optim.schedule!r})")
        fps[arm.name] = training_flops_per_row(cfg.model) * cfg.batch.global_batch
        params[arm.name] = parameter_count(cfg.model)
    budget = fps[spec.flops_reference] * spec.steps if spec.flops_reference else None
    flops_step: dict[str, int] = {}
    plan = StudyPlan(spec, wd, uri, configs, params, fps, flops_step, budget)
    for arm in spec.arms:
        cfg = configs[arm.name]
        every = cfg.run.val_every
        steps = spec.steps
        if budget is not None and arm.equal_flops:
            flops_step[arm.name] = max(every, round(budget / fps[arm.name] / every) * every)
            steps = max(steps, flops_step[arm.name])
        for seed in arm.seeds:
            raw = spec.raw_config(arm, root)
            model = raw.setdefault("model", {})
            # A fixed ramp horizon: a run to more steps than `steps` ramps gamma exactly as one to `steps`.
            if not model.get("gamma_horizon"):
                model["gamma_horizon"] = spec.steps
            name = f"{spec.name}-{arm.name}-s{seed}"
            raw.setdefault("run", {}).update(name=name, seed=seed, max_steps=steps)
            raw.setdefault("mlflow", {})["register"] = False
            TrainConfig.from_dict(raw)  # validated with its seed and length
            plan.runs.append(RunPlan(arm.name, seed, name, steps, raw))
    return plan


def _mlflow_runs(plan: StudyPlan) -> tuple[str | None, dict[str, str | None]]:
    """The parent run and a child per arm (created, or found on a rerun); Nones if MLflow is down."""
    spec = plan.spec
    with best_effort(plan.tracking_uri, "the study runs without its parent and arm runs"):  # refused: stops here
        require_tracking(plan.tracking_uri)
        exp = ensure_experiment(plan.configs[spec.arms[0].name].mlflow.experiment, plan.tracking_uri, plan.workdir)
        parent, _ = find_or_create_run(plan.tracking_uri, exp, f"study-{spec.name}",
                                       tags={"study": spec.name, "adlm.study_parent": "true"})
        log_params_once(plan.tracking_uri, parent, {
            "study": spec.name, "config": spec.config, "steps": spec.steps, "seeds": json.dumps(spec.seeds),
            "flops_reference": spec.flops_reference, "baseline": spec.baseline,
            "budget_flops": f"{plan.budget_flops:.4g}" if plan.budget_flops else None,
            "overrides": json.dumps(spec.overrides, sort_keys=True)[:6000], "arms": ",".join(a.name for a in spec.arms)})
        arms = {}
        for arm in spec.arms:
            rid, _ = find_or_create_run(plan.tracking_uri, exp, f"study-{spec.name}/{arm.name}", parent_run_id=parent,
                                        tags={"study": spec.name, "study.arm": arm.name})
            log_params_once(plan.tracking_uri, rid, {
                "arm": arm.name, "set": json.dumps(arm.sets, sort_keys=True), "seeds": json.dumps(arm.seeds),
                "equal_flops": arm.equal_flops, "model.kind": plan.configs[arm.name].model.kind,
                "parameters": plan.params[arm.name], "flops_per_step": plan.flops_per_step[arm.name],
                "max_steps": max(r.max_steps for r in plan.runs if r.arm == arm.name)})
            arms[arm.name] = rid
        return parent, arms
    return None, {a.name: None for a in spec.arms}  # the runs spool their metrics


@dataclass
class StudyResult:
    name: str
    arms: list[ArmResult]
    parent_run_id: str | None
    out_dir: str
    seconds: float
    artifacts: dict[str, str] = field(default_factory=dict)
    markdown: str = ""
    """The results table (``table.md``): what the command prints."""


def run_study(spec: StudySpec, *, workdir: str | os.PathLike | None = None, tracking_uri: str | None = None,
              root: Path = PROJECT_ROOT) -> StudyResult:
    """Plan, prepare, train every (arm, seed) through Ray Tune, then tabulate, plot and log (module docstring)."""
    quiet_environment()
    t0 = time.time()
    plan = plan_study(spec, workdir=workdir, tracking_uri=tracking_uri, root=root)
    tracking_reachable(plan.tracking_uri)  # refused credentials (401/403) stop here in one line, before Ray starts
    wd = plan.workdir
    # The trials get ``plan.workdir`` as an argument (TrialContext): none reads $ADLM_WORKDIR.
    log.info(f"[study {spec.name}] {len(spec.arms)} arms, {len(plan.runs)} runs; equal steps {spec.steps}"
             + (f", equal FLOPs {plan.budget_flops:.3g} ({spec.flops_reference} at {spec.steps} steps)"
             if plan.budget_flops else ""))
    for arm in spec.arms:
        log.info(f"  {arm.name:<22} {plan.params[arm.name] / 1e6:6.2f} M params  "
                 f"{plan.flops_per_step[arm.name] / 1e9:7.2f} GFLOP/step  "
                 f"runs to {max(r.max_steps for r in plan.runs if r.arm == arm.name)} steps  seeds {arm.seeds}")
    init_ray()
    warn_if_node_local([plan.workdir], "the study's work directory")
    if spec.data is not None:
        prepare(dataclasses.replace(spec.data, out=join(wd, spec.data.out)))
    parent, arm_runs = _mlflow_runs(plan)
    todo = [rp for rp in plan.runs if not trained(plan.workdir, rp)]
    if todo:
        _fit(plan, todo, arm_runs)
    result = _tabulate(plan, parent, time.time() - t0)
    return result


def _fit(plan: StudyPlan, todo: list[RunPlan], arm_runs: dict[str, str | None]) -> None:
    spec = plan.spec
    ctx = TrialContext({rp.run_name: rp for rp in todo}, plan.workdir, plan.tracking_uri, arm_runs,
                       tags={"study": spec.name}, prefix="study")
    # The trial trains in its own process (local mode), on the trial_cpu CPUs it reserves, never a GPU node's.
    fit_grid(f"study-{spec.name}", todo, ctx, max_concurrent=spec.max_concurrent, resources={"CPU": spec.trial_cpu},
             cost={a: float(f) for a, f in plan.flops_per_step.items()}, what=f"study {spec.name}")


def _truth(plan: StudyPlan) -> dict[str, Any] | None:
    """The validation data's ``manifest.truth`` when the study runs on the testbed, else None."""
    cfg = plan.configs[plan.spec.arms[0].name]
    return truth_of(cfg.resolve_path(cfg.data.validation, plan.workdir))


def _read_truth(plan: StudyPlan, a: ArmResult, truth: dict[str, Any]) -> None:
    """The arm's bounds as excess over the exact entropy on the positions its kind scores."""
    skip = skips_first(plan.configs[a.name].model)
    a.entropy = exact_entropy(truth, skip)[0]
    a.floor_excess = float(truth["floors_skip_first" if skip else "floors"]["unigram_position"]) - a.entropy
    a.excess_curves = excess_curves(a.curves, a.entropy)
    ex_steps = [math.log(v) - a.entropy for v in a.at_steps.values()]
    ex_flops = [math.log(v) - a.entropy for v in a.at_flops.values()]
    a.excess_steps = summarise(ex_steps) if ex_steps else None
    a.excess_flops = summarise(ex_flops) if ex_flops else None


def _tabulate(plan: StudyPlan, parent: str | None, seconds: float) -> StudyResult:
    spec = plan.spec
    arms: list[ArmResult] = []
    truth = _truth(plan)
    for arm in spec.arms:
        curves = {rp.seed: history(plan.tracking_uri, rp) for rp in plan.runs if rp.arm == arm.name}
        at_steps = {s: h[spec.steps] for s, h in curves.items() if spec.steps in h}
        fs = plan.flops_step.get(arm.name)
        at_flops = {s: h[fs] for s, h in curves.items() if fs is not None and fs in h}
        arms.append(ArmResult(
            name=arm.name, kind=plan.configs[arm.name].model.kind, sets=arm.sets, params=plan.params[arm.name],
            flops_per_step=plan.flops_per_step[arm.name], equal_flops=arm.equal_flops, curves=curves,
            at_steps=at_steps, steps_summary=summarise(list(at_steps.values())) if at_steps else None,
            flops_step=fs, at_flops=at_flops, steps_at=spec.steps,
            flops_summary=summarise(list(at_flops.values())) if at_flops else None))
        if truth is not None:
            _read_truth(plan, arms[-1], truth)
    base = next((a for a in arms if a.name == spec.baseline), None)
    if base is not None:
        for a in arms:
            a.gain_steps = relative_gain(a.at_steps, base.at_steps) if a is not base else None
            a.gain_flops = relative_gain(a.at_flops, base.at_flops) if a is not base and a.equal_flops else None
    out = join(plan.workdir, "studies", spec.name)
    md = table_markdown(spec, arms, plan.budget_flops, seconds)
    readings = {"steps": {a.name: a.at_steps for a in arms}, "flops": {a.name: a.at_flops for a in arms}}
    entropy = {a.name: a.entropy for a in arms} if truth is not None else None
    compared = [compare(c, readings, entropy) for c in spec.comparisons]
    extra = [] if truth is None else truth_markdown(
        truth, [(a.name, a.excess_steps, a.excess_flops, a.entropy, a.floor_excess) for a in arms])
    extra += comparisons_markdown(compared, spec.hypothesis)
    if extra:
        md += "\n".join(extra) + "\n"
    artifacts = {"table.md": join(out, "table.md"), "results.csv": join(out, "results.csv"),
                 "results.json": join(out, "results.json")}
    write_text(artifacts["table.md"], md)
    write_text(artifacts["results.csv"], results_csv(arms))
    write_text(artifacts["results.json"], json.dumps({"study": spec.name, "steps": spec.steps,
                                                      "budget_flops": plan.budget_flops, "seconds": seconds,
                                                      "arms": [a.as_dict() for a in arms], "truth": truth,
                                                      "hypothesis": spec.hypothesis,
                                                      "comparisons": [r.as_dict() for r in compared]}, indent=2))
    local_out = Path(temp_dir("study-plot")) if is_uri(out) else Path(out)
    png = plot_curves(spec, arms, local_out / "curves.png")
    if png is not None:
        if is_uri(out):
            write_bytes_atomic(join(out, "curves.png"), png.read_bytes())
        artifacts["curves.png"] = join(out, "curves.png")
    _log_results(plan, parent, arms, local_files=[Path(p) for p in (artifacts.values()) if not is_uri(p)])
    log.info(f"[study {spec.name}] {seconds / 60:.1f} min; table and curves in {out}")
    return StudyResult(spec.name, arms, parent, out, seconds, artifacts, md)


def _log_results(plan: StudyPlan, parent: str | None, arms: list[ArmResult], local_files: list[Path]) -> None:
    if parent is None:
        return
    # After the runs: the table is on disk and stays; refused credentials are a warning here.
    with best_effort(plan.tracking_uri, "the study's results are not logged to MLflow (the table is on disk)",
                     stop_on_refusal=False):
        c = client(plan.tracking_uri)
        for a in arms:
            found = c.search_runs([c.get_run(parent).info.experiment_id],
                                  filter_string=f"tags.`{RUN_NAME_TAG}` = 'study-{plan.spec.name}/{a.name}'",
                                  max_results=1)
            if not found:
                continue
            rid = found[0].info.run_id
            for prefix, summ, gain in (("equal_steps", a.steps_summary, a.gain_steps),
                                       ("equal_flops", a.flops_summary, a.gain_flops)):
                if summ is None:
                    continue
                for k in ("mean", "sd", "lo", "hi"):
                    v = getattr(summ, k)
                    if not math.isnan(v):
                        c.log_metric(rid, f"{prefix}/val_ppl_{k}", v)
                if gain is not None:
                    c.log_metric(rid, f"{prefix}/gain_pct_mean", gain.mean)
            c.set_terminated(rid, "FINISHED")
        for f in local_files:
            log_artifact_safely(plan.tracking_uri, parent, f, "study")
        c.set_terminated(parent, "FINISHED")
