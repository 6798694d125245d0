"""Samplers: MDLM ancestral (with caching), ReMDM-loop, ADLM's anchored sampler.

The entry point ``sample`` and the table of samplers live in ``kinds.py``; BD3-LM's block sampler in
``bd3lm.py``; the AR samplers in ``ar_sampling.py``.

Everything follows docs/design/method.md, section 4:

- start from the all-mask sequence (prefix positions excepted), run ``T`` steps on
  ``t = linspace(1, 1e-5, T + 1)``, ``dt = (1 - 1e-5) / T``, ``move_chance = t``;
- categoricals are drawn with float64 Gumbel noise (``argmax p / E``, ``E = -log u``), always from
  the ``torch.Generator`` the caller passes, never the global RNG;
- nucleus filtering (top-``p``, the reference rule: keep tokens while the sorted cumulative mass
  is ``<= p``, always the first) applies to ``p_x0`` at every position it is drawn from;
- one final greedy step fills any mask left (no nucleus there), as in MDLM's reference (``noise_removal``);
  ``diffusion_sample(..., final="draw")`` instead draws those positions from ``p_x0`` (nucleus applied), the
  ancestral chain's own transition from ``T_MIN`` to 0 (``p_stay = 0``). A position is still masked after the
  grid with probability ``T_MIN`` (1e-5), so the two differ on about one position in 100,000; ``stats
  ['final_filled']`` counts the positions the final step filled.

ADLM (the paper's Algorithm 1) is the same sampler run on the composed network ``psi(phi(z_t))``
through ``model.denoiser_logits(..., fused=True)``: the anchor logits are never materialised.

**How a step is drawn.** Every transition of section 4 has the same shape at each position: a
masked position stays masked with probability ``p_stay`` and otherwise takes a token from
``p_x0``; an unmasked position is remasked with probability ``p_remask`` (0 except in ReMDM's
loop phase) and otherwise keeps its token (SUBS carry-over). ``transition_probs`` writes that
distribution out in full (the tests compare it with the formulas); ``diffusion_step`` samples it
in two stages: one float64 uniform per position decides "mask or not", then a float64 Gumbel
categorical over the vocabulary is drawn only at the positions that unmask. The law is exactly
the same as one categorical over ``vocabulary + mask``; the point is cost: a step that changes
nothing costs ``B x L`` uniforms instead of ``B x L x V`` Gumbel draws.

**Caching** (MDLM's ``ddpm_cache``, per row): with time conditioning off, ``p_x0`` depends only
on the tokens, so a row whose tokens did not change since its ``p_x0`` was computed reuses it
without calling the network. The cached and the uncached paths run the same code and draw the
same random numbers in the same order (the draws do not depend on whether the network ran), so
they give identical tokens for the same seed.

**Prefix conditioning** (``prefix=``), for every sampler:

- a LongTensor ``(P,)`` or ``(B, P)`` with ``P <= length``: the leading ``P`` tokens are given;
- a pair ``(tokens, keep)``: ``tokens`` LongTensor ``(B or 1, length)``, ``keep`` bool of the same
  shape; positions with ``keep`` are given (anywhere: infilling for the diffusion samplers, forced
  tokens for AR). Given tokens are never changed and never remasked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from ..config import ModelConfig
from ..objectives.losses import conditioning_sigma, suppress_mask
from ..objectives.schedule import LogLinearSchedule

T_MIN = 1e-5
"""Last time of the sampling grid: ``linspace(1, T_MIN, T + 1)`` (docs/design/method.md, section 4)."""
FINAL_STEPS = ("greedy", "draw")
"""How ``diffusion_sample`` fills the masks left after the grid (module docstring)."""

Progress = Callable[[int, int], None]


class SamplerError(ValueError):
    """Bad sampler arguments; the message names the argument and the fix."""


@dataclass(frozen=True)
class ReMDMLoop:
    """ReMDM-loop schedule (docs/design/method.md, section 4); reference values eta 0.02, t_on 0.55, t_off 0.05,
    alpha_on 0.9."""

    eta: float = 0.02
    """Remasking probability of an unmasked token in the loop phase (sigma = eta)."""
    t_on: float = 0.55
    """Above t_on: MDLM steps that bring alpha from 0 to alpha_on."""
    t_off: float = 0.05
    """At or below t_off: MDLM steps that bring alpha from alpha_on to 1."""
    alpha_on: float = 0.9
    """alpha held during the loop phase t_off < t <= t_on."""

    def validate(self) -> ReMDMLoop:
        if not 0.0 < self.t_off < self.t_on < 1.0:
            raise SamplerError(f"ReMDM-loop needs 0 < t_off < t_on < 1, got t_off={self.t_off}, t_on={self.t_on}")
        if not 0.0 < self.alpha_on < 1.0:
            raise SamplerError(f"ReMDM-loop needs 0 < alpha_on < 1, got {self.alpha_on}")
        if not 0.0 <= self.eta <= 1.0 or 1 - self.alpha_on - self.alpha_on * self.eta < 0:
            raise SamplerError(f"ReMDM-loop eta={self.eta} must satisfy 0 <= eta <= (1 - alpha_on) / alpha_on")
        return self


# --------------------------------------------------------------------------------------------
# Primitive draws


def sample_categorical(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of (possibly unnormalised) ``probs`` (..., V) with float64 Gumbel noise.

    ``argmax_v p_v / E_v`` with ``E_v = 1e-10 - log(u_v + 1e-10)`` ~ Exp(1) (the reference's
    form) picks ``v`` with probability ``p_v / sum p``. float64 noise: float32 truncates the
    exponential's tail and measurably lowers the diversity of samples.
    """
    u = torch.rand(probs.shape, generator=generator, dtype=torch.float64, device=probs.device)
    return (probs.double() / (1e-10 - torch.log(u + 1e-10))).argmax(dim=-1)


def nucleus(probs: torch.Tensor, p: float, first_k: int = 64, last_k: int = 1024) -> torch.Tensor:
    """Top-p filtering of probabilities along the last dim, renormalised (reference rule: keep the
    sorted tokens whose cumulative mass is <= p, and always the most likely one).

    The full sort's result without sorting the whole vocabulary (sorting 8k-50k entries at every
    masked position is the main cost of diffusion sampling on a CPU), in three tiers per row:

    1. peaked rows: the kept prefix ends at the first sorted token whose cumulative mass exceeds
       ``p``, so once the top ``first_k`` (``torch.topk``, sorted) hold more than ``p`` the rest is
       dropped anyway. Bit for bit the full sort's result.
    2. flat rows (an untrained or high-temperature model): the dropped tokens are the smallest ones
       whose mass, counted from the bottom, stays below ``1 - p``; when they lie within the bottom
       ``last_k`` (``torch.topk(largest=False)``) nothing else is needed. Token j of the descending
       order is kept iff ``C_j = total - (mass of the tokens below it) <= p``: the same rule with
       the prefix mass summed from the other end, so equal to the full sort up to float rounding
       (the same tokens unless a cumulative mass lies within rounding of ``p``).
    3. the rest: the full sort.
    """
    if p >= 1.0:
        return probs
    shape, vocab = probs.shape, probs.shape[-1]
    flat = probs.reshape(-1, vocab)
    out = torch.zeros_like(flat)
    rows = torch.arange(flat.shape[0], device=flat.device)
    k = min(vocab, max(1, first_k))
    if rows.numel() and k < vocab:  # 1. the top k hold more than p
        sub = flat[rows]
        top, idx = torch.topk(sub, k, dim=-1, sorted=True)
        csum = torch.cumsum(top, dim=-1)
        done = csum[:, -1] > p
        if done.any():
            out[rows[done]] = _kept_prefix(top[done], idx[done], csum[done], p, vocab)
        rows = rows[~done]
    k = min(vocab - 1, max(1, last_k))
    if rows.numel() and 2 * k < vocab:  # 2. the dropped tail lies within the bottom k
        sub = flat[rows]
        bot, idx = torch.topk(sub, k, dim=-1, largest=False, sorted=True)  # ascending
        below = torch.cumsum(bot, dim=-1) - bot  # mass of the tokens below each one (within the bottom k)
        drop = sub.sum(dim=-1, keepdim=True) - below > p  # C_j > p
        done = ~drop[:, -1]  # the largest of the bottom k is kept: every dropped token is among them
        if done.any():
            kept = sub[done].scatter(-1, idx[done], bot[done] * ~drop[done])
            out[rows[done]] = kept / kept.sum(dim=-1, keepdim=True)
        rows = rows[~done]
    if rows.numel():  # 3. the full sort
        top, idx = torch.sort(flat[rows], dim=-1, descending=True)
        out[rows] = _kept_prefix(top, idx, torch.cumsum(top, dim=-1), p, vocab)
    return out.reshape(shape)


def _kept_prefix(top: torch.Tensor, idx: torch.Tensor, csum: torch.Tensor, p: float, vocab: int) -> torch.Tensor:
    """Rows of ``vocab`` probabilities from descending ``top`` (at ``idx``, cumulative ``csum``): the
    tokens whose cumulative mass is <= p, and always the first, renormalised."""
    keep = csum <= p
    keep[:, 0] = True
    kept = top * keep
    out = torch.zeros((top.shape[0], vocab), dtype=top.dtype, device=top.device)
    return out.scatter_(-1, idx, kept / kept.sum(dim=-1, keepdim=True))


# --------------------------------------------------------------------------------------------
# Transitions of docs/design/method.md, section 4


def mask_probabilities(sampler: str, t: float, s: float, remdm: ReMDMLoop | None = None) -> tuple[float, float]:
    """``(p_stay, p_remask)`` of one step from ``t`` to ``s = t - dt``.

    - MDLM: ``q = p_x0 (t - s)``, mass ``s`` on the mask, normalised by ``t``: ``p_stay = s / t``.
    - ReMDM-loop, ``t > t_on``: the same with ``move_chance(t) = 1 - (1 - t) alpha_on / (1 - t_on)``.
    - ReMDM-loop, ``t <= t_off``: the same with ``move_chance(t) = t (1 - alpha_on) / t_off``.
    - ReMDM-loop otherwise: an unmasked token is remasked with ``eta``; a masked one stays masked
      with ``(1 - alpha_on - alpha_on eta) / (1 - alpha_on)``.
    """
    if sampler == "mdlm":
        return max(s, 0.0) / t, 0.0
    if sampler != "remdm-loop":
        raise SamplerError(f"no diffusion transition for sampler {sampler!r}")
    r = remdm or ReMDMLoop()
    a = r.alpha_on
    if t > r.t_on:
        mt = 1 - (1 - t) * a / (1 - r.t_on)
        ms = 1 - (1 - s) * a / (1 - r.t_on)
        return max(ms, 0.0) / mt, 0.0
    if t <= r.t_off:
        mt = t * (1 - a) / r.t_off
        ms = s * (1 - a) / r.t_off
        return max(ms, 0.0) / mt, 0.0
    return (1 - a - a * r.eta) / (1 - a), r.eta


def transition_probs(p_x0: torch.Tensor, x: torch.Tensor, mask_id: int, p_stay: float, p_remask: float,
                     keep: torch.Tensor | None = None) -> torch.Tensor:
    """The full transition distribution ``q(z_s | z_t)`` (B, L, W), float64, that
    ``diffusion_step`` samples: masked positions ``(1 - p_stay) p_x0 + p_stay e_m``; unmasked
    positions ``(1 - p_remask) e_x + p_remask e_m`` (given prefix positions: ``e_x``)."""
    p = p_x0.double()
    e_m = torch.zeros_like(p)
    e_m[..., mask_id] = 1.0
    e_x = torch.zeros_like(p).scatter_(-1, x[..., None], 1.0)
    is_mask = (x == mask_id)[..., None]
    remask = torch.full_like(x, p_remask, dtype=torch.float64)
    if keep is not None:
        remask = remask.masked_fill(keep, 0.0)
    remask = remask[..., None]
    q_masked = (1 - p_stay) * p + p_stay * e_m
    q_unmasked = (1 - remask) * e_x + remask * e_m
    return torch.where(is_mask, q_masked, q_unmasked)


def diffusion_step(x: torch.Tensor, p_x0: torch.Tensor | None, keep: torch.Tensor, mask_id: int, p_stay: float,
                   p_remask: float, generator: torch.Generator) -> torch.Tensor:
    """Draw ``z_s ~ transition_probs(p_x0, x, ...)`` in two stages (see the module docstring).

    Random numbers drawn: ``B x L`` float64 uniforms, then ``n x W`` float64 Gumbel uniforms for
    the ``n`` positions that unmask. ``p_x0`` need only be valid at masked positions.
    """
    u = torch.rand(x.shape, generator=generator, dtype=torch.float64, device=x.device)
    is_mask = x == mask_id
    unmask = is_mask & (u >= p_stay)
    x_new = x.clone()
    if p_remask > 0:
        x_new[~is_mask & ~keep & (u < p_remask)] = mask_id
    idx = unmask.nonzero(as_tuple=True)
    if idx[0].numel():
        x_new[idx] = sample_categorical(p_x0[idx], generator)
    return x_new


# --------------------------------------------------------------------------------------------
# Helpers shared with bd3lm.py


def resolve_prefix(prefix: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None, batch_size: int, length: int,
                   cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``prefix`` (see the module docstring) -> ``(tokens (B, length) long, keep (B, length) bool)``."""
    tokens = torch.full((batch_size, length), cfg.mask_id, dtype=torch.long, device=device)
    keep = torch.zeros((batch_size, length), dtype=torch.bool, device=device)
    if prefix is None:
        return tokens, keep
    if isinstance(prefix, tuple | list):
        if len(prefix) != 2:
            raise SamplerError("prefix as a pair must be (tokens (B, length), keep (B, length) bool)")
        tok, kp = (torch.as_tensor(p, device=device) for p in prefix)
        if tok.dim() == 1:
            tok = tok[None]
        if kp.dim() == 1:
            kp = kp[None]
        if tok.shape[-1] != length or kp.shape[-1] != length or tok.shape[0] not in (1, batch_size) \
                or kp.shape[0] not in (1, batch_size):
            raise SamplerError(f"prefix tokens/keep must have shape ({batch_size} or 1, {length}), "
                               f"got {tuple(tok.shape)} and {tuple(kp.shape)}")
        tok, kp = tok.long().expand(batch_size, length), kp.bool().expand(batch_size, length)
    else:
        tok = torch.as_tensor(prefix, device=device).long()
        if tok.dim() == 1:
            tok = tok[None]
        if tok.dim() != 2 or tok.shape[0] not in (1, batch_size) or tok.shape[1] > length:
            raise SamplerError(f"prefix must be a LongTensor (P,) or ({batch_size}, P) with P <= length={length}, "
                               f"got shape {tuple(tok.shape)}")
        p = tok.shape[1]
        tok = torch.cat([tok.expand(batch_size, p), tokens[:, p:]], dim=1)
        kp = torch.zeros_like(keep)
        kp[:, :p] = True
    given = tok[kp]
    if given.numel() and (given.min() < 0 or given.max() >= cfg.width or (given == cfg.mask_id).any()):
        raise SamplerError(f"prefix tokens must be ids in [0, {cfg.width}) other than the mask id {cfg.mask_id}")
    tokens = torch.where(kp, tok, tokens)
    return tokens, kp.clone()


def denoiser_fn(model: nn.Module) -> Callable[..., torch.Tensor]:
    """The logits-before-SUBS callable of a diffusion model; ADLM through the fused projection."""
    if not hasattr(model, "denoiser_logits"):
        raise SamplerError(f"{type(model).__name__} has no denoiser_logits: use sampler='ar' for AR models")
    if hasattr(model, "fused_projection"):
        return lambda z, sigma, **kw: model.denoiser_logits(z, sigma, fused=True, **kw)
    return model.denoiser_logits


def subs_probs(logits: torch.Tensor, z: torch.Tensor, mask_id: int, nucleus_p: float) -> torch.Tensor:
    """SUBS ``p_x0`` as float32 probabilities; nucleus applied at the masked positions (unmasked
    positions carry over their token, so nothing is ever drawn there)."""
    probs = torch.softmax(suppress_mask(logits, mask_id), dim=-1)
    if nucleus_p < 1.0:
        m = z == mask_id
        if m.any():
            probs[m] = nucleus(probs[m], nucleus_p)
    return probs


def _sigma(cfg: ModelConfig, t: float, n: int, device: torch.device) -> torch.Tensor:
    return conditioning_sigma(cfg, LogLinearSchedule(cfg.noise_eps), torch.full((n,), t, device=device))


class RowCache:
    """``p_x0`` per batch row with a validity flag; ``use=False`` recomputes every row every time."""

    def __init__(self, fn: Callable[[torch.Tensor, float, torch.Tensor | None], torch.Tensor], batch: int,
                 use: bool, device: torch.device) -> None:
        self.fn, self.use = fn, use
        self.p: torch.Tensor | None = None
        self.valid = torch.zeros(batch, dtype=torch.bool, device=device)
        self.calls = 0  # network calls (rows x calls would also be a fair count; calls is what MDLM reports)

    def get(self, x: torch.Tensor, t: float, rows: torch.Tensor | None = None) -> torch.Tensor:
        """p_x0 for all rows, recomputing the invalid rows (restricted to ``rows`` when given)."""
        need = ~self.valid if self.use else torch.ones_like(self.valid)
        if rows is not None:
            need = need & rows
        if self.p is None or bool(need.all()):
            self.p = self.fn(x, t, None)
            self.calls += 1
        elif bool(need.any()):
            ix = need.nonzero(as_tuple=True)[0]
            self.p[ix] = self.fn(x[ix], t, ix)
            self.calls += 1
        self.valid |= need
        return self.p

    def invalidate(self, changed: torch.Tensor) -> None:
        self.valid &= ~changed


# --------------------------------------------------------------------------------------------
# Diffusion samplers (MDLM, ReMDM-loop; ADLM through denoiser_fn)


def check_sample_args(cfg: ModelConfig, batch_size: int, length: int, steps: int, nucleus_p: float,
                  generator: torch.Generator | None) -> None:
    if batch_size < 1:
        raise SamplerError(f"batch_size must be >= 1, got {batch_size}")
    if length < 1:
        raise SamplerError(f"length must be >= 1, got {length}")
    if steps < 1:
        raise SamplerError(f"steps must be >= 1, got {steps}")
    if not 0.0 < nucleus_p <= 1.0:
        raise SamplerError(f"nucleus_p must be in (0, 1], got {nucleus_p}")
    if not isinstance(generator, torch.Generator):
        raise SamplerError("pass generator=torch.Generator(device).manual_seed(seed): samplers never use global RNG")


def diffusion_sample(model: nn.Module, cfg: ModelConfig, tokens: torch.Tensor, keep: torch.Tensor, *, steps: int,
                     sampler: str, nucleus_p: float, generator: torch.Generator, progress: Progress | None,
                     cache: bool, remdm: ReMDMLoop | None = None, stats: dict | None = None,
                     final: str = "greedy") -> torch.Tensor:
    """MDLM ancestral or ReMDM-loop sampling of ``(B, L)`` from the all-mask sequence (given
    positions kept); see the module docstring. ``final``: how the masks left after the grid are
    filled, ``greedy`` (argmax of ``p_x0``, the default) or ``draw`` (a draw from ``p_x0``)."""
    if final not in FINAL_STEPS:
        raise SamplerError(f"final must be one of {', '.join(FINAL_STEPS)}, got {final!r}")
    m = cfg.mask_id
    fn = denoiser_fn(model)
    x = torch.where(keep, tokens, torch.full_like(tokens, m))
    b, device = x.shape[0], x.device

    def p_x0(z: torch.Tensor, t: float, rows: torch.Tensor | None) -> torch.Tensor:
        return subs_probs(fn(z, _sigma(cfg, t, z.shape[0], device)), z, m, nucleus_p)

    rc = RowCache(p_x0, b, cache and not cfg.conditions_on_time, device)
    ts = torch.linspace(1.0, T_MIN, steps + 1, dtype=torch.float64).tolist()
    dt = (1.0 - T_MIN) / steps
    for i in range(steps):
        t = ts[i]
        p_stay, p_remask = mask_probabilities(sampler, t, t - dt, remdm)
        has_mask = (x == m).any(-1)
        if p_remask == 0.0 and not bool(has_mask.any()):
            # Nothing can change any more (no mask, no remasking): skip the network, draw as usual
            # so that cached and uncached runs stay in step.
            probs = rc.p  # never indexed: no position can unmask
        else:
            probs = rc.get(x, t)
        x_new = diffusion_step(x, probs, keep, m, p_stay, p_remask, generator)
        rc.invalidate((x_new != x).any(-1))
        x = x_new
        if progress is not None:
            progress(i + 1, steps + 1)
    left = x == m
    rows = left.any(-1)
    if bool(rows.any()):  # the final step: fill every mask left (argmax of p_x0, or a draw from it)
        probs = rc.get(x, ts[-1], rows=rows)
        if final == "greedy":
            x = torch.where(left, probs.argmax(-1), x)
        else:
            idx = left.nonzero(as_tuple=True)
            x = x.clone()
            x[idx] = sample_categorical(probs[idx], generator)
    if progress is not None:
        progress(steps + 1, steps + 1)
    if stats is not None:
        stats["network_calls"] = rc.calls
        stats["final_filled"] = int(left.sum())
    return x


# --------------------------------------------------------------------------------------------
# Shared with kinds.sample and bd3lm.py


def reject_unknown(kw: dict, known: set[str], sampler: str) -> None:
    unknown = sorted(set(kw) - known)
    if unknown:
        raise SamplerError(f"unknown option(s) {', '.join(unknown)} for sampler {sampler!r}; "
                           f"known: {', '.join(sorted(known)) or 'none'}")


def unigram_entropy(ids: Sequence[int] | np.ndarray | torch.Tensor) -> float:
    """Entropy in nats of the token-id histogram of one sample (docs/design/method.md, section 6; BD3-LM's stop rule).

    ``H = -sum_v c_v/n log(c_v/n)`` over the ids ``v`` that occur ``c_v`` times among the ``n`` tokens.
    A sample of one repeated token has entropy 0; ``n`` distinct tokens give ``log n``.
    """
    a = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    a = a.reshape(-1).astype(np.int64)
    if a.size == 0:
        return 0.0
    _, counts = np.unique(a, return_counts=True)
    p = counts / a.size
    return float(-(p * np.log(p)).sum())


__all__ = [
    "FINAL_STEPS", "T_MIN", "ReMDMLoop", "SamplerError", "check_sample_args",
    "diffusion_sample", "diffusion_step",
    "mask_probabilities", "nucleus", "reject_unknown", "resolve_prefix", "sample_categorical", "transition_probs",
    "unigram_entropy",
]
