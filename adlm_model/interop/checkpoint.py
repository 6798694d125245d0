"""Checkpoints: safetensors for weights (model and EMA) plus a JSON config; no pickle, ever.

Layout of a checkpoint directory::

    config.json        {"model": ModelConfig, "meta": {...}}  (meta: step, run id, anything JSON)
    model.safetensors  model weights
    ema.safetensors    EMA weights (optional)
    state.safetensors  other tensors, e.g. optimizer state (optional, ``save_state``)
    state.json         the non-tensor part of that state

Loading checks the model kind, vocabulary size, mask id and sequence length against what the
caller expects and fails with one clear line on a mismatch. Before any tensor is made it also checks that the
network config.json describes is not far larger than the weights file (``check_size``): a config.json edited to ask for
4,096 blocks or a hidden size of 2^20 is one line, not gigabytes allocated on the way to a shape error. A config
that is not JSON, not a model config, or weights that are not safetensors are one line each too.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..config import ConfigError, ModelConfig
from ..kinds import build_model, count_parameters

CHECKED_FIELDS = ("kind", "vocab_size", "mask_id", "seq_len")


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged or does not fit what the caller expects."""


def atomic_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` through a temporary file: a reader sees the old file or the new one."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    os.replace(tmp, path)


def atomic_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (on the CPU, contiguous) as safetensors to ``path`` through a temporary file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def save_checkpoint(directory: str | os.PathLike, model: nn.Module, cfg: ModelConfig, *,
                    ema_state: dict[str, torch.Tensor] | None = None, meta: dict[str, Any] | None = None) -> Path:
    """Write weights, EMA weights and config to ``directory``; returns the directory."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    atomic_safetensors(d / "model.safetensors", model.state_dict())
    if ema_state is not None:
        atomic_safetensors(d / "ema.safetensors", ema_state)
    atomic_json(d / "config.json", {"model": cfg.to_dict(), "meta": meta or {}})
    return d


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:160] if text else type(e).__name__


def read_config(directory: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any]]:
    d = Path(directory)
    f = d / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{d} is not a checkpoint: no config.json (pass a directory written by save_checkpoint)")
    try:
        obj = json.loads(f.read_text(encoding="utf-8"))
    except RecursionError:
        raise CheckpointError(f"{f} is JSON nested too deep to be a model config") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{f} is not readable JSON ({_first_line(e)}): restore the folder (export or "
                              "download it again)") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("model"), dict):
        raise CheckpointError(f"{f} holds no model config (a JSON object with a 'model' object): restore the folder "
                              "(export or download it again)")
    meta = obj.get("meta", {})
    try:
        return ModelConfig.from_dict(obj["model"]), meta if isinstance(meta, dict) else {}
    except ConfigError as e:
        raise ConfigError(f"{f}: {e}") from None
    except (TypeError, ValueError, OverflowError) as e:
        raise CheckpointError(f"{f} holds a model config of the wrong types ({_first_line(e)})") from None


def check_compatible(cfg: ModelConfig, expected: dict[str, Any], where: str = "checkpoint") -> None:
    for key in CHECKED_FIELDS:
        if key in expected and expected[key] is not None and getattr(cfg, key) != expected[key]:
            raise CheckpointError(f"{where} has {key}={getattr(cfg, key)!r} but {expected[key]!r} was expected; "
                                  f"use a checkpoint trained for this data/model or change the {key}")


def stored_values(path: str | os.PathLike) -> int:
    """Values (elements) a safetensors file holds, from its header alone; CheckpointError if it is not one."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({_first_line(e)}): restore the folder "
                              "(export or download it again)") from None


def estimated_parameters(cfg: ModelConfig) -> int:
    """The parameters of ``cfg``'s network, counted on the meta device (nothing allocated) from networks of one
    and two blocks (a stack of equal blocks grows by the same count a block): seconds for any depth."""
    def count(**blocks: int) -> int:
        with torch.device("meta"):
            return count_parameters(build_model(cfg.replace(**blocks)))

    one = count(n_blocks=1, denoiser_blocks=1)
    per_block = count(n_blocks=2, denoiser_blocks=1) - one
    per_denoiser_block = count(n_blocks=1, denoiser_blocks=2) - one
    return one + (cfg.n_blocks - 1) * per_block + (cfg.denoiser_blocks - 1) * per_denoiser_block


SIZE_SLACK = 1 << 24
"""Parameters a config may ask for beyond twice the values its weights hold before it is refused unbuilt: a
smaller mismatch is built and named key by key (the weights' own check), a larger one is an allocation."""


def oversized(cfg: ModelConfig, values: int) -> int | None:
    """The parameters of ``cfg``'s network when they exceed what weights of ``values`` values can fill (twice them,
    plus ``SIZE_SLACK``), else None: what a config may allocate is bounded by the file it came with."""
    want = estimated_parameters(cfg)
    return want if want > 2 * values + SIZE_SLACK else None


def check_size(cfg: ModelConfig, weights: str | os.PathLike) -> None:
    """CheckpointError when ``cfg``'s network is far larger than ``weights`` (a safetensors file) holds
    (``oversized``), before any tensor is made."""
    have = stored_values(weights)
    want = oversized(cfg, have)
    if want is not None:
        raise CheckpointError(f"{Path(weights).parent / 'config.json'} describes a network of {want:,} parameters "
                              f"but {Path(weights).name} holds {have:,} values: the config does not belong to these "
                              "weights (restore it; nothing was built)")


def load_checkpoint(directory: str | os.PathLike, *, expect: dict[str, Any] | None = None, use_ema: bool = True,
                    map_location: str | torch.device = "cpu") -> tuple[nn.Module, ModelConfig, dict[str, Any]]:
    """Rebuild the model from ``config.json`` and load its weights (EMA ones when present and asked).

    ``expect`` maps any of kind / vocab_size / mask_id / seq_len to the required value.
    """
    d = Path(directory)
    cfg, meta = read_config(d)
    check_compatible(cfg, expect or {}, where=f"checkpoint {d}")
    weights = d / ("ema.safetensors" if use_ema and (d / "ema.safetensors").is_file() else "model.safetensors")
    if not weights.is_file():
        raise CheckpointError(f"checkpoint {d} has no {weights.name}")
    check_size(cfg, d / "model.safetensors" if (d / "model.safetensors").is_file() else weights)
    model = build_model(cfg)
    try:
        state = load_file(str(weights), device=str(map_location))
        if weights.name == "ema.safetensors":  # EMA holds parameters only: take buffers from the model file
            full = load_file(str(d / "model.safetensors"), device=str(map_location))
            full.update(state)
            state = full
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights} is not a readable safetensors file ({_first_line(e)}): restore the folder "
                              "(export or download it again)") from None
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of another shape than the config's network has
        raise CheckpointError(f"checkpoint {d} does not fit its config ({_first_line(e)})") from None
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
    atomic_safetensors(d / f"{name}.safetensors", tensors)
    atomic_json(d / f"{name}.json", skeleton)


def load_state(directory: str | os.PathLike, name: str = "state") -> Any:
    d = Path(directory)
    if not (d / f"{name}.json").is_file():
        raise CheckpointError(f"checkpoint {d} has no {name}.json")
    tensors = load_file(str(d / f"{name}.safetensors"))
    return unflatten_state(tensors, json.loads((d / f"{name}.json").read_text()))
