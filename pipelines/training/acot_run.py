"""The anchored chain-of-thought fine-tuning run that ``pipelines.train`` starts for a recipe with ``acot.arm``:
one arm of the comparison trained on a reasoning split with Coconut's staged schedule, tracked and registered.

    python -m pipelines.train --config configs/acot_prosqa_cpu.yaml --set acot.arm=cot

What ``finetune`` does, in order:

1. The recipe and both reasoning splits are checked before any work (one ``error:`` line each): the arm, the
   data's mode and tokenizer, the model's vocabulary and a ``seq_len`` that holds the longest row at every stage.
2. The MLflow run of the run name is found or created (the config as params; tags ``kind``, ``arm``, ``task``).
3. ``adlm_model.train.stages.StagedFineTuning`` trains the seeded model from scratch, stage by stage (a fresh
   AdamW at each switch), and after every epoch decodes the validation rows greedily and scores them by exact
   match; rank 0 is this process, so every epoch's loss parts and accuracy go to MLflow from here (steps:
   optimiser steps).
4. The kept weights (the best validation accuracy, ``acot.select``) are scored again on the whole validation
   split, their per-row answers logged as the artifact ``answers/validation.jsonl`` and their accuracy and
   counts as metrics; they are exported to ``<workdir>/checkpoints/<run name>`` and registered
   (``@candidate``) with the accuracy as a tag.

The loop runs in this process (local mode, ``scaling.num_workers: 0``); a recipe that asks for Ray Train workers
is refused in one line, as is a diffusion kind (greedy decoding reads a causal network). A rerun of the same run
name trains again from the seed (the same weights on one machine) and registers nothing new when the run has
that step registered already.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adlm_model.config import ConfigError
from adlm_model.interop.checkpoint import save_checkpoint
from adlm_model.kinds import build_model
from adlm_model.train.stages import ARMS, StagedFineTuning, arm_stages
from pipelines.core.logs import first_line, get_logger
from pipelines.core.storage import join, publish_dir, read_bytes, resolve_workdir, temp_dir
from pipelines.tracking.registry import register_once, training_tags
from pipelines.tracking.runs import (
    best_effort,
    client,
    ensure_experiment,
    find_or_create_run,
    log_artifact_safely,
    log_params_once,
    redact_uri,
    resolve_tracking_uri,
    tracking_reachable,
)
from pipelines.training.acot import answer_accuracy, read_split, stage_batches

log = get_logger(__name__)

ANSWERS_ARTIFACT = "answers"


@dataclass
class AcotResult:
    """What one fine-tuning run produced."""

    run_id: str
    run_name: str
    arm: str
    steps: int
    accuracy: float
    """Exact-match accuracy of the kept weights on the whole validation split (``correct / total``; the
    ``accuracy`` evaluation suite gives its Wilson interval)."""
    correct: int
    total: int
    best_stage: int
    best_epoch: int
    checkpoint_dir: str
    registered_version: str | None = None
    unregistered: str | None = None
    """Why a run that was to be registered is not (the command then exits 3)."""
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        """What the command prints: the run, the arm, its steps, the accuracy and its counts, where it went."""
        return {"run_id": self.run_id, "arm": self.arm, "step": self.steps, "accuracy": self.accuracy,
                "correct": self.correct, "total": self.total, "checkpoint_dir": self.checkpoint_dir,
                "registered_version": self.registered_version}


def _splits(cfg: Any, wd: str) -> tuple[Any, Any]:
    train = read_split(cfg.resolve_path(cfg.data.train, wd), "data.train")
    val = read_split(cfg.resolve_path(cfg.data.validation, wd), "data.validation")
    if train.manifest.tokenizer.get("hash") != val.manifest.tokenizer.get("hash"):
        raise ConfigError("data.train and data.validation were tokenized differently; prepare both with one tokenizer")
    m = train.manifest
    if cfg.model.vocab_size != m.vocab_size or cfg.model.mask_id != m.mask_id:
        raise ConfigError(f"data.train (tokenizer {m.tokenizer.get('name')}) has vocabulary {m.vocab_size} and mask "
                          f"id {m.mask_id}, the model {cfg.model.vocab_size} and {cfg.model.mask_id}; set "
                          f"model.vocab_size={m.vocab_size} model.mask_id={m.mask_id}")
    return train, val


def _log_metrics(uri: str, run_id: str | None, metrics: dict[str, float], step: int) -> None:
    """Finite metrics at ``step`` (a tracking outage warns and training goes on)."""
    if run_id is None:
        return
    # lazy: keeps mlflow out of this module's import
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if math.isfinite(float(v))]
    with best_effort(uri, "the fine-tuning goes on without these metrics", stop_on_refusal=False):
        client(uri).log_batch(run_id, metrics=batch)


def finetune(cfg: Any, *, workdir: str | os.PathLike | None = None, tracking_uri: str | None = None,
             register: bool | None = None) -> AcotResult:
    """Run the fine-tuning of ``cfg.acot.arm`` (module docstring); returns what it produced."""
    # lazy: keeps pydantic, yaml out of this module's import
    from pipelines.training.config import flatten

    t0 = time.time()
    cfg.validate()
    a = cfg.acot
    wd = resolve_workdir(workdir)
    uri = tracking_uri or resolve_tracking_uri(wd)
    tracking_reachable(uri)
    train, val = _splits(cfg, wd)
    stages = arm_stages(a.arm, a.max_ant, a.epochs_per_stage, remove_steps=a.remove_steps)
    longest = max(s.longest(st, a.arm) for s in (train, val) for st in stages)
    if cfg.model.seq_len < longest:
        raise ConfigError(f"the longest row laid out at a stage of arm {a.arm} has {longest} tokens, more than "
                          f"model.seq_len {cfg.model.seq_len}; set model.seq_len={longest}")
    if len(train.rows) < cfg.batch.micro_batch:
        raise ConfigError(f"data.train has {len(train.rows)} rows, fewer than batch.micro_batch "
                          f"{cfg.batch.micro_batch}; use more rows or a smaller batch.micro_batch")
    val_limit = a.val_rows
    device = torch.device("cuda" if cfg.scaling.use_gpu and torch.cuda.is_available() else "cpu")
    torch.set_num_threads(cfg.scaling.threads or os.cpu_count() or 1)
    manifest_hash = train.manifest.content_hash()
    weight = a.anchor_weight if ARMS[a.arm].anchors else 0.0

    run_id = None
    with best_effort(uri, "fine-tuning without an MLflow run: nothing is logged or registered"):
        exp = ensure_experiment(cfg.mlflow.experiment, uri, wd)
        run_id, _ = find_or_create_run(uri, exp, cfg.run.name, tags={
            "kind": cfg.model.kind, "arm": a.arm, "task": train.task, "data_manifest_hash": manifest_hash})
        log_params_once(uri, run_id, {**flatten(cfg.to_dict()), "data_manifest_hash": manifest_hash,
                                      "accumulation": cfg.accumulation, "task": train.task})
    log.info(f"[{cfg.run.name}] arm {a.arm}: {len(stages)} stage(s), {sum(s.epochs for s in stages)} epochs on "
             f"{len(train.rows)} {train.task} rows, global batch {cfg.batch.global_batch}; MLflow run {run_id} at "
             f"{redact_uri(uri)}")

    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model).to(device)
    o = cfg.optim

    def make_optimizer(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)

    ft = StagedFineTuning(model, stages, make_optimizer, anchor_weight=weight, exclude=cfg.model.mask_id,
                          clip=o.clip, select=a.select)

    def batches(stage: Any, epoch: int) -> Any:
        return stage_batches(train, stage, a.arm, epoch, micro_batch=cfg.batch.micro_batch,
                             accumulation=cfg.accumulation, seed=cfg.run.seed, anchor_position=a.anchor_position,
                             device=device)

    def validate(m: Any, stage: Any) -> float:
        return answer_accuracy(m, val, stage, a.arm, seq_len=cfg.model.seq_len, max_new=a.max_new,
                               limit=val_limit).accuracy

    def on_epoch(rec: Any) -> None:
        log.info(f"[{cfg.run.name}] stage {rec.stage} ({rec.n_ant} [ANT]) epoch {rec.epoch}: sft NLL "
                 f"{rec.sft_nll:.4f}, anchor CE {rec.anchor_ce:.4f}, validation accuracy {rec.accuracy:.3f}"
                 + (" (kept)" if rec.kept else ""))
        _log_metrics(uri, run_id, {"train_sft_nll": rec.sft_nll, "train_anchor_ce": rec.anchor_ce,
                                   "val_accuracy": rec.accuracy, "stage": rec.stage, "n_ant": rec.n_ant,
                                   "epoch": rec.global_epoch}, ft.steps)

    result = ft.run(batches, validate, on_epoch)
    if result.best_state is None:
        raise RuntimeError(f"fine-tuning run {cfg.run.name!r} kept no checkpoint (no epoch was validated)")
    model.load_state_dict(result.best_state)
    best_stage = stages[[s.index for s in stages].index(result.best_stage)]
    final = answer_accuracy(model, val, best_stage, a.arm, seq_len=cfg.model.seq_len, max_new=a.max_new)
    _log_metrics(uri, run_id, {"accuracy": final.accuracy, "correct": final.correct, "total": final.total}, ft.steps)

    local = temp_dir("adlm-acot-") / cfg.run.name
    meta = {"step": ft.steps, "mlflow_run_id": run_id, "run_name": cfg.run.name,
            "tokenizer": train.manifest.tokenizer.get("path") or train.manifest.tokenizer.get("name"),
            "tokenizer_hash": train.manifest.tokenizer.get("hash"), "data_manifest_hash": manifest_hash,
            "train_config": cfg.to_dict(), "arm": a.arm, "task": train.task, "n_ant": best_stage.n_ant,
            "removed_steps": best_stage.removed_steps, "accuracy": final.accuracy,
            "best_stage": result.best_stage, "best_epoch": result.best_epoch, "markers": train.manifest.options.get(
                "markers")}
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    save_checkpoint(local, model.cpu(), cfg.model, ema_state=state, meta=meta)
    tok_path = train.manifest.tokenizer.get("path")
    if tok_path:
        (local / "tokenizer.json").write_bytes(read_bytes(tok_path))
    answers = local.parent / "answers" / "validation.jsonl"
    answers.parent.mkdir(parents=True, exist_ok=True)
    answers.write_text("".join(json.dumps(vars(r)) + "\n" for r in final.records), encoding="utf-8")

    version, unregistered = None, None
    do_register = cfg.mlflow.register if register is None else register
    if run_id is not None:
        version, unregistered = _finish(cfg, uri, run_id, local, answers, do_register, {
            "step": ft.steps, "arm": a.arm, "task": train.task, "accuracy": f"{final.accuracy:.6f}",
            "correct": final.correct, "total": final.total, "n_ant": best_stage.n_ant,
            "removed_steps": best_stage.removed_steps, "anchor_weight": weight, "checkpoint": "best",
            "data_manifest_hash": manifest_hash, "tokenizer_hash": train.manifest.tokenizer.get("hash"),
            "run_name": cfg.run.name})
    elif do_register:
        unregistered = f"MLflow at {redact_uri(uri)} was unavailable"
    if unregistered and do_register:
        unregistered = (f"run {cfg.run.name!r} is fine-tuned (accuracy {final.accuracy:.3f}) but not registered: "
                        f"{unregistered}; rerun the same command to train and register it")
        log.warning(unregistered)
    export = publish_dir(local, join(wd, "checkpoints", cfg.run.name))
    shutil.rmtree(local.parent, ignore_errors=True)
    log.info(f"[{cfg.run.name}] done: {ft.steps} steps, validation accuracy {final.accuracy:.3f} "
             f"({final.correct}/{final.total}) at stage {result.best_stage} epoch "
             f"{result.best_epoch}; exported to {export}"
             + (f", registered {cfg.mlflow.registered_model} v{version} @candidate" if version else ""))
    return AcotResult(run_id or "", cfg.run.name, a.arm, ft.steps, final.accuracy, final.correct, final.total, result.best_stage, result.best_epoch, str(export), version,
                      unregistered if do_register else None, time.time() - t0)


def _finish(cfg: Any, uri: str, run_id: str, local: Path, answers: Path, do_register: bool,
            tags: dict[str, Any]) -> tuple[str | None, str | None]:
    """The answers and the checkpoint as artifacts, the version registered; (version, why not registered)."""
    log_artifact_safely(uri, run_id, answers, ANSWERS_ARTIFACT)
    logged = log_artifact_safely(uri, run_id, local, "checkpoint")
    version, failure = None, None
    if do_register and not logged:
        failure = "the checkpoint artifact could not be logged"
    elif do_register:
        try:
            mv, new = register_once(run_id, cfg.mlflow.registered_model, tags["step"], training_tags(cfg.model, **tags),
                                    tracking_uri=uri, checkpoint_dir=local)
            if not new:
                log.info(f"[{cfg.run.name}] step {tags['step']} is already registered as "
                         f"{cfg.mlflow.registered_model} v{mv.version}")
            version = str(mv.version)
        except Exception as e:  # noqa: BLE001 - the checkpoint is exported; say how to register it
            failure = f"registration failed ({type(e).__name__}: {first_line(e)})"
    with best_effort(uri, None, stop_on_refusal=False):
        client(uri).set_terminated(run_id, "FINISHED")
    return version, failure
