"""BD3-LM, block diffusion (docs/design/method.md, section 3; the BAM-DLM seed).

The sequence is split into blocks of size ``b`` (``b = 1`` is AR-like, ``b = L`` is MDLM). Each
block is a masked diffusion conditioned on the clean earlier blocks.

- **Training** (``bd3lm_objective``): ``x_t`` and ``x_0`` go through the network in one pass,
  concatenated, under ``block_diff_mask``: ``x_t`` tokens see their own noisy block
  (bidirectionally) and the clean *earlier* blocks of ``x_0``; ``x_0`` tokens see ``x_0``
  block-causally. Both halves use positions ``0..L-1`` (rotary), and only the ``x_t`` half goes
  through the output layer. ``t`` is drawn per block (stratified over batch x blocks), the NELBO
  weight is ``1/t`` per block and the loss is the sum over all blocks' masked tokens divided by
  the number of tokens, exactly as MDLM's (so ``b = L`` gives MDLM's loss on the same tokens,
  mask and ``t``).
- **Clipped ("data-driven") schedules**: during training ``t ~ U[beta, omega]``
  (``cfg.clip_low``, ``cfg.clip_high``); ``search_clipped_schedule`` measures the variance of the
  loss over a grid of intervals on held-out batches and picks the lowest (the seed's recipe:
  widths 0.5..0.9 slid in steps of ``delta``, plus the unclipped ``[eps, 1]``). Evaluation always
  uses the unclipped ``[sampling_eps, 1]``: only that is a bound on the NLL.
- **Sampling** (``sample_blocks``): block by block; inside a block the MDLM ancestral sampler of
  docs/design/method.md, section 4 (with ``p_x0`` caching) runs on the block alone, attending to a KV cache of
  the clean prefix (``kv_cache=True``) or to the recomputed prefix under a block-causal mask
  (``kv_cache=False``); the two agree within the training length. Beyond it, the prefix is a
  sliding window of ``context`` tokens (the cache keeps the last ``context - b`` positions;
  rotary scores depend only on relative positions), so any length can be generated. Stops per row
  at EOS or when the unigram entropy of the last ``entropy_window`` (256) tokens falls below
  ``entropy_threshold`` (reference 4 nats); a stopped row's tail is filled with ``pad_id``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..config import ModelConfig
from ..nn.backbone import DiT, KVCache
from ..nn.block_attention import block_causal_mask, block_diff_mask, block_diffusion_head, block_diffusion_pass
from ..objectives.losses import LossOutput, conditioning_sigma, head_loss, subs_nll, valid_positions
from ..objectives.schedule import LogLinearSchedule, mask_tokens
from ..sampling.samplers import (
    T_MIN,
    Progress,
    RowCache,
    SamplerError,
    denoiser_fn,
    diffusion_step,
    mask_probabilities,
    subs_probs,
    unigram_entropy,
)

# --------------------------------------------------------------------------------------------
# The network pass (masks and the pass itself: block_attention)


def _backbone(model: nn.Module) -> DiT:
    net = getattr(model, "backbone", None)
    if not isinstance(net, DiT):
        raise SamplerError(f"BD3-LM needs an MDLM-style network with one DiT backbone, got {type(model).__name__}")
    return net


def block_diffusion_logits(model: nn.Module, z_t: torch.Tensor, x0: torch.Tensor, sigma: torch.Tensor,
                           block_size: int) -> torch.Tensor:
    """Logits (B, L, width) for the ``x_t`` half of one pass over ``[x_t ; x_0]`` under
    ``block_diff_mask``; both halves at rotary positions ``0..L-1`` (``block_attention``)."""
    return block_diffusion_pass(_backbone(model), z_t, x0, sigma, block_size)


# --------------------------------------------------------------------------------------------
# Objective and clipped schedules


def block_times(batch: int, n_blocks: int, generator: torch.Generator | None, low: float, high: float,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """t per block (B, n_blocks) ~ U[low, high], stratified over the B x n_blocks cells
    (``(u_ij / N + k/N) mod 1`` with one uniform per cell, as the reference)."""
    n = batch * n_blocks
    u = torch.rand(batch, n_blocks, generator=generator, device=device, dtype=torch.float64)
    off = torch.arange(n, device=device, dtype=torch.float64).view(batch, n_blocks) / n
    t = (u / n + off) % 1.0
    return (low + (high - low) * t).float()


def clip_bounds(cfg: ModelConfig, train: bool) -> tuple[float, float]:
    """(beta, omega) of the masking rate: the clipped ``[clip_low, clip_high]`` in training (never
    below ``sampling_eps``), the full ``[sampling_eps, 1]`` in evaluation."""
    if not train:
        return cfg.sampling_eps, 1.0
    return max(cfg.clip_low, cfg.sampling_eps), cfg.clip_high


def block_noise(x: torch.Tensor, cfg: ModelConfig, generator: torch.Generator | None, *, train: bool = True,
                block_size: int | None = None, clip: tuple[float, float] | None = None,
                schedule: LogLinearSchedule | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The noise of one BD3-LM pass: times per block (B, n_blocks) from the clipped schedule (``train``; ``clip``
    overrides it) or ``[sampling_eps, 1]``, then the masked tokens ``z_t`` (B, L). Drawn apart from the network
    pass so that a compiled objective receives tensors, never a generator."""
    schedule = schedule or LogLinearSchedule(cfg.noise_eps)
    b = block_size or cfg.block_size
    batch, length = x.shape
    if length % b:
        raise SamplerError(f"BD3-LM block_size {b} must divide the sequence length {length}")
    low, high = clip if clip is not None else clip_bounds(cfg, train)
    t = block_times(batch, length // b, generator, low, high, x.device)
    z_t, _ = mask_tokens(x, schedule.move_chance(t.repeat_interleave(b, dim=1)), cfg.mask_id, generator)
    return t, z_t


def _block_terms(model: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None, cfg: ModelConfig,
                 t: torch.Tensor | None, generator: torch.Generator | None, z_t: torch.Tensor | None, train: bool,
                 block_size: int | None, clip: tuple[float, float] | None, schedule: LogLinearSchedule | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(z_t, sigma, per-token weight w(t_block), validity, b) of one pass: the noise drawn (``block_noise``)
    unless given."""
    schedule = schedule or LogLinearSchedule(cfg.noise_eps)
    b = block_size or cfg.block_size
    batch, length = x.shape
    if length % b:
        raise SamplerError(f"BD3-LM block_size {b} must divide the sequence length {length}")
    nb = length // b
    if t is None and z_t is None:
        t, z_t = block_noise(x, cfg, generator, train=train, block_size=b, clip=clip, schedule=schedule)
    elif t is None:
        low, high = clip if clip is not None else clip_bounds(cfg, train)
        t = block_times(batch, nb, generator, low, high, x.device)
    t = t.reshape(batch, -1).to(x.device)
    if t.shape[1] not in (1, nb):
        raise SamplerError(f"t must have shape (B,) or (B, {nb}), got {tuple(t.shape)}")
    t = t.expand(batch, nb)
    t_tok = t.repeat_interleave(b, dim=1)
    if z_t is None:
        z_t, _ = mask_tokens(x, schedule.move_chance(t_tok), cfg.mask_id, generator)
    # adaLN takes one condition per row: the mean of the blocks' sigmas (the reference's rule);
    # with time conditioning off (the default) it is the learned constant sigma = 0.
    sigma = conditioning_sigma(cfg, schedule, t).mean(-1) if cfg.conditions_on_time else torch.zeros(
        batch, device=x.device)
    return z_t, sigma, schedule.loss_weight(t_tok), valid_positions(x, attention_mask, cfg), b


def block_nelbo(model: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None, cfg: ModelConfig, *,
                t: torch.Tensor | None = None, generator: torch.Generator | None = None,
                z_t: torch.Tensor | None = None, train: bool = True, block_size: int | None = None,
                clip: tuple[float, float] | None = None,
                schedule: LogLinearSchedule | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token BD3-LM NELBO terms ``w(t_block) 1{z=m} (-log p(x | z, clean earlier blocks))`` (B, L),
    zero at pads, and the validity mask (B, L): what the schedule search groups per block.

    ``t``: None (drawn per block from the clipped schedule, or ``[sampling_eps, 1]`` when
    ``train=False``), shape (B,) (one time for every block of a row) or (B, n_blocks). ``z_t``:
    optional given noisy tokens. ``clip``: overrides ``(beta, omega)``.
    """
    z_t, sigma, w, valid, b = _block_terms(model, x, attention_mask, cfg, t, generator, z_t, train, block_size,
                                              clip, schedule)
    logits = block_diffusion_logits(model, z_t, x, sigma, b)
    return w * subs_nll(logits, x, z_t, cfg.mask_id) * valid, valid


def bd3lm_objective(model: nn.Module, x: torch.Tensor, attention_mask: torch.Tensor | None, cfg: ModelConfig,
                    t: torch.Tensor | None = None, generator: torch.Generator | None = None,
                    z_t: torch.Tensor | None = None, train: bool = True, block_size: int | None = None,
                    clip: tuple[float, float] | None = None,
                    schedule: LogLinearSchedule | None = None) -> LossOutput:
    """BD3-LM NELBO summed over blocks, divided by the tokens (docs/design/method.md, section 3); arguments as
    ``block_nelbo``. The ``x_t`` half's logits are never materialised (``losses.head_loss``)."""
    z_t, sigma, w, valid, b = _block_terms(model, x, attention_mask, cfg, t, generator, z_t, train, block_size,
                                              clip, schedule)
    head = block_diffusion_head(_backbone(model), z_t, x, sigma, b)
    total = head_loss(head, x, w * valid * (z_t == cfg.mask_id), exclude=cfg.mask_id)
    n = valid.sum()
    return LossOutput(loss=total / n.clamp(min=1), nll_sum=total.detach().double(), n_tokens=n)


def clip_intervals(widths: Sequence[float] = (0.5, 0.6, 0.7, 0.8, 0.9), delta: float = 0.05,
                   eps: float = 1e-3) -> list[tuple[float, float]]:
    """The reference grid: the unclipped ``(eps, 1)`` and, for each width ``w``, the intervals
    ``(max(i, eps), min(i + w, 1))`` for ``i = 0, delta, ..., 1 - w``."""
    out = [(eps, 1.0)]
    for w in widths:
        steps = int(round((1.0 - w) / delta))
        for k in range(steps + 1):
            lo = max(round(k * delta, 6), eps)
            hi = min(round(k * delta + w, 6), 1.0)
            if (lo, hi) not in out:
                out.append((lo, hi))
    return out


@dataclass
class ClipSearchResult:
    beta: float
    """Chosen lower bound of the masking rate (``cfg.clip_low``)."""
    omega: float
    """Chosen upper bound (``cfg.clip_high``)."""
    variances: dict[tuple[float, float], float] = field(default_factory=dict)
    """For every interval: the variance of the per-block mean loss over all (sequence, block) cells."""


def block_loss_moments(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
                       cfg: ModelConfig, intervals: Sequence[tuple[float, float]], seed: int = 0) -> torch.Tensor:
    """For every interval ``(beta, omega)``: (count, sum, sum of squares) of the per-block mean BD3-LM loss
    over the cells (sequence, block) of ``batches`` that hold a scored token, times drawn from the interval;
    float64 (len(intervals), 3). Moments add up, so workers can pool them (an all-reduce) before the choice.

    Every interval sees the same batches and the same random numbers (common random numbers), so the
    comparison measures the schedule, not the noise."""
    out = torch.zeros(len(intervals), 3, dtype=torch.float64)
    b = cfg.block_size
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for k, clip in enumerate(intervals):
                gen = torch.Generator(device=batches[0][0].device).manual_seed(seed)
                for x, am in batches:
                    per_token, valid = block_nelbo(model, x, am, cfg, generator=gen, clip=clip)
                    tok = per_token.double().view(x.shape[0], -1, b).sum(-1)
                    cnt = valid.view(x.shape[0], -1, b).sum(-1).double()
                    held = cnt > 0
                    means = (tok[held] / cnt[held]).cpu()
                    out[k] += torch.stack([torch.tensor(float(means.numel()), dtype=torch.float64), means.sum(),
                                           (means * means).sum()])
    finally:
        model.train(was_training)
    return out


def choose_clip(moments: torch.Tensor, intervals: Sequence[tuple[float, float]]) -> ClipSearchResult:
    """The interval of lowest variance of the per-block mean loss (the reference's data-driven schedule)."""
    n, s1, s2 = moments[:, 0], moments[:, 1], moments[:, 2]
    if bool((n < 2).any()):
        raise SamplerError("the clipped-schedule search needs at least two (sequence, block) cells per interval")
    var = (s2 - s1 * s1 / n) / (n - 1)
    variances = {tuple(iv): float(v) for iv, v in zip(intervals, var.tolist(), strict=True)}
    beta, omega = min(variances, key=variances.get)
    return ClipSearchResult(beta=beta, omega=omega, variances=variances)


def search_clipped_schedule(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor | None]],
                            cfg: ModelConfig, *, intervals: Sequence[tuple[float, float]] | None = None,
                            seed: int = 0) -> ClipSearchResult:
    """Pick the ``(beta, omega)`` minimising the variance of the per-block mean BD3-LM loss on held-out
    batches (over batch x blocks, as the reference). Training then draws block times from that interval until
    the next search; evaluation always uses the full ``[sampling_eps, 1]``."""
    intervals = list(intervals) if intervals is not None else clip_intervals(eps=cfg.sampling_eps)
    batches = list(batches)
    if not batches:
        raise SamplerError("search_clipped_schedule needs at least one held-out batch")
    return choose_clip(block_loss_moments(model, batches, cfg, intervals, seed), intervals)


# --------------------------------------------------------------------------------------------
# Block-by-block sampling


class BlockContext:
    """The clean prefix a block is denoised against: a KV cache (``kv_cache=True``) or the
    recomputed prefix under a block-causal mask. ``context`` bounds what a block attends to."""

    def __init__(self, model: nn.Module, block_size: int, context: int, kv_cache: bool, fold: bool = False) -> None:
        self.model, self.b, self.context = model, block_size, context
        self.fn = denoiser_fn(model)
        self.kv = KVCache() if kv_cache else None
        if kv_cache:
            _backbone(model)  # the cache is per DiT: one backbone only
        self.clean: torch.Tensor | None = None  # committed tokens (B, n), for the recompute path
        # Folding (KV path, same conditioning for clean and noisy blocks, i.e. time conditioning off): a
        # committed block's keys/values are computed in the next block's first network call, as the
        # leading half of a [clean block ; noisy block] pass, instead of in a call of their own. One
        # network call fewer per block (a fifth of them at T = 4); same logits (a test checks).
        self.fold = fold and kv_cache and context >= 2 * block_size
        self.pending: tuple[torch.Tensor, int, torch.Tensor] | None = None
        self.commit_calls = 0  # network calls spent on commits alone (0 when every commit folds)
        self._out: tuple[tuple[int, int], torch.Tensor] | None = None

    def _output(self, net: DiT, h: torch.Tensor) -> torch.Tensor:
        """The vocabulary projection of a block's b positions. With so few rows the matmul is bound by
        reading the (width x hidden) weight; a contiguous (hidden x width) copy, made once per set of
        weights, reads it in the order the kernel wants (about 25% faster on a CPU for b = 16)."""
        lin = net.output_layer.linear
        key = (lin.weight.data_ptr(), lin.weight._version)
        if self._out is None or self._out[0] != key:
            self._out = (key, lin.weight.detach().t().contiguous())
        out = torch.addmm(lin.bias, h.reshape(-1, h.shape[-1]), self._out[1])
        return out.view(*h.shape[:-1], out.shape[-1])

    def logits(self, z: torch.Tensor, start: int, sigma: torch.Tensor, rows: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Logits (B', b, width) of the block ``z`` at absolute position ``start`` (``rows``: the
        batch rows ``z`` holds, None = all)."""
        if self.kv is not None:
            if self.pending is not None and rows is None:
                return self._folded_logits(z, start, sigma)
            self._flush()
            kv = self.kv
            if rows is not None and kv.length:
                kv = kv.select(rows)
            net = _backbone(self.model)
            h = net.trunk(net.embed(z), sigma, cache=kv, cache_mode="read", position_offset=start)
            return self._output(net, h)
        ws = max(0, start + z.shape[1] - self.context)
        if self.clean is None or start == ws:
            seq, mask = z, None
        else:
            prev = self.clean[:, ws:start] if rows is None else self.clean[rows, ws:start]
            seq = torch.cat([prev, z], dim=1)
            mask = block_causal_mask(seq.shape[1], self.b, z.device)
        net = getattr(self.model, "backbone", None)
        if isinstance(net, DiT):  # only the block's positions go through the vocabulary projection
            h = net.trunk(net.embed(seq), sigma, mask=mask, position_offset=ws)
            return self._output(net, h[:, -z.shape[1]:])
        return self.fn(seq, sigma, mask=mask, position_offset=ws)[:, -z.shape[1]:]

    def commit(self, z: torch.Tensor, start: int, sigma: torch.Tensor) -> None:
        """Append the finished clean block (its keys/values to the cache, its tokens to the prefix)."""
        self.clean = z if self.clean is None else torch.cat([self.clean, z], dim=1)
        if self.kv is not None:
            self._flush()
            self.pending = (z, start, sigma)
            if not self.fold:
                self._flush()

    def _flush(self) -> None:
        """Run a pending commit in a call of its own."""
        if self.pending is None:
            return
        z, start, sigma = self.pending
        self.pending = None
        self.commit_calls += 1
        net = _backbone(self.model)
        net.trunk(net.embed(z), sigma, cache=self.kv, cache_mode="append", position_offset=start)
        self.kv.keep_last(max(self.context - self.b, 0))

    def _folded_logits(self, z: torch.Tensor, start: int, sigma: torch.Tensor) -> torch.Tensor:
        """One pass over [pending clean block ; z]: the clean half joins the cache (it sees the cache and
        itself, as its own commit call would), the noisy half reads the clean half and the cache minus
        what the unfolded path would have dropped from it (it keeps the last ``context - b`` positions)."""
        clean, c_start, _ = self.pending
        self.pending = None
        net = _backbone(self.model)
        seq = torch.cat([clean, z], dim=1)
        n, bc, before = seq.shape[1], clean.shape[1], self.kv.length
        mask = torch.ones(n, before + n, dtype=torch.bool, device=z.device)
        mask[:, before:] = block_causal_mask(n, bc, z.device)
        mask[bc:, :max(0, before - (self.context - 2 * self.b))] = False
        h = net.trunk(net.embed(seq), sigma, mask=mask, cache=self.kv, cache_append=bc, position_offset=c_start)
        self.kv.keep_last(max(self.context - self.b, 0))
        return self._output(net, h[:, -z.shape[1]:])


@dataclass
class BlockSample:
    tokens: torch.Tensor
    """(B, length) token ids; positions at or after ``lengths[r]`` hold ``pad_id``."""
    lengths: torch.Tensor
    """(B,) generated length of each row (``length`` unless it stopped)."""
    network_calls: int = 0
    """Network evaluations inside blocks (cache commits not counted)."""


def sample_blocks(model: nn.Module, cfg: ModelConfig, tokens: torch.Tensor, keep: torch.Tensor, *, steps: int,
                  nucleus_p: float, generator: torch.Generator, progress: Progress | None = None,
                  cache: bool = True, stats: dict | None = None, block_size: int | None = None,
                  kv_cache: bool = True, context: int | None = None, eos_id: int | None = None,
                  entropy_threshold: float | None = None, entropy_window: int = 256,
                  pad_id: int | None = None, bos_id: int | None = None) -> BlockSample:
    """Block-by-block BD3-LM sampling of ``tokens.shape`` (given positions ``keep`` are kept).

    ``steps`` T per block on ``linspace(1, 1e-5, T + 1)`` (a block stops early once it has no
    mask), then the greedy fill; ``cache``: ``p_x0`` reuse; ``kv_cache``: KV cache vs
    recomputation; ``context`` (default ``cfg.seq_len``): the longest prefix window a block sees.
    ``eos_id``: a row stops after its first generated EOS; ``entropy_threshold`` (reference 4.0
    nats): a row stops when the entropy of its last ``entropy_window`` tokens falls below it and
    loses those tokens. ``bos_id``: given first token (the reference starts with BOS).
    """
    b = block_size or cfg.block_size
    ctx = context or cfg.seq_len
    if b < 1 or ctx < b:
        raise SamplerError(f"need block_size >= 1 and context >= block_size, got {b} and {ctx}")
    stopping = eos_id is not None or entropy_threshold is not None
    fill = pad_id if pad_id is not None else eos_id
    if stopping and fill is None:
        raise SamplerError("entropy_threshold needs pad_id= (or eos_id=) to fill the tail of stopped rows")
    m = cfg.mask_id
    batch, length = tokens.shape
    device = tokens.device
    n_blocks = math.ceil(length / b)
    total = n_blocks * b
    tok = torch.full((batch, total), m, dtype=torch.long, device=device)
    kp = torch.zeros((batch, total), dtype=torch.bool, device=device)
    tok[:, :length], kp[:, :length] = tokens, keep
    if bos_id is not None:
        tok[:, 0] = torch.where(kp[:, 0], tok[:, 0], torch.full_like(tok[:, 0], bos_id))
        kp[:, 0] = True
    x = torch.where(kp, tok, torch.full_like(tok, m))
    ctxt = BlockContext(model, b, ctx, kv_cache, fold=not cfg.conditions_on_time)
    ts = torch.linspace(1.0, T_MIN, steps + 1, dtype=torch.float64).tolist()
    dt = (1.0 - T_MIN) / steps
    schedule = LogLinearSchedule(cfg.noise_eps)
    lengths = torch.full((batch,), length, dtype=torch.long)
    stopped = torch.zeros(batch, dtype=torch.bool)
    calls = 0

    def sigma_at(t: float, n: int) -> torch.Tensor:
        return conditioning_sigma(cfg, schedule, torch.full((n,), t, device=device))

    for k in range(n_blocks):
        s0 = k * b
        blk, kb = x[:, s0:s0 + b].clone(), kp[:, s0:s0 + b]

        def p_x0(z: torch.Tensor, t: float, rows: torch.Tensor | None, s0: int = s0) -> torch.Tensor:
            return subs_probs(ctxt.logits(z, s0, sigma_at(t, z.shape[0]), rows), z, m, nucleus_p)

        rc = RowCache(p_x0, batch, cache and not cfg.conditions_on_time, device)
        t_last = ts[0]
        for i in range(steps):
            if not bool((blk == m).any()):
                break
            t_last = ts[i]
            p_stay, _ = mask_probabilities("mdlm", t_last, t_last - dt)
            probs = rc.get(blk, t_last)
            new = diffusion_step(blk, probs, kb, m, p_stay, 0.0, generator)
            rc.invalidate((new != blk).any(-1))
            blk = new
        rows = (blk == m).any(-1)
        if bool(rows.any()):
            t_last = ts[-1]
            probs = rc.get(blk, t_last, rows=rows)
            blk = torch.where(blk == m, probs.argmax(-1), blk)
        calls += rc.calls
        x[:, s0:s0 + b] = blk
        end = min(s0 + b, length)
        if k + 1 < n_blocks:
            ctxt.commit(blk, s0, sigma_at(t_last, batch))
        if stopping:
            _check_stops(x, kp, s0, end, eos_id, entropy_threshold, entropy_window, lengths, stopped)
        if progress is not None:
            progress(k + 1, n_blocks)
        if stopping and bool(stopped.all()):
            break
    out = x[:, :length].clone()
    if stopping:
        pos = torch.arange(length, device=device)[None, :]
        out = torch.where(pos >= lengths.to(device)[:, None], torch.full_like(out, fill), out)
    if stats is not None:
        stats["network_calls"] = calls
        stats["commit_calls"] = ctxt.commit_calls
    return BlockSample(tokens=out, lengths=lengths, network_calls=calls)


def _check_stops(x: torch.Tensor, keep: torch.Tensor, s0: int, end: int, eos_id: int | None,
                 entropy_threshold: float | None, window: int, lengths: torch.Tensor, stopped: torch.Tensor) -> None:
    """Per row: stop after the first generated EOS in this block, or drop the last ``window``
    tokens when their unigram entropy is below the threshold (the reference's two criteria)."""
    for r in (~stopped).nonzero(as_tuple=True)[0].tolist():
        if eos_id is not None:
            hits = ((x[r, s0:end] == eos_id) & ~keep[r, s0:end]).nonzero(as_tuple=True)[0]
            if hits.numel():
                lengths[r] = s0 + int(hits[0]) + 1
                stopped[r] = True
                continue
        if entropy_threshold is not None and end > window:
            if unigram_entropy(x[r, end - window:end]) < entropy_threshold:
                lengths[r] = end - window
                stopped[r] = True


__all__ = [
    "BlockContext", "BlockSample", "ClipSearchResult", "bd3lm_objective", "block_causal_mask", "block_diff_mask",
    "block_diffusion_logits", "block_loss_moments", "block_nelbo", "block_noise", "block_times", "choose_clip", "clip_bounds", "clip_intervals", "sample_blocks",
    "search_clipped_schedule",
]
