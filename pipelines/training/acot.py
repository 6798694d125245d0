"""Anchored chain-of-thought fine-tuning's data and accuracy: a reasoning split (``prepare_data --source prosqa``)
read whole, its rows laid out for a stage of the schedule and an arm, batched, and answered by greedy decoding.

A reasoning split is small (thousands of rows of at most a few hundred tokens) and its layout changes with the
stage, so its shards are read into memory once and laid out again at every stage; nothing is packed. The
validation accuracy is Coconut's: the prompt is the question with the stage's ``[ANT]`` slots as inputs
(through ``[EoA]``), the rest is decoded greedily (the ``[ANT]`` outputs are never read, the ``[ANT]`` id and the
markers are never emitted), the answer is the text after the last ``#`` and counts when it equals the gold
answer exactly. Both texts are decoded by the split's tokenizer, so a word-level vocabulary's spacing is the
same on both sides.
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from adlm_model.config import ConfigError
from adlm_model.kinds import KINDS
from adlm_model.sampling.greedy import greedy_decode
from adlm_model.train.stages import ARMS, SELECTS, Batch, Stage
from pipelines.core.storage import read_bytes
from pipelines.data.manifest import Manifest, ManifestError, read_manifest
from pipelines.data.reasoning.answers import exact_match, extract_answer
from pipelines.data.reasoning.layout import ANCHOR_POSITIONS, Laid, Markers, collate, lay_out
from pipelines.data.tokenizer import TokenizerInfo, load_tokenizer

COLUMNS = ("question", "answer", "question_ids", "step_ids", "answer_ids", "anchor_ids")


@dataclass
class ReasoningSplit:
    """One reasoning split in memory: its manifest, its rows (the shard columns), the layout's markers and the
    tokenizer that decodes generated text."""

    manifest: Manifest
    rows: list[dict[str, Any]]
    markers: Markers
    tokenizer: TokenizerInfo

    @property
    def task(self) -> str:
        return str(self.manifest.options.get("task", ""))

    def longest(self, stage: Stage, arm: str) -> int:
        """The longest row of the split laid out at ``stage`` for ``arm`` (what the model's positions must hold)."""
        return max(len(laid.input_ids) for laid in self.laid(stage, arm))

    def laid(self, stage: Stage, arm: str, anchor_position: str = "at") -> list[Laid]:
        """Every row laid out at ``stage`` for ``arm`` (``layout.lay_out``)."""
        cot = ARMS[arm].cot
        return [lay_out(r["question_ids"], r["step_ids"], r["answer_ids"], r["anchor_ids"], self.markers,
                        stage.n_ant, removed_steps=stage.removed_steps, cot=cot, anchor_position=anchor_position)
                for r in self.rows]


def read_split(split_dir: str, what: str) -> ReasoningSplit:
    """The reasoning split in ``split_dir``; ConfigError (one line, naming ``what``) when it is none."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.parquet as pq

    try:
        m = read_manifest(split_dir)
    except ManifestError as e:
        raise ConfigError(f"{what}: {e}") from None
    if m.mode != "reasoning":
        raise ConfigError(f"{what}: {split_dir} holds {m.mode} rows, not reasoning rows; prepare them with "
                          "python -m pipelines.prepare_data --source prosqa (or prontoqa, gsm8k, files)")
    marks = m.options.get("markers") or {}
    try:
        markers = Markers(bos=int(m.bos_id), eos=int(m.eos_id), pad=int(m.pad_id if m.pad_id is not None else m.eos_id),
                          boa=int(marks["[BoA]"]), eoa=int(marks["[EoA]"]), ant=int(marks["[ANT]"]),
                          answer=tuple(int(t) for t in marks["answer"]))
    except (KeyError, TypeError) as e:
        raise ConfigError(f"{what}: the manifest in {split_dir} has no marker ids ({e}); prepare the split again "
                          "with python -m pipelines.prepare_data") from None
    rows: list[dict[str, Any]] = []
    for uri in m.shard_uris():
        try:
            table = pq.read_table(io.BytesIO(read_bytes(uri)), columns=list(COLUMNS))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{what}: shard {uri} cannot be read ({e}); rerun pipelines.prepare_data") from None
        rows.extend(table.to_pylist())
    tok_spec = m.tokenizer.get("path") or m.tokenizer.get("name")
    return ReasoningSplit(m, rows, markers, load_tokenizer(str(tok_spec)))


def to_batch(laid: Sequence[Laid], pad: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A micro-batch of laid rows as tensors on ``device``."""
    return {k: torch.as_tensor(v, device=device) for k, v in collate(laid, pad).items()}


def stage_batches(split: ReasoningSplit, stage: Stage, arm: str, epoch: int, *, micro_batch: int, accumulation: int,
                  seed: int, anchor_position: str = "at", device: torch.device | str = "cpu"
                  ) -> Iterator[list[Batch]]:
    """One epoch of a stage: the rows shuffled by ``(seed, stage, epoch)``, ``accumulation`` micro-batches of
    ``micro_batch`` rows a step (the last step may be short)."""
    laid = split.laid(stage, arm, anchor_position)
    order = list(range(len(laid)))
    random.Random(f"{seed}:{stage.index}:{epoch}").shuffle(order)
    per_step = micro_batch * accumulation
    for lo in range(0, len(order), per_step):
        idx = order[lo:lo + per_step]
        yield [to_batch([laid[i] for i in idx[j:j + micro_batch]], split.markers.pad, device)
               for j in range(0, len(idx), micro_batch)]


@dataclass
class AnswerRecord:
    """One row's answer: the question, the gold answer, the generated text after the prompt, the answer read
    off it and whether it matches."""

    question: str
    gold: str
    generated: str
    predicted: str
    correct: bool


@dataclass
class Accuracy:
    """Exact-match accuracy over rows, with every row's record."""

    correct: int
    total: int
    records: list[AnswerRecord]

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else float("nan")


def decode_limit(split: ReasoningSplit, stage: Stage, arm: str, seq_len: int, max_new: int = 0) -> int:
    """Tokens greedy decoding may generate: ``max_new``, or the longest generated part of the split's rows at
    this stage plus 8, never past the model's ``seq_len`` for the longest prompt."""
    laid = split.laid(stage, arm)
    need = max_new or max(len(x.input_ids) - x.prompt_len for x in laid) + 8
    return max(1, min(need, seq_len - max(x.prompt_len for x in laid)))


def answer_accuracy(model: nn.Module, split: ReasoningSplit, stage: Stage, arm: str, *, seq_len: int,
                    max_new: int = 0, limit: int = 0, suppress_extra: Sequence[int] = ()) -> Accuracy:
    """Greedy answers of the split's rows (the first ``limit``; 0: all) at ``stage`` for ``arm``, scored by exact
    match (module docstring)."""
    rows = split.rows[:limit] if limit else split.rows
    laid = split.laid(stage, arm)[:len(rows)]
    mk = split.markers
    n_new = decode_limit(split, stage, arm, seq_len, max_new)
    outs = greedy_decode(model, [x.input_ids[:x.prompt_len] for x in laid], eos_id=mk.eos, max_new=n_new,
                         suppress=(mk.ant, mk.boa, mk.eoa, mk.bos, mk.pad, *suppress_extra))
    tok = split.tokenizer
    records = []
    for r, out in zip(rows, outs, strict=True):
        text = tok.decode(out, skip_special_tokens=True)
        gold = tok.decode(r["answer_ids"], skip_special_tokens=True)
        records.append(AnswerRecord(r["question"], extract_answer(gold), text, extract_answer(text),
                                    exact_match(text, gold)))
    return Accuracy(sum(x.correct for x in records), len(records), records)


def validate_acot(cfg: Any) -> None:
    """The ``acot`` section's checks that need no data (``TrainConfig.validate``); ConfigError with one line."""
    a = cfg.acot

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    need(a.arm in ARMS, f"acot.arm {a.arm!r}: use one of {', '.join(ARMS)} (or leave it empty for ordinary training)")
    need(a.max_ant >= 0 and a.epochs_per_stage >= 1, "acot.max_ant must be >= 0 and acot.epochs_per_stage >= 1")
    need(not ARMS[a.arm].pauses or a.max_ant >= 1, f"acot.arm {a.arm} needs acot.max_ant >= 1 (its pause tokens)")
    need(math.isfinite(a.anchor_weight) and a.anchor_weight >= 0, f"acot.anchor_weight must be >= 0, got {a.anchor_weight}")
    need(a.anchor_position in ANCHOR_POSITIONS, f"acot.anchor_position must be one of {', '.join(ANCHOR_POSITIONS)}, "
         f"got {a.anchor_position!r}")
    need(a.select in SELECTS, f"acot.select must be one of {', '.join(SELECTS)}, got {a.select!r}")
    need(a.max_new >= 0 and a.val_rows >= 0, "acot.max_new and acot.val_rows must be >= 0 (0: automatic, all)")
    need(not KINDS[cfg.model.kind].diffusion, f"acot: model.kind {cfg.model.kind} is a diffusion kind; the answers "
         "are decoded greedily by a causal network: set model.kind=ar")
    need(cfg.scaling.num_workers == 0, f"acot: scaling.num_workers {cfg.scaling.num_workers}: the staged fine-tuning "
         "runs in this process only (Ray Train workers are not wired for it); set scaling.num_workers=0")
    need(not cfg.distill.teacher and not cfg.run.init, "acot: the fine-tuning starts from the seeded "
         "initialisation; drop distill.teacher and run.init")
