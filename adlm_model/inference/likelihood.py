"""Log-likelihoods of a continuation given a clean context, for every model kind (docs/design/method.md, sections 1-3).

- **AR**: exact, ``sum_i log p(y_i | c, y_<i)`` from one causal pass.
- **MDLM / ADLM / BD3-LM**: a Monte Carlo estimate of the ELBO of the continuation ``y`` (``n`` tokens) given
  the clean context ``c`` (only the continuation is ever masked). One draw masks ``l`` of the ``n`` tokens,
  ``l`` uniform on ``1..n``, the positions uniform given ``l``, and scores
  ``(n / l) sum_{masked i} -log p(y_i | c, visible y)``: the discrete-time form of the NELBO (the any-order
  autoregressive bound of docs/design/method.md, section 1 -- its expectation is the average over orderings of the
  any-order NLL, so with the exact conditionals of a known distribution every draw's expectation is exactly
  ``-log p(y | c)``). For BD3-LM the draw is made per block of the continuation, each block conditioned on
  the clean blocks before it (docs/design/method.md, section 3), and the blocks' terms add up.
- **SEDD**: the same draws with its score entropy in place of ``-log p`` (``sedd.continuation_fns``: an upper bound
  on the NLL of its normalised score, equal to it with the exact score), the time-conditioned network at the sigma
  whose masking rate is the row's masked fraction.

The draws of ``l`` over the ``K`` samples of one request are ``plain`` (independent), ``antithetic`` (pairs
``l, n + 1 - l``) or ``stratified`` (``l_k = ceil(n (k + U_k) / K)``: one draw in each of ``K`` equal slices of
the masking rate). Each request's estimate comes with a standard error: the sample standard error for plain
draws, that of the pair means for antithetic ones, and the collapsed-strata estimate
``sqrt(sum_j (x_2j - x_2j+1)^2) / K`` for stratified ones (pairs of adjacent strata; conservative: it also
counts the difference between the strata's means).

The networks are called through ``nll_fn(z, x) -> (N, L)`` (per-token ``-log p(x^l | z)`` at the masked
positions of ``z``, anything elsewhere): ``model_nll_fn`` builds it for a model; a test passes an exact oracle.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..config import KIND_TABLE, ModelConfig
from ..objectives.losses import subs_nll, suppress_mask

MASK_DRAWS = ("plain", "antithetic", "stratified")
NLLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class LikelihoodError(ValueError):
    """Settings of an estimate that cannot be used (one line with the fix)."""


@dataclass
class Estimate:
    """One request's log-likelihood (nats) and its Monte Carlo standard error (0 when exact)."""

    loglik: float
    stderr: float
    tokens: int
    """Continuation tokens scored."""
    samples: int
    """Monte Carlo draws (0: exact)."""


def check_draws(samples: int, scheme: str) -> None:
    if scheme not in MASK_DRAWS:
        raise LikelihoodError(f"mask draws {scheme!r}: use one of {', '.join(MASK_DRAWS)}")
    if samples < 2:
        raise LikelihoodError(f"Monte Carlo samples must be >= 2 (a standard error needs two), got {samples}")
    if scheme != "plain" and samples % 2:
        raise LikelihoodError(f"{scheme} mask draws pair the samples: use an even number of samples, got {samples}")


def mask_counts(n: int, samples: int, scheme: str, generator: torch.Generator | None) -> torch.Tensor:
    """``samples`` numbers of masked tokens in ``1..n`` (LongTensor) drawn by ``scheme`` (module docstring)."""
    if scheme == "plain":
        return torch.randint(1, n + 1, (samples,), generator=generator)
    if scheme == "antithetic":
        first = torch.randint(1, n + 1, (samples // 2,), generator=generator)
        return torch.stack([first, n + 1 - first], dim=1).reshape(-1)
    u = (torch.arange(samples, dtype=torch.float64) + torch.rand(samples, generator=generator, dtype=torch.float64))
    return torch.ceil(u / samples * n).long().clamp(1, n)


def combine(draws: torch.Tensor, scheme: str) -> tuple[float, float]:
    """(mean, standard error) of one request's ``K`` draws under ``scheme``."""
    x = draws.double()
    k = x.numel()
    if scheme == "plain":
        return float(x.mean()), float(x.std(unbiased=True) / math.sqrt(k))
    pairs = x.view(-1, 2)
    if scheme == "antithetic":
        m = pairs.mean(1)
        se = float(m.std(unbiased=True) / math.sqrt(m.numel())) if m.numel() > 1 else float("nan")
        return float(x.mean()), se
    return float(x.mean()), float(((pairs[:, 0] - pairs[:, 1]) ** 2).sum().sqrt() / k)


def draw_masks(scored: torch.Tensor, groups: torch.Tensor, samples: int, scheme: str,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks ``(K, L)`` over the scored positions of one row and the weights ``(K, L)`` of the masked ones.

    ``scored`` (L,) marks the continuation; ``groups`` (L,) numbers the independent groups (one for MDLM/ADLM,
    the blocks for BD3-LM). In each group with ``n`` scored positions, draw ``k`` masks ``l_k`` of them
    (``mask_counts``) and weigh each masked position ``n / l_k``.
    """
    length = scored.shape[0]
    masks = torch.zeros(samples, length, dtype=torch.bool)
    weights = torch.zeros(samples, length, dtype=torch.float64)
    for g in torch.unique(groups[scored]).tolist():
        pos = torch.nonzero(scored & (groups == g)).flatten()
        n = pos.numel()
        counts = mask_counts(n, samples, scheme, generator)
        # A uniform subset of size l: the l smallest of n uniform keys.
        keys = torch.rand(samples, n, generator=generator)
        ranks = keys.argsort(dim=1).argsort(dim=1)
        chosen = ranks < counts[:, None]
        masks[:, pos] = chosen
        weights[:, pos] = chosen.double() * (n / counts.double())[:, None]
    return masks, weights


@torch.no_grad()
def elbo_draws(nll_fn: NLLFn, x: torch.Tensor, scored: torch.Tensor, mask_id: int, *, samples: int, scheme: str,
               generators: list[torch.Generator], groups: torch.Tensor | None = None,
               batch_size: int = 32) -> torch.Tensor:
    """The ``K`` draws of the continuation's NELBO (B, K) for rows ``x`` (B, L) with continuations ``scored``
    (B, L); ``groups`` (B, L) as ``draw_masks`` (None: one group per row). Row ``i`` draws its masks from
    ``generators[i]`` (CPU): its figure does not depend on the rows batched with it."""
    check_draws(samples, scheme)
    b, length = x.shape
    device = x.device
    groups = torch.zeros_like(x) if groups is None else groups
    masks, weights = zip(*(draw_masks(scored[i].cpu(), groups[i].cpu(), samples, scheme, generators[i])
                           for i in range(b)), strict=True)
    m = torch.cat(masks).to(device)  # (B*K, L), row i*K + k
    w = torch.cat(weights).to(device)
    xs = x.repeat_interleave(samples, dim=0)
    out = torch.empty(b * samples, dtype=torch.float64, device=device)
    for s in range(0, b * samples, batch_size):
        xb, mb = xs[s:s + batch_size], m[s:s + batch_size]
        z = torch.where(mb, torch.full_like(xb, mask_id), xb)
        nll = nll_fn(z, xb).double()
        out[s:s + batch_size] = (torch.where(mb, nll, torch.zeros_like(nll)) * w[s:s + batch_size]).sum(1)
    return out.view(b, samples).cpu()


def model_nll_fn(model: nn.Module, cfg: ModelConfig) -> NLLFn:
    """``nll_fn`` of a diffusion model: SUBS NLL of its denoiser (ADLM through the fused projection), BD3-LM
    with its block-diffusion attention over ``[z ; x]`` (clean earlier blocks)."""
    from ..baselines.bd3lm import block_diffusion_logits
    from ..sampling.samplers import denoiser_fn

    zeros = lambda z: torch.zeros(z.shape[0], device=z.device)  # noqa: E731 - sigma: the learned constant
    if hasattr(model, "log_score"):  # SEDD: its score entropy, the network at the masked fraction's sigma
        from ..baselines.sedd import continuation_fns

        return continuation_fns(model, cfg)[0]
    if cfg.conditions_on_time:
        raise LikelihoodError("the continuation ELBO runs models with time conditioning off (sigma = 0, the "
                              "reference setting); this checkpoint conditions on time")
    if KIND_TABLE[cfg.kind].block_diffusion:
        return lambda z, x: subs_nll(block_diffusion_logits(model, z, x, zeros(z), cfg.block_size), x, z, cfg.mask_id)
    fn = denoiser_fn(model)
    return lambda z, x: subs_nll(fn(z, zeros(z)), x, z, cfg.mask_id)


@torch.no_grad()
def ar_loglik(model: nn.Module, cfg: ModelConfig, x: torch.Tensor, scored: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact ``sum log p(x_i | x_<i)`` over the ``scored`` positions (B,) and whether each scored token is the
    argmax of its distribution (B,), from one causal pass (right padding never reaches real positions)."""
    logp = torch.log_softmax(suppress_mask(model(x), cfg.mask_id)[:, :-1], dim=-1)
    target, sc = x[:, 1:], scored[:, 1:]
    tok = logp.gather(-1, target[..., None]).squeeze(-1).double()
    greedy = (logp.argmax(-1) == target) | ~sc
    return torch.where(sc, tok, torch.zeros_like(tok)).sum(1), greedy.all(1)


@torch.no_grad()
def greedy_matches(nll_logits_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
                   scored: torch.Tensor, mask_id: int, block_size: int | None = None) -> torch.Tensor:
    """Whether greedy decoding of the masked continuation gives it back (B,): from all continuation tokens
    masked, unmask one token a step, the most confident masked position first (within the earliest block
    that still has masks for BD3-LM), with its argmax. ``nll_logits_fn(z, x)`` gives log-probabilities
    (N, L, V); ``x`` supplies the clean earlier blocks for BD3-LM."""
    z = torch.where(scored, torch.full_like(x, mask_id), x)
    ok = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    pos = torch.arange(x.shape[1], device=x.device)
    for _ in range(int(scored.sum(1).max())):
        masked = (z == mask_id) & scored  # the padding after the continuation stays masked
        if not masked.any():
            break
        logp = nll_logits_fn(z, z)  # BD3-LM: a block sees only the (decoded) blocks before it
        conf, arg = logp.max(-1)
        allowed = masked
        if block_size:
            first = torch.where(masked, pos, x.shape[1]).min(1).values // block_size
            allowed = masked & (pos // block_size == first[:, None])
        conf = torch.where(allowed, conf, torch.full_like(conf, -math.inf))
        i = conf.argmax(1)
        rows = torch.nonzero(allowed.any(1)).flatten()
        chosen = arg[rows, i[rows]]
        ok[rows] &= chosen == x[rows, i[rows]]
        z[rows, i[rows]] = chosen
    return ok


def model_logp_fn(model: nn.Module, cfg: ModelConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(z, x) -> log p(. | z)`` (N, L, V), mask column excluded: what ``greedy_matches`` reads."""
    from ..baselines.bd3lm import block_diffusion_logits
    from ..sampling.samplers import denoiser_fn

    zeros = lambda z: torch.zeros(z.shape[0], device=z.device)  # noqa: E731
    if hasattr(model, "log_score"):
        from ..baselines.sedd import continuation_fns

        return continuation_fns(model, cfg)[1]
    if KIND_TABLE[cfg.kind].block_diffusion:
        return lambda z, x: torch.log_softmax(suppress_mask(
            block_diffusion_logits(model, z, x, zeros(z), cfg.block_size), cfg.mask_id), -1)
    fn = denoiser_fn(model)
    return lambda z, x: torch.log_softmax(suppress_mask(fn(z, zeros(z)), cfg.mask_id), -1)


@dataclass
class ContinuationScorer:
    """Log-likelihoods of (context ids, continuation ids) pairs for one model: the row is
    ``[BOS] context continuation``, cut on the left to ``seq_len`` (the BOS kept), and for the diffusion kinds
    filled up to ``seq_len`` with the mask id (the tokens after the continuation are unknown: the model
    marginalises them, as in training rows that go on). Only continuation tokens are ever scored or masked."""

    seq_len: int
    mask_id: int
    bos_id: int | None = None
    ar_model: nn.Module | None = None
    """An AR network (with ``ar_cfg``): exact log-likelihoods; otherwise the diffusion functions below."""
    ar_cfg: ModelConfig | None = None
    nll_fn: NLLFn | None = None
    logp_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    block_size: int | None = None
    """BD3-LM: masks are drawn per block, greedy decoding goes block by block."""
    samples: int = 32
    scheme: str = "stratified"
    batch_size: int = 32
    greedy_max_tokens: int = 8
    """Diffusion: ``is_greedy`` is decoded for continuations of at most this many tokens (longer: False)."""
    pad_id: int = 0
    device: torch.device | str = "cpu"

    def layout(self, context: list[int], continuation: list[int]) -> tuple[list[int], int]:
        """(the row's ids, where the continuation starts)."""
        head = [self.bos_id] if self.bos_id is not None else []
        body = (list(context) + list(continuation))[-(self.seq_len - len(head)):]
        n = min(len(continuation), len(body))
        return head + body, len(head) + len(body) - n

    def score(self, pairs: list[tuple[list[int], list[int]]], seeds: list[int]) -> list[tuple[Estimate, bool]]:
        """One (estimate, is_greedy) per pair; ``seeds[i]`` seeds pair ``i``'s mask draws."""
        if not pairs:
            return []
        rows = [self.layout(c, y) for c, y in pairs]
        width = self.seq_len if self.ar_model is None else max(len(r) for r, _ in rows)
        fill = self.mask_id if self.ar_model is None else self.pad_id
        x = torch.full((len(rows), width), fill, dtype=torch.long)
        scored = torch.zeros_like(x, dtype=torch.bool)
        for i, (r, start) in enumerate(rows):
            x[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            scored[i, start:len(r)] = True
        x, scored = x.to(self.device), scored.to(self.device)
        n_tok = scored.sum(1).tolist()
        if self.ar_model is not None:
            ll, greedy = ar_loglik(self.ar_model, self.ar_cfg, x, scored)
            return [(Estimate(float(v), 0.0, int(n), 0), bool(g)) for v, g, n in zip(ll, greedy, n_tok, strict=True)]
        groups = None
        if self.block_size:
            groups = (torch.arange(width, device=x.device) // self.block_size).expand_as(x)
        gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
        draws = elbo_draws(self.nll_fn, x, scored, self.mask_id, samples=self.samples, scheme=self.scheme,
                           generators=gens, groups=groups, batch_size=self.batch_size)
        greedy = torch.zeros(len(rows), dtype=torch.bool)
        short = [i for i, n in enumerate(n_tok) if 0 < n <= self.greedy_max_tokens]
        if short and self.logp_fn is not None:
            idx = torch.tensor(short, device=x.device)
            greedy[short] = greedy_matches(self.logp_fn, x[idx], scored[idx], self.mask_id, self.block_size).cpu()
        out = []
        for i, n in enumerate(n_tok):
            if n == 0:
                out.append((Estimate(0.0, 0.0, 0, self.samples), True))
                continue
            mean, se = combine(draws[i], self.scheme)
            out.append((Estimate(-mean, se, int(n), self.samples), bool(greedy[i])))
        return out


__all__ = ["ContinuationScorer", "MASK_DRAWS", "Estimate", "LikelihoodError", "ar_loglik", "check_draws", "combine", "draw_masks",
           "elbo_draws", "greedy_matches", "mask_counts", "model_logp_fn", "model_nll_fn"]
