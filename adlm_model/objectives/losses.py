"""Objectives: SUBS, the MDLM NELBO, ADLM's ANELBO, the AR NLL and A2R's anchored NLL (docs/design/method.md,
sections 1-3).

Every objective returns per-batch *sums* and token counts (``LossOutput``) besides the mean it
backpropagates, so that perplexity pools exactly across batches and workers:
``PPL = exp(sum of nll_sum / sum of n_tokens)``. Pad positions (attention mask 0) never count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..config import ModelConfig
from .schedule import LogLinearSchedule, antithetic_times, mask_tokens
from .vocab_loss import full_linear_loss, linear_loss, logits_loss


@dataclass
class LossOutput:
    loss: torch.Tensor
    """What training backpropagates: total per-token loss summed, divided by n_tokens."""
    nll_sum: torch.Tensor
    """Sum over tokens of the (denoiser) NELBO or AR NLL, detached, float64."""
    n_tokens: torch.Tensor
    """Number of non-pad tokens the sum runs over."""
    anchor_sum: torch.Tensor | None = None
    """ADLM: sum over tokens of w(t) a^l (-log softmax(y_phi)^l[x^l]), detached (before gamma_k); A2R: the anchor
    network's cross-entropy summed over the positions that have an anchor target."""
    n_anchor: torch.Tensor | None = None
    """ADLM: number of anchor tokens (a^l = 1) in the batch; A2R: of positions with an anchor target."""
    gamma_k: float | torch.Tensor | None = None
    """ADLM, A2R: anchor weight at this step."""


FUSED_VOCABULARY = True
"""Training losses read a network's ``head`` (final hidden state and output projection) through
``vocab_loss.linear_loss``, never holding the float32 logits; False: through the whole logits and autograd (the
reference path: ``materialised_logits``)."""


@contextlib.contextmanager
def materialised_logits() -> Iterator[None]:
    """Compute the losses through the whole float32 logits (the reference the fused path is checked against)."""
    global FUSED_VOCABULARY
    saved, FUSED_VOCABULARY = FUSED_VOCABULARY, False
    try:
        yield
    finally:
        FUSED_VOCABULARY = saved


def head_loss(head: tuple[torch.Tensor, torch.Tensor, torch.Tensor], target: torch.Tensor, a: torch.Tensor, *,
              exclude: int | None, **kw: torch.Tensor | str) -> torch.Tensor:
    """``vocab_loss.linear_loss`` of a network's ``head``, or its reference through the logits when
    ``FUSED_VOCABULARY`` is off."""
    fn = linear_loss if FUSED_VOCABULARY else full_linear_loss
    return fn(*head, target, a, exclude=exclude, **kw)


def subs_nll_sum(model: nn.Module, z_t: torch.Tensor, sigma: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 mask_id: int) -> torch.Tensor:
    """``sum_l weight^l 1{z_t^l = m} (-log p_theta(x^l | z_t))`` under SUBS, float32: through the network's ``head``
    and the fused projection and log-softmax (``vocab_loss``) where it has one, else through its logits."""
    a = weight * (z_t == mask_id)
    if hasattr(model, "head"):
        return head_loss(model.head(z_t, sigma), x, a, exclude=mask_id)
    return (a * subs_nll(model.denoiser_logits(z_t, sigma), x, z_t, mask_id)).sum()


def _anelbo_terms(model: nn.Module, z_t: torch.Tensor, sigma: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                  anchors: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the denoiser's SUBS NELBO sum weighted by ``w``, the anchor term's sum weighted by ``w`` on ``anchors``):
    through ``train_heads`` and the fused losses, or through the (anchor, denoiser) logits of ``model(z_t, sigma)``
    for a network without it."""
    a = w * (z_t == mask_id)
    if hasattr(model, "train_heads"):
        anchor_logits, head = model.train_heads(z_t, sigma)
        nelbo = head_loss(head, x, a, exclude=mask_id)
        if FUSED_VOCABULARY:
            return nelbo, logits_loss(anchor_logits, x, w * anchors)
    else:
        anchor_logits, denoiser_logits = model(z_t, sigma)
        nelbo = (a * subs_nll(denoiser_logits, x, z_t, mask_id)).sum()
    lf = anchor_logits.float()
    return nelbo, (w * anchors * (torch.logsumexp(lf, -1) - lf.gather(-1, x[..., None]).squeeze(-1))).sum()


def conditioning_sigma(cfg: ModelConfig, schedule: LogLinearSchedule, t: torch.Tensor) -> torch.Tensor:
    """sigma(t) with time conditioning on; zeros (a learned constant condition) with it off."""
    return schedule.sigma(t) if cfg.conditions_on_time else torch.zeros_like(t)


def suppress_mask(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """float32 logits with the mask column at -inf (SUBS "zero masking probability")."""
    lf = logits.float()
    return lf.index_fill(-1, torch.tensor([mask_id], device=lf.device), float("-inf"))


def subs_log_probs(logits: torch.Tensor, z_t: torch.Tensor, mask_id: int) -> torch.Tensor:
    """The full SUBS distribution log p_theta(. | z_t), float32 (docs/design/method.md, section 1).

    Mask column -inf, log-softmax, and at every unmasked position a one-hot on z_t
    ("carry-over unmasking").
    """
    logp = torch.log_softmax(suppress_mask(logits, mask_id), dim=-1)
    unmasked = z_t != mask_id
    if unmasked.any():
        carry = torch.full_like(logp, float("-inf")).scatter_(-1, z_t[..., None], 0.0)
        logp = torch.where(unmasked[..., None], carry, logp)
    return logp


def subs_nll(logits: torch.Tensor, x: torch.Tensor, z_t: torch.Tensor, mask_id: int) -> torch.Tensor:
    """-log p_theta(x^l | z_t) under SUBS, per token (B, L): 0 wherever z_t^l is not the mask."""
    lf = suppress_mask(logits, mask_id)
    nll = torch.logsumexp(lf, dim=-1) - lf.gather(-1, x[..., None]).squeeze(-1)
    return torch.where(z_t == mask_id, nll, torch.zeros_like(nll))


def anchor_mask(x: torch.Tensor, attention_mask: torch.Tensor | None, tau: int, width: int) -> torch.Tensor:
    """a^l = 1 when token x^l occurs at most tau times in its own clean sequence (docs/design/method.md, section 2).

    Counts run over the non-pad positions (BOS/EOS included); pads are never anchors. Vectorised
    with a per-row scatter-add, no Python loop.
    """
    valid = torch.ones_like(x, dtype=torch.int32) if attention_mask is None else attention_mask.to(torch.int32)
    counts = torch.zeros(x.shape[0], width, dtype=torch.int32, device=x.device).scatter_add_(1, x, valid)
    return (counts.gather(1, x) <= tau) & valid.bool()


def gamma_at(step: int | torch.Tensor, gamma: float, beta: float, horizon: int) -> float | torch.Tensor:
    """gamma_k = min(gamma, beta k / K) at optimiser step k, K = ``horizon`` (docs/design/method.md, section 2); a ramp of
    gamma / beta * K steps. ``horizon`` 0: no ramp (gamma from the start). ``step`` a tensor (a compiled step,
    whose graph must not depend on the step's value): a float32 tensor equal to the float's rounding."""
    if horizon <= 0:
        return gamma
    if isinstance(step, torch.Tensor):
        return (beta * step.double() / horizon).clamp(max=gamma).float()
    return min(gamma, beta * step / horizon)


def valid_positions(x: torch.Tensor, attention_mask: torch.Tensor | None, cfg: ModelConfig | None = None) -> torch.Tensor:
    """The positions a bound counts (B, L): the non-pad ones, without the first when ``cfg.skips_bos``
    (BD3-LM's reference leaves the BOS position out of training and evaluation; ``ModelConfig.ignore_bos``)."""
    valid = torch.ones_like(x, dtype=torch.bool) if attention_mask is None else attention_mask.bool().clone()
    if cfg is not None and cfg.skips_bos:
        valid[:, 0] = False
    return valid


def masked_noise(cfg: ModelConfig, x: torch.Tensor, generator: torch.Generator | None,
                 schedule: LogLinearSchedule | None = None, t: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t, z_t)`` of the masked-diffusion objectives: antithetic times (unless ``t`` is given), then each token
    masked with its row's move chance, both drawn from ``generator`` in that order."""
    schedule = schedule or LogLinearSchedule(cfg.noise_eps)
    if t is None:
        t = antithetic_times(x.shape[0], generator, cfg.sampling_eps, device=x.device)
    z_t, _ = mask_tokens(x, schedule.move_chance(t)[:, None], cfg.mask_id, generator)
    return t, z_t


def _noised(cfg: ModelConfig, schedule: LogLinearSchedule, x: torch.Tensor, t: torch.Tensor | None,
            z_t: torch.Tensor | None, generator: torch.Generator | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(t, z_t, sigma): drawn (``masked_noise``) unless ``z_t`` is given with its ``t``."""
    if z_t is None:
        t, z_t = masked_noise(cfg, x, generator, schedule, t)
    return t, z_t, conditioning_sigma(cfg, schedule, t)


def mdlm_objective(model: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None, cfg: ModelConfig,
                   *, t: torch.Tensor | None = None, z_t: torch.Tensor | None = None,
                   generator: torch.Generator | None = None,
                   schedule: LogLinearSchedule | None = None) -> LossOutput:
    """Continuous-time NELBO: E_t[w(t) sum_l 1{z_t^l = m} (-log p(x^l | z_t))], w(t) = 1/t."""
    schedule = schedule or LogLinearSchedule(cfg.noise_eps)
    t, z_t, sigma = _noised(cfg, schedule, x, t, z_t, generator)
    valid = valid_positions(x, attention_mask, cfg)
    total = subs_nll_sum(model, z_t, sigma, x, schedule.loss_weight(t)[:, None] * valid, cfg.mask_id)
    n = valid.sum()
    return LossOutput(loss=total / n.clamp(min=1), nll_sum=total.detach().double(), n_tokens=n)


def adlm_objective(model: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None, cfg: ModelConfig,
                   *, step: int | torch.Tensor = 0, t: torch.Tensor | None = None, z_t: torch.Tensor | None = None,
                   generator: torch.Generator | None = None,
                   schedule: LogLinearSchedule | None = None) -> LossOutput:
    """ANELBO (docs/design/method.md, section 2), per token l:

    w(t) [1{z_t^l = m} (-log p_psi(x^l | y_phi(z_t))) - gamma_k a^l log softmax(y_phi(z_t))^l[x^l]]

    The anchor logits feed the denoiser, so they exist; their log-softmax is taken chunk by chunk
    (``vocab_loss.logits_loss``), the denoiser's through its fused head.
    """
    schedule = schedule or LogLinearSchedule(cfg.noise_eps)
    t, z_t, sigma = _noised(cfg, schedule, x, t, z_t, generator)
    valid = valid_positions(x, attention_mask, cfg)
    w = schedule.loss_weight(t)[:, None] * valid
    # The anchor term: plain log-softmax of the anchor logits, all positions, no SUBS.
    a = anchor_mask(x, attention_mask, cfg.tau, cfg.width) & valid
    nelbo, anchor = _anelbo_terms(model, z_t, sigma, x, w, a, cfg.mask_id)
    g = gamma_at(step, cfg.gamma, cfg.gamma_beta, cfg.gamma_horizon)
    n = valid.sum()
    total = nelbo + g * anchor
    return LossOutput(loss=total / n.clamp(min=1), nll_sum=nelbo.detach().double(), n_tokens=n,
                      anchor_sum=anchor.detach().double(), n_anchor=a.sum(), gamma_k=g)


def ar_objective(model: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None,
                 cfg: ModelConfig, **_: object) -> LossOutput:
    """Next-token NLL with causal attention; token l+1 is predicted from tokens <= l (the mask column never)."""
    h, weight, bias = model.head(x)
    valid = valid_positions(x, attention_mask)[:, 1:]  # position 0 is no target: BOS never counts
    total = head_loss((h[:, :-1], weight, bias), x[:, 1:], valid, exclude=cfg.mask_id)
    n = valid.sum()
    return LossOutput(loss=total / n.clamp(min=1), nll_sum=total.detach().double(), n_tokens=n)


def anchor_targets(x: torch.Tensor, attention_mask: torch.Tensor | None, cfg: ModelConfig
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A2R's anchor network targets (docs/design/method.md, section 3): (the target token at each position (B, L),
    whether the position has one (B, L)), both from the anchor mask a (``anchor_mask``, pads never anchors).

    ``next_anchor`` (``ModelConfig.anchor_target``): at l, x^j for the first j > l with a^j = 1, none where no
    anchor follows; ``next_token``: x^{l+1} where a^{l+1} = 1. Vectorised: a reversed running minimum of the anchor
    positions, no Python loop.
    """
    valid = valid_positions(x, attention_mask)
    a = anchor_mask(x, attention_mask, cfg.tau, cfg.width) & valid
    length = x.shape[1]
    following = torch.zeros_like(a)  # a^{l+1}
    following[:, :-1] = a[:, 1:]
    if cfg.anchor_target == "next_token":
        target = torch.cat([x[:, 1:], x[:, -1:]], dim=1)
        return target, following & valid
    pos = torch.arange(length, device=x.device).expand_as(x)
    idx = torch.where(a, pos, torch.full_like(pos, length))
    after = torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], length)], dim=1)  # anchor positions > l
    nxt = after.flip(1).cummin(1).values.flip(1)
    return x.gather(1, nxt.clamp(max=length - 1)), (nxt < length) & valid


def a2r_objective(model: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None, cfg: ModelConfig,
                  *, step: int | torch.Tensor = 0, **_: object) -> LossOutput:
    """A2R's training loss (docs/design/method.md, section 3): the AR model's next-token NLL plus gamma_k times the
    anchor network's cross-entropy at the positions with an anchor target (``anchor_targets``), per token

    -log p_psi(x^{l+1} | y_phi(x^{<=l})) - gamma_k h^l log softmax(y_phi(x^{<=l}))[x^{j(l)}]

    divided by the next-token targets. ``nll_sum`` is the NLL alone: the exact bound evaluation reports
    (``ar_objective`` on the composed network). The anchor logits feed the AR model, so they exist; their
    log-softmax is taken chunk by chunk (``vocab_loss.logits_loss``), the AR model's through its fused head.
    """
    target, has = anchor_targets(x, attention_mask, cfg)
    anchor_logits, (h, weight, bias) = model.train_heads(x)
    valid = valid_positions(x, attention_mask)[:, 1:]  # position 0 is no next-token target
    nll = head_loss((h[:, :-1], weight, bias), x[:, 1:], valid, exclude=cfg.mask_id)
    if FUSED_VOCABULARY:
        anchor = logits_loss(anchor_logits, target, has)
    else:
        lf = anchor_logits.float()
        anchor = (has * (torch.logsumexp(lf, -1) - lf.gather(-1, target[..., None]).squeeze(-1))).sum()
    g = gamma_at(step, cfg.gamma, cfg.gamma_beta, cfg.gamma_horizon)
    n = valid.sum()
    total = nll + g * anchor
    return LossOutput(loss=total / n.clamp(min=1), nll_sum=nll.detach().double(), n_tokens=n,
                      anchor_sum=anchor.detach().double(), n_anchor=has.sum(), gamma_k=g)
