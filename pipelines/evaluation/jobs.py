"""The evaluation's units of work: pure functions that run the same in this process or in Ray tasks.

- ``ppl_job``: pooled NELBO sums over a row range of a split, each batch seeded by its global index (a
  split cut into tasks at batch boundaries gives exactly the figure of one pass).
- ``sample_job``: one seeded batch of samples.
- ``gen_ppl_job`` / ``mauve_job``: the evaluation LM's gen-PPL and MAUVE on features.

Models, evaluation LMs and featurizers are loaded once per process (a Ray worker reuses them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from adlm_model import compute_loss, sample
from adlm_model.interop.checkpoint import load_checkpoint
from pipelines.core.logs import verbosity
from pipelines.core.seeds import EVAL_LONG_SAMPLES, EVAL_MAUVE, EVAL_NELBO, EVAL_SAMPLES, derive_seed
from pipelines.data.reader import read_subset
from pipelines.evaluation.config import EvalConfig
from pipelines.evaluation.eval_lm import load_eval_lm, load_featurizer, resolve_device
from pipelines.evaluation.metrics import PooledNLL, generative_perplexity, mauve_score
from pipelines.tracking.registry import resolve_model_ref


def batch_seed(seed: int, batch_index: int, draw: int = 0) -> int:
    """Seed of the ``t``/mask draws of NELBO batch ``batch_index`` (global index in its split), draw ``draw``."""
    return derive_seed(seed, EVAL_NELBO, batch_index, draw)


def sample_seed(seed: int, batch_index: int) -> int:
    """Seed of sampling batch ``batch_index``."""
    return derive_seed(seed, EVAL_SAMPLES, batch_index)


@dataclass
class JobSettings:
    """What every job needs (pickled into Ray tasks): the evaluation's settings and what the plan resolved."""

    cfg: EvalConfig
    sampler: str = "mdlm"
    """The sampler ``cfg.sampler`` resolved to (``auto``: the model kind's default)."""
    sampler_kwargs: dict[str, Any] = field(default_factory=dict)
    """Its options, with the special ids the AR and BD3-LM samplers take from the tokenizer."""
    length: int = 0
    """Tokens per sample."""
    steps: int = 0
    """Sampling steps T for this model's kind."""
    cache_dir: str | None = None
    """Where registry versions are downloaded on this node (None: ``storage.cache_dir()``)."""
    shared_cache: str | None = None
    """The work directory's cache in the object store (a remote work directory): converted evaluation LMs that
    every node fetches instead of converting again."""
    tracking_uri: str | None = None




_MODELS: dict[tuple, Any] = {}


def _device(device: str) -> Any:
    return resolve_device(device)


def load_eval_model(model: str, settings: JobSettings) -> tuple[Any, Any, dict[str, Any]]:
    """(model in eval mode, ModelConfig, meta) of ``model`` (a ``models:/`` URI or a checkpoint location),
    resolved on this node (``registry.resolve_model_ref``: downloaded into this node's cache) and kept per process:
    a Ray worker reuses it across tasks."""
    dev = _device(settings.cfg.device)
    key = (model, settings.tracking_uri, str(dev), settings.cfg.use_ema)
    if key not in _MODELS:
        local = resolve_model_ref(model, settings.tracking_uri, settings.cache_dir).local_dir
        m, cfg, meta = load_checkpoint(local, use_ema=settings.cfg.use_ema, map_location=dev)
        _MODELS.clear()  # one model per worker process at a time
        _MODELS[key] = (m.eval(), cfg, meta)
    return _MODELS[key]


def score_rows(model: Any, cfg: Any, ids: np.ndarray, mask: np.ndarray | None, *, batch_size: int, seed: int,
               t_draws: int = 1, first_batch: int = 0, progress: Callable[[int], Any] | None = None) -> Any:
    """Pooled NELBO (docs/design/method.md, section 1) of ``ids`` with the evaluation objective.

    Batch ``k`` of these rows is global batch ``first_batch + k`` of its split and draws its stratified
    times and masks from ``batch_seed(seed, first_batch + k, draw)``: so a split cut into tasks at batch
    boundaries gives exactly the figure of one pass. ``compute_loss(train=False)`` is the training code's
    objective with the anchor term left out (docs/design/method.md, section 2: evaluation reports the pure NELBO).
    """
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


def ppl_job(model: str, split_dir: str, start: int, stop: int, settings: JobSettings,
            progress: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """NELBO sums over rows ``[start, stop)`` of a split's evaluation subset (``max_rows`` rows spread over the
    split, or all of it; ``start`` is a multiple of the batch size)."""
    net, cfg, _ = load_eval_model(model, settings)
    ids, mask = read_subset(split_dir, settings.cfg.max_rows, start, stop)
    bs = settings.cfg.batch_size
    pooled = score_rows(net, cfg, ids, mask, batch_size=bs, seed=settings.cfg.seed, t_draws=settings.cfg.t_draws,
                        first_batch=start // bs, progress=progress)
    return {"nll_sum": pooled.nll_sum, "n_tokens": pooled.n_tokens, "rows": int(ids.shape[0])}


def sample_job(model: str, batch_index: int, n: int, settings: JobSettings,
               progress: Callable[[int, int], Any] | None = None) -> np.ndarray:
    """``n`` samples (int64 ids ``(n, length)``) of sampling batch ``batch_index``, seeded per batch."""
    net, cfg, _ = load_eval_model(model, settings)
    dev = next(net.parameters()).device
    g = torch.Generator(device=dev).manual_seed(sample_seed(settings.cfg.seed, batch_index))
    out = sample(net, cfg, batch_size=n, length=settings.length, steps=settings.steps,
                 sampler=settings.sampler, nucleus_p=settings.cfg.nucleus_p, generator=g, progress=progress,
                 **settings.sampler_kwargs)
    return out.detach().cpu().numpy().astype(np.int64)


def long_sample_job(model: str, batch_index: int, n: int, settings: JobSettings,
                    progress: Callable[[int, int], Any] | None = None) -> dict[str, Any]:
    """``sample_job`` for the arbitrary-length suite: ``n`` samples of ``settings.length`` tokens, seeded per batch on
    a stream of their own, with the network calls the batch took (``ids``, ``network_calls``)."""
    net, cfg, _ = load_eval_model(model, settings)
    dev = next(net.parameters()).device
    g = torch.Generator(device=dev).manual_seed(derive_seed(settings.cfg.seed, EVAL_LONG_SAMPLES, batch_index))
    stats: dict[str, Any] = {}
    out = sample(net, cfg, batch_size=n, length=settings.length, steps=settings.steps, sampler=settings.sampler,
                 nucleus_p=settings.cfg.nucleus_p, generator=g, progress=progress, stats=stats,
                 **settings.sampler_kwargs)
    return {"ids": out.detach().cpu().numpy().astype(np.int64), "network_calls": int(stats.get("network_calls", 0))}


_LOADED: dict[str, tuple[Any, Any]] = {}


def _cached(slot: str, key: Any, load: Callable[[], Any]) -> Any:
    """One loaded evaluation LM / featurizer per process (a Ray worker reuses it across tasks)."""
    if slot not in _LOADED or _LOADED[slot][0] != key:
        _LOADED.pop(slot, None)
        _LOADED[slot] = (key, load())
    return _LOADED[slot][1]


def gen_ppl_job(texts: list[list[str]], settings: JobSettings, max_length: int = 0,
                long: bool = False) -> dict[str, Any]:
    """Load the evaluation LM and compute gen-PPL (docs/design/method.md, section 6) of the samples ``texts`` (each a list
    of its documents' texts). ``long``: truncated to ``max_length`` tokens and scored in windows of the LM's
    context moved by half of it (BD3-LM's arbitrary-length table: 1024 and 512 for gpt2-large)."""
    # lazy: keeps tqdm out of this module's import
    from tqdm.auto import tqdm

    lm = _cached("lm", (settings.cfg.eval_lm, settings.cfg.device), lambda: load_eval_lm(
        settings.cfg.eval_lm, device=settings.cfg.device, tracking_uri=settings.tracking_uri,
        shared_cache=settings.shared_cache))
    # Documents inside one sample are joined with the LM's EOS text: they re-tokenise to EOS, and EOS
    # targets are excluded (docs/design/method.md, section 6), as in the reference where <|endoftext|> stays in the text.
    sep = lm.eos_text if lm.eos_text else "\n\n"
    joined = [sep.join(segs) for segs in texts]
    with tqdm(total=len(joined), desc="gen-PPL scoring", unit="sample", disable=verbosity() < 0) as bar:
        r = generative_perplexity(lm, joined, batch_size=settings.cfg.eval_lm_batch_size,
                                  max_length=max_length or settings.cfg.gen_ppl_max_length,
                                  first_token=settings.cfg.gen_ppl_first_token, progress=bar.update,
                                  stride=max(lm.max_length // 2, 1) if long else 0)
    return dataclasses.asdict(r)


def mauve_job(sample_texts: list[str], reference_texts: list[str], settings: JobSettings) -> dict[str, Any]:
    """Featurise both sets with the configured featurizer, then MAUVE (docs/design/method.md, section 6)."""
    feat = _cached("featurizer", (settings.cfg.mauve_featurizer, settings.cfg.device), lambda: load_featurizer(
        settings.cfg.mauve_featurizer, device=settings.cfg.device, shared_cache=settings.shared_cache))
    p = feat.features(sample_texts)
    q = feat.features(reference_texts)
    r = mauve_score(p, q, featurizer=feat.name, min_samples=settings.cfg.mauve_min_samples,
                    seed=derive_seed(settings.cfg.seed, EVAL_MAUVE), scaling_factor=settings.cfg.mauve_scaling)
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
