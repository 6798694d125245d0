"""Reading the released checkpoints (``reference_layouts``' sources): what a file or folder holds, as a
:class:`Source`, with no code of the checkpoint run.

:func:`read_source` takes a Lightning ``.ckpt`` (through :mod:`adlm_model.interop.safe_pickle`: never plain pickle), a
Hub-layout folder (``config.json`` + safetensors, a sharded index, or a ``pytorch_model.bin``; remote code is never
run), a SEDD training run (its folder: the hydra ``.hydra/config.yaml`` and the training state
``checkpoints-meta/checkpoint.pth``, or a state file inside it), a bare state dict, or this project's own export
folder (``model_type: adlm``). Anything unreadable (an empty, truncated or corrupt file, JSON or safetensors that do
not parse, hyper-parameters, state dicts or EMA of the wrong type) is :class:`ImportRefused`, one line. Which family
a source is, and how it maps onto our networks, is ``reference_layouts``'.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .checkpoint import CheckpointError
from .safe_pickle import UnreadablePickleError, load_pickled, plain

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
HUB_MODULE_FILES = ("embed_sum_layer", "timestep_layer")
"""Modules a Hub folder may keep beside its weights, each in its own ``NAME.safetensors`` or ``NAME.pt`` (a pickled
state dict): SSD-LM's simplex projection and timestep embedding. Read under the prefix ``NAME.``."""


class ImportRefused(CheckpointError):
    """A checkpoint that cannot be imported exactly (unknown layout, unmatched keys, wrong shapes)."""


@dataclass
class Source:
    """What was read from a released checkpoint."""

    tensors: dict[str, torch.Tensor]
    """The state dict as the file stores it (Lightning: the module's ``state_dict``; Hub: the safetensors)."""
    hparams: dict[str, Any]
    """Saved hyper-parameters as plain data: a Lightning ``hyper_parameters`` tree or a Hub ``config.json``."""
    layout: str
    """``lightning``, ``hub`` or ``export`` (this project's own folder)."""
    files: list[Path]
    """The files read (their sha256 go into the version's tags)."""
    ema: list[torch.Tensor] | None = None
    """A Lightning checkpoint's EMA shadow parameters, in the order of the module's parameters."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Top-level entries of a Lightning checkpoint besides the weights (epoch, global_step, versions)."""

    def find(self, *names: str) -> Any:
        """The first hyper-parameter of ``names`` (depth first), looked up in a ``model`` sub-tree first (the
        references' ``config.model``: ``algo.dropout`` is not the network's), then anywhere; else None."""
        def walk(o: Any, inside: bool) -> Any:
            if isinstance(o, dict):
                if inside:
                    for n in names:
                        if n in o and not isinstance(o[n], dict):
                            return o[n]
                for k, v in o.items():
                    r = walk(v, inside or k == "model")
                    if r is not None:
                        return r
            return None

        found = walk(self.hparams, False)
        return found if found is not None else walk(self.hparams, True)


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__


def _read_json(f: Path) -> Any:
    try:
        return json.loads(f.read_text())
    except RecursionError:
        raise ImportRefused(f"{f} is JSON nested too deep to be a model config: download the folder again") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ImportRefused(f"{f} is not readable JSON ({_first_line(e)}): download the folder again") from None


def _load_safetensors(f: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError) as e:
        raise ImportRefused(f"{f} is not a readable safetensors file ({_first_line(e)}): download it again") from None


def _load_pickle(f: Path) -> Any:
    try:
        return load_pickled(f)
    except UnreadablePickleError as e:
        raise ImportRefused(str(e)) from None


def _plain(obj: Any, path: Path) -> Any:
    try:
        return plain(obj)
    except UnreadablePickleError as e:
        raise ImportRefused(f"{path}: {e}") from None


def _tensor_dict(obj: Any, what: str) -> dict[str, torch.Tensor]:
    """``obj`` as a state dict (names to tensors), or ImportRefused naming ``what`` held something else."""
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise ImportRefused(f"{what} is not a state dict of named tensors (it holds "
                            f"{type(obj).__name__ if not isinstance(obj, dict) else 'other values'})")
    return dict(obj)


def _read_hub_weights(d: Path) -> tuple[dict[str, torch.Tensor], list[Path]]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        idx = _read_json(index)
        weight_map = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ImportRefused(f"{index} has no weight_map: download the folder again")
        files = [d / s for s in sorted(set(map(str, weight_map.values())))]
    elif (d / "model.safetensors").is_file():
        files = [d / "model.safetensors"]
    elif (d / "pytorch_model.bin").is_file():  # written by older huggingface_hub releases: a pickle, read safely
        f = d / "pytorch_model.bin"
        return _tensor_dict(_load_pickle(f), str(f)), [f]
    else:
        raise ImportRefused(f"{d} holds no weights (model.safetensors, its index or pytorch_model.bin)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(_load_safetensors(f))
    return tensors, files


def _read_hub_modules(d: Path) -> tuple[dict[str, torch.Tensor], list[Path]]:
    """The ``HUB_MODULE_FILES`` a Hub folder holds, their keys under ``NAME.`` (a DDP ``module.`` prefix dropped)."""
    tensors: dict[str, torch.Tensor] = {}
    files: list[Path] = []
    for name in HUB_MODULE_FILES:
        st, pt = d / f"{name}.safetensors", d / f"{name}.pt"
        if st.is_file():
            state, f = _load_safetensors(st), st
        elif pt.is_file():
            state, f = _tensor_dict(_load_pickle(pt), str(pt)), pt
        else:
            continue
        tensors.update({f"{name}.{normalise_key(str(k))}": v for k, v in state.items()})
        files.append(f)
    return tensors, files


def normalise_key(key: str) -> str:
    """A state-dict key without the wrappers training adds around a module: DDP's leading ``module.`` and
    ``torch.compile``'s ``_orig_mod.``."""
    key = key.replace("_orig_mod.", "")
    return key[len("module."):] if key.startswith("module.") else key


SEDD_RUN_CHECKPOINT = Path("checkpoints-meta") / "checkpoint.pth"
"""Where SEDD's ``run_train.py`` keeps a run's latest training state (``checkpoints/checkpoint_N.pth``: snapshots)."""
SEDD_RUN_CONFIG = Path(".hydra") / "config.yaml"
"""The run config hydra writes into a SEDD run folder (what ``load_model_local`` reads)."""


def _sedd_run_config(ckpt: Path) -> tuple[dict[str, Any], Path]:
    """The hydra config of the SEDD run a training-state file belongs to (``<run>/checkpoints-meta/`` or
    ``<run>/checkpoints/``), or ImportRefused saying where it was looked for."""
    import yaml

    for run in (ckpt.parent.parent, ckpt.parent):
        f = run / SEDD_RUN_CONFIG
        if f.is_file():
            try:
                cfg = yaml.safe_load(f.read_text())
            except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
                raise ImportRefused(f"{f} is not readable YAML ({_first_line(e)})") from None
            if not isinstance(cfg, dict):
                raise ImportRefused(f"{f} holds no run config (a {type(cfg).__name__})")
            return cfg, f
    raise ImportRefused(f"{ckpt} is a SEDD training state ('model', 'ema', 'step') without its run config: pass the "
                        f"run folder (it holds {SEDD_RUN_CONFIG} beside {SEDD_RUN_CHECKPOINT})")


def _sedd_run(p: Path, obj: dict[str, Any]) -> Source:
    """SEDD's training state (``utils.save_checkpoint``: ``model``, ``ema`` {decay, num_updates, shadow_params},
    ``optimizer``, ``step``) with its run folder's config; the EMA replaces the weights as ``load_model_local``
    does."""
    state = _tensor_dict(obj["model"], f"{p}'s 'model'")
    shadow = obj["ema"].get("shadow_params")
    if not isinstance(shadow, list) or not all(isinstance(t, torch.Tensor) for t in shadow):
        raise ImportRefused(f"{p}'s 'ema' has no list of shadow_params tensors")
    hp, cfg_file = _sedd_run_config(p)
    step = obj.get("step")
    return Source({normalise_key(k): v for k, v in state.items()}, hp, "run", [p, cfg_file], ema=list(shadow),
                  extra={"step": int(step)} if isinstance(step, int) else {})


def _is_sedd_run(obj: dict[str, Any]) -> bool:
    return "state_dict" not in obj and isinstance(obj.get("model"), dict) and isinstance(obj.get("ema"), dict)


def read_source(path: str | os.PathLike) -> Source:
    """Read a Lightning checkpoint file, a Hub-layout folder, a SEDD run (its folder or its training-state file) or
    this project's export folder (no code run); ImportRefused (one line) for anything unreadable."""
    p = Path(path)
    if p.is_dir():
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            if (p / SEDD_RUN_CHECKPOINT).is_file():  # a SEDD run folder: its latest training state
                return read_source(p / SEDD_RUN_CHECKPOINT)
            raise ImportRefused(f"{p} has no config.json: pass a Hub-layout folder or a Lightning .ckpt file")
        hp = _read_json(cfg_file)
        if not isinstance(hp, dict):
            raise ImportRefused(f"{cfg_file} holds a {type(hp).__name__}, not a model config (a JSON object)")
        tensors, files = _read_hub_weights(p)
        tensors = {normalise_key(k): v for k, v in tensors.items()}
        extra, extra_files = _read_hub_modules(p)
        tensors.update(extra)
        files = [*files, *extra_files]
        layout = "export" if hp.get("model_type") == "adlm" and isinstance(hp.get("model"), dict) else "hub"
        return Source(tensors, hp, layout, [cfg_file, *files])
    if not p.is_file():
        raise ImportRefused(f"{p} does not exist")
    if p.suffix == ".safetensors":
        raise ImportRefused(f"{p} is a bare safetensors file: pass the folder that holds it with its config.json")
    if p.suffix not in PICKLE_SUFFIXES:
        raise ImportRefused(f"{p}: not a checkpoint this importer reads (a Lightning .ckpt, a .bin/.pt, or a folder)")
    obj = _load_pickle(p)
    if not isinstance(obj, dict):
        raise ImportRefused(f"{p} holds a {type(obj).__name__}, not a checkpoint dictionary")
    if "state_dict" in obj:
        state = _tensor_dict(obj["state_dict"], f"{p}'s 'state_dict'")
        ema = obj.get("ema")
        shadow = ema.get("shadow_params") if isinstance(ema, dict) else None
        if shadow is not None and (not isinstance(shadow, list | tuple)
                                   or not all(isinstance(t, torch.Tensor) for t in shadow)):
            raise ImportRefused(f"{p}'s 'ema' shadow_params is not a list of tensors")
        hparams = _plain(obj.get("hyper_parameters") or {}, p)
        if not isinstance(hparams, dict):
            raise ImportRefused(f"{p}'s 'hyper_parameters' is a {type(hparams).__name__}, not a mapping of "
                                "hyper-parameters: not a Lightning checkpoint of the references")
        extra = {k: _plain(v, p) for k, v in obj.items() if k in ("epoch", "global_step", "pytorch-lightning_version")}
        return Source({normalise_key(k): v for k, v in state.items()}, hparams, "lightning", [p],
                      ema=list(shadow) if shadow else None, extra=extra)
    if _is_sedd_run(obj):
        return _sedd_run(p, obj)
    if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):  # a bare state dict (torch.save(model.state_dict()))
        return Source({normalise_key(str(k)): v for k, v in obj.items()}, {}, "hub", [p])
    raise ImportRefused(f"{p} is a pickle without a 'state_dict': not a Lightning checkpoint of the references "
                        f"(top-level keys: {', '.join(map(str, list(obj)[:8]))})")


__all__ = ["HUB_MODULE_FILES", "PICKLE_SUFFIXES", "SEDD_RUN_CHECKPOINT", "SEDD_RUN_CONFIG", "ImportRefused", "Source", "normalise_key",
           "read_source"]
