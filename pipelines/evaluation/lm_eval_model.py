"""The project's models on EleutherAI's lm-evaluation-harness: an ``lm_eval.api.model.LM`` registered as ``adlm``.

Any model reference the pipeline takes (``models:/adlm@champion``, ``models:/adlm/3``, a checkpoint folder or
object-store location, an export) and every kind (docs/design/method.md, sections 1-3; ``adlm_model.inference.likelihood``):

- ``loglikelihood``: exact for AR; for MDLM, ADLM and BD3-LM the Monte Carlo ELBO of the continuation given
  the clean context (only the continuation is masked; ``mc_samples`` draws a request, ``mask_draws`` plain,
  antithetic or stratified masking counts); each request's standard error is kept (``self.stats``) and
  aggregated per task by the ``lm-eval`` suite. ``is_greedy`` (LAMBADA's accuracy): AR, the argmax at every
  token; the diffusion kinds, greedy decoding of the masked continuation (most confident token first) for
  continuations of at most ``greedy_max_tokens`` tokens (longer ones: False);
- ``loglikelihood_rolling``: minus the NELBO bound the pipeline computes (``compute_loss(train=False)``, the
  ``ppl`` suite's figure; AR: the exact NLL) on the document framed as training rows (``BOS doc EOS`` cut into
  rows of ``seq_len``, the last one padded and the padding not counted);
- ``generate_until``: the kind's sampler (``sampler=auto``) or any other (``sampler=remdm-loop``, ...) with
  ``steps`` and ``nucleus_p``, ``max_gen_toks`` new tokens after the context, cut at EOS and at the first stop
  sequence (``until``).

Settings (``--model_args`` of the harness, or ``EvalConfig.lm_eval_*``): ``AdapterSettings``. Every random draw
is seeded by the request's text and ``seed``: a request gets the same figure in any batch, order or process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from adlm_model import compute_loss
from adlm_model.config import ConfigError
from adlm_model.inference.infill import infill
from adlm_model.inference.likelihood import (
    MASK_DRAWS,
    ContinuationScorer,
    LikelihoodError,
    check_draws,
    model_logp_fn,
    model_nll_fn,
)
from adlm_model.interop.checkpoint import load_checkpoint
from adlm_model.kinds import check_sampler_kind, check_sampler_options, get_sampler, model_kind
from adlm_model.sampling.samplers import SamplerError
from pipelines.core.configlib import coerce_fields
from pipelines.core.seeds import derive_seed
from pipelines.core.storage import cache_dir, is_uri, resolve_workdir
from pipelines.evaluation.config import EvalError, resolve_sampler, sampler_options
from pipelines.evaluation.eval_lm import checkpoint_tokenizer, resolve_device
from pipelines.tracking.registry import resolve_model_ref
from pipelines.tracking.runs import resolve_tracking_uri

MODEL_NAME = "adlm"
"""The name the harness knows the adapter by (``lm_eval --model adlm``)."""
LM_EVAL_SEEDS = 26
"""Purpose part of the adapter's seeds (``pipelines.core.seeds``: the streams 10-12 are the evaluation's)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class AdapterSettings:
    """How the adapter scores and generates (every field a ``--model_args`` key)."""

    mc_samples: int = 32
    """Monte Carlo draws per request (diffusion kinds; even for antithetic and stratified draws)."""
    mask_draws: str = "stratified"
    """How the draws' numbers of masked tokens are spread: plain, antithetic or stratified."""
    batch_size: int = 32
    """Rows per forward pass."""
    device: str = "auto"
    """``auto`` (CUDA when present), ``cpu``, ``cuda``, ``cuda:N``."""
    dtype: str = "float32"
    """float32, or bfloat16/float16 autocast on CUDA (on CPU bf16 is about 19x slower: refused)."""
    seed: int = 0
    use_ema: bool = True
    """The EMA weights (docs/design/method.md, section 7) when the checkpoint has them."""
    greedy_max_tokens: int = 8
    """Diffusion kinds: continuations up to this long get a greedy-decoding ``is_greedy``; longer ones False."""
    t_draws: int = 1
    """``loglikelihood_rolling``: draws of t per row of the NELBO bound."""
    sampler: str = "auto"
    """``generate_until``: ``auto`` (the kind's default) or a sampler that runs on the kind
    (``adlm_model.kinds.samplers_for``: mdlm, remdm-loop, confidence, ar, bd3lm, sedd-euler, sedd-analytic)."""
    steps: int = 64
    """``generate_until``: sampling steps T."""
    nucleus_p: float = 1.0
    sampler_kwargs: dict[str, Any] = field(default_factory=dict)
    """``generate_until``: the sampler's options (ReMDM ``eta``, ...; the evaluation's ``--set sampler.NAME=V``)."""
    max_gen_toks: int = 32
    """``generate_until``: new tokens when the task does not say."""

    def validate(self) -> AdapterSettings:
        try:
            check_draws(self.mc_samples, self.mask_draws)
        except LikelihoodError as e:
            raise EvalError(f"lm-eval adapter: {e} (mc_samples, mask_draws: {', '.join(MASK_DRAWS)})") from e
        problems = [
            (self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}"),
            (self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"),
            (self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
             f"device must be auto, cpu or cuda[:N], got {self.device!r}"),
            (self.greedy_max_tokens >= 0, f"greedy_max_tokens must be >= 0, got {self.greedy_max_tokens}"),
            (self.t_draws >= 1, f"t_draws must be >= 1, got {self.t_draws}"),
            (self.steps >= 1, f"steps must be >= 1, got {self.steps}"),
            (0.0 < self.nucleus_p <= 1.0, f"nucleus_p must be in (0, 1], got {self.nucleus_p}"),
            (self.max_gen_toks >= 1, f"max_gen_toks must be >= 1, got {self.max_gen_toks}"),
        ]
        for ok, msg in problems:
            if not ok:
                raise EvalError(f"lm-eval adapter: {msg}")
        if self.sampler != "auto":
            try:
                check_sampler_options(self.sampler, dict(self.sampler_kwargs))
            except SamplerError as e:
                raise EvalError(f"lm-eval adapter: {e}") from e
        return self

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> AdapterSettings:
        """Typed settings from ``--model_args`` values (unknown keys refused in one line)."""
        try:
            return cls(**coerce_fields(cls, {k: v for k, v in kwargs.items() if v is not None}, "lm-eval adapter"))
        except ConfigError as e:
            raise EvalError(str(e)) from e


def request_seed(seed: int, *texts: str) -> int:
    """The seed of one request: its text and the run's seed (not its position in a batch)."""
    return derive_seed(seed, LM_EVAL_SEEDS, zlib.crc32("\x00".join(texts).encode()))


@register_model(MODEL_NAME)
class ADLMEvalLM(LM):
    """A project model as the harness sees it (module docstring)."""

    def __init__(self, pretrained: str = "", tracking_uri: str | None = None, max_batch_size: Any = None,
                 **settings: Any) -> None:
        super().__init__()
        if not pretrained:
            raise EvalError("lm-eval adapter: pass pretrained=MODEL (models:/adlm@champion, a checkpoint folder or "
                            "an export) in --model_args")
        if str(settings.get("batch_size", "")).startswith("auto"):
            settings.pop("batch_size")  # the harness's automatic batch size: ours is a setting
        self.settings = AdapterSettings.from_kwargs(settings).validate()
        s = self.settings
        self._device = resolve_device(s.device)
        if s.dtype != "float32" and self._device.type != "cuda":
            raise EvalError(f"lm-eval adapter: dtype {s.dtype} needs a CUDA device (autocast on CPU is about 19x "
                            "slower than float32); use dtype=float32")
        # The harness is this adapter's entry point: the work directory is resolved here, once ($ADLM_WORKDIR >
        # ./work), for the tracking store and the node's cache of downloaded versions.
        cache = None
        if pretrained.startswith("models:/") or is_uri(pretrained):  # a local folder needs no work directory
            wd = resolve_workdir(None)
            cache = None if is_uri(wd) else cache_dir(wd)
            if tracking_uri is None and pretrained.startswith("models:/"):
                tracking_uri = resolve_tracking_uri(wd)
        self.ref = resolve_model_ref(pretrained, tracking_uri, cache)
        self.model, self.cfg, meta = load_checkpoint(self.ref.local_dir, use_ema=s.use_ema, map_location=self._device)
        self.model.eval()
        if model_kind(self.cfg.kind).sample_only:  # the harness's tasks score likelihoods, which it has none of
            raise EvalError(f"lm-eval adapter: model kind {self.cfg.kind} is sample-only (no likelihood to score); "
                            "evaluate its samples with --suite gen_ppl or entropy")
        if s.sampler != "auto":  # a sampler that does not run on this kind: one line now, not at the first request
            try:
                check_sampler_kind(s.sampler, self.cfg.kind)
            except SamplerError as e:
                raise EvalError(f"lm-eval adapter: {e}") from e
        self.tok = checkpoint_tokenizer(self.ref.local_dir, meta)
        self.stats: list[dict[str, Any]] = []
        """One entry per loglikelihood request: task, loglik, stderr, tokens, samples (what the suite logs)."""
        self.scorer = self._scorer()

    # -- the model ------------------------------------------------------------------------------------
    def _scorer(self) -> ContinuationScorer:
        s, cfg = self.settings, self.cfg
        common = dict(seq_len=cfg.seq_len, mask_id=cfg.mask_id, bos_id=self.tok.bos_id, samples=s.mc_samples,
                      scheme=s.mask_draws, batch_size=s.batch_size, greedy_max_tokens=s.greedy_max_tokens,
                      pad_id=self._pad_id(), device=self._device)
        if not model_kind(cfg.kind).diffusion:
            return ContinuationScorer(ar_model=self.model, ar_cfg=cfg, **common)
        try:
            nll = model_nll_fn(self.model, cfg)
        except LikelihoodError as e:
            raise EvalError(f"lm-eval adapter: {e}") from e
        return ContinuationScorer(nll_fn=nll, logp_fn=model_logp_fn(self.model, cfg),
                                  block_size=cfg.block_size if model_kind(cfg.kind).block_diffusion else None,
                                  **common)

    def _pad_id(self) -> int:
        for i in (self.tok.pad_id, self.tok.eos_id):
            if i is not None:
                return int(i)
        return 0

    def _autocast(self) -> Any:
        if self.settings.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device_type="cuda", dtype=DTYPES[self.settings.dtype])

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode([text])[0] if text else []

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids as the whole text tokenises (the harness's convention: a context's
        trailing spaces move to the continuation)."""
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole, ctx = self._encode(context + continuation), self._encode(context)
        if whole[:len(ctx)] != ctx:  # a merge across the boundary: tokenise the two apart
            return ctx, self._encode(continuation)
        return ctx, whole[len(ctx):]

    # -- the harness's three requests -----------------------------------------------------------------
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out: list[tuple[float, bool]] = []
        chunk = max(1, self.settings.batch_size)
        with tqdm(total=len(requests), desc=f"lm-eval loglikelihood ({self.cfg.kind})", unit="request",
                  disable=disable_tqdm) as bar, self._autocast():
            for start in range(0, len(requests), chunk):
                reqs = requests[start:start + chunk]
                pairs = [self._encode_pair(*r.args) for r in reqs]
                seeds = [request_seed(self.settings.seed, *r.args) for r in reqs]
                for r, (est, greedy) in zip(reqs, self.scorer.score(pairs, seeds), strict=True):
                    out.append((est.loglik, greedy))
                    self.stats.append({"task": getattr(r, "task_name", None), "loglik": est.loglik,
                                       "stderr": est.stderr, "tokens": est.tokens, "samples": est.samples})
                    self.cache_hook.add_partial("loglikelihood", r.args, (est.loglik, greedy))
                bar.update(len(reqs))
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        cfg, s = self.cfg, self.settings
        out = []
        for r in tqdm(requests, desc="lm-eval loglikelihood_rolling (NELBO bound)", unit="document",
                      disable=disable_tqdm):
            (text,) = r.args[:1]
            ids = ([self.tok.bos_id] if self.tok.bos_id is not None else []) + self._encode(text) + \
                ([self.tok.eos_id] if self.tok.eos_id is not None else [])
            total = 0.0
            g = torch.Generator(device=self._device).manual_seed(request_seed(s.seed, text))
            for start in range(0, len(ids), cfg.seq_len):
                part = ids[start:start + cfg.seq_len]
                x = torch.full((1, cfg.seq_len), self._pad_id(), dtype=torch.long)
                am = torch.zeros((1, cfg.seq_len), dtype=torch.long)
                x[0, :len(part)] = torch.tensor(part)
                am[0, :len(part)] = 1
                with torch.no_grad(), self._autocast():
                    for _ in range(s.t_draws):
                        total += float(compute_loss(self.model, x.to(self._device), am.to(self._device), cfg,
                                                    train=False, generator=g).nll_sum) / s.t_draws
            out.append(-total)
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, -total)
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        cfg, s = self.cfg, self.settings
        sampler = resolve_sampler(s.sampler, cfg.kind)
        options = sampler_options(sampler, s.sampler_kwargs, self.tok)
        # infill puts BOS first itself (its bos_id); the samplers that list bos_id (ar, bd3lm) get it from there
        bos_id = options.pop("bos_id", self.tok.bos_id)
        out = []
        for r in tqdm(requests, desc=f"lm-eval generate_until ({sampler}, T={s.steps})", unit="request",
                      disable=disable_tqdm):
            context, kw = r.args[0], dict(r.args[1] if len(r.args) > 1 else {})
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(kw.get("max_gen_toks", s.max_gen_toks))
            prompt = self._encode(context)
            head = 1 if bos_id is not None else 0
            if not get_sampler(sampler).any_length:
                new = min(new, cfg.seq_len - head - 1)
                prompt = prompt[-(cfg.seq_len - head - new):]
            g = torch.Generator(device=self._device).manual_seed(request_seed(s.seed, context))
            with self._autocast():
                ids = infill(self.model, cfg, prompt, new_tokens=new, steps=s.steps, sampler=sampler,
                             nucleus_p=s.nucleus_p, generator=g, bos_id=bos_id, **options)[0].tolist()
            if self.tok.eos_id is not None and self.tok.eos_id in ids:
                ids = ids[:ids.index(self.tok.eos_id)]
            ids = [i for i in ids if i != cfg.mask_id and i != self.tok.pad_id]
            text = self._decode_after(prompt, ids)
            cuts = [text.find(u) for u in until if u and u in text]
            text = text[:min(cuts)] if cuts else text
            out.append(text)
            self.cache_hook.add_partial("generate_until", r.args, text)
        return out

    def _decode_after(self, prompt: list[int], new: list[int]) -> str:
        whole, head = self.tok.decode(prompt + new, skip_special_tokens=True), self.tok.decode(prompt, skip_special_tokens=True)
        return whole[len(head):] if whole.startswith(head) else self.tok.decode(new, skip_special_tokens=True)

    # -- what the harness reads besides ---------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return f"adlm-{self.ref.pinned}"

    def describe(self) -> dict[str, Any]:
        """The model and the settings, recorded with the figures."""
        return {"model": self.ref.uri, "pinned": self.ref.pinned, "kind": self.cfg.kind,
                "exact": not model_kind(self.cfg.kind).diffusion, **dataclasses.asdict(self.settings)}
