"""Training checkpoints: what a worker writes and reads back, and what the driver finds and exports.

A training checkpoint is an ``adlm_model.interop.checkpoint`` folder (``config.json`` with the full training
config in its meta, ``model.safetensors``, ``ema.safetensors``, ``tokenizer.json``) plus the trainer
state (``trainer_state.{json,safetensors}``: optimiser, scheduler, step, data position) and one RNG
file per rank (``rng_rank<r>.{json,safetensors}``). safetensors + JSON only, never a pickle.

The registered artifact is the export: config, weights, EMA weights and tokenizer, no optimiser state.

The best checkpoint by validation bound is replaced atomically (``publish_best``): each one is written under a
new name (``best-<step>-<nonce>``) and becomes the best only when the pointer ``best.json`` naming it is
written, last, in one write. A writer killed mid-upload leaves an unnamed folder that nothing reads (the next
best removes it); ``best_checkpoint`` is always a complete one.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from pipelines.core.logs import get_logger
from pipelines.core.storage import (
    delete_dir,
    exists,
    get_fs,
    is_file,
    join,
    list_dir,
    name_of,
    read_bytes,
    read_text,
    write_bytes_atomic,
    write_text,
)

log = get_logger(__name__)

CKPT_PREFIX = "checkpoint_"
EXPORT_FILES = ("config.json", "model.safetensors", "ema.safetensors", "tokenizer.json")
REQUIRED_EXPORT = ("config.json", "model.safetensors", "ema.safetensors")
"""What an export cannot do without (the tokenizer is optional: a run on pre-tokenised data may have none)."""
TRAINER_STATE = "trainer_state"
BEST = "best"
"""Prefix of the run folder's copies of the best checkpoint by validation bound (weights, EMA, config,
tokenizer); ``<run_dir>/best`` itself is the folder older runs wrote in place (still read when complete)."""
BEST_POINTER = "best.json"
"""``{"name": <folder>, "step": ...}``: which ``best-*`` folder is the best; written last, in one write."""


def checkpoint_name(step: int) -> str:
    return f"{CKPT_PREFIX}{step:08d}"


def step_of(path: str | Path) -> int:
    """The step in a checkpoint folder's name, -1 for any other name."""
    name = name_of(path)
    return int(name[len(CKPT_PREFIX):]) if name.startswith(CKPT_PREFIX) and name[len(CKPT_PREFIX):].isdigit() else -1


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, str]]:
    """(step, location) of the complete checkpoints of a run folder (local or in an object store), oldest
    first. A checkpoint is complete once its config and trainer state are written (they are written last)."""
    out = []
    for name in list_dir(run_dir):
        step = step_of(name)
        loc = join(run_dir, name)
        if step >= 0 and is_file(join(loc, "config.json")) and is_file(join(loc, f"{TRAINER_STATE}.json")):
            out.append((step, loc))
    return sorted(out)


def latest_checkpoint(run_dir: str | Path) -> tuple[int, str] | None:
    cks = list_checkpoints(run_dir)
    return cks[-1] if cks else None


RAY_TRAIN_RECORD = "checkpoint_manager_snapshot.json"
"""Ray Train's record of a run's checkpoints, in the run folder: a rerun of the run name restores it, and fails
(``CheckpointManagerInitializationError``) when a checkpoint it lists is gone."""


def missing_recorded_checkpoints(run_dir: str | Path) -> list[str]:
    """The checkpoint folders Ray Train's record of ``run_dir`` lists that no longer exist (deleted by hand); [] when
    it has no record, or an unreadable one (Ray Train then says so itself)."""
    try:
        record = json.loads(read_text(join(run_dir, RAY_TRAIN_RECORD)))
        names = [r["checkpoint_dir_name"] for r in record.get("checkpoint_results", [])]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    return [n for n in names if not exists(join(run_dir, n))]


def forget_missing_checkpoints(run_dir: str | Path, resume: tuple[int, str] | None, run_name: str) -> None:
    """Before a rerun of a run whose checkpoints were deleted in part or whole: with one left (``resume``), Ray Train's
    record is dropped (its bookkeeping starts again; the run resumes from that checkpoint, as it does from the
    folder anyway), with a warning; with none left, a one-line ``ConfigError``: the run cannot resume, and
    starting it again under its name would mix two runs in one MLflow run."""
    # lazy: keeps torch out of this module's import
    from adlm_model.config import ConfigError

    missing = missing_recorded_checkpoints(run_dir)
    if not missing:
        return
    if resume is None:
        raise ConfigError(f"run {run_name!r} cannot resume: its checkpoints in {run_dir} were deleted (Ray Train's "
                          f"record still lists {', '.join(missing[-2:])}); start it under another run.name, or "
                          f"delete {run_dir} to start this one again from step 0")
    log.warning(f"[{run_name}] {len(missing)} checkpoint(s) of this run were deleted ({', '.join(missing[-2:])}); "
                f"resuming from step {resume[0]}, the latest one left")
    fs, path = get_fs(join(run_dir, RAY_TRAIN_RECORD))
    fs.delete_file(path)


def complete_export(src: str | Path) -> bool:
    """Whether checkpoint ``src`` holds every file an export needs."""
    return all(is_file(join(src, f)) for f in REQUIRED_EXPORT)


def publish_best(local: Path, run_dir: str | Path, step: int, *, crash_at: int | None = None) -> str:
    """Make the local folder ``local`` (config, weights, EMA, tokenizer) the run's best checkpoint, atomically:
    uploaded under a new name, then the pointer ``best.json`` is written (one object: a reader sees the old best
    or the new one, whole), then older best folders go. Returns the new folder's location. ``crash_at``: the
    fault ``train.crash_writing_best`` (the writer dies mid-upload at that step, once per run)."""
    run_dir = str(run_dir)
    name = f"{BEST}-{step:08d}-{uuid.uuid4().hex[:8]}"
    dest = join(run_dir, name)
    crash = crash_at == step and not exists(join(run_dir, ".crashed_writing_best"))
    # config.json first: a folder cut short then looks like a checkpoint to a reader that trusts it; this one
    # never does (only the pointer names a best).
    for f in sorted(local.iterdir(), key=lambda p: (p.name != "config.json", p.name)):
        write_bytes_atomic(join(dest, f.name), f.read_bytes())
        if crash:
            write_text(join(run_dir, ".crashed_writing_best"), str(step))
            log.warning(f"fault train.crash_writing_best: the writer dies after {f.name} of {name}")
            shutil.rmtree(local, ignore_errors=True)  # the scratch copy only: what the fault leaves is in run_dir
            os._exit(1)
    write_text(join(run_dir, BEST_POINTER), json.dumps({"name": name, "step": step}))
    shutil.rmtree(local, ignore_errors=True)
    for old in list_dir(run_dir):  # earlier bests and any folder a killed writer left
        if old.startswith(f"{BEST}-") and old != name:
            delete_dir(join(run_dir, old))
    return dest


def best_checkpoint(run_dir: str | Path) -> str | None:
    """The run's best checkpoint (what it exports and registers): the folder ``best.json`` names, else the
    in-place ``best`` folder of older runs when complete; None when the run never validated."""
    run_dir = str(run_dir)
    if is_file(join(run_dir, BEST_POINTER)):
        name = json.loads(read_text(join(run_dir, BEST_POINTER)))["name"]
        if not complete_export(join(run_dir, name)):
            raise FileNotFoundError(f"the best checkpoint {join(run_dir, name)} named by {BEST_POINTER} is "
                                    "incomplete (files deleted by hand?): delete its best.json to export the latest")
        return join(run_dir, name)
    legacy = join(run_dir, BEST)
    return legacy if complete_export(legacy) else None


def fetch_export(src: str | Path, dst: Path) -> Path:
    """The registered artifact, as a local folder: config + model + EMA weights + tokenizer of checkpoint
    ``src`` (local or remote), without optimiser or RNG state. A missing config or weights file (model or EMA)
    is an error: never an empty or partial export."""
    missing = [f for f in REQUIRED_EXPORT if not is_file(join(src, f))]
    if missing:
        raise FileNotFoundError(f"checkpoint {src} lacks {', '.join(missing)}: it cannot be exported")
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in EXPORT_FILES:
        if is_file(join(src, f)):
            (dst / f).write_bytes(read_bytes(join(src, f)))
    return dst


def gather_state(raw: Any, ema: Any, opt: Any, fsdp: bool) -> tuple[dict | None, dict, dict]:
    """(full model state or None = take it from the module, EMA state, optimiser state) on every rank.

    With FSDP the parameters are sharded: every rank takes part in gathering the full state dicts.
    """
    if not fsdp:
        return None, ema.state_dict(), opt.state_dict()
    # lazy: keeps torch out of this module's import
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(raw, options=opts)
    with ema.applied(raw):
        ema_full = get_model_state_dict(raw, options=opts)
    ema_sd = {k: v for k, v in ema_full.items() if k in ema.shadow}
    return model_sd, ema_sd, get_optimizer_state_dict(raw, opt, options=opts)


def load_weights_and_optimizer(d: Path, raw: Any, ema: Any, opt: Any, fsdp: bool, device: Any) -> dict[str, Any]:
    """Load model, EMA and optimiser state from checkpoint ``d`` into the live objects; returns the trainer
    state (step, scheduler, data position, world)."""
    # lazy: keeps safetensors out of this module's import
    from safetensors.torch import load_file

    # lazy: keeps torch out of this module's import
    from adlm_model.interop.checkpoint import load_state

    state = load_state(d, TRAINER_STATE)
    model_sd = load_file(str(d / "model.safetensors"))
    ema_sd = load_file(str(d / "ema.safetensors"))
    if fsdp:
        # lazy: keeps torch out of this module's import
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(raw, model_sd, options=opts)
        with ema.applied(raw):  # EMA shards: load the full EMA weights into the model, copy the shards
            set_model_state_dict(raw, {**model_sd, **ema_sd}, options=opts)
            ema.shadow = {k: p.detach().clone() for k, p in raw.named_parameters() if k in ema.shadow}
        set_optimizer_state_dict(raw, opt, state["optimizer"], options=opts)
    else:
        raw.load_state_dict(model_sd)
        ema.load_state_dict({k: v.to(device) for k, v in ema_sd.items()})
        opt.load_state_dict(state["optimizer"])
    return state
