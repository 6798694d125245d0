"""Self-distillation through time (SDTT) for MDLM and ADLM: the objective and its round schedule.

A student learns to do in one sampler step of size ``dt`` what its teacher does in two. Facts taken from the
method's reference implementation (jdeschena/sdtt, ``multi_round_sdtt.py``):

- a clean row ``x`` is noised at ``t`` exactly as in training (antithetic times, the forward process of
  METHOD.md section 1): ``z_t``;
- the frozen **teacher** runs ``teacher_steps`` (2) MDLM ancestral steps of size ``dt`` from ``t``
  (METHOD.md section 4: from ``t`` to ``s = t - dt``, a masked position unmasks with probability
  ``(t - s) / t`` and then takes a token drawn from the teacher's ``p_x0``). The **target** at each masked
  position of ``z_t`` is the teacher's ``p_x0`` at the step where that position unmasked, or at the last step
  for a position still masked after all of them;
- the **student** runs once on ``z_t`` at ``t``; the loss is a divergence between its ``p_x0`` and the target,
  averaged over the masked positions of ``z_t`` (the reference's default: the reverse KL,
  ``KL(student || teacher)``, "kl-bwd"; the forward KL and the total variation are options);
- **rounds**: ``dt`` starts at ``(1 - eps) / T0`` (``T0`` the teacher's sampling steps); after a round
  ``dt`` is multiplied by ``teacher_steps`` and the student becomes the next round's teacher, so round ``k``'s
  student samples in ``T0 / 2^k`` steps.

ADLM is distilled as the composed network ``psi(phi(z_t))`` (METHOD.md section 2): the student's anchor
network and denoiser are both trained by the one loss on the denoiser's output (the anchor loss plays no part).
Time conditioning off, ``p_x0`` does not depend on ``t``; the objective is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .config import ModelConfig
from .losses import conditioning_sigma, subs_log_probs
from .samplers import T_MIN, denoiser_fn, sample_categorical
from .schedule import LogLinearSchedule, antithetic_times, mask_tokens

DIVERGENCES = ("kl-bwd", "kl-fwd", "tvd")
"""``kl-bwd``: KL(student || teacher), the reference's default; ``kl-fwd``: KL(teacher || student); ``tvd``."""
LOG_FLOOR = -1e4
"""Log-probabilities are floored here before a divergence: the SUBS mask column (-inf in both) contributes 0."""


@dataclass
class TeacherTargets:
    """What the teacher's steps give: the target log-probabilities (B, L, width), float32, valid at the masked
    positions of ``z_t``; per position the teacher step (0-based) whose ``p_x0`` is the target (-1 where ``z_t``
    is unmasked); the states the teacher's steps started from (``states[0] = z_t``)."""

    log_probs: torch.Tensor
    step: torch.Tensor
    states: list[torch.Tensor]


def round_steps(teacher_steps: int, rounds: int, per_round: int = 2) -> list[int]:
    """The sampling steps of each round's student: ``T0 / per_round^k`` for k = 1 .. rounds (``dt`` multiplied
    by ``per_round`` a round); ValueError if a round's steps would not be a whole number >= 1."""
    out, steps = [], teacher_steps
    for k in range(1, rounds + 1):
        if steps % per_round:
            raise ValueError(f"round {k}: {steps} teacher steps do not split into {per_round}-step pairs; use a "
                             f"teacher step count divisible by {per_round}^{rounds}")
        steps //= per_round
        out.append(steps)
    return out


def _p_x0_log(model: nn.Module, cfg: ModelConfig, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    sigma = conditioning_sigma(cfg, LogLinearSchedule(cfg.noise_eps), t.float())
    return subs_log_probs(denoiser_fn(model)(z, sigma), z, cfg.mask_id)


@torch.no_grad()
def teacher_targets(teacher: nn.Module, cfg: ModelConfig, z_t: torch.Tensor, t: torch.Tensor, dt: float,
                    generator: torch.Generator, teacher_steps: int = 2) -> TeacherTargets:
    """The teacher's ``teacher_steps`` ancestral steps of size ``dt`` from ``(z_t, t)`` (per-row ``t``) and the
    targets they give (module docstring). Draws: per step one float64 uniform per position, then float64 Gumbel
    noise at the positions that unmask (the sampler's ``diffusion_step``), all from ``generator``."""
    m = cfg.mask_id
    z, tt = z_t, t.double()
    target = torch.zeros((*z_t.shape, cfg.width), dtype=torch.float32, device=z_t.device)
    step = torch.full(z_t.shape, -1, dtype=torch.long, device=z_t.device)
    states, logp = [], None
    for k in range(teacher_steps):
        states.append(z)
        logp = _p_x0_log(teacher, cfg, z, tt)
        s = (tt - dt).clamp(min=T_MIN)
        u = torch.rand(z.shape, generator=generator, dtype=torch.float64, device=z.device)
        unmask = (z == m) & (u >= (s / tt)[:, None])
        target = torch.where(unmask[..., None], logp, target)
        step = torch.where(unmask, k, step)
        z = z.clone()
        z[unmask] = sample_categorical(logp[unmask].exp(), generator)
        tt = s
    left = (z == m) & (step < 0)
    target = torch.where(left[..., None], logp, target)
    step = torch.where(left, teacher_steps - 1, step)
    return TeacherTargets(target, step, states)


def divergence(student_log_probs: torch.Tensor, target_log_probs: torch.Tensor, kind: str = "kl-bwd") -> torch.Tensor:
    """Per-position divergence (N,) between rows of log-probabilities (N, width) (``DIVERGENCES``)."""
    q, p = student_log_probs.clamp_min(LOG_FLOOR), target_log_probs.clamp_min(LOG_FLOOR)
    if kind == "kl-bwd":
        return (q.exp() * (q - p)).sum(-1)
    if kind == "kl-fwd":
        return (p.exp() * (p - q)).sum(-1)
    if kind == "tvd":
        return 0.5 * (q.exp() - p.exp()).abs().sum(-1)
    raise ValueError(f"divergence must be one of {', '.join(DIVERGENCES)}, got {kind!r}")


@dataclass
class DistillLoss:
    loss: torch.Tensor
    """Mean divergence over the masked positions of ``z_t`` (what training backpropagates)."""
    n_masked: int
    targets: TeacherTargets


def sdtt_loss(student: nn.Module, teacher: nn.Module, x: torch.Tensor, cfg: ModelConfig, dt: float,
              generator: torch.Generator, teacher_steps: int = 2, kind: str = "kl-bwd",
              t: torch.Tensor | None = None) -> DistillLoss:
    """SDTT's objective on clean rows ``x`` (B, L) (module docstring); ``t`` (B,) defaults to antithetic times."""
    if kind not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {', '.join(DIVERGENCES)}, got {kind!r}")
    if t is None:
        t = antithetic_times(x.shape[0], generator, cfg.sampling_eps, device=x.device)
    z_t, _ = mask_tokens(x, LogLinearSchedule(cfg.noise_eps).move_chance(t)[:, None], cfg.mask_id, generator)
    targets = teacher_targets(teacher, cfg, z_t, t, dt, generator, teacher_steps)
    sigma = conditioning_sigma(cfg, LogLinearSchedule(cfg.noise_eps), t.float())
    fn = student.denoiser_logits if hasattr(student, "denoiser_logits") else student
    logq = subs_log_probs(fn(z_t, sigma), z_t, cfg.mask_id)
    masked = z_t == cfg.mask_id
    n = int(masked.sum())
    if n == 0:
        return DistillLoss(logq.sum() * 0.0, 0, targets)
    return DistillLoss(divergence(logq[masked], targets.log_probs[masked], kind).mean(), n, targets)


__all__ = ["DIVERGENCES", "DistillLoss", "TeacherTargets", "divergence", "round_steps", "sdtt_loss",
           "teacher_targets"]
