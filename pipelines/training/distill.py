"""Self-distillation through time as a training recipe mode (the ``distill:`` section; ``adlm_model/train/distill.py``
holds the objective).

A distillation run is a training run whose student starts from the teacher version's EMA weights (``run.init``
is set to ``distill.teacher`` and pinned like any start from a version: ``pipelines/training/init.py``) and
whose loss is SDTT's. It trains ``rounds x steps_per_round`` optimiser steps (``run.max_steps``); at the start of
round ``r`` (step ``r * steps_per_round``) the teacher takes the student's current (non-EMA) weights, as the
reference does, and its step ``dt`` doubles. The worker keeps the teacher in a ``Teacher`` (not a submodule of the
trained network: DDP, the EMA and the optimiser never see it).

Resume: every checkpoint stores the teacher's weights and the round they belong to (``distill_teacher``); a resumed
worker loads them, so a run killed mid-round continues in that round with the same teacher, and a run resumed at
a round boundary promotes the (restored) student exactly as the uninterrupted run did.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adlm_model import compute_loss
from adlm_model.interop.checkpoint import load_state, save_state
from adlm_model.objectives.losses import LossOutput
from adlm_model.train.distill import round_dt, sdtt_objective, student_steps
from pipelines.core.logs import get_logger

log = get_logger(__name__)

TEACHER_STATE = "distill_teacher"
"""The checkpoint files (``.json`` + ``.safetensors``) that hold the teacher's weights and round."""


@dataclass
class Teacher:
    """The frozen teacher network and the round whose teacher it is."""

    net: torch.nn.Module
    round: int = 0


class DistillLoss(torch.nn.Module):
    """``adlm_model.train.train_step.Objective``'s counterpart for a distillation run: SDTT's loss in training, the
    student's NELBO bound in validation (the same figure every run reports)."""

    def __init__(self, model: torch.nn.Module, cfg: Any, teacher: Teacher, section: Any) -> None:
        super().__init__()
        self.model, self.cfg, self.section = model, cfg, section
        self._teacher = [teacher]  # a list: not a registered submodule

    @property
    def teacher(self) -> Teacher:
        return self._teacher[0]

    def draw(self, x: torch.Tensor, attention_mask: torch.Tensor | None, generator: torch.Generator,
             train: bool) -> torch.Generator:
        """SDTT draws its noise (times, masks, the teacher's steps) inside its objective: the generator itself is
        what ``forward`` gets (a distillation is never compiled)."""
        return generator

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None, generator: torch.Generator,
                step: int | torch.Tensor, train: bool) -> LossOutput:
        if not train:
            return compute_loss(self.model, x, attention_mask, self.cfg, step=step, train=False, generator=generator)
        d = self.section
        return sdtt_objective(self.model, self.teacher.net, x, attention_mask, self.cfg,
                              dt=round_dt(d.teacher_steps, self.teacher.round, d.substeps), substeps=d.substeps,
                              divergence_kind=d.divergence, generator=generator)


def make_teacher(raw: torch.nn.Module) -> Teacher:
    """The round-0 teacher: a frozen copy of the student as initialised (the teacher version's EMA weights)."""
    net = copy.deepcopy(raw).eval()
    net.requires_grad_(False)
    return Teacher(net, 0)


def round_of(step: int, steps_per_round: int) -> int:
    return step // steps_per_round


def advance(w: Any) -> None:
    """Before optimiser step ``w.step``: when it opens a new round, the student's weights become the teacher."""
    d, t = w.cfg.distill, w.teacher
    r = round_of(w.step, d.steps_per_round)
    if r <= t.round:
        return
    t.net.load_state_dict(w.raw.state_dict())
    t.round = r
    if w.rank == 0:
        log.info(f"[{w.cfg.run.name}] distillation round {r + 1}/{d.rounds} at step {w.step}: the student becomes the "
                 f"teacher ({student_steps(d.teacher_steps, r, d.substeps)} steps; the student learns "
                 f"{student_steps(d.teacher_steps, r + 1, d.substeps)})")


def metrics(w: Any) -> dict[str, float]:
    """What the log window adds for a distillation run: its round, the teacher's dt, the student's step count."""
    d, r = w.cfg.distill, w.teacher.round
    return {"distill/round": float(r), "distill/dt": round_dt(d.teacher_steps, r, d.substeps),
            "distill/student_steps": float(student_steps(d.teacher_steps, r + 1, d.substeps))}


def save_teacher(w: Any, directory: Path) -> None:
    save_state(directory, {"round": w.teacher.round, "weights": w.teacher.net.state_dict()}, TEACHER_STATE)


def load_teacher(w: Any, directory: Path) -> None:
    state = load_state(directory, TEACHER_STATE)
    w.teacher.net.load_state_dict({k: v.to(w.device) for k, v in state["weights"].items()})
    w.teacher.round = int(state["round"])


def version_facts(cfg: Any) -> dict[str, Any]:
    """Checkpoint meta and registered-version tags of a distillation run: the pinned teacher (lineage), the
    sampler's default step count of the student, the rounds and the divergence."""
    d = cfg.distill
    return {"teacher": d.teacher, "sampler_steps": student_steps(d.teacher_steps, d.rounds, d.substeps),
            "distill_rounds": d.rounds, "distill_divergence": d.divergence}


__all__ = ["TEACHER_STATE", "DistillLoss", "Teacher", "advance", "load_teacher", "make_teacher", "metrics",
           "round_of", "save_teacher", "version_facts"]
