"""One optimiser step of every model kind, the one the training loop and the GPU check both run.

``TrainStep`` takes the micro-batches of a step and runs, for each, the noise draw (``draw_noise``: times, masks,
BD3-LM's block times, from the caller's generator) and then the objective (network, vocabulary projection, SUBS
and the loss: ``Objective``) under autocast, with the gradient synchronisation of a DDP or FSDP network on the
last micro-batch only; then clipping, AdamW, the learning-rate schedule and the EMA.

Compilation. With ``compile`` the objective runs under ``torch.compile`` (static shapes). The noise is drawn
before the compiled function and passed to it as tensors: a ``torch.Generator`` cannot enter a graph, and every
draw from one inside it split the graph (eleven breaks an MDLM step). The step index enters as an int64 tensor too
(ADLM's anchor weight ramps with it), so every step reuses the first step's graph. BD3-LM's attention mask (dense,
or FlexAttention's on CUDA) is built before the compiled function, which only reads it. A micro-batch of another
shape than the first (a last partial batch) runs the eager objective instead of compiling a second graph. Only
torch and ``adlm_model`` are imported here: the GPU check runs this module on a machine that has nothing else.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..baselines.bd3lm import block_noise
from ..config import ModelConfig
from ..kinds import KINDS, compute_loss
from ..nn.block_attention import prepare_block_mask
from ..objectives.losses import LossOutput, masked_noise
from .ema import EMA

Noise = tuple[torch.Tensor | None, torch.Tensor | None]
"""``(t, z_t)`` of one micro-batch (both None for a kind without noise: AR)."""

MicroBatch = tuple[torch.Tensor, torch.Tensor | None]
"""``(input_ids, attention_mask or None)`` on the device."""


def draw_noise(cfg: ModelConfig, x: torch.Tensor, generator: torch.Generator | None, *, train: bool = True) -> Noise:
    """The noise of ``cfg.kind``'s objective for the rows ``x``, drawn from ``generator`` in the order the
    objectives draw it themselves (the same generator gives the same noise either way): antithetic times and the
    masks for the masked-diffusion kinds (MDLM, ADLM, SEDD), BD3-LM's block times from its (clipped) schedule and
    the masks, nothing for AR."""
    kind = KINDS[cfg.kind]
    if not kind.diffusion:
        return None, None
    if kind.block_diffusion:
        return block_noise(x, cfg, generator, train=train)
    return masked_noise(cfg, x, generator)


class Objective(nn.Module):
    """A network's objective as a module: what DDP wraps (it sees the forward pass, so it syncs the gradients)
    and ``torch.compile`` compiles. ``forward`` draws nothing: the noise comes from ``draw``."""

    def __init__(self, model: nn.Module, cfg: ModelConfig) -> None:
        super().__init__()
        self.model, self.cfg = model, cfg

    def draw(self, x: torch.Tensor, attention_mask: torch.Tensor | None, generator: torch.Generator | None,
             train: bool) -> Noise:
        if KINDS[self.cfg.kind].block_diffusion:  # the attention mask is built outside any compiled region
            prepare_block_mask(x.shape[1], self.cfg.block_size, x.device)
        return draw_noise(self.cfg, x, generator, train=train)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None, noise: Noise,
                step: int | torch.Tensor, train: bool) -> LossOutput:
        t, z_t = noise
        return compute_loss(self.model, x, attention_mask, self.cfg, step=step, train=train, t=t, z_t=z_t)


@dataclass
class StepOutput:
    """What one optimiser step measured (tensors stay on the device: reading them is the caller's sync)."""

    loss: torch.Tensor
    """The step's mean training loss (float64), the micro-batches' means averaged."""
    nll_sum: torch.Tensor
    n_tokens: torch.Tensor
    anchor_sum: torch.Tensor | None
    n_anchor: torch.Tensor | None
    grad_norm: torch.Tensor
    """The global gradient norm before clipping."""
    lr: float
    """The learning rate this step used."""
    group_norms: torch.Tensor | None = None
    """The gradient norm of each of ``TrainStep.groups`` before clipping, in their order (None without groups)."""


class TrainStep:
    """The optimiser step (module docstring). ``objective``: an ``Objective`` (or a module with its ``draw`` and
    ``forward``); ``net``: the same wrapped in DDP or sharded by FSDP (``sync``: ``ddp`` / ``fsdp``); ``model``:
    the parameters clipped and averaged."""

    def __init__(self, objective: nn.Module, model: nn.Module, opt: torch.optim.Optimizer, *,
                 sched: Any = None, ema: EMA | None = None, clip: float = 1.0, net: nn.Module | None = None,
                 sync: str | None = None, autocast: torch.dtype | None = None, compile: bool = False,
                 backend: Any = "inductor", groups: dict[str, list[nn.Parameter]] | None = None) -> None:
        self.objective, self.model, self.opt, self.sched, self.ema = objective, model, opt, sched, ema
        self.groups = groups if groups and sync != "fsdp" else None
        """Parameter groups whose gradient norms each step measures apart (an ADLM's two networks: a stall of one
        shows in its curve); not under FSDP, whose gradients are shards."""
        self.clip, self.sync, self.autocast_dtype = clip, sync, autocast
        self.net = net if net is not None else objective
        self.compiled = torch.compile(self.net, backend=backend, dynamic=False) if compile else None
        self.shape: tuple[int, ...] | None = None
        """The micro-batch shape the compiled objective was traced for (the first one's)."""
        self.compile_s: float | None = None
        """Wall seconds of the first compiled step (tracing and compilation, forward and backward)."""
        self.eager_micro_batches = 0
        """Micro-batches of another shape, run by the eager objective."""
        self._k: torch.Tensor | None = None

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def _call(self, x: torch.Tensor, am: torch.Tensor | None, noise: Noise, k: torch.Tensor) -> LossOutput:
        fn = self.net
        if self.compiled is not None:
            if self.shape is None:
                self.shape = tuple(x.shape)
            if tuple(x.shape) == self.shape:
                fn = self.compiled
            else:
                self.eager_micro_batches += 1
        return fn(x, am, noise, k, True)

    def __call__(self, batches: Sequence[MicroBatch], *, step: int, generator: torch.Generator | None
                 ) -> StepOutput:
        """One optimiser step over ``batches`` (its micro-batches: gradients accumulated, each weighted
        1 / len(batches)) at step index ``step``."""
        if not batches:
            raise ValueError("an optimiser step needs at least one micro-batch")
        first = self.compiled is not None and self.compile_s is None
        t0 = time.perf_counter()
        device = batches[0][0].device
        if self._k is None or self._k.device != device:
            # int64: dynamo takes a 0-dim float64 CPU tensor for a Python float, traces it as a symbolic float and
            # then traces the whole objective again ("Restarting analysis": ADLM's anchor-weight ramp reads it).
            self._k = torch.zeros((), dtype=torch.int64, device=device)
        self._k.fill_(step)  # a kernel argument, no host sync; the compiled graph reads it as an input
        accum = len(batches)
        self.opt.zero_grad(set_to_none=True)
        sums: dict[str, Any] = {"loss": 0.0, "nll": 0.0, "ntok": 0, "anc": None, "nanc": None}
        for m, (x, am) in enumerate(batches):
            last = m == accum - 1
            no_sync = self.sync == "ddp" and not last
            if self.sync == "fsdp":
                self.net.set_requires_gradient_sync(last)
            with self.net.no_sync() if no_sync else contextlib.nullcontext():
                noise = self.objective.draw(x, am, generator, True)
                with self.autocast(x.device):
                    out = self._call(x, am, noise, self._k)
                (out.loss / accum).backward()
            sums["loss"] = sums["loss"] + out.loss.detach().double() / accum
            sums["nll"] = sums["nll"] + out.nll_sum
            sums["ntok"] = sums["ntok"] + out.n_tokens
            if out.anchor_sum is not None:
                sums["anc"] = out.anchor_sum if sums["anc"] is None else sums["anc"] + out.anchor_sum
                sums["nanc"] = out.n_anchor if sums["nanc"] is None else sums["nanc"] + out.n_anchor
        group_norms = self.group_norms()
        grad_norm = self.clip_gradients()
        lr = self.opt.param_groups[0]["lr"] if self.sched is None else self.sched.get_last_lr()[0]
        self.opt.step()
        if self.sched is not None:
            self.sched.step()
        if self.ema is not None:
            self.ema.update(self.model)
        if first:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.compile_s = time.perf_counter() - t0
        return StepOutput(loss=sums["loss"], nll_sum=sums["nll"], n_tokens=sums["ntok"], anchor_sum=sums["anc"],
                          n_anchor=sums["nanc"], grad_norm=grad_norm, lr=lr, group_norms=group_norms)

    def group_norms(self) -> torch.Tensor | None:
        """The gradient norm of each group (float64, one tensor in the groups' order; a group without gradients: 0)."""
        if self.groups is None:
            return None
        norms = []
        for params in self.groups.values():
            grads = [p.grad.detach().norm() for p in params if p.grad is not None]
            norms.append(torch.linalg.vector_norm(torch.stack(grads)).double() if grads
                         else torch.zeros((), dtype=torch.float64, device=self._k.device))
        return torch.stack(norms)

    def clip_gradients(self) -> torch.Tensor:
        """The global gradient norm (a full tensor under FSDP), the gradients clipped to ``clip`` when > 0."""
        if self.clip > 0:
            gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        else:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            gn = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn
        return gn.detach().double()


def lr_factor(step: int, warmup: int, schedule: str, max_steps: int, min_ratio: float) -> float:
    """The learning rate's factor at ``step`` (reference recipe): linear warm-up to 1, then constant or cosine
    down to ``min_ratio``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, max_steps - warmup)
    prog = min(1.0, (step - warmup) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))


def lr_schedule(opt: torch.optim.Optimizer, *, warmup: int = 0, schedule: str = "constant", max_steps: int = 1,
                min_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """``lr_factor`` as the optimiser's scheduler."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, warmup, schedule, max_steps, min_ratio))


def fused_adamw(params: Any, *, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                weight_decay: float = 0.0, fused: bool = True) -> torch.optim.AdamW:
    """AdamW with its fused kernel (CPU and CUDA) unless ``fused`` is off (then ``foreach``)."""
    kw = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **kw)


__all__ = ["MicroBatch", "Noise", "Objective", "StepOutput", "TrainStep", "draw_noise", "fused_adamw", "lr_factor",
           "lr_schedule"]
