"""Self-distillation through time (SDTT): the objective that teaches a masked-diffusion student to take in one
step what its teacher takes in ``substeps`` steps of the MDLM ancestral sampler (docs/design/method.md, sections 1, 4).

Facts from the reference (jdeschena/sdtt, "multi-round SDTT"), as implemented here:

- A clean row ``x`` is noised to ``z_t`` with the training forward process (one ``t`` per row, the antithetic
  draw of training). The teacher, frozen, runs ``substeps`` (reference 2) MDLM ancestral steps of size ``dt``
  from ``t`` (times ``t, t - dt, ...``; move chance ``t`` at sampling time, as ``samplers.py``), drawing its
  categoricals with the samplers' float64 Gumbel machinery from the caller's generator.
- The target is a distribution, not the samples: at a position the teacher unmasks at its ``i``-th step, the
  teacher's ``p_x0`` of that step; at a position still masked after the last step, the last step's ``p_x0``.
  The samples only decide which step's ``p_x0`` a position takes.
- The student sees ``z_t`` once; its SUBS ``log p_x0`` is compared with the target at the positions masked in
  ``z_t`` (non-pad). The reference's default divergence is the reverse KL, ``KL(student || teacher)``
  (``kl-bwd``), averaged over those positions; forward KL, TVD and MSE on log-probabilities are options.
- Rounds: the teacher starts at ``T0`` sampling steps (``dt = (1 - 1e-5) / T0``); after each round the student
  becomes the teacher and ``dt`` is multiplied by ``substeps``, so after ``R`` rounds the student samples with
  ``T0 / substeps**R`` steps (``student_steps``).

Any diffusion kind with ``denoiser_logits`` works: for ADLM the composed network ``psi(phi(z_t))`` is the
student (its anchor network and denoiser both receive the gradient; the anchor loss is not part of SDTT).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..config import ModelConfig
from ..objectives.losses import LossOutput, conditioning_sigma, masked_noise, suppress_mask, valid_positions
from ..objectives.schedule import LogLinearSchedule
from ..sampling.samplers import T_MIN, denoiser_fn, sample_categorical

DIVERGENCES = ("kl-bwd", "kl-fwd", "tvd", "mse")
"""``kl-bwd``: KL(student || teacher), the reference's default; ``kl-fwd``: KL(teacher || student); ``tvd``: total
variation; ``mse``: mean squared difference of the log-probabilities (over the vocabulary without the mask)."""


def round_dt(teacher_steps: int, round_index: int, substeps: int = 2) -> float:
    """The teacher's step size in round ``round_index`` (0-based): ``(1 - 1e-5) / T0 * substeps**round``."""
    return (1.0 - T_MIN) / teacher_steps * substeps ** round_index


def student_steps(teacher_steps: int, rounds_done: int, substeps: int = 2) -> int:
    """Sampling steps of the student after ``rounds_done`` rounds: ``T0 / substeps**rounds_done``."""
    return max(1, teacher_steps // substeps ** rounds_done)


def _log_p_x0(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """log p_x0 (float32, the mask column at -inf): SUBS at the masked positions, the only ones compared."""
    return torch.log_softmax(suppress_mask(logits, mask_id), dim=-1)


@torch.no_grad()
def teacher_target(teacher: nn.Module, cfg: ModelConfig, z_t: torch.Tensor, t: torch.Tensor, dt: float,
                   substeps: int, generator: torch.Generator | None) -> torch.Tensor:
    """The teacher's ``log p_x0`` target (B, L, W) after ``substeps`` ancestral steps of size ``dt`` from ``z_t``
    at per-row times ``t`` (see the module docstring). Meaningful at the positions masked in ``z_t``."""
    m, fn, schedule = cfg.mask_id, denoiser_fn(teacher), LogLinearSchedule(cfg.noise_eps)
    x = z_t
    target: torch.Tensor | None = None
    decided = torch.zeros_like(z_t, dtype=torch.bool)
    ti = t.double()
    log_p = None
    for _ in range(substeps):
        tc = ti.clamp(min=T_MIN)  # the network never sees t below the samplers' floor
        log_p = _log_p_x0(fn(x, conditioning_sigma(cfg, schedule, tc.float())), m)
        if target is None:
            target = torch.zeros_like(log_p)
        s = (tc - dt).clamp(min=0.0)
        p_stay = (s / tc)[:, None]
        # The samplers' two-stage draw (samplers.diffusion_step) with a per-row p_stay: one float64 uniform a
        # position decides whether it unmasks, a float64 Gumbel categorical over p_x0 picks its token.
        u = torch.rand(x.shape, generator=generator, dtype=torch.float64, device=x.device)
        unmask = (x == m) & (u >= p_stay)
        x_new = x.clone()
        idx = unmask.nonzero(as_tuple=True)
        if idx[0].numel():
            x_new[idx] = sample_categorical(log_p[idx].exp(), generator)
        target[unmask] = log_p[unmask]
        decided |= unmask
        x, ti = x_new, ti - dt
    assert target is not None and log_p is not None
    rest = (z_t == m) & ~decided
    target[rest] = log_p[rest]
    return target


def divergence(student_log_p: torch.Tensor, target_log_p: torch.Tensor, kind: str = "kl-bwd") -> torch.Tensor:
    """Per-position divergence (N,) between two rows of log-probabilities (N, W); columns where both are -inf
    (the mask) count as zero."""
    a, b = student_log_p.float(), target_log_p.float()
    both = torch.isinf(a) & torch.isinf(b)
    # Zero the shared -inf columns before any arithmetic: a -inf - -inf would make the backward pass NaN even
    # where the forward pass discards it.
    a, b = a.masked_fill(both, 0.0), b.masked_fill(both, 0.0)
    if kind == "kl-bwd":
        term = a.exp() * (a - b)
    elif kind == "kl-fwd":
        term = b.exp() * (b - a)
    elif kind == "tvd":
        term = 0.5 * (a.exp() - b.exp()).abs()
    elif kind == "mse":
        term = (a - b) ** 2
    else:
        raise ValueError(f"unknown divergence {kind!r}: use one of {', '.join(DIVERGENCES)}")
    term = torch.where(both, torch.zeros_like(term), term)
    out = term.sum(-1)
    if kind == "mse":
        out = out / (~both).sum(-1).clamp(min=1)
    return out


def sdtt_objective(student: nn.Module, teacher: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None,
                   cfg: ModelConfig, *, dt: float, substeps: int = 2, divergence_kind: str = "kl-bwd",
                   t: torch.Tensor | None = None, generator: torch.Generator | None = None) -> LossOutput:
    """One SDTT loss on a clean batch ``x``: the mean divergence over the masked (non-pad) positions of ``z_t``
    between the student's one-step ``log p_x0`` and the teacher's ``substeps``-step target. ``nll_sum`` and
    ``n_tokens`` carry the summed divergence and the positions it counts (the window's per-token figure)."""
    schedule = LogLinearSchedule(cfg.noise_eps)
    t, z_t = masked_noise(cfg, x, generator, schedule, t)
    was = teacher.training
    teacher.eval()
    try:
        target = teacher_target(teacher, cfg, z_t, t, dt, substeps, generator)
    finally:
        teacher.train(was)
    student_log_p = _log_p_x0(student.denoiser_logits(z_t, conditioning_sigma(cfg, schedule, t)), cfg.mask_id)
    where = (z_t == cfg.mask_id) & valid_positions(x, attention_mask, cfg)
    per = divergence(student_log_p[where], target[where], divergence_kind)
    n = where.sum()
    total = per.sum()
    return LossOutput(loss=total / n.clamp(min=1), nll_sum=total.detach().double(), n_tokens=n)


__all__ = ["DIVERGENCES", "divergence", "round_dt", "sdtt_objective", "student_steps", "teacher_target"]
