"""The training driver: plan, track, fit with Ray Train, export and register (METHOD.md sections 2, 7).

What ``train`` does, in order:

1. The recipe is validated; both splits' manifests are read; the data must fit the model
   (``training.data.plan_data``). All of this fails with one line before Ray starts.
2. The MLflow run of this run name is found (run id from the latest checkpoint, else by the run-name
   tag) or created; the full config and the data manifest hash are its params.
3. A Ray Train ``TorchTrainer`` runs ``training.loop.train_loop_per_worker`` on ``scaling.num_workers``
   workers (DDP: gloo on CPU, nccl on GPU; or FSDP), or in the driver process with ``num_workers: 0``.
4. At the end the final EMA checkpoint is logged as the run artifact ``checkpoint`` and registered
   (alias ``candidate``) as an MLflow Model logged into the run (``pipelines.registry``), with a
   loss-curve plot.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.faults import fault
from pipelines.runtime import init_ray, quiet_environment
from pipelines.storage import resolve_workdir
from pipelines.tracking import client, ensure_experiment, resolve_tracking_uri
from pipelines.training.checkpoints import export_checkpoint, latest_checkpoint
from pipelines.training.config import TrainConfig, flatten
from pipelines.training.data import plan_data
from pipelines.training.loop import LoopConfig, train_loop_per_worker


class TrainError(RuntimeError):
    """Training failed after it started (the message names the run and where its logs are)."""


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
    checkpoint_dir: Path
    """Local folder of the final checkpoint (model + EMA + config + tokenizer)."""
    registered_version: str | None = None
    """Version of the registered model that received the checkpoint, if registered."""
    model_name: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    """The last metrics the workers reported."""


def storage_root(cfg: TrainConfig, workdir: Path) -> str:
    return cfg.run.storage_path or str(workdir / "ray_results")


def train(cfg: TrainConfig, *, workdir: str | os.PathLike | None = None, tracking_uri: str | None = None,
          callbacks: list | None = None, parent_run_id: str | None = None, extra_tags: dict[str, str] | None = None,
          register: bool | None = None, quiet: bool = False) -> TrainResult:
    """Train ``cfg`` with Ray Train, track it in MLflow and register the final checkpoint.

    Rerunning with the same ``run.name`` (and storage) resumes the run from its latest checkpoint.
    ``callbacks`` go to the trainer's ``RunConfig`` (e.g. Tune's ``TuneReportCallback``);
    ``parent_run_id`` nests the MLflow run (Tune trials).
    """
    quiet_environment()
    cfg.validate()
    wd = resolve_workdir(workdir)
    uri = tracking_uri or resolve_tracking_uri(wd)
    plan = plan_data(cfg, wd)  # every data error before Ray starts
    storage = storage_root(cfg, wd)
    run_dir = Path(storage) / cfg.run.name
    local_mode = cfg.scaling.num_workers == 0
    local_root = run_dir  # local mode writes its checkpoints straight into the run folder
    prev = latest_checkpoint(run_dir) if "://" not in storage else None

    # ---- MLflow: one run per run name, reopened on resume ----
    from pipelines.tracking import find_or_create_run, log_params_once

    run_id = None
    try:
        exp_id = ensure_experiment(cfg.mlflow.experiment, uri, wd)
        prev_id = None
        if prev is not None:
            prev_id = json.loads((prev[1] / "config.json").read_text()).get("meta", {}).get("mlflow_run_id")
        tags = {"kind": cfg.model.kind, "data_manifest_hash": plan.manifest_hash, **(extra_tags or {})}
        run_id, created = find_or_create_run(uri, exp_id, cfg.run.name, run_id=prev_id, tags=tags,
                                             parent_run_id=parent_run_id)
        params = {**flatten(cfg.to_dict()), "data_manifest_hash": plan.manifest_hash,
                  "accumulation": cfg.accumulation, "tokenizer": plan.tokenizer_spec,
                  "gamma": cfg.model.gamma, "tau": cfg.model.tau}
        log_params_once(uri, run_id, params)
    except Exception as e:  # noqa: BLE001 - a tracking outage must not stop training
        print(f"WARNING: MLflow unavailable at start ({type(e).__name__}: {str(e)[:200]}); training without "
              "a run id", flush=True)
    if not quiet:
        print(f"[{cfg.run.name}] {cfg.model.kind} model, {cfg.world} worker(s) x micro-batch {cfg.batch.micro_batch} "
              f"x accumulation {cfg.accumulation} = global batch {cfg.batch.global_batch}; data {plan.train_rows} "
              f"train rows; storage {run_dir}; MLflow run {run_id} at {uri}"
              + (f"; resuming from step {prev[0]}" if prev else ""), flush=True)

    import ray
    import ray.data
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    init_ray()
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # deterministic order (the driver's context: local mode)
    ctx.enable_progress_bars = False
    exec_opts = ray.data.ExecutionOptions(preserve_order=True)
    train_ds = ray.data.read_parquet(plan.train_uris, num_cpus=cfg.data.read_cpus,
                                     override_num_blocks=max(len(plan.train_uris), 2 * cfg.world))
    train_ds = train_ds.select_columns(plan.columns)
    train_ds = train_ds.randomize_block_order(seed=cfg.run.seed)

    crash_at = fault("train.crash_at_step")
    loop = LoopConfig(
        cfg=cfg, run_id=run_id, tracking_uri=uri, val_split=plan.val_split, val_rows=plan.val_rows,
        manifest_hash=plan.manifest_hash, tokenizer_spec=plan.tokenizer_spec, tokenizer_path=plan.tokenizer_path,
        # torch threads = the worker's CPUs rounded half up (0.5 -> 1, 1.5 -> 2).
        threads=max(1, int(cfg.scaling.cpus_per_worker + 0.5)) if not local_mode else max(1, os.cpu_count() or 1),
        local_mode=local_mode, local_ckpt_root=str(local_root), resume_dir=str(prev[1]) if prev else None,
        crash_at_step=crash_at, crash_marker=str(run_dir / ".crashed_once") if crash_at is not None else None)
    resources = {"CPU": cfg.scaling.cpus_per_worker}
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"loop": loop},
        torch_config=TorchConfig(backend="nccl" if cfg.scaling.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=cfg.scaling.num_workers, use_gpu=cfg.scaling.use_gpu,
                                     resources_per_worker=resources),
        run_config=RunConfig(name=cfg.run.name, storage_path=storage,
                             failure_config=FailureConfig(max_failures=cfg.failure.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=cfg.run.num_to_keep),
                             callbacks=callbacks or None),
        datasets={"train": train_ds},
        dataset_config=DataConfig(datasets_to_split=["train"], execution_options=exec_opts),
    )
    try:
        result = trainer.fit()
    except Exception as e:
        msg = str(e).strip().splitlines()
        raise TrainError(f"training run {cfg.run.name!r} failed: {type(e).__name__}: "
                         f"{msg[-1] if msg else ''} (worker logs: {run_dir} and the Ray session logs)") from e
    metrics = dict(result.metrics or {})

    final = latest_checkpoint(run_dir)
    if final is None and result.checkpoint is not None:
        final = (int(metrics.get("step", cfg.run.max_steps)), Path(result.checkpoint.path))
    if final is None:
        raise TrainError(f"training run {cfg.run.name!r} finished without a checkpoint in {run_dir}")
    export = export_checkpoint(final[1], wd / "checkpoints" / cfg.run.name)
    val_ppl = metrics.get("val_ppl")
    if val_ppl is None:
        val_ppl = json.loads((final[1] / "config.json").read_text()).get("meta", {}).get("val_ppl")

    version = None
    do_register = cfg.mlflow.register if register is None else register
    if run_id is not None:
        from pipelines.tracking import log_artifact_safely, plot_loss_curve

        try:
            png = plot_loss_curve(uri, run_id, wd / "plots" / cfg.run.name / "loss_curve.png")
            if png is not None:
                log_artifact_safely(uri, run_id, png, "plots")
        except Exception as e:  # noqa: BLE001
            print(f"WARNING: loss-curve plot failed: {e}", flush=True)
        logged = log_artifact_safely(uri, run_id, export, "checkpoint")
        if do_register and logged:
            from pipelines.registry import register_checkpoint, training_tags

            try:
                tags = training_tags(cfg.model, data_manifest_hash=plan.manifest_hash, val_ppl=val_ppl,
                                     run_name=cfg.run.name, step=final[0], **(extra_tags or {}))
                mv = register_checkpoint(run_id, cfg.mlflow.registered_model, tags, tracking_uri=uri,
                                         checkpoint_dir=export)
                version = str(mv.version)
            except Exception as e:  # noqa: BLE001
                print(f"WARNING: registration failed ({type(e).__name__}: {e}); the checkpoint is at {export}",
                      flush=True)
        try:
            client(uri).set_terminated(run_id, "FINISHED")
        except Exception:  # noqa: BLE001
            pass
    if not quiet:
        print(f"[{cfg.run.name}] done: step {final[0]}, validation PPL <= {val_ppl}, checkpoint {export}"
              + (f", registered {cfg.mlflow.registered_model} v{version} @candidate" if version else ""), flush=True)
    return TrainResult(run_id=run_id or "", run_name=cfg.run.name, step=final[0], val_ppl=val_ppl,
                       checkpoint_dir=export, registered_version=version,
                       model_name=cfg.mlflow.registered_model if version else None, metrics=metrics)
