"""A Hugging Face-style model folder: what ``python -m pipelines.export`` writes and ``load_pretrained`` reads.

Layout::

    config.json        Hugging Face-style keys (model_type, architectures, torch_dtype, *_token_id) plus
                       {"model": ModelConfig, "meta": provenance}: the checkpoint layout's two keys, so
                       ``checkpoint.load_checkpoint`` reads the folder too
    model.safetensors  the weights the registered version serves: the EMA parameters with the model's
                       buffers, one file, no EMA twin ("format": "pt" metadata, as the Hub expects)
    tokenizer.json     the tokenizer the model was trained with
    README.md          the model card (written by the exporter)
    *.py               the network code ``transformers`` loads (``auto_map`` in config.json):
                       ``configuration_adlm.py``, ``modeling_adlm.py`` and copies of the network's modules
                       (``HF_CODE``), so ``AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)``
                       gives the same logits from the same file of weights

safetensors + JSON only. ``load_pretrained`` rebuilds the network from config.json and loads the weights
bit for bit; ``textgen.TextGenerator.from_dir`` generates from the folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..config import ModelConfig
from ..kinds import model_kind
from .checkpoint import CheckpointError, atomic_json, atomic_safetensors, load_checkpoint

PRETRAINED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
MODEL_TYPE = "adlm"
HF_SOURCES = {"configuration_adlm.py": "interop/configuration_adlm.py", "modeling_adlm.py": "interop/modeling_adlm.py",
              "config.py": "config.py", "attention.py": "nn/attention.py", "backbone.py": "nn/backbone.py",
              "models.py": "nn/models.py", "block_attention.py": "nn/block_attention.py"}
"""The modules an export ships for ``transformers``, by their name in the folder: the two wrappers and the network's
own modules (torch only), each the file of this package at the path given (relative to the package)."""
HF_CODE = tuple(HF_SOURCES)
"""The export folder's code files: one flat folder, the same names as the exports of the flat package had."""
_RELATIVE_IMPORT = re.compile(r"^(\s*)from \.+(?:\w+\.)*(\w+) import ", re.M)


def shipped_code(name: str) -> str:
    """The text of ``name`` (one of ``HF_CODE``) as an export ships it: this package's module with each relative
    import flattened (``from ..nn.backbone import x`` -> ``from .backbone import x``), since ``transformers`` loads
    the shipped files side by side in one folder and follows their relative imports there."""
    text = (Path(__file__).parents[1] / HF_SOURCES[name]).read_text()
    return _RELATIVE_IMPORT.sub(r"\1from .\2 import ", text)


KIND_FIELDS = ("diffusion", "anchored", "adaln", "skips_bos", "time_conditioned", "block_diffusion")
"""The ``kinds.ModelKind`` fields an export's config.json carries for its shipped network (``kind_fields``)."""
AUTO_MAP = {"AutoConfig": "configuration_adlm.AdlmConfig", "AutoModelForMaskedLM": "modeling_adlm.AdlmForMaskedLM"}


def save_pretrained(directory: str | os.PathLike, model: nn.Module, cfg: ModelConfig, *, tokenizer_json: str | os.PathLike,
                    special_tokens: dict[str, int | None], meta: dict[str, Any] | None = None) -> Path:
    """Write ``config.json``, ``model.safetensors`` (``model``'s state as it is: pass the EMA-loaded model)
    and ``tokenizer.json`` into ``directory``; returns it. ``special_tokens``: ``bos_id``, ``eos_id``,
    ``pad_id``, ``mask_id``. A sample-only kind (SSD-LM) is refused: its released Hub folder is its export."""
    if model_kind(cfg.kind).sample_only:
        raise CheckpointError(f"a {cfg.kind} model is not exported: it is sample-only here and its released Hub folder "
                              "is already its transformers layout; sample it with python -m pipelines.generate")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    dtypes = {str(v.dtype).removeprefix("torch.") for v in state.values() if v.is_floating_point()}
    atomic_safetensors(d / "model.safetensors", state, metadata={"format": "pt"})
    shutil.copyfile(tokenizer_json, d / "tokenizer.json")
    for name in HF_CODE:
        (d / name).write_text(shipped_code(name))
    config = {
        "model_type": MODEL_TYPE,
        "architectures": ["AdlmForMaskedLM"],
        "auto_map": AUTO_MAP,
        "adlm_kind": cfg.kind,
        "torch_dtype": dtypes.pop() if len(dtypes) == 1 else "float32",
        **{f"{k.removesuffix('_id')}_token_id": v for k, v in special_tokens.items()},
        "model": cfg.to_dict(),
        # The kind's fields of the kinds table (its defaults and capabilities): the shipped modules cannot import
        # ``kinds`` (it pulls in the samplers and objectives), so the export carries what its network reads.
        "kind_fields": {f: getattr(model_kind(cfg.kind), f) for f in KIND_FIELDS},
        "meta": meta or {},
    }
    atomic_json(d / "config.json", config)
    return d


def load_pretrained(directory: str | os.PathLike, *, map_location: str | torch.device = "cpu",
                    expect: dict[str, Any] | None = None) -> tuple[nn.Module, ModelConfig, dict[str, Any]]:
    """The model of a ``save_pretrained`` folder in eval mode, its config and its provenance (``meta``).

    One clear line when a file is missing or the folder is not an ADLM export."""
    d = Path(directory)
    missing = [f for f in PRETRAINED_FILES if not (d / f).is_file()]
    if missing:
        raise CheckpointError(f"{d} is not an exported model: missing {', '.join(missing)} "
                              "(write one with python -m pipelines.export)")
    head = json.loads((d / "config.json").read_text())
    if head.get("model_type") != MODEL_TYPE or "model" not in head:
        raise CheckpointError(f"{d}/config.json is not an ADLM export (model_type {head.get('model_type')!r}); "
                              "export the model with python -m pipelines.export")
    model, cfg, meta = load_checkpoint(d, expect=expect, use_ema=False, map_location=map_location)
    return model.eval(), cfg, meta


__all__ = ["AUTO_MAP", "HF_CODE", "HF_SOURCES", "MODEL_TYPE", "PRETRAINED_FILES", "load_pretrained", "save_pretrained",
           "shipped_code"]
