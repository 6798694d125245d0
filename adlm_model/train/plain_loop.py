"""The training loop to read first: rows of token ids in, a trained model and its checkpoint out, in plain PyTorch.

It runs on one device with no Ray and no MLflow, and it uses the same pieces as the pipeline's loop
(``pipelines/training/loop.py``), in the order that loop calls them: ``build_model`` after ``torch.manual_seed``,
the kind's objective (``Objective``), AdamW (``fused_adamw``), the learning rate of ``lr_factor``, the ``EMA``,
the optimiser step (``TrainStep``: noise, loss, backward, clipping, AdamW, EMA) and the checkpoint
(``adlm_model.interop.checkpoint``: safetensors and JSON). Given the same rows in the same order and the seeds
the pipeline derives for rank 0 (``pipelines/core/seeds.py``), its per-step losses equal a one-process run of
``python -m pipelines.train`` (``tests/pipelines/test_plain_loop.py`` holds it to that). What the pipeline adds around
these steps is distribution, validation, tracking and registration.

    python -c "from adlm_model.train.plain_loop import demo; demo()"

trains a tiny MDLM on random rows for a few steps. Only torch and ``adlm_model`` are imported here.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from ..config import ModelConfig, preset
from ..interop.checkpoint import load_checkpoint, load_state, read_config, save_checkpoint, save_state
from ..kinds import build_model
from .ema import EMA
from .train_step import MicroBatch, Objective, TrainStep, fused_adamw, lr_factor

log = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state"
"""The checkpoint's optimiser, RNG and step file (``trainer_state.safetensors`` and ``.json``), as the pipeline's."""


@dataclass
class PlainConfig:
    """The loop's settings besides the model's config; the defaults are the reference recipe's."""

    max_steps: int = 100
    accumulation: int = 1
    """Micro-batches per optimiser step (their gradients averaged)."""
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    fused: bool = True
    """AdamW's fused kernel; False: its ``foreach`` kernel, whose updates equal ``torch.optim.AdamW``'s default."""
    warmup_steps: int = 0
    schedule: str = "constant"
    """``constant`` or ``cosine`` after the warm-up (``lr_factor``)."""
    min_lr_ratio: float = 0.1
    lr_at: Callable[[int], float] | None = None
    """The learning rate of each step, replacing ``lr`` through ``lr_factor`` (a benchmark's own schedule)."""
    clip: float = 1.0
    """The gradient norm clipped to (0: no clipping)."""
    ema: float | None = 0.9999
    """The EMA's decay; None: no EMA."""
    ema_warmup: bool = True
    seed: int = 0
    """The initial weights' seed."""
    noise_seed: int | None = None
    """The seed of the objective's noise (times and masks); None: ``seed``."""
    dropout_seed: int | None = None
    """The torch seed set after the model is built (dropout draws from it); None: none set."""
    device: str = "cpu"
    bf16: bool = False
    """bf16 autocast (a GPU's: about 19 times slower on a CPU)."""
    compile: bool = False
    out_dir: str | None = None
    """Where the checkpoint is written and resumed from; None: nowhere."""
    ckpt_every: int = 0
    """Steps between checkpoints (0: only the last step's)."""
    log_every: int = 0
    """Steps between progress lines on the ``adlm_model.train.plain_loop`` logger (0: none)."""


@dataclass
class Run:
    """The live objects of one run and how far it got."""

    cfg: ModelConfig
    tc: PlainConfig
    model: nn.Module
    train_step: TrainStep
    ema: EMA | None
    noise: torch.Generator
    step: int = 0
    losses: list[float] = field(default_factory=list)
    """The mean training loss of each step this process took."""


def setup(cfg: ModelConfig, tc: PlainConfig) -> Run:
    """Seed, build the model, its objective, AdamW, the EMA and the optimiser step, in the pipeline's order (the
    same order draws the same initial weights and the same noise)."""
    device = torch.device(tc.device)
    torch.manual_seed(tc.seed)
    model = build_model(cfg).to(device)
    ema = EMA(model, tc.ema, warmup=tc.ema_warmup) if tc.ema is not None else None
    opt = fused_adamw(model.parameters(), lr=tc.lr, betas=tc.betas, eps=tc.eps, weight_decay=tc.weight_decay,
                      fused=tc.fused)
    step = TrainStep(Objective(model, cfg), model, opt, ema=ema, clip=tc.clip,
                     autocast=torch.bfloat16 if tc.bf16 else None, compile=tc.compile)
    noise = torch.Generator(device=device)
    noise.manual_seed(tc.seed if tc.noise_seed is None else tc.noise_seed)
    if tc.dropout_seed is not None:
        torch.manual_seed(tc.dropout_seed)
    return Run(cfg=cfg, tc=tc, model=model, train_step=step, ema=ema, noise=noise)


def learning_rate(tc: PlainConfig, step: int) -> float:
    """The learning rate of ``step``: ``lr_at``'s, else ``lr`` times ``lr_factor`` (what the pipeline's
    scheduler gives)."""
    if tc.lr_at is not None:
        return tc.lr_at(step)
    return tc.lr * lr_factor(step, tc.warmup_steps, tc.schedule, tc.max_steps, tc.min_lr_ratio)


def as_micro_batch(b: torch.Tensor | MicroBatch, device: torch.device) -> MicroBatch:
    """``(input_ids as int64, attention mask or None)`` on ``device``, from rows or such a pair."""
    x, am = (b, None) if isinstance(b, torch.Tensor) else b
    return x.to(device).long(), (am.to(device) if am is not None else None)


def save(run: Run, directory: str | Path) -> None:
    """The checkpoint: config, weights and EMA weights (``save_checkpoint``), then AdamW's state, the RNG
    streams and the step (``save_state``): everything ``resume`` needs to continue exactly."""
    ema = run.ema.state_dict() if run.ema is not None else None
    save_checkpoint(directory, run.model, run.cfg, ema_state=ema,
                    meta={"step": run.step, "device": run.noise.device.type})
    cuda = run.noise.device.type == "cuda"  # dropout on a GPU draws from its own generator
    save_state(directory, {"optimizer": run.train_step.opt.state_dict(), "noise": run.noise.get_state().cpu(),
                           "torch": torch.get_rng_state(), "step": run.step,
                           "cuda": torch.cuda.get_rng_state(run.noise.device) if cuda else None,
                           "ema_updates": run.ema.num_updates if run.ema is not None else 0}, TRAINER_STATE)


def saved_step(directory: str | Path) -> int | None:
    """The step of the checkpoint in ``directory``, or None when it holds none."""
    d = Path(directory)
    if not (d / f"{TRAINER_STATE}.json").is_file():
        return None
    return int(read_config(d)[1]["step"])


def resume(run: Run, directory: str | Path) -> int | None:
    """Continue ``run`` from the checkpoint in ``directory``; returns its step, or None (no checkpoint, or one
    written on another device type: a random stream does not carry across devices, so the run starts over)."""
    if saved_step(directory) is None:
        return None
    _, meta = read_config(directory)
    if meta.get("device", "cpu") != run.noise.device.type:
        log.warning(f"{directory}: the checkpoint was written on {meta.get('device')}: starting over")
        return None
    saved, _, _ = load_checkpoint(directory, expect={"kind": run.cfg.kind, "vocab_size": run.cfg.vocab_size},
                                  use_ema=False)
    run.model.load_state_dict(saved.state_dict())
    state = load_state(directory, TRAINER_STATE)
    run.train_step.opt.load_state_dict(state["optimizer"])
    if run.ema is not None:
        averaged, _, _ = load_checkpoint(directory, use_ema=True)
        run.ema.load_state_dict(averaged.state_dict(), state["ema_updates"])
    run.noise.set_state(state["noise"])
    torch.set_rng_state(state["torch"])  # last: building the models above drew from it
    if state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], run.noise.device)
    run.step = int(state["step"])
    return run.step


def train(cfg: ModelConfig, tc: PlainConfig, batches: Callable[[int], Iterable[torch.Tensor | MicroBatch]], *,
          on_step: Callable[[Run], None] | None = None) -> Run:
    """Train ``cfg`` for ``tc.max_steps`` optimiser steps and return the run (model, EMA, losses).

    ``batches(start)`` gives the micro-batches from optimiser step ``start`` on (``accumulation`` a step): rows
    ``(B, L)`` of token ids, or ``(rows, attention mask)`` pairs; ``micro_batches`` makes them from a tensor of
    rows. With ``out_dir`` the run resumes from the checkpoint there, writes one every ``ckpt_every`` steps and
    one after the last step. ``on_step(run)`` is called after every step (a caller's progress lines)."""
    run = setup(cfg, tc)
    if tc.out_dir is not None and resume(run, tc.out_dir) is not None:
        log.info(f"resuming from step {run.step} ({tc.out_dir})")
    device = torch.device(tc.device)
    stream = iter(batches(run.step))
    run.model.train()
    while run.step < tc.max_steps:
        for group in run.train_step.opt.param_groups:
            group["lr"] = learning_rate(tc, run.step)
        micro = [as_micro_batch(b, device) for b in itertools.islice(stream, tc.accumulation)]
        if len(micro) < tc.accumulation:
            raise ValueError(f"the batches ran out at step {run.step} of {tc.max_steps}")
        out = run.train_step(micro, step=run.step, generator=run.noise)
        run.losses.append(float(out.loss))
        run.step += 1
        if tc.log_every and run.step % tc.log_every == 0:
            log.info(f"step {run.step}/{tc.max_steps} loss {run.losses[-1]:.4f} lr {out.lr:.3g} "
                     f"grad norm {float(out.grad_norm):.3f}")
        if on_step is not None:
            on_step(run)
        if tc.out_dir is not None and tc.ckpt_every and run.step % tc.ckpt_every == 0 and run.step < tc.max_steps:
            save(run, tc.out_dir)
    if tc.out_dir is not None:
        save(run, tc.out_dir)
    return run


def micro_batches(rows: torch.Tensor, size: int, start: int = 0) -> Iterator[torch.Tensor]:
    """Micro-batches of ``size`` rows in order, epoch after epoch (a last partial one dropped), from micro-batch
    ``start`` on: the pipeline's stream of one worker without a shuffle buffer."""
    per_epoch = rows.shape[0] // size
    if per_epoch == 0:
        raise ValueError(f"{rows.shape[0]} rows hold no micro-batch of {size}")
    for i in itertools.count(start):
        j = i % per_epoch
        yield rows[j * size:(j + 1) * size]


def demo(steps: int = 20) -> list[float]:
    """A tiny MDLM trained ``steps`` steps on random rows (the loop's smallest use); returns its losses."""
    cfg = preset("tiny", kind="mdlm", vocab_size=64, mask_id=2, seq_len=16, hidden=32, heads=2, n_blocks=1,
                 cond_dim=16)
    rows = torch.randint(3, 64, (64, 16), generator=torch.Generator().manual_seed(0))
    run = train(cfg, PlainConfig(max_steps=steps, lr=3e-3, warmup_steps=5, ema=0.99, log_every=5),
                lambda start: micro_batches(rows, 8, start))
    return run.losses


__all__ = ["PlainConfig", "Run", "TRAINER_STATE", "demo", "learning_rate", "micro_batches", "resume", "save",
           "saved_step", "setup", "train"]
