"""The training driver: plan, track, fit with Ray Train, export and register (docs/design/method.md, sections 2, 7).

``train`` runs these steps in order, each a function of one ``RunContext`` (the recipe, its data plan, the work
directory, the tracking URI, the run folder, the latest checkpoint and the MLflow run id):

1. ``plan_run``: the recipe is validated; both splits' manifests are read; the data must fit the model
   (``training.data.plan_data``); the run folder's latest checkpoint is found. All of this fails with one line
   before Ray starts.
2. ``check_resume``: that checkpoint must belong to this data and this kind of run; a ``run.init`` version is
   pinned and checked against the model (``training.init``; a fresh run only).
3. ``open_run``: the MLflow run of this run name is found (run id from the latest checkpoint, else by the
   run-name tag) or created; the full config and the data manifest hash are its params, ``init_from`` its
   lineage tag.
4. ``_fit``: a Ray Train ``TorchTrainer`` runs ``training.loop.train_loop_per_worker`` on ``scaling.num_workers``
   workers (DDP: gloo on CPU, nccl on GPU; or FSDP), or in the driver process with ``num_workers: 0``; a
   finished run is not fitted again.
5. ``choose_export``: the best checkpoint by validation bound (else the latest) is copied out.
6. ``register_or_spool``: it is logged as the run artifact ``checkpoint`` and registered (alias ``candidate``)
   as an MLflow Model logged into the run (``pipelines.tracking.registry``), with a loss-curve plot; with tracking
   down, the metrics stay in the run's spool and the rerun registers.
7. ``publish_export``: the checkpoint goes to ``<workdir>/checkpoints/<run name>``.

The same model, objective and optimiser step without Ray or MLflow: ``adlm_model/train/plain_loop.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Any

from adlm_model.config import ConfigError
from adlm_model.kinds import model_kind
from pipelines.compat import ray as compat_ray
from pipelines.core.faults import fault
from pipelines.core.logs import first_line, get_logger, quiet_ray_data, run_progress, verbosity, worker_console
from pipelines.core.placement import check_run
from pipelines.core.runtime import cpu_work_selector, environ, init_ray, quiet_environment
from pipelines.core.storage import (
    check_location,
    is_uri,
    join,
    publish_dir,
    read_text,
    resolve_workdir,
    temp_dir,
    warn_if_node_local,
    write_bytes_atomic,
)
from pipelines.data.ray_source import split_dataset
from pipelines.tracking.registry import register_once, training_tags
from pipelines.tracking.runs import (
    TrackingAuthError,
    best_effort,
    client,
    ensure_experiment,
    find_or_create_run,
    log_artifact_safely,
    log_params_once,
    plot_loss_curve,
    redact_uri,
    require_tracking,
    resolve_tracking_uri,
    tracking_reachable,
)
from pipelines.tracking.spool import send_spool
from pipelines.training.checkpoints import (
    best_checkpoint,
    fetch_export,
    forget_missing_checkpoints,
    latest_checkpoint,
)
from pipelines.training.config import TrainConfig, flatten
from pipelines.training.context import Export, RunContext
from pipelines.training.data import DataPlan, plan_data
from pipelines.training.init import INIT_TAG, pin_init
from pipelines.training.loop import TrialSession, train_loop_per_worker
from pipelines.training.worker import LoopConfig

log = get_logger(__name__)

DISTILL_TAGS = ("teacher", "sampler_steps", "distill_rounds", "distill_divergence")
"""What a distillation's registered version carries from its checkpoint's meta (``training/distill.py``)."""


class TrainError(RuntimeError):
    """Training failed after it started (the message names the run and where its logs are)."""


class RegistrationError(RuntimeError):
    """Training finished and its checkpoint is in storage, but it could not be registered."""


@dataclass
class TrainResult:
    """What one training run produced."""

    run_id: str
    """MLflow run id."""
    run_name: str
    step: int
    """Steps trained (== run.max_steps)."""
    val_ppl: float | None
    """Final validation NELBO perplexity bound (EMA weights)."""
    checkpoint_dir: str
    """Where the final checkpoint's export lives (model + EMA + config + tokenizer): ``<workdir>/checkpoints/
    <run name>``, a local path or a URI."""
    registered_version: str | None = None
    """Version of the registered model that received the checkpoint, if registered."""
    model_name: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    """The last metrics the workers reported."""
    best_step: int | None = None
    """Step of the checkpoint the run exported and registered: its best by validation bound."""
    best_val_ppl: float | None = None
    checkpoint: str = "best"
    """Which checkpoint was exported: ``best`` (by validation bound) or ``latest`` (a run that never validated)."""
    unregistered: str | None = None
    """Why a run that was to be registered is not (tracking down at its end, registration refused): the
    command's exit is then non-zero and this one line says how to finish it (rerun the same command)."""


def plan_run(cfg: TrainConfig, workdir: str | os.PathLike | None, tracking_uri: str | None,
             parent_run_id: str | None = None, extra_tags: dict[str, str] | None = None) -> RunContext:
    """The recipe validated, the work directory and tracking URI resolved (refused credentials fail here), both
    splits checked against the model (``plan_data``) and the run's latest checkpoint found: every input error
    before Ray starts."""
    cfg.validate()
    wd = resolve_workdir(workdir)
    uri = tracking_uri or resolve_tracking_uri(wd)
    tracking_reachable(uri)  # refused credentials (401/403) fail here in one line; an outage trains on
    plan = plan_data(cfg, wd)
    storage = storage_root(cfg, wd)
    if is_uri(storage):
        check_location(storage)
    run_dir = join(storage, cfg.run.name)
    prev = latest_checkpoint(run_dir)
    prev_meta = json.loads(read_text(join(prev[1], "config.json"))).get("meta", {}) if prev else {}
    return RunContext(cfg=cfg, plan=plan, workdir=wd, tracking_uri=uri, storage=storage, run_dir=run_dir, prev=prev,
                      prev_meta=prev_meta, parent_run_id=parent_run_id, extra_tags=extra_tags)


def check_resume(ctx: RunContext) -> RunContext:
    """The run folder's checkpoint checked against the recipe (the same tokenizer, the same kind of run) and
    ``run.init`` pinned (a fresh run only: a resume keeps its own lineage); returns the context with the pinned
    recipe and whether the run is finished. Checkpoints deleted by hand are forgotten here, so that the run
    resumes from what is left."""
    cfg, prev, prev_meta, plan = ctx.cfg, ctx.prev, ctx.prev_meta, ctx.plan
    if prev_meta.get("tokenizer_hash") and plan.tokenizer_hash and prev_meta["tokenizer_hash"] != plan.tokenizer_hash:
        raise ConfigError(f"run {cfg.run.name!r} was trained on data of another tokenizer (hash "
                          f"{prev_meta['tokenizer_hash'][:12]}) than data.train's ({plan.tokenizer_hash[:12]}); resume "
                          "it on its own data or start a new run.name")
    if prev and bool(cfg.distill.teacher) != bool(prev_meta.get("teacher")):  # a distillation resumes only one
        raise ConfigError(f"run {cfg.run.name!r} holds a {'training' if cfg.distill.teacher else 'distillation'} "
                          f"run (step {prev[0]}), not a {'distillation' if cfg.distill.teacher else 'training'}; "
                          "give this one another run.name")
    cfg = pin_init(cfg, prev_meta if prev else None, ctx.tracking_uri, plan.tokenizer_hash)
    if cfg.distill.teacher:  # a distillation's teacher is the version its student started from, pinned
        cfg = dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, teacher=cfg.run.init))
    forget_missing_checkpoints(ctx.run_dir, prev, cfg.run.name)
    # Inside a Tune trial a finished run's loop still runs: its report is the trial's result.
    finished = prev is not None and prev[0] >= cfg.run.max_steps and not _in_tune()
    return dataclasses.replace(ctx, cfg=cfg, finished=finished)


def open_run(ctx: RunContext, prev_id: str | None, without: str | None) -> str | None:
    """The MLflow run of this run name (``prev_id``, the checkpoint's run id, else found by name, else created)
    with the config as params; None when the tracking store is out (``without``: what the warning says goes on;
    refused credentials raise ``TrackingAuthError``: ``best_effort``)."""
    cfg, plan, uri = ctx.cfg, ctx.plan, ctx.tracking_uri
    run_id = None
    with best_effort(uri, without):  # a tracking outage must not stop training
        require_tracking(uri)  # a quick probe, not MLflow's 4 minutes of retries on a dead server
        exp_id = ensure_experiment(cfg.mlflow.experiment, uri, ctx.workdir)
        tags = {"kind": cfg.model.kind, "data_manifest_hash": plan.manifest_hash, **(ctx.extra_tags or {}),
                **({INIT_TAG: cfg.run.init} if cfg.run.init else {})}
        run_id, _ = find_or_create_run(uri, exp_id, cfg.run.name, run_id=prev_id, tags=tags,
                                       parent_run_id=ctx.parent_run_id)
        params = {**flatten(cfg.to_dict()), "data_manifest_hash": plan.manifest_hash,
                  "accumulation": cfg.accumulation, "tokenizer": plan.tokenizer_spec}
        if model_kind(cfg.model.kind).anchored:  # the sweep's knobs, under their paper names
            params.update(gamma=cfg.model.gamma, tau=cfg.model.tau)
        log_params_once(uri, run_id, params)
        return run_id
    return None


def _finish_tracking(ctx: RunContext, export: Export, do_register: bool, tags: dict[str, Any]) -> str | None:
    """After training: the spooled metrics, the loss curve, the checkpoint artifact and the registered version
    (``tags``: its step, validation bound, which checkpoint it is, ...; reused when this step is already
    registered: a rerun registers nothing new). Returns the version; raises ``RegistrationError`` when
    registration was asked for and failed (the checkpoint is safe in storage: the rerun registers it)."""
    # lazy: keeps mlflow out of this module's import
    from mlflow.exceptions import MlflowException

    cfg, plan, uri, run_id, local_export = ctx.cfg, ctx.plan, ctx.tracking_uri, ctx.run_id, export.local_dir
    version = None
    with best_effort(uri, f"the spooled metrics stay in {ctx.spool} for the next command", stop_on_refusal=False):
        sent = send_spool(uri, run_id, ctx.spool)
        if sent:
            log.info(f"[{cfg.run.name}] sent {sent} metrics that waited in the spool")
    try:
        png = plot_loss_curve(uri, run_id, local_export.parent / "loss_curve.png")
        if png is not None:
            log_artifact_safely(uri, run_id, png, "plots")
            write_bytes_atomic(join(ctx.workdir, "plots", cfg.run.name, "loss_curve.png"), png.read_bytes())
    except Exception as e:  # noqa: BLE001 - a plot must not fail a finished run
        log.warning(f"loss-curve plot failed: {e}")
    logged = log_artifact_safely(uri, run_id, local_export, "checkpoint")
    failure = None
    if do_register and not logged:
        failure = "the checkpoint artifact could not be logged"
    if do_register and logged:
        try:
            step = tags["step"]
            tags = training_tags(cfg.model, data_manifest_hash=plan.manifest_hash,
                                 tokenizer_hash=plan.tokenizer_hash, run_name=cfg.run.name, **tags)
            mv, new = register_once(run_id, cfg.mlflow.registered_model, step, tags, tracking_uri=uri,
                                    checkpoint_dir=local_export)
            if not new:  # a rerun of a finished run: nothing new, no alias moves
                log.info(f"[{cfg.run.name}] step {step} is already registered as {cfg.mlflow.registered_model} "
                         f"v{mv.version}")
            version = str(mv.version)
        except Exception as e:  # noqa: BLE001 - the checkpoint is safe in storage; say how to register it
            failure = f"registration failed ({type(e).__name__}: {first_line(e)})"
    try:
        client(uri).set_terminated(run_id, "FINISHED")
    except (MlflowException, OSError) as e:  # the run's status is cosmetic; training is done: say so, go on
        log.warning(f"could not mark MLflow run {run_id} finished ({first_line(e)})")
    if failure:
        raise RegistrationError(failure)
    return version


def storage_root(cfg: TrainConfig, workdir: str) -> str:
    """Ray Train's storage: ``run.storage_path`` or ``<workdir>/ray_results`` (local or an object store)."""
    return cfg.run.storage_path or join(workdir, "ray_results")


def _in_tune() -> bool:
    """Whether this process runs a Ray Tune trial (Ray not imported: no)."""
    if "ray.tune" not in sys.modules:
        return False
    return compat_ray.in_tune_trial()


def _tune_trial_cpus() -> float | None:
    """The CPUs of the Tune trial this process runs (its resource request), or None outside a trial."""
    if not _in_tune():
        return None
    # lazy: keeps ray out of this module's import
    from ray import tune

    return float(tune.get_context().get_trial_resources().required_resources.get("CPU", 1.0))


def training_dataset(cfg: TrainConfig, plan: DataPlan) -> Any:
    """The training split as the Ray Dataset the workers stream: read from its manifest in at least two blocks a
    worker, in a block order seeded by ``run.seed``, its order preserved (the driver's Ray Data context is set
    for it: the order local mode reads). Ray must be running."""
    # lazy: keeps ray out of this module's import
    import ray.data

    # A CPU run is CPU work from end to end: its Ray Train workers and its Ray Data reads never go to a GPU node
    # (pipelines.core.runtime.cpu_work_selector). A GPU run's workers go where the GPUs are, and its reads may use any
    # node's CPUs, the GPU nodes' own included.
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # deterministic order (the driver's context: local mode)
    ctx.execution_options.label_selector = _selector(cfg)
    ctx.enable_progress_bars = verbosity() > 0  # Ray Data's bars only with -v: the loop prints its own progress
    quiet_ray_data()
    # Ray Data's read_parquet samples the files in tasks of a whole CPU that no argument lowers (either datasource
    # of Ray 2.60): on nodes whose CPUs placement groups hold in part (a trial's driver, fractional workers) they
    # never start and the run waits for good. The split is read from its manifest instead: read tasks of
    # data.read_cpus and nothing else (pipelines.data.ray_source).
    ds = split_dataset(plan.train_manifest, plan.columns, blocks=max(len(plan.train_uris), 2 * cfg.world),
                       num_cpus=cfg.data.read_cpus)
    return ds.randomize_block_order(seed=cfg.run.seed)


def _selector(cfg: TrainConfig) -> Any:
    """The label selector of a run's Ray work: CPU nodes for a CPU run, none for a GPU run."""
    return None if cfg.scaling.use_gpu else cpu_work_selector()


def loop_config(ctx: RunContext, trial_cpus: float | None) -> LoopConfig:
    """What the driver hands every worker: the recipe, the data's facts, the MLflow run, the run folder and the
    checkpoint to resume from, the torch thread count and the fault switches."""
    cfg, plan, run_dir = ctx.cfg, ctx.plan, ctx.run_dir
    local_mode = cfg.scaling.num_workers == 0
    crash_at = fault("train.crash_at_step")
    return LoopConfig(
        cfg=cfg, run_id=ctx.run_id, tracking_uri=ctx.tracking_uri, val_split=plan.val_split, val_rows=plan.val_rows,
        manifest_hash=plan.manifest_hash, tokenizer_spec=plan.tokenizer_spec, tokenizer_path=plan.tokenizer_path,
        tokenizer_hash=plan.tokenizer_hash,
        # torch threads (scaling.threads, else) = the worker's CPUs rounded half up (0.5 -> 1, 1.5 -> 2); in local
        # mode the Tune trial's CPUs (a sweep's 0.01 -> 1), or every core outside a trial.
        threads=cfg.scaling.threads or max(1, int((cfg.scaling.cpus_per_worker if not local_mode else trial_cpus
                                                   or os.cpu_count() or 1) + 0.5)),
        local_mode=local_mode, run_dir=run_dir, resume_dir=ctx.prev[1] if ctx.prev else None,
        crash_at_step=crash_at, crash_marker=join(run_dir, ".crashed_once") if crash_at is not None else None,
        crash_writing_best=fault("train.crash_writing_best"), step_pause_ms=fault("train.step_pause_ms"))


def _fit(ctx: RunContext, callbacks: list | None) -> dict[str, Any]:
    """Train: a Ray Train ``TorchTrainer`` over the training split, or the loop in this process inside a Tune
    trial (local mode). Returns the last metrics reported."""
    # lazy: keeps ray out of this module's import
    import ray.data
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    cfg, plan, run_dir, prev = ctx.cfg, ctx.plan, ctx.run_dir, ctx.prev
    # A local-mode run inside a Tune trial (a sweep's or a study's) trains in the trial's own process: no Ray Train
    # worker group to start (about 20 CPU-seconds and 15 processes a run on 2 cores), the same numbers.
    trial_cpus = _tune_trial_cpus() if cfg.scaling.num_workers == 0 else None

    init_ray()
    warn_if_node_local([*plan.train_uris[:1], ctx.storage, ctx.workdir], "training reads or writes")
    selector = _selector(cfg)
    train_ds = training_dataset(cfg, plan)
    exec_opts = ray.data.ExecutionOptions(preserve_order=True, label_selector=selector)
    loop = loop_config(ctx, trial_cpus)
    trainer = None  # inside a Tune trial in local mode, the loop runs right here (TrialSession)
    if trial_cpus is None:
        trainer = TorchTrainer(
            _worker_loop,
            train_loop_config={"loop": loop},
            torch_config=TorchConfig(backend="nccl" if cfg.scaling.use_gpu else "gloo"),
            scaling_config=ScalingConfig(num_workers=cfg.scaling.num_workers, use_gpu=cfg.scaling.use_gpu,
                                         resources_per_worker={"CPU": cfg.scaling.cpus_per_worker},
                                         label_selector=selector),
            run_config=RunConfig(name=cfg.run.name, storage_path=ctx.storage,
                                 failure_config=FailureConfig(max_failures=cfg.failure.max_failures),
                                 checkpoint_config=CheckpointConfig(num_to_keep=cfg.run.num_to_keep),
                                 callbacks=callbacks or None),
            datasets={"train": train_ds},
            dataset_config=DataConfig(datasets_to_split=["train"], execution_options=exec_opts),
        )
    try:
        if trainer is None:
            session = TrialSession({"train": train_ds})
            train_loop_per_worker({"loop": loop, "session": session})
            metrics = dict(session.last)
        else:
            # Ray Train tags its Prometheus metrics with the run's name, and Ray's metrics take ASCII tags alone: a
            # name such as "café" failed the run in its controller. Such a run trains without those metrics.
            no_metrics = {} if cfg.run.name.isascii() else {"RAY_TRAIN_METRICS_ENABLED": "0"}
            with run_progress(cfg.run.name, cfg.run.max_steps, prev[0] if prev else 0), environ(no_metrics):
                metrics = dict(trainer.fit().metrics or {})
    except Exception as e:  # re-raised as TrainError naming the run and its logs: any worker failure
        msg = str(e).strip().splitlines()
        raise TrainError(f"training run {cfg.run.name!r} failed: {type(e).__name__}: "
                         f"{msg[-1] if msg else ''} (worker logs: {run_dir} and the Ray session logs)") from e
    return metrics


def _ppl(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def _worker_loop(config: dict[str, Any]) -> None:
    """What each Ray Train worker runs: the training loop, its log lines in the project's format on the console (the
    driver tells a warning from a progress line by it: ``pipelines.core.logs.WorkerOutput``)."""
    worker_console()
    train_loop_per_worker(config)


def choose_export(ctx: RunContext) -> Export:
    """The checkpoint the run exports and registers, copied here: its best by validation bound (docs/design/method.md,
    section 7), else its latest; the latest stays in the run folder for resuming. A best cut short mid-upload is
    never named (complete or None). A distillation exports its last round's student: the NELBO bound is not what
    it was trained for."""
    final = latest_checkpoint(ctx.run_dir)
    if final is None:
        raise TrainError(f"training run {ctx.name!r} finished without a checkpoint in {ctx.run_dir}")
    best = best_checkpoint(ctx.run_dir) if not ctx.cfg.distill.teacher else None
    source = best or final[1]
    local = fetch_export(source, temp_dir("adlm-export-") / ctx.name)
    meta = json.loads((local / "config.json").read_text()).get("meta", {})
    return Export(final=final, source=source, local_dir=local, meta=meta, step=int(meta.get("step", final[0])),
                  val_ppl=meta.get("val_ppl"), which="best" if best else "latest",
                  lineage=meta.get(INIT_TAG) or ctx.cfg.run.init)


def register_or_spool(ctx: RunContext, export: Export, do_register: bool) -> tuple[str | None, str | None]:
    """After training: with tracking up, the spooled metrics sent, the artifacts logged and ``export`` registered
    (``_finish_tracking``); with tracking down, everything left for the rerun. Returns (version, why the run is not
    registered: one line saying how to finish it, or None)."""
    version, unregistered = None, None
    try:
        if ctx.run_id is None:  # tracking was down at start: try again now that training is done
            ctx.run_id = open_run(ctx, None, without=None)  # said below
        reachable = ctx.run_id is not None and tracking_reachable(ctx.tracking_uri)
    except TrackingAuthError as e:  # credentials revoked while training: the checkpoint is safe, say what to set
        reachable, unregistered = False, str(e)
    uri = redact_uri(ctx.tracking_uri)
    if reachable:
        try:
            version = _finish_tracking(ctx, export, do_register, {
                **(ctx.extra_tags or {}), "step": export.step, "val_ppl": export.val_ppl,
                "final_step": export.final[0], "checkpoint": export.which,
                **({INIT_TAG: export.lineage} if export.lineage else {}),
                **{k: export.meta[k] for k in DISTILL_TAGS if k in export.meta}})
        except RegistrationError as e:
            unregistered = str(e)
    elif unregistered is None:
        unregistered = f"MLflow at {uri} is unreachable"
        log.warning(f"MLflow at {uri} is unreachable: the run is trained (checkpoint {export.final[1]}) but its "
                    f"metrics wait in {ctx.spool} and it is not registered; run the same command again once "
                    "the tracking server is back: it trains nothing, sends the metrics and registers")
    if unregistered and do_register:
        unregistered = (f"run {ctx.name!r} is trained (best step {export.step}, in {ctx.run_dir}) but not registered: "
                        f"{unregistered}; rerun the same command to register it (it trains nothing)")
        log.warning(unregistered)
    elif not do_register:
        unregistered = None
    return version, unregistered


def publish_export(ctx: RunContext, export: Export) -> str:
    """The exported checkpoint published to ``<workdir>/checkpoints/<run name>`` (local or a URI), its local copy
    removed; returns where it is."""
    out = publish_dir(export.local_dir, join(ctx.workdir, "checkpoints", ctx.name))
    shutil.rmtree(export.local_dir.parent, ignore_errors=True)
    return out


def train(cfg: TrainConfig, *, workdir: str | os.PathLike | None = None, tracking_uri: str | None = None,
          callbacks: list | None = None, parent_run_id: str | None = None, extra_tags: dict[str, str] | None = None,
          register: bool | None = None) -> TrainResult:
    """Train ``cfg`` with Ray Train, track it in MLflow and register the final checkpoint.

    Rerunning with the same ``run.name`` (and storage) resumes the run from its latest checkpoint.
    ``callbacks`` go to the trainer's ``RunConfig`` (e.g. Tune's ``TuneReportCallback``; a local-mode run inside a
    Tune trial has no trainer: it trains in the trial's process and reports to Tune itself);
    ``parent_run_id`` nests the MLflow run (Tune trials). The steps, in order: ``plan_run``, ``check_resume``,
    ``open_run``, ``_fit`` (nothing to fit for a finished run), ``choose_export``, ``register_or_spool``,
    ``publish_export``.
    """
    quiet_environment()
    ctx = check_resume(plan_run(cfg, workdir, tracking_uri, parent_run_id, extra_tags))
    cfg, prev = ctx.cfg, ctx.prev
    if not ctx.finished:  # a run that will train: what a Ray that will not grow cannot place fails here, in one line
        init_ray()
        check_run(cfg)
    ctx.run_id = open_run(ctx, ctx.prev_meta.get("mlflow_run_id"),
                          without=f"training without a run: the metrics wait in {ctx.spool} and the next run "
                                  "of this command sends them and registers")
    # A Tune trial's run lines are detail (Tune's status table shows the trials): -v shows them.
    say = log.debug if _in_tune() else log.info
    say(f"[{cfg.run.name}] {cfg.model.kind} model, {cfg.world} worker(s) x micro-batch {cfg.batch.micro_batch} "
        f"x accumulation {cfg.accumulation} = global batch {cfg.batch.global_batch}; data {ctx.plan.train_rows} "
        f"train rows; storage {ctx.run_dir}; MLflow run {ctx.run_id} at {redact_uri(ctx.tracking_uri)}"
        + (f"; resuming from step {prev[0]}" if prev else ""))

    if ctx.finished:
        # A rerun of a finished run: nothing to train, so no Ray and no Ray Train worker group (20-30 s of start-up
        # on 2 cores; a job's second run on a cluster); its result is the final checkpoint's, validated at
        # max_steps. The spooled metrics and the registration below are done as after any run.
        log.info(f"[{cfg.run.name}] finished at step {prev[0]} (run.max_steps {cfg.run.max_steps}): nothing to train")
        metrics: dict[str, Any] = {"step": prev[0], "val_ppl": ctx.prev_meta.get("val_ppl")}
    else:
        metrics = _fit(ctx, callbacks)

    export = choose_export(ctx)
    val_ppl = metrics.get("val_ppl", export.val_ppl if export.source == export.final[1] else None)
    do_register = cfg.mlflow.register if register is None else register
    version, unregistered = register_or_spool(ctx, export, do_register)
    path = publish_export(ctx, export)
    final_step = export.final[0]
    say(f"[{cfg.run.name}] done: step {final_step}, validation PPL <= {_ppl(val_ppl)}; best step {export.step} (PPL <= "
        f"{_ppl(export.val_ppl)}) exported to {path}"
        + (f", registered {cfg.mlflow.registered_model} v{version} @candidate" if version else ""))
    return TrainResult(run_id=ctx.run_id or "", run_name=cfg.run.name, step=final_step, val_ppl=val_ppl,
                       checkpoint_dir=path, registered_version=version,
                       model_name=cfg.mlflow.registered_model if version else None, metrics=metrics,
                       best_step=export.step, best_val_ppl=export.val_ppl, checkpoint=export.which,
                       unregistered=unregistered)
