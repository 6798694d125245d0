"""Checkpoints: safetensors for weights (model and EMA) plus a JSON config; no pickle, ever.

Layout of a checkpoint directory::

    config.json        {"model": ModelConfig, "meta": {...}}  (meta: step, run id, anything JSON)
    model.safetensors  model weights
    ema.safetensors    EMA weights (optional)
    state.safetensors  other tensors, e.g. optimizer state (optional, ``save_state``)
    state.json         the non-tensor part of that state

Loading checks the model kind, vocabulary size, mask id and sequence length against what the
caller expects and fails with one clear line on a mismatch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .kinds import build_model

CHECKED_FIELDS = ("kind", "vocab_size", "mask_id", "seq_len")


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged or does not fit what the caller expects."""


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    os.replace(tmp, path)


def _atomic_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def save_checkpoint(directory: str | os.PathLike, model: nn.Module, cfg: ModelConfig, *,
                    ema_state: dict[str, torch.Tensor] | None = None, meta: dict[str, Any] | None = None) -> Path:
    """Write weights, EMA weights and config to ``directory``; returns the directory."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _atomic_safetensors(d / "model.safetensors", model.state_dict())
    if ema_state is not None:
        _atomic_safetensors(d / "ema.safetensors", ema_state)
    _atomic_json(d / "config.json", {"model": cfg.to_dict(), "meta": meta or {}})
    return d


def read_config(directory: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any]]:
    d = Path(directory)
    f = d / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{d} is not a checkpoint: no config.json (pass a directory written by save_checkpoint)")
    obj = json.loads(f.read_text())
    return ModelConfig.from_dict(obj["model"]), obj.get("meta", {})


def check_compatible(cfg: ModelConfig, expected: dict[str, Any], where: str = "checkpoint") -> None:
    for key in CHECKED_FIELDS:
        if key in expected and expected[key] is not None and getattr(cfg, key) != expected[key]:
            raise CheckpointError(f"{where} has {key}={getattr(cfg, key)!r} but {expected[key]!r} was expected; "
                                  f"use a checkpoint trained for this data/model or change the {key}")


def load_checkpoint(directory: str | os.PathLike, *, expect: dict[str, Any] | None = None, use_ema: bool = True,
                    map_location: str | torch.device = "cpu") -> tuple[nn.Module, ModelConfig, dict[str, Any]]:
    """Rebuild the model from ``config.json`` and load its weights (EMA ones when present and asked).

    ``expect`` maps any of kind / vocab_size / mask_id / seq_len to the required value.
    """
    d = Path(directory)
    cfg, meta = read_config(d)
    check_compatible(cfg, expect or {}, where=f"checkpoint {d}")
    model = build_model(cfg)
    weights = d / ("ema.safetensors" if use_ema and (d / "ema.safetensors").is_file() else "model.safetensors")
    if not weights.is_file():
        raise CheckpointError(f"checkpoint {d} has no {weights.name}")
    state = load_file(str(weights), device=str(map_location))
    if weights.name == "ema.safetensors":  # EMA holds parameters only: take buffers from the model file
        full = load_file(str(d / "model.safetensors"), device=str(map_location))
        full.update(state)
        state = full
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {d} does not fit its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.to(map_location), cfg, meta


def flatten_state(obj: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], Any]:
    """Split a nested state (dicts, lists, tensors, scalars) into tensors and a JSON skeleton."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(o: Any, path: str) -> Any:
        if isinstance(o, torch.Tensor):
            tensors[path] = o
            return {"__tensor__": path}
        if isinstance(o, dict):
            return {"__dict__": [[walk(k, f"{path}.k{i}"), walk(v, f"{path}.{i}")] for i, (k, v) in enumerate(o.items())]}
        if isinstance(o, (list, tuple)):
            return {"__list__": [walk(v, f"{path}.{i}") for i, v in enumerate(o)], "tuple": isinstance(o, tuple)}
        if o is None or isinstance(o, (bool, int, float, str)):
            return o
        raise TypeError(f"cannot store {type(o).__name__} at {path} in a checkpoint")

    return tensors, walk(obj, prefix or "s")


def unflatten_state(tensors: dict[str, torch.Tensor], skeleton: Any) -> Any:
    def walk(o: Any) -> Any:
        if isinstance(o, dict) and "__tensor__" in o:
            return tensors[o["__tensor__"]]
        if isinstance(o, dict) and "__dict__" in o:
            return {walk(k): walk(v) for k, v in o["__dict__"]}
        if isinstance(o, dict) and "__list__" in o:
            items = [walk(v) for v in o["__list__"]]
            return tuple(items) if o.get("tuple") else items
        return o

    return walk(skeleton)


def save_state(directory: str | os.PathLike, state: Any, name: str = "state") -> None:
    """Store any nested state (optimizer, scheduler, RNG, data position) as safetensors + JSON."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors, skeleton = flatten_state(state)
    _atomic_safetensors(d / f"{name}.safetensors", tensors)
    _atomic_json(d / f"{name}.json", skeleton)


def load_state(directory: str | os.PathLike, name: str = "state") -> Any:
    d = Path(directory)
    if not (d / f"{name}.json").is_file():
        raise CheckpointError(f"checkpoint {d} has no {name}.json")
    tensors = load_file(str(d / f"{name}.safetensors"))
    return unflatten_state(tensors, json.loads((d / f"{name}.json").read_text()))
