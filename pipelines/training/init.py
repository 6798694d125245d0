"""Start from a version (``run.init`` / ``python -m pipelines.train --init``): a fresh run's model begins with the
EMA weights of a registered (or imported) version, as BD3-LM's paper fine-tunes from an MDLM checkpoint.

- The driver (``pin_init``), before Ray starts: the version is resolved to its pinned URI
  ``models:/NAME/VERSION`` (an alias could move), downloaded into the node's cache, and checked against the
  recipe's model: the same network class (MDLM and BD3-LM share one; ADLM and AR have their own) with the same
  parameter names and shapes, and the same tokenizer when both record one. A mismatch is one line naming it.
- Each worker (``load_init``) resolves the pinned URI on its own node (the registry's cache: one download a
  node) and loads the version's EMA weights (its model weights when it has no EMA) into the new network before
  the EMA and the optimiser are built, so the step-0 weights are the version's.
- Lineage: the pinned URI is ``run.init`` in the run's params, the run's tag ``init_from``, every checkpoint's
  meta ``init_from`` and the registered version's tag ``init_from``. A resumed run continues from its own
  checkpoint and keeps the lineage it started with: ``run.init`` never re-initialises it (resume wins).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from adlm_model.config import ConfigError, ModelConfig
from adlm_model.interop.checkpoint import load_checkpoint, read_config
from adlm_model.kinds import build_model, model_kind
from pipelines.core.logs import get_logger
from pipelines.tracking.registry import RegistryError, resolve_model_ref
from pipelines.tracking.runs import redact_uri, tracking_reachable
from pipelines.training.config import TrainConfig

log = get_logger(__name__)

INIT_TAG = "init_from"
"""The tag (run and registered version) and checkpoint-meta key holding the pinned URI a run started from."""
ARCHITECTURE = ("vocab_size", "mask_id", "hidden", "heads", "n_blocks", "denoiser_blocks", "cond_dim", "mlp_ratio",
                "uses_adaln")
"""The fields that shape the network (``denoiser_blocks``: ADLM only), named in a mismatch."""


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in build_model(cfg).state_dict().items()}


def architecture_mismatch(version: ModelConfig, recipe: ModelConfig) -> str | None:
    """Why weights of a ``version`` network cannot start a ``recipe`` network (None: they fit)."""
    theirs, ours = model_kind(version.kind).network, model_kind(recipe.kind).network
    if theirs is not ours:
        return (f"it is a {version.kind} model (network {theirs.__name__}) and the recipe's is {recipe.kind} (network "
                f"{ours.__name__}); start from a version of a kind with the same network (mdlm and bd3lm share one)")
    fields = [f for f in ARCHITECTURE if f != "denoiser_blocks" or model_kind(recipe.kind).anchored]
    diff = [f for f in fields if getattr(version, f) != getattr(recipe, f)]
    if diff:
        named = "; ".join(f"{f} {getattr(version, f)} there, {getattr(recipe, f)} here" for f in diff)
        return f"its network differs: {named}; set model.{', model.'.join(diff)} to the version's (or drop run.init)"
    a, b = _shapes(version), _shapes(recipe)
    bad = [f"{k} {a.get(k)} there, {b.get(k)} here" for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
    return f"its parameters differ: {'; '.join(bad[:3])}" if bad else None


def pin_init(cfg: TrainConfig, prev_meta: dict[str, Any] | None, tracking_uri: str,
             tokenizer_hash: str | None) -> TrainConfig:
    """``cfg`` with ``run.init`` pinned (a fresh run) or set to what the resumed run started from (``prev_meta``:
    the latest checkpoint's meta, None for a fresh run). Raises ConfigError (one line) for a version that does
    not exist or does not fit."""
    asked = cfg.run.init
    if prev_meta is not None:  # resume wins: the run keeps the weights (and the lineage) it has
        started = prev_meta.get(INIT_TAG) or ""
        if asked and asked != started:
            log.info(f"[{cfg.run.name}] resuming at step {prev_meta.get('step')}: run.init {asked} is not applied "
                     f"(the run started from {started or 'its own initialisation'})")
        return _with_init(cfg, started)
    if not asked:
        return cfg
    # lazy: keeps mlflow out of this module's import
    from mlflow.exceptions import MlflowException

    store = tracking_uri[len("sqlite:///"):] if tracking_uri.startswith("sqlite:///") else None
    if asked.startswith("models:/") and store is not None and not Path(store).is_file():  # not created by asking
        raise ConfigError(f"run.init {asked}: the tracking store {redact_uri(tracking_uri)} does not exist yet, so no "
                          "version is registered there; train, import or register one first (or point "
                          "MLFLOW_TRACKING_URI / --workdir at the store that holds it)")
    if asked.startswith("models:/") and not tracking_reachable(tracking_uri):  # not MLflow's minutes of retries
        raise ConfigError(f"run.init {asked}: the tracking server at {redact_uri(tracking_uri)} does not answer; "
                          "start from a version once it is back, or from a checkpoint folder")
    try:
        ref = resolve_model_ref(asked, tracking_uri)
        version, meta = read_config(ref.local_dir)
    except (RegistryError, ValueError, OSError, MlflowException) as e:
        raise ConfigError(f"run.init {asked}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    why = architecture_mismatch(version, cfg.model)
    if why:
        raise ConfigError(f"run.init {ref.pinned} does not fit the recipe's model: {why}")
    theirs = meta.get("tokenizer_hash")
    if theirs and tokenizer_hash and theirs != tokenizer_hash:
        raise ConfigError(f"run.init {ref.pinned} was trained with another tokenizer (hash {theirs[:12]}) than "
                          f"data.train's ({tokenizer_hash[:12]}): its token ids mean other strings; start from a "
                          "version of this tokenizer")
    log.info(f"[{cfg.run.name}] starting from the EMA weights of {ref.pinned}")
    return _with_init(cfg, ref.pinned)


def _with_init(cfg: TrainConfig, init: str) -> TrainConfig:
    return cfg if cfg.run.init == init else dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, init=init))


def load_init(raw: torch.nn.Module, init: str, tracking_uri: str) -> None:
    """Load the EMA weights of the pinned version ``init`` into ``raw`` (a worker, before its EMA and optimiser
    exist); the version resolves on this node (the registry's cache)."""
    model, _, _ = load_checkpoint(resolve_model_ref(init, tracking_uri).local_dir)  # EMA weights when present
    device = next(raw.parameters()).device
    raw.load_state_dict({k: v.to(device) for k, v in model.state_dict().items()})


__all__ = ["ARCHITECTURE", "INIT_TAG", "architecture_mismatch", "load_init", "pin_init"]
