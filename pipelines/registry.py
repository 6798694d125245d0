"""The MLflow model registry as the pipeline uses it.

Contract shared by training, tuning and evaluation:

- A checkpoint directory (``adlm_model.checkpoint`` layout: ``config.json``, ``model.safetensors``,
  ``ema.safetensors``) is logged as the run artifact folder ``checkpoint`` and registered with
  ``create_model_version(name, source=<artifact URI of that folder>, run_id=...)``.
- Versions carry tags (``kind``, ``gamma``, ``tau``, ``data_manifest_hash``, ``val_ppl``,
  ``checkpoint_uri``, ...) and aliases (``candidate``, ``champion``); stages are never used.
- ``resolve_model(uri)`` accepts ``models:/name@alias``, ``models:/name/3`` or a local checkpoint
  directory and returns a local directory to ``load_checkpoint`` from.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from pipelines.tracking import client

DEFAULT_MODEL_NAME = "adlm"
CHECKPOINT_ARTIFACT = "checkpoint"


class RegistryError(ValueError):
    """A model URI, alias or version that the registry does not have."""


def training_tags(model_cfg: Any, **extra: Any) -> dict[str, Any]:
    """The tags every registered training checkpoint carries: its kind and, for the anchored kind only,
    gamma and tau (an MDLM, AR or BD3-LM version has no anchor loss to describe), plus ``extra``."""
    from adlm_model.kinds import model_kind

    tags: dict[str, Any] = {"kind": model_cfg.kind}
    if model_kind(model_cfg.kind).anchored:
        tags.update(gamma=model_cfg.gamma, tau=model_cfg.tau)
    return {**tags, **extra}


def register_checkpoint(run_id: str, name: str, tags: dict[str, Any], *, tracking_uri: str | None = None,
                        aliases: tuple[str, ...] = ("candidate",), artifact_path: str = CHECKPOINT_ARTIFACT):
    """Register the run's logged checkpoint folder as a new version with tags and aliases."""
    c = client(tracking_uri)
    try:
        c.get_registered_model(name)
    except Exception:  # noqa: BLE001 - RESOURCE_DOES_NOT_EXIST
        try:
            c.create_registered_model(name, description="ADLM pipeline checkpoints (safetensors + JSON config)")
        except Exception:  # noqa: BLE001 - created concurrently
            pass
    source = c.get_run(run_id).info.artifact_uri.rstrip("/") + "/" + artifact_path
    mv = c.create_model_version(name, source=source, run_id=run_id,
                                     tags={k: str(v) for k, v in {**tags, "checkpoint_uri": source}.items()})
    for alias in aliases:
        c.set_registered_model_alias(name, alias, mv.version)
    return mv


def registered_version(name: str, run_id: str, step: int, *, tracking_uri: str | None = None) -> Any:
    """The version already registered from training run ``run_id`` at ``step``, or None: what makes a rerun
    of a finished run (training, sweep, the whole pipeline) register nothing new and move no alias."""
    c = client(tracking_uri)
    try:
        versions = c.search_model_versions(f"name='{name}' and run_id='{run_id}'")
    except Exception:  # noqa: BLE001 - no such registered model yet
        return None
    same = [v for v in versions if (v.tags or {}).get("step") == str(step)]
    return min(same, key=lambda v: int(v.version)) if same else None


def parse_model_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``models:/name@alias`` -> (name, None, alias); ``models:/name/3`` -> (name, "3", None)."""
    m = re.fullmatch(r"models:/([^/@]+)(?:@([\w\-.]+)|/(\d+))", uri)
    if not m:
        raise RegistryError(f"bad model URI {uri!r}: use models:/NAME@ALIAS, models:/NAME/VERSION or a checkpoint dir")
    return m.group(1), m.group(3), m.group(2)


def get_version(uri: str, tracking_uri: str | None = None):
    """The ModelVersion a ``models:/`` URI names, or a one-line RegistryError."""
    name, version, alias = parse_model_uri(uri)
    c = client(tracking_uri)
    try:
        if alias is not None:
            return c.get_model_version_by_alias(name, alias)
        return c.get_model_version(name, version)
    except Exception as e:
        what = f"alias {alias!r}" if alias else f"version {version}"
        raise RegistryError(f"registered model {name!r} has no {what} in {tracking_uri or 'the tracking store'}: "
                            f"list versions with `mlflow models` or the UI, or pass a checkpoint directory") from e


def resolve_model(uri: str, tracking_uri: str | None = None, dst: str | os.PathLike | None = None) -> Path:
    """A local checkpoint directory for a registry URI or a path."""
    if not uri.startswith("models:/"):
        p = Path(uri).expanduser()
        if not (p / "config.json").is_file():
            raise RegistryError(f"{uri} is neither a models:/ URI nor a checkpoint directory with config.json")
        return p
    mv = get_version(uri, tracking_uri)
    import mlflow

    local = mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(dst) if dst else None,
                                                tracking_uri=tracking_uri)
    return Path(local)
