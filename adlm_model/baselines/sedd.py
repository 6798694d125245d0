"""SEDD: score entropy discrete diffusion with the absorbing graph (Lou et al. 2024; docs/design/method.md, section 8's baseline).

The forward process is MDLM's (docs/design/method.md, section 1): each token independently jumps to the mask with probability
``1 - exp(-sigma(t))`` under the log-linear noise ``sigma(t) = -log(1 - (1 - eps) t)``, whose rate is
``dsigma(t) = (1 - eps) / (1 - (1 - eps) t)``. What differs is the parameterisation and the objective:

- **The score.** The network (our DiT, time-conditioned: it sees sigma, as the reference's timestep embedder does)
  returns ``width`` outputs ``o`` per position; the log concrete score is
  ``log s_y = o_y - log(e^sigma - 1) - log(width - 1)``, and ``log s`` at the input token is set to 0 (the ratio
  of a state to itself). ``width - 1`` counts the states other than the mask, so an untrained network (``o = 0``)
  spreads the total jump rate out of the mask evenly. With the exact ratios
  ``s_y = p_t(y) / p_t(mask) = p(x^l = y | z_t) / (e^sigma - 1)`` at a masked position.
- **The loss** (diffusion-weighted denoising score entropy, at masked positions only; unmasked ones never move):
  ``dsigma [sum_{y != mask} s_y - log s_{x} / (e^sigma - 1) + K(1 / (e^sigma - 1))]``, ``K(a) = a (log a - 1)``.
  It is an upper bound on the NLL (the reference's Theorem); since ``dsigma / (e^sigma - 1) = 1 / t`` for this noise
  it reads ``(1/t) [Z - 1 - log p(x | z_t)]`` with ``p = s (e^sigma - 1)`` and ``Z = sum_y p_y``: MDLM's NELBO term
  with the normalised denoiser ``p / Z`` plus ``(1/t) (Z - 1 - log Z) >= 0``. With the exact score (``Z = 1``) both
  coincide, so SEDD's bound is tight exactly where MDLM's is (``tests/model/test_sedd.py``).

The implied denoiser at a masked position is the score normalised over the non-mask states, i.e. SUBS on the raw
output ``o`` (the shift is constant over ``y``): ``denoiser_logits`` returns ``o``, so code that reads a diffusion
model's denoiser (infilling checks, the continuation likelihood with time conditioning off) works on SEDD as on MDLM.

Sampling (``sedd_sample``), as the reference's predictor-corrector loop with no corrector: ``T`` predictor steps on
``t = linspace(1, 1e-5, T + 1)`` then the final denoising step:

- ``euler``: a masked position jumps to ``y`` with probability ``dt dsigma(t) s_y`` and stays masked otherwise;
- ``analytic`` (Tweedie tau-leaping): the staggered score gives, for ``d = sigma(t) - sigma(t - dt)``, the jump to
  ``y`` with weight ``(e^d - 1) s_y`` and staying masked with ``1 - (e^d - 1) sum_y s_y``: with the exact score
  exactly the reverse process's ``(1 - alpha_s) / (1 - alpha_t)`` (MDLM's ancestral step);
- the denoiser: every mask left is drawn from the normalised score at ``t = 1e-5`` (drawn, not argmax, as the
  reference).

Nucleus (top-p, off in the reference) applies where a token is drawn: to the normalised jump distribution
``s_y / sum s`` at each masked position, the probability of jumping at all unchanged. MDLM's caching sampler does
not apply: the network is time-conditioned, so its output changes at every step even when the tokens do not.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from ..config import ModelConfig
from ..nn.models import config_dit
from ..objectives import losses
from ..objectives.losses import LossOutput, masked_noise, valid_positions
from ..objectives.schedule import LogLinearSchedule
from ..sampling.samplers import T_MIN, Progress, SamplerError, nucleus, sample_categorical

PREDICTORS = ("euler", "analytic")


def expm1_sigma(sigma: torch.Tensor) -> torch.Tensor:
    """e^sigma - 1, with expm1 below 0.5 (the reference's split: accurate at small sigma)."""
    return torch.where(sigma < 0.5, torch.expm1(sigma), sigma.exp() - 1)


def rate_sigma(schedule: LogLinearSchedule, t: torch.Tensor) -> torch.Tensor:
    """dsigma/dt of the log-linear noise: (1 - eps) / (1 - (1 - eps) t)."""
    return (1 - schedule.eps) / (1 - (1 - schedule.eps) * t)


class SEDD(nn.Module):
    """The score network: one DiT with output width ``cfg.width`` (the vocabulary plus the absorbing mask)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.backbone = config_dit(cfg, cfg.n_blocks)

    def denoiser_logits(self, z_t: torch.Tensor, sigma: torch.Tensor, **kw: Any) -> torch.Tensor:
        """The raw output ``o`` for the conditioning ``sigma`` (the caller's ``conditioning_sigma``): SUBS on it
        is the implied denoiser (module docstring)."""
        return self.backbone(z_t, sigma, **kw)

    forward = denoiser_logits

    def head(self, z_t: torch.Tensor, sigma: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The final hidden state and output projection of ``denoiser_logits`` (``sigma``: the conditioning)."""
        return self.backbone.head(z_t, sigma, **kw)

    def condition(self, sigma: torch.Tensor) -> torch.Tensor:
        """What the network sees of the total noise: sigma, or 0 with time conditioning off."""
        return sigma if self.cfg.conditions_on_time else torch.zeros_like(sigma)

    def log_score(self, z_t: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """``log s`` (B, L, width) float32 at the total noise ``sigma`` (B,): the network sees sigma (or 0 with time
        conditioning off), the shift always reads the true sigma."""
        return log_score_from_output(self.backbone(z_t, self.condition(sigma)), z_t, sigma)


def log_score_from_output(out: torch.Tensor, z_t: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The score parameterisation: ``o - log(e^sigma - 1) - log(width - 1)``, 0 at the input token."""
    shift = expm1_sigma(sigma.float()).log()[:, None, None] + math.log(out.shape[-1] - 1)
    s = out.float() - shift
    return s.scatter(-1, z_t[..., None], 0.0)


def score_entropy(log_score: torch.Tensor, sigma: torch.Tensor, z_t: torch.Tensor, x: torch.Tensor,
                  mask_id: int) -> torch.Tensor:
    """Denoising score entropy per token (B, L), 0 where ``z_t`` is not the mask (module docstring)."""
    masked = z_t == mask_id
    ratio = 1.0 / expm1_sigma(sigma.float())[:, None].expand_as(x)
    neg = ratio * log_score.gather(-1, x[..., None]).squeeze(-1)
    pos = log_score.index_fill(-1, torch.tensor([mask_id], device=x.device), float("-inf")).exp().sum(-1)
    const = ratio * (ratio.log() - 1)
    return torch.where(masked, pos - neg + const, torch.zeros_like(pos))


def sedd_objective(model: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None, cfg: ModelConfig, *,
                   t: torch.Tensor | None = None, z_t: torch.Tensor | None = None,
                   generator: torch.Generator | None = None,
                   schedule: LogLinearSchedule | None = None) -> LossOutput:
    """``E_t [dsigma(t) sum_l score_entropy^l]`` over the valid positions: training's loss and evaluation's bound
    (nats per token over MDLM's positions: same rows, same units). Times are MDLM's antithetic draws (the reference
    draws them independently; the expectation is the same, the variance lower); ``z_t`` with its ``t`` fixes the
    noise (the reference-equivalence test)."""
    schedule = schedule or LogLinearSchedule(cfg.noise_eps)
    if z_t is None:
        t, z_t = masked_noise(cfg, x, generator, schedule, t)
    sigma = schedule.sigma(t)
    valid = valid_positions(x, attention_mask, cfg)
    total = score_entropy_sum(model, z_t, sigma, x, rate_sigma(schedule, t)[:, None] * valid, cfg.mask_id)
    n = valid.sum()
    return LossOutput(loss=total / n.clamp(min=1), nll_sum=total.detach().double(), n_tokens=n)


def score_entropy_sum(model: nn.Module, z_t: torch.Tensor, sigma: torch.Tensor, x: torch.Tensor,
                      weight: torch.Tensor, mask_id: int) -> torch.Tensor:
    """``sum_l weight^l score_entropy^l``, float32. At a masked position, with ``o`` the raw output, ``shift`` the
    score's (``log_score_from_output``) and ``r = 1 / (e^sigma - 1)``: ``sum_{y != m} s_y = exp(lse_{y != m}(o) -
    shift)`` and ``log s_x = o_x - shift``, so the term is ``exp(lse - shift) - r o_x`` plus what the output does
    not enter, and the fused projection and log-sum-exp (``vocab_loss``, mode ``exp``) compute it without the
    float32 scores; ``losses.FUSED_VOCABULARY`` off (or a network without ``head``): through the scores."""
    if not (losses.FUSED_VOCABULARY and hasattr(model, "head")):
        return (weight * score_entropy(model.log_score(z_t, sigma), sigma, z_t, x, mask_id)).sum()
    m = weight * (z_t == mask_id)
    h, w, b = model.head(z_t, model.condition(sigma))
    shift = (expm1_sigma(sigma.float()).log() + math.log(w.shape[0] - 1))[:, None].expand_as(x)
    ratio = 1.0 / expm1_sigma(sigma.float())[:, None].expand_as(x)
    fused = losses.head_loss((h, w, b), x, m, c=m * ratio, s=shift, mode="exp", exclude=mask_id)
    return fused + (m * (ratio * shift + ratio * (ratio.log() - 1))).sum()


def masked_fraction_sigma(z_t: torch.Tensor, mask_id: int, schedule: LogLinearSchedule) -> torch.Tensor:
    """sigma at the time whose masking rate is each row's masked fraction (B,): what a time-conditioned score sees
    when the mask pattern, not a time, is given (the continuation likelihood)."""
    frac = (z_t == mask_id).double().mean(-1)
    return schedule.sigma((frac / (1 - schedule.eps)).clamp(1e-3, 1.0)).float()


def continuation_fns(model: nn.Module, cfg: ModelConfig) -> tuple[Any, Any]:
    """``(nll_fn, logp_fn)`` of ``likelihood.py`` for a SEDD model. ``nll_fn(z, x)``: the per-token score entropy
    times ``e^sigma - 1`` (so ``dsigma`` times it is ``(1/t)`` times it: the any-order estimator's weight takes the
    place of ``1/t``), i.e. ``Z - 1 - log p(x^l | z)`` in the module docstring's terms, an upper bound on the SUBS
    NLL of the normalised score (equal with the exact score). ``logp_fn(z, x)``: log of the normalised score. The
    network sees ``masked_fraction_sigma``."""
    schedule = LogLinearSchedule(cfg.noise_eps)

    def nll(z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        sigma = masked_fraction_sigma(z, cfg.mask_id, schedule)
        se = score_entropy(model.log_score(z, sigma), sigma, z, x, cfg.mask_id)
        return expm1_sigma(sigma)[:, None] * se

    def logp(z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        s = model.log_score(z, masked_fraction_sigma(z, cfg.mask_id, schedule))
        return torch.log_softmax(s.index_fill(-1, torch.tensor([cfg.mask_id], device=z.device), float("-inf")), -1)

    return nll, logp


# --------------------------------------------------------------------------------------------
# Sampling


def jump_weights(score: torch.Tensor, x: torch.Tensor, mask_id: int, move: torch.Tensor,
                 nucleus_p: float) -> torch.Tensor:
    """The transition weights (B, L, width) of one step, written out in full (the tests compare them with the
    reference's; ``sedd_step`` draws them): at a masked position ``move`` (B,) times the score toward each non-mask
    state, and staying masked with what is left (clamped at 0: a step longer than the rates allow jumps surely, as
    the reference's Gumbel draw does with its negative weight). Nucleus filters the jump distribution."""
    s = score.index_fill(-1, torch.tensor([mask_id], device=x.device), 0.0).double()
    total = s.sum(-1, keepdim=True)
    if nucleus_p < 1.0:
        s = nucleus(s / total.clamp_min(1e-300), nucleus_p) * total
    w = move.double()[:, None, None] * s
    stay = (1 - w.sum(-1)).clamp_min(0.0)
    return w.index_copy(-1, torch.tensor([mask_id], device=x.device), stay[..., None])


def sedd_step(score: torch.Tensor, x: torch.Tensor, mask_id: int, move: torch.Tensor, nucleus_p: float,
              generator: torch.Generator) -> torch.Tensor:
    """Draw one step of ``jump_weights`` in two stages, as MDLM's ``diffusion_step``: one float64 uniform per masked
    position decides whether it jumps (probability ``min(move sum_y s_y, 1)``), then a float64 Gumbel categorical
    over the score, only at the positions that jump. The same law as one categorical over ``jump_weights`` (the clamp
    included: ``test_sedd``), without ``B x L x width`` float64 draws at every step."""
    masked = x == mask_id
    idx = masked.nonzero(as_tuple=True)
    if not idx[0].numel():
        return x
    s = score[idx].index_fill(-1, torch.tensor([mask_id], device=x.device), 0.0)  # (N, width)
    total = s.sum(-1, dtype=torch.float64)
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=x.device)
    jump = (u < move[idx[0]] * total) | torch.isinf(move[idx[0]])  # inf: the denoiser, every mask jumps
    x_new = x.clone()
    if bool(jump.any()):
        rows = s[jump].double() / total[jump, None].clamp_min(1e-300)
        if nucleus_p < 1.0:
            rows = nucleus(rows, nucleus_p)
        x_new[idx[0][jump], idx[1][jump]] = sample_categorical(rows, generator)
    return x_new


def sedd_sample(model: nn.Module, cfg: ModelConfig, tokens: torch.Tensor, keep: torch.Tensor, *, steps: int,
                predictor: str, nucleus_p: float, generator: torch.Generator, progress: Progress | None,
                cache: bool = False, stats: dict | None = None) -> torch.Tensor:
    """``T`` Euler or analytic predictor steps from the all-mask sequence (given positions kept), then the final
    denoising step (module docstring). ``cache`` is accepted and ignored (time-conditioned: nothing to reuse)."""
    if predictor not in PREDICTORS:
        raise SamplerError(f"unknown SEDD predictor {predictor!r}: use one of {', '.join(PREDICTORS)}")
    if not hasattr(model, "log_score"):
        raise SamplerError(f"{type(model).__name__} has no score: the sedd-* samplers run SEDD models only")
    m = cfg.mask_id
    schedule = LogLinearSchedule(cfg.noise_eps)
    x = torch.where(keep, tokens, torch.full_like(tokens, m))
    b, device = x.shape[0], x.device
    calls = 0

    def score(t: float) -> torch.Tensor:
        nonlocal calls
        calls += 1
        sigma = schedule.sigma(torch.full((b,), t, device=device, dtype=torch.float64)).float()
        return model.log_score(x, sigma).exp()

    ts = torch.linspace(1.0, T_MIN, steps + 1, dtype=torch.float64)
    dt = (1.0 - T_MIN) / steps
    for i in range(steps):
        if bool((x == m).any()):  # no mask left: nothing can move, the network is not called
            t = ts[i]
            if predictor == "euler":
                move = dt * rate_sigma(schedule, t)
            else:
                move = torch.expm1(schedule.sigma(t) - schedule.sigma(t - dt))
            x = sedd_step(score(float(t)), x, m, torch.full((b,), float(move), dtype=torch.float64, device=device),
                          nucleus_p, generator)
        if progress is not None:
            progress(i + 1, steps + 1)
    if bool((x == m).any()):  # the final denoiser: every mask left jumps, drawn from the normalised score
        x = sedd_step(score(float(ts[-1])), x, m, torch.full((b,), math.inf, dtype=torch.float64, device=device),
                      nucleus_p, generator)
    if progress is not None:
        progress(steps + 1, steps + 1)
    if stats is not None:
        stats["network_calls"] = calls
    return x


__all__ = ["PREDICTORS", "SEDD", "continuation_fns", "expm1_sigma", "masked_fraction_sigma", "log_score_from_output", "rate_sigma", "score_entropy",
           "sedd_objective", "sedd_sample", "sedd_step"]
