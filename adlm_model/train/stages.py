"""Coconut's multi-stage fine-tuning schedule, as anchored chain-of-thought (ACoT) fine-tuning runs it.

Stage 0 is plain chain of thought; each later stage adds one ``[ANT]`` slot after the question (GSM8K up to 2
with 3 epochs a stage, ProntoQA and ProsQA up to 6 with 5 epochs a stage), and ProsQA's schedule also removes
one more reasoning step at each new ``[ANT]`` (``remove_steps``). The optimiser is built afresh at each stage
switch (Coconut resets it): the moments of one layout do not steer the first steps on the next. After every
epoch the model is validated by the caller's accuracy (greedy decoding, exact match) on that stage's layout,
and the weights of the best validation accuracy are kept: among the last stage's epochs by default (a
checkpoint is read with its own stage's layout, and an arm is defined by its last stage), or among all.

The arms of the comparison share this loop and differ by their stages, their layout and the anchor weight:

- ``no_cot``: question then answer, no trace (one stage);
- ``cot``: the full trace (stage 0 alone);
- ``pause``: ``max_ant`` pause tokens after the question, no trace (one stage, the anchor term off);
- ``pause_as_thought``: the staged schedule and layout, the supervised loss alone (anchor weight 0);
- ``acot``: the staged schedule with the anchor term (``anchor_weight`` times the anchor cross-entropy).

Single-stage arms train for as many epochs as the staged ones in all (an equal training budget).
Only torch and ``adlm_model`` are imported here; the layout of a row at a stage belongs to the caller.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..objectives.acot import acot_objective

Batch = Mapping[str, torch.Tensor]
"""A micro-batch laid out for a stage: ``input_ids``, ``sft_labels``, ``anchor_labels`` (B, L), on the device."""
SELECTS = ("last_stage", "all")


@dataclass(frozen=True)
class Arm:
    """One arm of the comparison (module docstring)."""

    name: str
    cot: bool
    """The layout keeps the trace (the steps left at the stage)."""
    staged: bool
    """Runs the multi-stage schedule; else one stage."""
    anchors: bool
    """The anchor term is on (its weight the recipe's ``anchor_weight``); off, the weight is 0."""
    pauses: bool = False
    """The single stage holds ``max_ant`` ``[ANT]`` slots (pause tokens)."""


ARMS: dict[str, Arm] = {a.name: a for a in (
    Arm("no_cot", cot=False, staged=False, anchors=False),
    Arm("cot", cot=True, staged=False, anchors=False),
    Arm("pause", cot=False, staged=False, anchors=False, pauses=True),
    Arm("pause_as_thought", cot=True, staged=True, anchors=False),
    Arm("acot", cot=True, staged=True, anchors=True),
)}


@dataclass(frozen=True)
class Stage:
    """One stage: ``n_ant`` ``[ANT]`` slots, the first ``removed_steps`` steps removed, ``epochs`` epochs."""

    index: int
    n_ant: int
    removed_steps: int
    epochs: int


def coconut_stages(max_ant: int, epochs_per_stage: int, *, remove_steps: bool = False) -> list[Stage]:
    """Stages 0..``max_ant``: stage k has k ``[ANT]`` slots and, with ``remove_steps``, k steps removed."""
    if max_ant < 0 or epochs_per_stage < 1:
        raise ValueError(f"max_ant must be >= 0 and epochs_per_stage >= 1, got {max_ant} and {epochs_per_stage}")
    return [Stage(k, k, k if remove_steps else 0, epochs_per_stage) for k in range(max_ant + 1)]


def arm_stages(arm: str, max_ant: int, epochs_per_stage: int, *, remove_steps: bool = False) -> list[Stage]:
    """The stages of an arm (module docstring): the schedule, or one stage of the schedule's total epochs."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; use one of {', '.join(ARMS)}")
    a = ARMS[arm]
    staged = coconut_stages(max_ant, epochs_per_stage, remove_steps=remove_steps)
    if a.staged:
        return staged
    return [Stage(0, max_ant if a.pauses else 0, 0, sum(s.epochs for s in staged))]


@dataclass
class StepParts:
    """One optimiser step's loss parts, summed over its micro-batches (detached)."""

    sft_sum: float = 0.0
    n_sft: int = 0
    anchor_sum: float = 0.0
    n_anchor: int = 0

    def add(self, other: StepParts) -> None:
        self.sft_sum += other.sft_sum
        self.n_sft += other.n_sft
        self.anchor_sum += other.anchor_sum
        self.n_anchor += other.n_anchor

    @property
    def sft_nll(self) -> float:
        """Mean supervised NLL per scored token (NaN without any)."""
        return self.sft_sum / self.n_sft if self.n_sft else math.nan

    @property
    def anchor_ce(self) -> float:
        """Mean anchor cross-entropy per labelled ``[ANT]`` output (NaN without any)."""
        return self.anchor_sum / self.n_anchor if self.n_anchor else math.nan


@dataclass
class EpochRecord:
    """What one epoch gave: its place in the schedule, its loss parts and its validation accuracy."""

    stage: int
    n_ant: int
    epoch: int
    """The epoch within its stage (0-based)."""
    global_epoch: int
    steps: int
    sft_nll: float
    anchor_ce: float
    accuracy: float
    seconds: float
    kept: bool
    """Whether these weights became the kept (best) checkpoint."""


@dataclass
class ScheduleResult:
    """The schedule's outcome: the kept weights (best validation accuracy), where they were reached, the history."""

    best_state: dict[str, torch.Tensor] | None
    best_accuracy: float
    best_stage: int
    best_epoch: int
    history: list[EpochRecord] = field(default_factory=list)
    steps: int = 0


OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class StagedFineTuning:
    """The staged loop over a model (module docstring). ``make_optimizer`` builds the optimiser of a stage
    (called at every stage switch: the reset); ``exclude`` is a column no label may take (the mask id);
    ``clip`` the global gradient norm (0: none)."""

    def __init__(self, model: nn.Module, stages: Sequence[Stage], make_optimizer: OptimizerFactory, *,
                 anchor_weight: float = 0.0, exclude: int | None = None, clip: float = 1.0,
                 select: str = "last_stage") -> None:
        if not stages:
            raise ValueError("a schedule needs at least one stage")
        if select not in SELECTS:
            raise ValueError(f"select {select!r}: use one of {', '.join(SELECTS)}")
        self.model, self.stages, self.make_optimizer = model, list(stages), make_optimizer
        self.anchor_weight, self.exclude, self.clip, self.select = anchor_weight, exclude, clip, select
        self.optimizer: torch.optim.Optimizer | None = None
        self.stage: Stage | None = None
        self.steps = 0

    def begin_stage(self, stage: Stage) -> torch.optim.Optimizer:
        """Switch to ``stage`` with a fresh optimiser (no moments, no step count); returns it."""
        self.stage = stage
        self.optimizer = self.make_optimizer(self.model.parameters())
        return self.optimizer

    def step(self, micro_batches: Sequence[Batch]) -> StepParts:
        """One optimiser step over ``micro_batches`` (gradient accumulation: each micro-batch's loss weighs
        ``1 / len(micro_batches)``)."""
        if self.optimizer is None:
            raise RuntimeError("call begin_stage before step")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        parts = StepParts()
        for mb in micro_batches:
            out = acot_objective(self.model, mb["input_ids"], mb["sft_labels"], mb["anchor_labels"],
                                 weight=self.anchor_weight, exclude=self.exclude)
            (out.loss / len(micro_batches)).backward()
            parts.add(StepParts(float(out.sft_sum), int(out.n_sft), float(out.anchor_sum), int(out.n_anchor)))
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.steps += 1
        return parts

    def run(self, batches: Callable[[Stage, int], Iterable[Sequence[Batch]]],
            validate: Callable[[nn.Module, Stage], float],
            on_epoch: Callable[[EpochRecord], None] | None = None) -> ScheduleResult:
        """The whole schedule: ``batches(stage, epoch)`` yields each step's micro-batches, ``validate(model,
        stage)`` gives the validation accuracy after each epoch; ``on_epoch`` sees every record."""
        result = ScheduleResult(None, -math.inf, -1, -1)
        g = 0
        last = self.stages[-1].index
        for stage in self.stages:
            self.begin_stage(stage)
            for epoch in range(stage.epochs):
                t0 = time.perf_counter()
                parts, n = StepParts(), 0
                for mbs in _nonempty(batches(stage, epoch)):
                    parts.add(self.step(mbs))
                    n += 1
                acc = float(validate(self.model, stage))
                eligible = self.select == "all" or stage.index == last
                kept = eligible and acc > result.best_accuracy
                if kept:
                    result.best_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
                    result.best_accuracy, result.best_stage, result.best_epoch = acc, stage.index, epoch
                rec = EpochRecord(stage.index, stage.n_ant, epoch, g, n, parts.sft_nll, parts.anchor_ce, acc,
                                  time.perf_counter() - t0, kept)
                result.history.append(rec)
                if on_epoch is not None:
                    on_epoch(rec)
                g += 1
        result.steps = self.steps
        return result


def _nonempty(it: Iterable[Sequence[Batch]]) -> Iterator[Sequence[Batch]]:
    for mbs in it:
        if len(mbs):
            yield mbs


__all__ = ["ARMS", "Arm", "EpochRecord", "ScheduleResult", "Stage", "StagedFineTuning", "StepParts", "arm_stages",
           "coconut_stages"]
