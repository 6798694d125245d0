"""Evaluation metrics, each with exactly one definition (docs/design/method.md, section 6).

- **Perplexity bound** (docs/design/method.md, sections 1 and 6): ``PPL = exp(sum of per-token NELBO / number of
  tokens)`` over the whole split. The per-batch sums come from ``adlm_model.kinds.compute_loss`` (its
  ``nll_sum`` and ``n_tokens``); ``PooledNLL`` adds them up exactly (float64 sums, integer counts), so the
  result does not depend on how batches were split across workers.
- **Generative perplexity** (``generative_perplexity``): decoded samples are re-tokenised with the
  evaluation LM's tokenizer, truncated to 1024 tokens (or the LM's maximum when smaller), scored by the
  evaluation LM, and the NLL is pooled over tokens -- ``exp(sum of NLL / number of scored tokens)``, not a
  mean of per-sample perplexities. Targets that are the evaluation LM's EOS token are excluded. Each
  sample's first token has no context and is never a target.
- **Unigram entropy** (``unigram_entropy``): per sample, the entropy in nats of the histogram of its token
  ids; reported as the mean over samples, always next to gen-PPL.
- **MAUVE** (``mauve_score``): ``mauve-text`` on features that we compute (never raw text, which makes
  the package download GPT-2), generated texts against the same number of reference texts.
- **Answer accuracy** (the ``accuracy`` suite, ``pipelines/evaluation/accuracy.py``): the share of a reasoning
  split's rows whose greedy answer (the text after the last ``#``) equals the gold answer exactly
  (``pipelines/data/reasoning/answers.py``), with Wilson's 95% score interval (``wilson_interval``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Protocol

import numpy as np
import torch

from adlm_model.sampling.samplers import unigram_entropy

GEN_PPL_MAX_TOKENS = 1024
"""docs/design/method.md, section 6: samples are truncated to 1024 evaluation-LM tokens (or the LM's maximum)."""

MAUVE_MIN_SAMPLES = 50
"""Fewer samples than this make MAUVE's k-means histogram (n/10 buckets) meaningless; the paper uses 5,000."""


class MetricError(ValueError):
    """Input a metric cannot be computed on (too few samples, mismatched sets); one line with the fix."""


# ----------------------------------------------------------------------------------------------------------
# Exact pooling of token-level NLL sums.


@dataclass
class PooledNLL:
    """A float64 sum of per-token NLL (or NELBO) and the number of tokens it runs over."""

    nll_sum: float = 0.0
    n_tokens: int = 0

    def add(self, nll_sum: float | torch.Tensor, n_tokens: int | torch.Tensor) -> PooledNLL:
        self.nll_sum += float(nll_sum)
        self.n_tokens += int(n_tokens)
        return self

    def __add__(self, other: PooledNLL) -> PooledNLL:
        return PooledNLL(self.nll_sum + other.nll_sum, self.n_tokens + other.n_tokens)

    @property
    def nll(self) -> float:
        """Mean NLL per token in nats (``nan`` when no token was scored)."""
        return self.nll_sum / self.n_tokens if self.n_tokens else float("nan")

    @property
    def ppl(self) -> float:
        """``exp(sum NLL / tokens)``: the pooled perplexity (docs/design/method.md, sections 1 and 6)."""
        return (math.exp(self.nll) if self.nll < 709.0 else math.inf) if self.n_tokens else float("nan")


# ----------------------------------------------------------------------------------------------------------
# Unigram entropy (one definition, in adlm_model.sampling.samplers: BD3-LM's stop rule uses it too).


def mean_unigram_entropy(samples: Iterable[Sequence[int] | np.ndarray | torch.Tensor]) -> float:
    """Mean over samples of ``unigram_entropy`` (the figure reported with gen-PPL)."""
    values = [unigram_entropy(s) for s in samples]
    if not values:
        raise MetricError("unigram entropy of an empty sample set: generate at least one sample")
    return float(np.mean(values))


# ----------------------------------------------------------------------------------------------------------
# Generative perplexity.


class CausalScorer(Protocol):
    """What ``generative_perplexity`` needs from an evaluation LM (``pipelines.evaluation.eval_lm.EvalLM``)."""

    name: str
    eos_id: int | None
    max_length: int

    def encode(self, texts: list[str]) -> list[list[int]]: ...

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...


@dataclass
class GenPPLResult:
    """Token-pooled generative perplexity and what it was pooled over."""

    gen_ppl: float
    nll_sum: float
    n_tokens: int
    """Scored target tokens (EOS targets excluded; each sample's first token scored after a leading EOS with
    ``first_token='keep'``, left out as context with ``'drop'``)."""
    n_samples: int
    n_truncated: int
    """Samples longer than the truncation length (cut to ``max_length`` evaluation-LM tokens)."""
    max_length: int
    eval_lm: str
    first_token: str = "keep"
    """``keep`` (the reference: the sample is scored after the LM's EOS, so its first token is a target) or
    ``drop`` (the first token is context only)."""


GEN_PPL_FIRST_TOKEN = ("keep", "drop")
GEN_PPL_DEFINITIONS = {
    "keep": "first token scored after the LM's EOS (reference)",
    "drop": "first token context only (not the reference)",
}
"""What each ``first_token`` choice means, as printed next to every gen-PPL figure."""


def token_nll(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              eos_id: int | None) -> tuple[float, int]:
    """Pooled next-token NLL of a right-padded batch: (float64 sum, number of targets).

    Targets are ``input_ids[:, 1:]``; a target counts when it is a real (non-pad) position and not the
    EOS token (docs/design/method.md, section 6: EOS targets are excluded).
    """
    lf = logits[:, :-1].float()
    target = input_ids[:, 1:].to(lf.device)
    valid = attention_mask[:, 1:].to(lf.device).bool()
    if eos_id is not None:
        valid &= target != eos_id
    # -log softmax(l)[y] = logsumexp(l) - l[y], in float32 (a float64 copy of (B, L, V) would not fit for
    # gpt2-large); the sum over tokens is taken in float64.
    nll = torch.logsumexp(lf, dim=-1) - lf.gather(-1, target[..., None]).squeeze(-1)
    return float(nll[valid].double().sum()), int(valid.sum())


def sliding_window_nll(lm: CausalScorer, seqs: Sequence[Sequence[int]], window: int, stride: int) -> tuple[float, int]:
    """Pooled NLL (float64 sum, targets) of sequences longer than the LM's context, as BD3-LM scores its long
    samples: the first window of ``window`` tokens scores every target in it; each next window, moved by
    ``stride``, scores only its last ``stride`` targets, each seen after ``window - stride`` tokens or more of
    context. EOS targets excluded (docs/design/method.md, section 6)."""
    if not 1 <= stride < window:
        raise MetricError(f"the gen-PPL stride must lie in [1, {window}) (the LM's context), got {stride}")
    total, count, k = 0.0, 0, 0
    while True:
        start = k * stride
        first = 1 if k == 0 else start + window - stride  # first target position this window scores
        rows = [s[start:start + window] for s in seqs if len(s) > first]
        if not rows:
            return total, count
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(list(r), dtype=torch.long)
            mask[i, :len(r)] = 1
        lf = lm.logits(ids, mask)[:, :-1].float()
        target = ids[:, 1:].to(lf.device)
        valid = mask[:, 1:].to(lf.device).bool()
        valid &= (start + 1 + torch.arange(width - 1, device=lf.device)) >= first
        if lm.eos_id is not None:
            valid &= target != lm.eos_id
        nll = torch.logsumexp(lf, dim=-1) - lf.gather(-1, target[..., None]).squeeze(-1)
        total += float(nll[valid].double().sum())
        count += int(valid.sum())
        k += 1


def reached_length(ids: Sequence[int] | np.ndarray | torch.Tensor, window: int, min_entropy: float) -> bool:
    """Whether a sample of the arbitrary-length suite reached its length: every whole window of ``window`` tokens
    (``[0, w)``, ``[w, 2w)``, ...) keeps a unigram entropy of at least ``min_entropy`` nats, BD3-LM's stop rule (its
    sampler stops, and its table redraws, a sample whose last 256 tokens fall below 4 nats)."""
    a = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    a = a.reshape(-1)
    return all(unigram_entropy(a[i:i + window]) >= min_entropy for i in range(0, a.size - window + 1, window))


@torch.no_grad()
def generative_perplexity(lm: CausalScorer, texts: Sequence[str], *, batch_size: int = 8,
                          max_length: int | None = None, first_token: str = "keep",
                          progress: Callable[[int], Any] | None = None, stride: int = 0) -> GenPPLResult:
    """Gen-PPL of ``texts`` under ``lm`` (docs/design/method.md, section 6).

    Each text is re-tokenised with the LM's tokenizer (no special tokens added); with ``first_token='keep'``
    (the reference, whose samples keep their leading EOS) the LM's EOS id goes first, so that the sample's
    first real token is a target; with ``'drop'`` the first token is context only. Each sequence is truncated
    to ``min(1024, lm.max_length)`` tokens (or ``max_length``), scored in right-padded batches, and the NLL of
    every target except EOS targets is pooled over tokens. ``progress(n)`` is called after each batch.

    ``stride`` > 0 (long samples, BD3-LM's arbitrary-length table): truncated to ``max_length`` tokens, not to the
    LM's context, and a sequence longer than the context is scored in windows moved by ``stride``
    (``sliding_window_nll``).
    """
    if first_token not in GEN_PPL_FIRST_TOKEN:
        raise MetricError(f"first_token {first_token!r}: use keep (the reference) or drop")
    limit = (max_length or GEN_PPL_MAX_TOKENS) if stride else min(max_length or GEN_PPL_MAX_TOKENS, lm.max_length)
    encoded = lm.encode(list(texts))
    if first_token == "keep" and lm.eos_id is not None:
        encoded = [[lm.eos_id, *ids] for ids in encoded]
    n_truncated = sum(len(ids) > limit for ids in encoded)
    encoded = [ids[:limit] for ids in encoded]
    pooled = PooledNLL()
    # Sorting by length keeps padding small; the pooled sum does not depend on the order.
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    for start in range(0, len(order), batch_size):
        batch = [encoded[i] for i in order[start:start + batch_size]]
        width = max((len(b) for b in batch), default=0)
        if stride and width > lm.max_length:
            pooled.add(*sliding_window_nll(lm, batch, lm.max_length, stride))
        elif width >= 2:
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for r, b in enumerate(batch):
                ids[r, :len(b)] = torch.tensor(b, dtype=torch.long)
                mask[r, :len(b)] = 1
            pooled.add(*token_nll(lm.logits(ids, mask), ids, mask, lm.eos_id))
        if progress is not None:
            progress(len(batch))
    return GenPPLResult(gen_ppl=pooled.ppl, nll_sum=pooled.nll_sum, n_tokens=pooled.n_tokens,
                        n_samples=len(encoded), n_truncated=n_truncated, max_length=limit, eval_lm=lm.name,
                        first_token=first_token)


# ----------------------------------------------------------------------------------------------------------
# MAUVE.


@dataclass
class MauveResult:
    mauve: float
    frontier_integral: float
    num_buckets: int
    n_samples: int
    featurizer: str


def check_mauve_inputs(n_generated: int, n_reference: int, min_samples: int = MAUVE_MIN_SAMPLES) -> None:
    """Raise MetricError (before any featurisation) when MAUVE cannot be meaningful."""
    if n_generated < min_samples:
        raise MetricError(f"MAUVE needs at least {min_samples} samples, got {n_generated}: raise num_samples "
                          f"(the paper uses 5000) or lower mauve_min_samples")
    if n_reference < n_generated:
        raise MetricError(f"MAUVE compares {n_generated} samples with as many reference texts, but only "
                          f"{n_reference} are available: use a larger reference split or fewer samples")


def mauve_score(p_features: np.ndarray, q_features: np.ndarray, *, featurizer: str,
                min_samples: int = MAUVE_MIN_SAMPLES, num_buckets: int | str = "auto", seed: int = 25,
                scaling_factor: float = 5.0, kmeans_num_redo: int = 5, kmeans_max_iter: int = 500) -> MauveResult:
    """MAUVE of generated features ``p`` against as many reference features ``q`` (docs/design/method.md, section 6).

    Features (``(n, d)`` arrays) come from ``pipelines.evaluation.eval_lm.Featurizer``; the featurizer's name is
    recorded with the score. Runs on CPU (``device_id=-1``): featurisation already happened.
    """
    p = np.asarray(p_features, dtype=np.float32)
    q = np.asarray(q_features, dtype=np.float32)
    check_mauve_inputs(p.shape[0], q.shape[0], min_samples)
    if p.shape[0] != q.shape[0]:
        raise MetricError(f"MAUVE compares equal numbers of texts: {p.shape[0]} generated vs {q.shape[0]} reference")
    if p.ndim != 2 or p.shape[1] != q.shape[1]:
        raise MetricError(f"MAUVE features must be (n, d) arrays of one width, got {p.shape} and {q.shape}")
    # lazy: keeps mauve out of this module's import
    import mauve

    out = mauve.compute_mauve(p_features=p, q_features=q, device_id=-1, num_buckets=num_buckets, seed=seed,
                              mauve_scaling_factor=scaling_factor, kmeans_num_redo=kmeans_num_redo,
                              kmeans_max_iter=kmeans_max_iter, verbose=False)
    return MauveResult(mauve=float(out.mauve), frontier_integral=float(out.frontier_integral),
                       num_buckets=int(out.num_buckets), n_samples=int(p.shape[0]), featurizer=featurizer)


# ----------------------------------------------------------------------------------------------------------
# A proportion's interval (an accuracy over rows).


def wilson_interval(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval for a proportion (an accuracy of ``successes`` out of ``n``): unlike the normal
    approximation it stays inside [0, 1] and is not empty at 0 or ``n`` successes."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval({successes}, {n}): need 0 <= successes <= n and n >= 1")
    z = NormalDist().inv_cdf(0.5 + level / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)
