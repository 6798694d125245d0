"""Ray Tune searches ADLM's anchor-loss knobs, gamma and tau (docs/design/method.md, section 2).

What happens, in order:

1. The search space (``tune_spaces/*.yaml``, schema in :class:`SearchSpace`) and the training recipe
   are loaded and validated; every corner of the space is applied to the recipe and validated too
   (a negative gamma, an unknown key), and the data must fit the model: all before Ray starts.
2. One MLflow *parent* run for the sweep (its name is the sweep name; reopened on a rerun).
3. A Tune driver function per trial builds and fits a ``TorchTrainer`` through
   :func:`pipelines.training.trainer.train` (the current Ray pattern; ``Tuner(trainer)`` is deprecated). The
   trainer's ``TuneReportCallback`` forwards every validation report to Tune, so ASHA can stop bad
   trials early on the validation NELBO perplexity (minimised) with ``step`` as its time unit.
   Each trial is an MLflow *child* run (nested under the parent, tagged with the trial id, params
   ``gamma`` and ``tau``), and a training run named ``<sweep>-<trial id>`` with its own checkpoints.
4. The parent logs the trial table (CSV and Markdown) and a picture of the search (gamma against tau,
   coloured by validation PPL, stopped trials marked), and the best trial that reached ``max_t`` is
   registered (alias ``candidate``, tags naming the sweep and the trial).

Resume: rerun the same command (same sweep name and work directory). Tune restores the experiment
from ``<workdir>/ray_results/tune/<sweep>``: finished and stopped trials are not rerun; unfinished ones
are rerun, and their training runs continue from their own latest checkpoints. A trial whose training
ended in the moment before Ctrl-C, before Tune processed its last report, is saved as running: its rerun
finds its final checkpoint, trains nothing and reports the same validation again.
"""


from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from ray import tune
from ray.tune import FailureConfig, RunConfig, TuneConfig, Tuner
from ray.tune.integration.ray_train import TuneReportCallback
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search import ConcurrencyLimiter
from ray.tune.search.basic_variant import BasicVariantGenerator
from ray.tune.search.optuna import OptunaSearch

from adlm_model.config import ConfigError
from adlm_model.kinds import model_kind
from pipelines.core import placement
from pipelines.core.logs import get_logger
from pipelines.core.runtime import cpu_placement, driver_resources, init_ray, quiet_environment
from pipelines.core.storage import join, publish_dir, resolve_workdir, temp_dir, warn_if_node_local
from pipelines.tracking.registry import register_checkpoint, training_tags
from pipelines.tracking.runs import (
    best_effort,
    client,
    ensure_experiment,
    find_or_create_run,
    log_artifact_safely,
    log_params_once,
    redact_uri,
    require_tracking,
    resolve_tracking_uri,
    tracking_reachable,
)
from pipelines.training.config import TrainConfig, apply_override, load_raw
from pipelines.training.data import plan_data
from pipelines.training.init import pin_init
from pipelines.tuning.progress import progress_callbacks, tune_output, tune_verbosity
from pipelines.tuning.report import TrialRow, plot_search, table_markdown
from pipelines.tuning.space import METRIC, TIME_ATTR, SearchSpace, parse_space
from pipelines.tuning.trials import finish_trial_runs, trial_config, with_params

log = get_logger(__name__)

TRIAL_RETRIES = 3
"""How often Tune restarts a trial whose driver failed (a lost node) before the sweep reports it errored."""


class TuneError(RuntimeError):
    """A sweep that failed while running (bad input is a ConfigError, raised before Ray starts)."""



# ----------------------------------------------------------------------------------------------------
# Planning: the recipe + the space, everything checked before Ray


@dataclass
class SweepPlan:
    space: SearchSpace
    base_raw: dict[str, Any]
    """The recipe with ``--set`` and the space's overrides applied (the trials add their params)."""
    base: TrainConfig
    workdir: str
    tracking_uri: str
    storage: str
    """Tune's storage: ``<workdir>/ray_results/tune`` (local or an object store)."""
    max_t: int


def plan_sweep(space: SearchSpace, config: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (), *,
               workdir: str | os.PathLike | None = None, tracking_uri: str | None = None,
               check_data: bool = True) -> SweepPlan:
    """Apply the space to the recipe and check every corner; check the data. Raises ConfigError /
    ValueError with one line, before any Ray or MLflow work."""
    raw = load_raw(config)
    for a in overrides:
        apply_override(raw, a)
    for k, v in space.overrides.items():
        apply_override(raw, f"{k}={json.dumps(v)}")
    base = TrainConfig.from_dict(json.loads(json.dumps(raw)))
    if not model_kind(base.model.kind).anchored and any(p.key in ("model.gamma", "model.tau") for p in space.params):
        raise ConfigError(f"the space searches gamma/tau but the recipe's model.kind is {base.model.kind!r}; "
                          "gamma and tau only act on ADLM (set model.kind=adlm)")
    for p in space.params:  # every corner must make a valid recipe (e.g. gamma >= 0, tau >= 0)
        for v in p.corners():
            try:
                TrainConfig.from_dict(with_params(raw, {p.name: v}, space))
            except ConfigError as e:
                raise ConfigError(f"search space {space.source}: params.{p.name} value {v!r} is invalid for the "
                                  f"recipe: {e}") from None
        if p.distribution in ("uniform", "loguniform"):  # its draws are fractions: a whole-number key takes none
            v = p.low + (p.high - p.low) * 0.382
            try:
                TrainConfig.from_dict(with_params(raw, {p.name: v}, space))
            except ConfigError as e:
                raise ConfigError(f"search space {space.source}: params.{p.name}: {p.distribution} draws fractions "
                                  f"such as {v:g}, which {p.key} does not take ({e}); use randint (low inclusive, "
                                  "high exclusive) or choice") from None
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
            # lazy: optional: optuna may be absent, and that is handled
            import optuna  # noqa: F401
        except ImportError:
            raise ConfigError("search.algorithm optuna needs the optuna extra: pip install -e '.[optuna]'") from None
    wd = resolve_workdir(workdir)
    data = plan_data(base, wd) if check_data else None  # the data must exist and fit the model
    uri = tracking_uri or resolve_tracking_uri(wd)
    if base.run.init:  # the version every trial starts from must exist and fit, as train checks it
        pin_init(base, None, uri, data.tokenizer_hash if data else None)
    return SweepPlan(space=space, base_raw=raw, base=base, workdir=wd, tracking_uri=uri,
                     storage=join(wd, "ray_results", "tune"), max_t=max_t)


# ----------------------------------------------------------------------------------------------------
# The trial: a Tune driver function that fits a TorchTrainer


@dataclass
class TrialPlan:
    """What every trial's driver function needs (pickled into its Tune actor)."""

    space_raw: dict[str, Any]
    """The space in its YAML form (re-parsed in the actor)."""
    space_source: str
    base_raw: dict[str, Any]
    """The recipe with ``--set`` and the space's overrides applied."""
    workdir: str
    tracking_uri: str
    parent_run_id: str | None


def run_trial(config: dict[str, Any], *, plan: TrialPlan) -> None:
    """One trial, in its Tune actor: the recipe plus this trial's params, trained by ``pipelines.train``."""
    # lazy: keeps torch.distributed out of this module's import
    from pipelines.training.trainer import train

    space = parse_space(plan.space_raw, plan.space_source)
    cfg, tags = trial_config(plan.base_raw, space, tune.get_context().get_trial_id(), config)
    # The callback forwards a Ray Train worker group's reports through a queue actor it starts (a process, about
    # 1.5 CPU-seconds): a local-mode trial has no worker group, it reports to Tune itself (TrialSession).
    callbacks = [TuneReportCallback()] if cfg.scaling.num_workers > 0 else []
    res = train(cfg, workdir=plan.workdir, tracking_uri=plan.tracking_uri, callbacks=callbacks,
                parent_run_id=plan.parent_run_id, extra_tags=tags, register=False)
    tune.report({TIME_ATTR: res.step, METRIC: res.val_ppl, "mlflow_run_id": res.run_id,
                 "checkpoint_dir": str(res.checkpoint_dir), "finished": True, "best_step": res.best_step,
                 "best_val_ppl": res.best_val_ppl, "checkpoint": res.checkpoint})


# ----------------------------------------------------------------------------------------------------
# The sweep


@dataclass
class SweepResult:
    name: str
    parent_run_id: str | None
    trials: list[TrialRow]
    best: TrialRow | None
    registered_version: str | None
    interrupted: bool
    artifacts: dict[str, str] = field(default_factory=dict)
    """The trial table and search plot under ``<workdir>/sweeps/<name>/`` (local paths or URIs)."""
    unregistered: str | None = None
    """Why a finished sweep whose best trial was to be registered is not (the tracking store was down or refused):
    the command's exit is then non-zero and this one line says how to finish it (rerun the same command)."""


def _parent_run(plan: SweepPlan) -> str | None:
    with best_effort(plan.tracking_uri, "sweeping without a parent run"):  # refused credentials stop it here
        require_tracking(plan.tracking_uri)
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
    return None


def _search_alg(space: SearchSpace) -> Any:
    # The concurrency limit lives in the searcher: Tune ignores max_concurrent_trials for a
    # BasicVariantGenerator, and on 2 cores unlimited trials starve each other's worker groups.
    if space.algorithm == "optuna":
        return ConcurrencyLimiter(OptunaSearch(seed=space.seed), max_concurrent=space.max_concurrent)
    return BasicVariantGenerator(random_state=space.seed, max_concurrent=space.max_concurrent)


def _scheduler(space: SearchSpace, max_t: int) -> Any:
    if space.scheduler == "fifo":
        return FIFOScheduler()
    # ASHA (Li et al.): rungs at grace_period * rf^k optimiser steps; a trial is stopped at a rung
    # when its validation PPL is worse than the top 1/rf of the trials recorded there.
    # stop_last_trials=False: a trial that reaches max_t is left to finish on its own, so that its
    # training run exports, logs and can be registered (ASHA would otherwise kill it at its last report).
    return ASHAScheduler(time_attr=TIME_ATTR, max_t=max_t, grace_period=space.grace_period,
                         reduction_factor=space.reduction_factor, stop_last_trials=False)


def _number(v: Any, kind: type) -> Any:
    """A dataframe cell as ``kind``, or None where Tune left it empty (None or NaN)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return kind(v)


def _rows(grid: Any, space: SearchSpace, max_t: int) -> list[TrialRow]:
    df = grid.get_dataframe()
    rows = []
    names = [p.name for p in space.params]
    for _, rec in df.iterrows():
        params = {n: rec.get(f"config/{n}") for n in names}
        params = {k: (v.item() if hasattr(v, "item") else v) for k, v in params.items()}
        step, ppl = _number(rec.get(TIME_ATTR), int), _number(rec.get(METRIC), float)
        rid = rec.get("mlflow_run_id")
        rid = rid if isinstance(rid, str) and rid else None
        status = "finished" if step is not None and step >= max_t else "stopped"
        best_step, best_ppl, which = rec.get("best_step"), rec.get("best_val_ppl"), rec.get("checkpoint")
        rows.append(TrialRow(trial_id=str(rec["trial_id"]), params=params, status=status, step=step, val_ppl=ppl,
                             mlflow_run_id=rid, best_step=_number(best_step, int), best_val_ppl=_number(best_ppl, float),
                             checkpoint=which if isinstance(which, str) and which else None))
    errored = {str(r.metrics.get("trial_id")) for r in grid if r.error is not None and r.metrics}
    for r in rows:
        if r.trial_id in errored:
            r.status = "error"
    return sorted(rows, key=lambda r: r.trial_id)


def _ended(grid: Any) -> int:
    """How many trials ended: with a report of their own (finished, or stopped by the scheduler) or an error.
    Counted from the results, not from Tune's statuses: a trial still pending when Ctrl-C stops Tune comes back
    TERMINATED without ever having run (its result holds nothing but its id), and a sweep that counted it done
    would register its best before the rest of the search had run."""
    return sum(1 for r in grid if r.error is not None or (r.metrics or {}).get(TIME_ATTR) is not None)


def every_trial_failed(grid: Any, name: str) -> str | None:
    """When every trial that ended failed (a sweep with nothing to choose from): the line that says so, with the first
    trial's error; else None."""
    errors = [r.error for r in grid if r.error is not None]
    if not errors or len(errors) != _ended(grid):
        return None
    said = str(errors[0]).strip().splitlines()
    return (f"every trial of sweep {name!r} failed ({len(errors)} of {len(errors)}); the first: "
            f"{said[-1][:300] if said else type(errors[0]).__name__}")


def _child_runs(plan: SweepPlan, parent: str) -> dict[str, Any]:
    c = client(plan.tracking_uri)
    exp = c.get_experiment_by_name(plan.base.mlflow.experiment)
    runs = c.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'", max_results=1000)
    return {r.data.tags.get("tune.trial_id"): r for r in runs}


def _finalise(plan: SweepPlan, parent: str | None, rows: list[TrialRow], best: TrialRow | None,
              interrupted: bool, register: bool = True) -> tuple[str | None, dict[str, str]]:
    """The trial table and search plot (``<workdir>/sweeps/<name>/``), child-run bookkeeping, parent artifacts,
    registration of the best trial. Returns the registered version and where the artifacts were written."""
    space = plan.space
    out = temp_dir("adlm-sweep-")
    buf = io.StringIO()
    w = csv.writer(buf)
    names = [p.name for p in space.params]
    w.writerow(["trial_id", *names, "status", "step", METRIC, "best_step", "best_val_ppl", "mlflow_run_id"])
    for r in rows:
        w.writerow([r.trial_id, *[r.params.get(n) for n in names], r.status, r.step, r.val_ppl, r.best_step,
                    r.best_val_ppl, r.mlflow_run_id])
    (out / "trials.csv").write_text(buf.getvalue())
    (out / "trials.md").write_text(table_markdown(rows, best))
    plot_search(rows, out / "search.png", f"sweep {space.name}: {len(rows)} trials")
    local = {p.name: p for p in sorted(out.iterdir())}
    try:
        version = _bookkeeping(plan, parent, rows, best, interrupted, list(local.values()), register) \
            if parent else None
    finally:
        dest = publish_dir(out, join(plan.workdir, "sweeps", space.name))
    return version, {name: join(dest, name) for name in local}


def _bookkeeping(plan: SweepPlan, parent: str, rows: list[TrialRow], best: TrialRow | None, interrupted: bool,
                 artifacts: list[Path], register: bool = True) -> str | None:
    """Child-run status tags, the parent's artifacts and figures, the best trial registered (once)."""
    space = plan.space

    # lazy: keeps mlflow out of this module's import
    import mlflow

    c = client(plan.tracking_uri)
    version = None
    # After the trials: their results are on disk and stay; refused credentials are a warning here.
    with best_effort(plan.tracking_uri, "the sweep's MLflow bookkeeping is incomplete", stop_on_refusal=False):
        children = _child_runs(plan, parent)
        if finish_trial_runs(plan.base_raw, space, plan.workdir, plan.tracking_uri, parent, rows, children):
            children = _child_runs(plan, parent)
        for r in rows:
            run = children.get(r.trial_id)
            if run is None:
                continue
            r.mlflow_run_id = r.mlflow_run_id or run.info.run_id
            c.set_tag(run.info.run_id, "tune.status", r.status)
            if r.status == "stopped" and run.info.status == "RUNNING":
                c.set_terminated(run.info.run_id, "KILLED")  # ASHA killed the trial's actor mid-run
        for p in artifacts:
            log_artifact_safely(plan.tracking_uri, parent, p, "sweep")
        c.log_text(parent, yaml.safe_dump(space.to_dict(), sort_keys=False), "sweep/space.yaml")
        stamp = int(time.time() * 1000)
        metrics = [mlflow.entities.Metric("trials", len(rows), stamp, 0),
                   mlflow.entities.Metric("trials_stopped", sum(r.status == "stopped" for r in rows), stamp, 0)]
        if best is not None:
            metrics.append(mlflow.entities.Metric("best_val_ppl", best.selection_ppl, stamp, 0))
        c.log_batch(parent, metrics=metrics)
        if best is not None:
            c.set_tag(parent, "best_trial", best.trial_id)
            existing = [v for v in c.search_model_versions(f"name='{plan.base.mlflow.registered_model}'")
                        if (v.tags or {}).get("sweep") == space.name
                        and (v.tags or {}).get("tune.trial_id") == best.trial_id]
            if existing:
                version = str(existing[0].version)
            elif plan.base.mlflow.register and register and best.mlflow_run_id:
                params = dict(best.params)
                mc = plan.base.model.replace(gamma=params.get("gamma", plan.base.model.gamma),
                                             tau=params.get("tau", plan.base.model.tau))
                # The version's figures are those of the checkpoint it holds (the trial run's export: its best by
                # validation bound), as for a training run's version (pipelines.training.trainer).
                tags = training_tags(
                    mc, val_ppl=best.selection_ppl, run_name=f"{space.name}-{best.trial_id}",
                    step=best.best_step if best.best_step is not None else best.step, final_step=best.step,
                    checkpoint=best.checkpoint or "best", sweep=space.name, sweep_parent_run_id=parent,
                    **{"tune.trial_id": best.trial_id},
                    data_manifest_hash=c.get_run(best.mlflow_run_id).data.params.get("data_manifest_hash", ""))
                mv = register_checkpoint(best.mlflow_run_id, plan.base.mlflow.registered_model, tags,
                                         tracking_uri=plan.tracking_uri)
                version = str(mv.version)
            if version is not None:
                c.set_tag(parent, "registered_version", version)
        if not interrupted:
            c.set_terminated(parent, "FINISHED")
    return version


def sweep(space: SearchSpace, config: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (), *,
          workdir: str | os.PathLike | None = None, tracking_uri: str | None = None,
          register: bool = True) -> SweepResult:
    """Run (or resume) the sweep ``space.name``; see the module docstring. Progress goes to the log; the trial table
    (``table_markdown(result.trials, result.best)``) is the command's to print. ``register``: False leaves the best
    trial unregistered whatever the recipe says (a baseline arm's search: its winner is not a candidate)."""
    quiet_environment()
    plan = plan_sweep(space, config, overrides, workdir=workdir, tracking_uri=tracking_uri)
    tracking_reachable(plan.tracking_uri)  # refused credentials (401/403) fail here in one line, before Ray

    init_ray()
    warn_if_node_local([plan.storage], "the sweep's Tune storage")
    exp_dir = join(plan.storage, space.name)
    resuming = Tuner.can_restore(exp_dir)  # one look at the sweep's storage (a bucket's listing on a cluster)
    nodes = placement.fixed_nodes(cpu_work=not plan.base.scaling.use_gpu)  # CPU trials: never on a GPU node
    if nodes is not None and not resuming:
        # A Ray that will not grow (this process's own, or a cluster without an autoscaler) is all there will be:
        # as many trials at once as it can place, each with its workers and a read task (more would wait on each
        # other's reads for good), said once; none fits: one line, before the parent run or any trial.
        fitted = placement.fit_concurrency(plan.base, driver_resources(space.trial_cpu), space.max_concurrent, nodes)
        if fitted < space.max_concurrent:
            log.warning(f"[sweep {space.name}] {fitted} trial(s) at a time, not max_concurrent {space.max_concurrent}: "
                        f"this Ray's nodes ({placement.brief(nodes)}) cannot place more with their workers and reads")
            space = dataclasses.replace(space, max_concurrent=fitted)
    parent = _parent_run(plan)
    trial_plan = TrialPlan(space_raw=space.to_raw(), space_source=space.source, base_raw=plan.base_raw,
                           workdir=plan.workdir, tracking_uri=plan.tracking_uri, parent_run_id=parent)
    # Each trial's driver (and the Ray Train controller, which attaches to its driver's node) asks for what only
    # never-preempted nodes offer on a cluster (cluster.yaml's head), so a spot preemption takes only training
    # workers, which Ray Train restarts from the bucket's checkpoint (failure.max_failures of the recipe); never on a
    # GPU node (pipelines.core.runtime.cpu_work_selector).
    trainable = tune.with_resources(tune.with_parameters(run_trial, plan=trial_plan),
                                    cpu_placement(driver_resources(space.trial_cpu)))
    if resuming:
        log.info(f"[sweep {space.name}] resuming from {exp_dir}: finished trials are not rerun")
        tuner = Tuner.restore(exp_dir, trainable=trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = Tuner(
            trainable,
            param_space={p.name: p.to_tune() for p in space.params},
            tune_config=TuneConfig(metric=METRIC, mode="min", search_alg=_search_alg(space),
                                   scheduler=_scheduler(space, plan.max_t), num_samples=space.num_samples),
            # A trial whose driver dies anyway (its node lost) is retried: the retry's training resumes from the
            # run's latest checkpoint, so the trial ends as if undisturbed.
            run_config=RunConfig(name=space.name, storage_path=plan.storage, verbose=tune_verbosity(),
                                 failure_config=FailureConfig(max_failures=TRIAL_RETRIES), callbacks=progress_callbacks(space.name, space.total_trials)),
        )
    log.info(f"[sweep {space.name}] {space.total_trials} trials ({space.algorithm} search, {space.scheduler} "
             f"scheduler, max_t {plan.max_t} steps), {space.max_concurrent} at a time; MLflow parent run {parent} "
             f"at {redact_uri(plan.tracking_uri)}")
    try:
        with tune_output():
            grid = tuner.fit()
    except Exception as e:  # re-raised with the rerun line: anything a trial or Tune raises ends here
        raise TuneError(f"sweep {space.name!r} failed: {type(e).__name__}: {str(e).strip().splitlines()[-1:]}; "
                        f"rerun the same command to resume from {exp_dir}") from e
    placement.check()  # Tune stops on the interrupt of a wait that cannot end (pipelines.core.placement): say which
    # A stopped trial's Ray Train controller, killed while restarting its workers, can leave a worker group's
    # placement group that Ray keeps until this job ends: nothing of the sweep may outlive it.
    placement.release_orphaned_groups()
    rows = _rows(grid, space, plan.max_t)
    ended = _ended(grid)
    interrupted = ended < space.total_trials
    finished = [r for r in rows if r.status == "finished" and r.selection_ppl is not None]
    best = min(finished, key=lambda r: r.selection_ppl) if finished and not interrupted else None
    version, arts = _finalise(plan, parent, rows, best, interrupted, register)
    failed = None if interrupted else every_trial_failed(grid, space.name)
    if failed:  # nothing to choose from: not a success a script may take for one
        raise TuneError(f"{failed}; fix it and rerun the same command (it retries the failed trials), or see {exp_dir}")
    unregistered = None
    if best is not None and version is None and plan.base.mlflow.register and register:
        unregistered = (f"sweep {space.name!r} is done but its best trial {best.trial_id} is not registered (MLflow at "
                        f"{redact_uri(plan.tracking_uri)} was unavailable or refused: see the warning above); rerun "
                        "the same command to register it (it trains nothing)")
        log.warning(unregistered)
    if interrupted:
        log.info(f"[sweep {space.name}] interrupted with {ended} of {space.total_trials} trials done; "
                 "rerun the same command to resume")
    elif best is not None:
        at = f" (step {best.best_step})" if best.best_step is not None else ""
        registered = f"; registered {plan.base.mlflow.registered_model} v{version} @candidate" if version else ""
        log.info(f"[sweep {space.name}] best trial {best.trial_id}: {best.params}, validation PPL <= "
                 f"{best.selection_ppl:.3f}{at}{registered}")
    return SweepResult(name=space.name, parent_run_id=parent, trials=rows, best=best, registered_version=version,
                       interrupted=interrupted, artifacts=arts, unregistered=unregistered)
