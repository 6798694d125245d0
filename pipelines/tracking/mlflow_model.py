"""How a checkpoint becomes an MLflow Model: what every registered version is (the registry's contract, beside
``registry.py``, which registers it; ``serving/`` reads it: the served code is ``serving/pyfunc_model.py``).

``log_text_model(run_id, checkpoint_dir, tracking_uri)`` logs a pyfunc model into the training run,
models-from-code (``pyfunc_model.py``, never a pickle):

- ``artifacts/checkpoint/``: the checkpoint as training exported it (``config.json``, ``model.safetensors``,
  ``ema.safetensors``, ``tokenizer.json``) plus ``special_tokens.json`` (the tokenizer's BOS/EOS/pad/mask
  ids, resolved here once with ``pipelines.data.tokenizer`` so the served model needs no ``pipelines``);
- ``code/adlm_model/``: the model package, the only project code the served model imports;
- the signature (``signature()``), and ``requirements.txt`` pinned to the versions of this environment,
  the one that trained the model (``pip_requirements()``).

A checkpoint that lacks a file fails here with one line (``RegistryError``), before anything is logged:
a registered version is never an empty or partial model.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import adlm_model
from adlm_model.inference.textgen import SPECIAL_TOKENS_FILE
from adlm_model.interop.checkpoint import read_config
from pipelines.compat import mlflow as compat_mlflow
from pipelines.data.tokenizer import TokenizerError, load_tokenizer
from pipelines.tracking.runs import client

CODE_FILE = Path(__file__).parents[1] / "serving" / "pyfunc_model.py"
"""The model's code (models-from-code)."""
MODEL_NAME = "model"
"""Name of the logged model inside the run."""
MODEL_TYPE = "adlm-text-generation"
CHECKPOINT_KEY = "checkpoint"
"""The pyfunc artifact holding the checkpoint: ``artifacts/checkpoint`` in the model folder."""
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
OPTIONAL_FILES = ("ema.safetensors",)
PINNED = ("mlflow", "torch", "safetensors", "tokenizers", "numpy", "pandas")
"""The distributions the served model imports (``pyfunc_model.py`` and ``adlm_model``)."""


class ModelPackagingError(ValueError):
    """A checkpoint that cannot become a registered model (a missing file, no tokenizer)."""


REQUEST_FIELDS = {"prompt": "string", "suffix": "string", "length": "integer", "steps": "integer",
                  "sampler": "string", "nucleus_p": "double", "seed": "integer", "threshold": "double",
                  "block": "integer", "refresh": "integer", "kv_cache": "string", "stop_at_eos": "boolean"}
"""The request fields of the served model and their types (``adlm_model.inference.textgen.GenerationRequest`` without
``num_samples``), recorded in the MLmodel's ``metadata.request_fields``; ``prompt`` is the only required one."""


def signature() -> Any:
    """Output: ``text``, ``completion``, ``new_tokens``, ``seconds``, ``seed``, ``sampler``, ``steps``,
    ``settings``, ``network_calls``. No input schema on purpose: MLflow enforces one by dropping the columns it
    does not name before the model sees them, so a misspelt field (``lenght``) would be answered with the
    default instead of refused. The request fields and their types are ``REQUEST_FIELDS`` (the MLmodel's
    metadata), checked by ``adlm_model.inference.textgen`` (integers, ranges, unknown fields) and ``adlm_model.inference.limits``."""
    # lazy: keeps mlflow out of this module's import
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    outputs = Schema([ColSpec("string", "text"), ColSpec("string", "completion"), ColSpec("long", "new_tokens"),
                      ColSpec("double", "seconds"), ColSpec("long", "seed"), ColSpec("string", "sampler"),
                      ColSpec("long", "steps"), ColSpec("string", "settings"), ColSpec("long", "network_calls")])
    return ModelSignature(outputs=outputs)


def pip_requirements() -> list[str]:
    """``name==version`` of ``PINNED`` as installed here (local labels such as ``+cpu`` dropped: a GPU
    host installs its CUDA build of the same version)."""
    return [f"{name}=={re.sub(r'[+].*$', '', metadata.version(name))}" for name in PINNED]


def stage_checkpoint(src: Path, dst: Path) -> Path:
    """Copy the checkpoint files the model serves into ``dst`` and add ``special_tokens.json``."""
    missing = [f for f in ("config.json", "model.safetensors") if not (src / f).is_file()]
    if missing:
        raise ModelPackagingError(f"checkpoint {src} lacks {', '.join(missing)}: register a folder written by "
                                  "training (<workdir>/checkpoints/<run name>, or a Ray checkpoint folder)")
    dst.mkdir(parents=True, exist_ok=True)
    for f in REQUIRED_FILES + OPTIONAL_FILES:
        if (src / f).is_file():
            shutil.copyfile(src / f, dst / f)
    cfg, meta = read_config(src)
    try:
        if (src / "tokenizer.json").is_file():
            tok = load_tokenizer(str(src / "tokenizer.json"))
        elif meta.get("tokenizer"):  # a named tokenizer (gpt2): write its tokenizer.json into the model
            tok = load_tokenizer(str(meta["tokenizer"]))
            tok.save(dst / "tokenizer.json")
        else:
            raise ModelPackagingError(f"checkpoint {src} has no tokenizer.json and names no tokenizer in its meta: "
                                      "the served model could not encode text")
    except TokenizerError as e:
        raise ModelPackagingError(f"checkpoint {src}: its tokenizer cannot be loaded ({e})") from e
    if tok.mask_id != cfg.mask_id or tok.width > cfg.width:
        raise ModelPackagingError(f"checkpoint {src}: tokenizer {tok.name!r} (mask {tok.mask_id}, width {tok.width}) "
                                  f"does not fit the model (mask {cfg.mask_id}, width {cfg.width})")
    (dst / SPECIAL_TOKENS_FILE).write_text(json.dumps(
        {"bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id, "mask_id": tok.mask_id}, indent=2))
    missing = [f for f in REQUIRED_FILES if not (dst / f).is_file()]
    if missing:
        raise ModelPackagingError(f"staged model {dst} lacks {', '.join(missing)}")
    return dst


@contextlib.contextmanager
def using_tracking_uri(tracking_uri: str) -> Iterator[None]:
    """MLflow's process-wide tracking URI set to ``tracking_uri`` for a block, then restored as it was.

    Logging a model, and registering one by its ``models:/<model id>`` URI (the registry store looks the
    logged model up with a default client), read the tracking store from that global, not from a client.
    Restored by hand: ``mlflow.set_tracking_uri(None)`` would also delete a ``MLFLOW_TRACKING_URI`` that the
    user's environment set."""
    # lazy: keeps mlflow out of this module's import
    import mlflow

    old_global, old_env = compat_mlflow.global_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(tracking_uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(old_global)
        if old_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old_env


def log_text_model(run_id: str, checkpoint_dir: Path, tracking_uri: str, tmp: Path) -> Any:
    """Log the MLflow Model of ``checkpoint_dir`` into run ``run_id``; returns MLflow's ``ModelInfo``
    (``model_id``, ``model_uri``). ``tmp``: a scratch folder for the staged checkpoint."""
    # lazy: keeps mlflow out of this module's import
    import mlflow
    from mlflow.models import Model

    staged = stage_checkpoint(checkpoint_dir, tmp / CHECKPOINT_KEY)
    c = client(tracking_uri)
    run = c.get_run(run_id)
    # The logged model is created here, in the run's experiment: Model.log would put it in the process's
    # active experiment (the default one, whose artifacts land in ./mlruns) when no run is active.
    logged = c.create_logged_model(experiment_id=run.info.experiment_id, name=MODEL_NAME, source_run_id=run_id,
                                   params=dict(run.data.params), model_type=MODEL_TYPE)
    with using_tracking_uri(tracking_uri), warnings.catch_warnings():
        # No input example on purpose: MLflow would run a generation at logging time to check it.
        warnings.filterwarnings("ignore", message=".*input example was not provided.*", category=UserWarning)
        return Model.log(artifact_path=None, name=MODEL_NAME, flavor=mlflow.pyfunc, run_id=run_id,
                         model_id=logged.model_id, python_model=str(CODE_FILE), artifacts={CHECKPOINT_KEY: str(staged)},
                         code_paths=[str(Path(adlm_model.__file__).parent)], signature=signature(),
                         pip_requirements=pip_requirements(), metadata={"request_fields": REQUEST_FIELDS})


def checkpoint_in_model(model_dir: Path) -> Path | None:
    """The checkpoint folder inside a downloaded MLflow Model (from its MLmodel), None if it is not one."""
    # lazy: keeps yaml out of this module's import
    import yaml

    mlmodel = model_dir / "MLmodel"
    if not mlmodel.is_file():
        return None
    spec = yaml.safe_load(mlmodel.read_text()) or {}
    arts = ((spec.get("flavors") or {}).get("python_function") or {}).get("artifacts") or {}
    rel = (arts.get(CHECKPOINT_KEY) or {}).get("path")
    return model_dir / rel if rel else None
