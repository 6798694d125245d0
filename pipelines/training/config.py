"""Typed training configuration (docs/design/method.md, section 7): YAML recipes plus ``--set key.sub=value``.

A recipe is a YAML mapping with the sections below; every section and key is optional and falls
back to the reference recipe of docs/design/method.md, section 7. Unknown sections or keys fail with one line
that lists the known ones.

::

    model:   {preset: tiny, kind: adlm, gamma: 3e-3, ...}   # ModelConfig fields (+ optional preset)
    data:    {train: data/embedded/train, validation: data/embedded/validation}
    optim:   {lr: 3e-4, betas: [0.9, 0.999], eps: 1e-8, weight_decay: 0.0, warmup_steps: 2500,
              schedule: constant, clip: 1.0}
    batch:   {global_batch: 512, micro_batch: 16}              # accumulation is derived
    run:     {name: ..., max_steps: ..., val_every: ..., val_batches: ..., ckpt_every: ..., init: ..., ...}
    scaling: {num_workers: 2, use_gpu: false, cpus_per_worker: 0.5, strategy: ddp, bf16: true, compile: auto}
    failure: {max_failures: 0}
    ema: 0.9999
    mlflow:  {experiment: adlm, registered_model: adlm, register: true}
    distill: {teacher: models:/adlm/3, rounds: 3, steps_per_round: 1000, teacher_steps: 1024}  # SDTT mode
    acot:    {arm: acot, max_ant: 6, epochs_per_stage: 5, remove_steps: true, anchor_weight: 1.0}  # reasoning
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adlm_model.config import MODEL_KINDS, PRESETS, ConfigError, ModelConfig, preset, refuse_unknown
from adlm_model.kinds import KINDS
from adlm_model.train.distill import DIVERGENCES
from pipelines.core.configlib import ConfigKey, coerce, config_keys, read_yaml_file, set_nested, validate
from pipelines.core.storage import join
from pipelines.data.sources import KNOWN_SOURCES
from pipelines.training.acot import validate_acot


@dataclass
class DataSection:
    """Where the Parquet shards are (written by ``pipelines.prepare_data``)."""

    train: str = "data/embedded/train"
    """Training split directory (holds ``manifest.json``); a relative path lies under the work directory."""
    validation: str = "data/embedded/validation"
    """Validation split directory; a relative path lies under the work directory."""
    shuffle_buffer: int = 256
    """Rows in each worker's seeded local shuffle buffer (0 = no local shuffle); block order is seeded too."""
    read_cpus: float = 0.25
    """CPUs each Ray Data read task asks for. Reading Parquet is I/O-light; a whole CPU per read task
    starves when the trainer's workers hold fractional CPUs (several Tune trials on 2 cores)."""
    source: str = ""
    """The named source the recipe is for (``prepare_data --source``), e.g. ``openwebtext``, ``lm1b``; empty:
    any. Recipes name it so that their splits and tokenizer can be checked against what preparing it produces."""
    mode: str = ""
    """``wrap`` (packed) or ``pad`` (one sentence a row): training refuses data prepared the other way (the
    published LM1B rows differ by it); empty: either."""


@dataclass
class OptimSection:
    """AdamW and the learning-rate schedule (reference: lr 3e-4, betas 0.9/0.999, eps 1e-8, no decay)."""

    lr: float = 3e-4
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (reference 0)."""
    warmup_steps: int = 2500
    """Linear warm-up steps from 0 to ``lr`` (reference 2,500)."""
    schedule: str = "constant"
    """After warm-up: ``constant`` (reference) or ``cosine`` (decays to ``min_lr_ratio * lr`` at max_steps)."""
    min_lr_ratio: float = 0.1
    """Cosine only: the final learning rate as a fraction of ``lr``."""
    clip: float = 1.0
    """Gradient clipping by global norm (0 disables)."""
    fused: bool = True
    """AdamW's fused kernel (CPU and CUDA): one pass over each parameter instead of one per elementwise
    op; measured here 4-5x faster optimiser steps at ``small`` (0.29 vs 1.58 s for ADLM on 2 cores).
    Off: the ``foreach`` implementation."""


@dataclass
class BatchSection:
    """Batch sizes in sequences; accumulation = global_batch / (micro_batch * workers)."""

    global_batch: int = 512
    """Sequences per optimiser step over all workers (reference 512)."""
    micro_batch: int = 16
    """Sequences per forward/backward pass on one worker."""


@dataclass
class RunSection:
    """Length, cadence and identity of a run."""

    name: str = "adlm"
    """Run name: Ray Train run folder and MLflow run name. Rerunning the same name resumes it."""
    max_steps: int = 1_000_000
    """Optimiser steps to train for (reference 1M)."""
    val_every: int = 500
    """Validate (EMA weights, NELBO bound) every N steps and at the end."""
    val_batches: int = 16
    """Micro-batches of validation data per worker per validation (0 = the whole split)."""
    ckpt_every: int = 500
    """Checkpoint every N steps (and at the end)."""
    num_to_keep: int = 3
    """Checkpoints Ray Train keeps."""
    log_every: int = 10
    """MLflow metrics and a progress line every N steps."""
    seed: int = 0
    """Seeds model init, data order, noise and dropout."""
    storage_path: str = ""
    """Ray Train storage; empty = ``<workdir>/ray_results``. On a cluster: shared storage (s3://, NFS)."""
    init: str = ""
    """Start a fresh run from the EMA weights of a registered or imported version: ``models:/NAME/VERSION``,
    ``models:/NAME@ALIAS`` (pinned to its version at the start) or a checkpoint folder (``--init`` of
    ``pipelines.train``). Its network must be the recipe's (same class, parameter names and shapes: MDLM and
    BD3-LM share one). Recorded as lineage (``init_from``) on the run, its checkpoints and its registered version; a
    resumed run keeps its own weights (``pipelines/training/init.py``). Empty: the seeded initialisation."""
    clip_search: bool = True
    """BD3-LM: search the clipped ("data-driven") schedule at each validation, as the reference: the interval
    of masking rates of lowest per-block loss variance; training draws block times from it until the next
    search (evaluation always uses the full schedule). Off: train on ``model.clip_low``/``clip_high``."""
    clip_search_batches: int = 4
    """BD3-LM: validation micro-batches per worker the search scores every interval of its grid on."""


@dataclass
class ScalingSection:
    """Ray Train ScalingConfig and the parallel strategy."""

    num_workers: int = 2
    """Training workers; 0 runs the loop in the driver process (Ray Train local mode, for quick tests)."""
    use_gpu: bool = False
    """One GPU per worker; backend nccl (gloo on CPU)."""
    cpus_per_worker: float = 0.5
    """CPUs each worker reserves. Leave some for Ray Data's read tasks: workers that hold every CPU starve them
    and the run waits for data (fractional CPUs on a laptop; on GPU nodes, a few CPUs per GPU)."""
    threads: int = 0
    """torch intra-op threads of each worker; 0: its CPUs rounded half up (0.5 -> 1), or every core in local
    mode. Set it when several local-mode runs share a machine (the study runs two at once on 2 cores)."""
    strategy: str = "ddp"
    """``ddp`` or ``fsdp`` (shards parameters, gradients and optimiser state; for larger models)."""
    bf16: bool = True
    """bf16 autocast on GPU workers; ignored on CPU (19x slower there)."""
    compile: str = "auto"
    """``torch.compile`` the training objective (network, vocabulary projection, SUBS, loss; the noise is drawn
    outside it): ``auto`` on CUDA workers, not on CPU ones; ``on``; ``off``. A distillation or an FSDP run never
    compiles under ``auto``; ``on`` with either is refused."""


@dataclass
class FailureSection:
    """Ray Train FailureConfig."""

    max_failures: int = 0
    """Worker-group restarts allowed; each restart resumes from the latest checkpoint."""


@dataclass
class MLflowSection:
    """Tracking and registration."""

    experiment: str = "adlm"
    """MLflow experiment name."""
    registered_model: str = "adlm"
    """Registered model that receives the final EMA checkpoint."""
    register: bool = True
    """Register the final checkpoint (alias ``candidate``)."""
    drain_timeout_s: float = 60.0
    """At the end of training, how long rank 0 waits for queued metrics to reach a tracking store that is
    answering (one that is failing is not waited for): the rest waits in the run's spool for the next run of
    the command."""


@dataclass
class DistillSection:
    """Self-distillation through time (SDTT; ``pipelines/training/distill.py``): set ``teacher`` to make the run a
    distillation of that version. The student starts from the teacher's EMA weights (``run.init`` is set to it),
    trains ``rounds x steps_per_round`` steps (``run.max_steps`` is set to it) and registers with the tags
    ``teacher`` (the pinned version) and ``sampler_steps`` (``teacher_steps / substeps**rounds``)."""

    teacher: str = ""
    """The version to distil: ``models:/NAME/VERSION``, ``models:/NAME@ALIAS`` (pinned at the start) or a checkpoint
    folder; empty: an ordinary training run."""
    rounds: int = 3
    """Rounds; after each the student becomes the teacher and its step count halves (reference: 7, 1024 -> 8)."""
    steps_per_round: int = 1000
    """Optimiser steps of each round (reference 10,000)."""
    teacher_steps: int = 1024
    """T0: the sampling steps of the first teacher (reference 1024); it must divide by ``substeps**rounds``."""
    substeps: int = 2
    """Teacher steps the student learns to take in one (reference 2)."""
    divergence: str = "kl-bwd"
    """``kl-bwd`` (KL(student || teacher), the reference's default), ``kl-fwd``, ``tvd`` or ``mse``."""


@dataclass
class AcotSection:
    """Anchored chain-of-thought fine-tuning on reasoning rows (``pipelines/training/acot_run.py``; checked by ``acot.validate_acot``): set ``arm``
    to make the run Coconut's staged fine-tuning of one arm on a reasoning split (``prepare_data --source
    prosqa``), validated by greedy-decoding accuracy, its best checkpoint registered with that accuracy. The
    optimiser is ``optim``'s AdamW at a constant ``optim.lr``, the batch ``batch``'s; ``run.max_steps`` is unused
    (the schedule's epochs decide the length)."""

    arm: str = ""
    """``no_cot``, ``cot``, ``pause`` (pause tokens, no trace), ``pause_as_thought`` (the ACoT layout and schedule,
    anchor weight 0) or ``acot``; empty: an ordinary training run."""
    max_ant: int = 6
    """``[ANT]`` slots of the last stage (GSM8K 2, ProntoQA and ProsQA 6); the pause tokens of ``pause``."""
    epochs_per_stage: int = 5
    """Epochs of each stage (GSM8K 3, ProntoQA and ProsQA 5); a single-stage arm trains the schedule's total."""
    remove_steps: bool = False
    """Remove one more reasoning step at each new ``[ANT]`` (ProsQA's schedule)."""
    anchor_weight: float = 1.0
    """The anchor cross-entropy's weight in ``acot`` (``pause_as_thought`` and the others: 0)."""
    anchor_position: str = "at"
    """``at``: the output at the i-th ``[ANT]`` predicts anchor i; ``before``: the output before it does."""
    select: str = "last_stage"
    """Which epochs the kept checkpoint is chosen among by validation accuracy: ``last_stage`` or ``all``."""
    max_new: int = 0
    """Tokens greedy decoding may generate; 0: the longest generated part of the split plus 8."""
    val_rows: int = 0
    """Validation rows decoded after every epoch (0: the whole split)."""


SECTIONS: dict[str, type] = {
    "data": DataSection, "optim": OptimSection, "batch": BatchSection, "run": RunSection,
    "scaling": ScalingSection, "failure": FailureSection, "mlflow": MLflowSection, "distill": DistillSection,
    "acot": AcotSection,
}
TOP_KEYS = ("model", *SECTIONS, "ema", "ema_warmup")


@dataclass
class TrainConfig:
    """A full training recipe."""

    model: ModelConfig = field(default_factory=lambda: preset("tiny"))
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    batch: BatchSection = field(default_factory=BatchSection)
    run: RunSection = field(default_factory=RunSection)
    scaling: ScalingSection = field(default_factory=ScalingSection)
    failure: FailureSection = field(default_factory=FailureSection)
    ema: float = 0.9999
    """EMA decay of the weights used for validation, checkpoints and sampling (reference 0.9999)."""
    ema_warmup: bool = True
    """The references' EMA warm-up, ``min(ema, (1 + n) / (10 + n))`` at update ``n`` (``adlm_model.train.ema``)."""
    mlflow: MLflowSection = field(default_factory=MLflowSection)
    distill: DistillSection = field(default_factory=DistillSection)
    acot: AcotSection = field(default_factory=AcotSection)

    # ----- derived -----
    @property
    def world(self) -> int:
        """Processes that split the global batch (local mode counts as one)."""
        return max(1, self.scaling.num_workers)

    @property
    def accumulation(self) -> int:
        return self.batch.global_batch // (self.batch.micro_batch * self.world)

    def compiles(self, device_type: str) -> bool:
        """Whether the training objective is compiled on a worker of ``device_type`` (``scaling.compile``)."""
        c = self.scaling.compile
        if c == "auto":
            return device_type == "cuda" and not self.distill.teacher and self.scaling.strategy != "fsdp"
        return c == "on"

    def validate(self) -> TrainConfig:
        """Every check that needs no data or Ray; raises ConfigError with one line."""

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        self.model.validate()
        need(not KINDS[self.model.kind].sample_only, f"model.kind {self.model.kind}: {KINDS[self.model.kind].sample_only}")
        o, b, r, s = self.optim, self.batch, self.run, self.scaling
        need(o.lr > 0, f"optim.lr must be > 0, got {o.lr}")
        need(len(o.betas) == 2 and all(0 <= x < 1 for x in o.betas), f"optim.betas must be two numbers in [0, 1), got {o.betas}")
        need(o.eps > 0 and o.weight_decay >= 0, "optim.eps must be > 0 and optim.weight_decay >= 0")
        need(o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
        need(o.schedule in ("constant", "cosine"), f"optim.schedule must be constant or cosine, got {o.schedule!r}")
        need(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
        need(o.clip >= 0, f"optim.clip must be >= 0 (0 disables), got {o.clip}")
        need(b.global_batch >= 1 and b.micro_batch >= 1, "batch.global_batch and batch.micro_batch must be >= 1")
        need(b.global_batch % (b.micro_batch * self.world) == 0,
             f"batch.global_batch {b.global_batch} is not divisible by workers x micro_batch = {self.world} x "
             f"{b.micro_batch}; pick a global batch that is a multiple of {self.world * b.micro_batch}")
        need(r.max_steps >= 1, f"run.max_steps must be >= 1, got {r.max_steps}")
        for k in ("val_every", "ckpt_every", "log_every", "num_to_keep"):
            need(getattr(r, k) >= 1, f"run.{k} must be >= 1, got {getattr(r, k)}")
        need(r.val_batches >= 0, f"run.val_batches must be >= 0, got {r.val_batches}")
        need(bool(r.name) and "/" not in r.name, f"run.name must be a non-empty name without '/', got {r.name!r}")
        need(s.num_workers >= 0, f"scaling.num_workers must be >= 0, got {s.num_workers}")
        need(s.cpus_per_worker > 0, f"scaling.cpus_per_worker must be > 0, got {s.cpus_per_worker}")
        need(s.threads >= 0, f"scaling.threads must be >= 0 (0: automatic), got {s.threads}")
        need(s.strategy in ("ddp", "fsdp"), f"scaling.strategy must be ddp or fsdp, got {s.strategy!r}")
        # YAML reads a bare on / off as a boolean, which arrives here as "True" / "False"
        s.compile = {"true": "on", "false": "off"}.get(str(s.compile).lower(), str(s.compile).lower())
        need(s.compile in ("auto", "on", "off"), f"scaling.compile must be auto, on or off, got {s.compile!r}")
        need(not (s.compile == "on" and (self.distill.teacher or s.strategy == "fsdp")),
             "scaling.compile on: a distillation (its noise is drawn inside its objective) and an FSDP run are "
             "not compiled; use scaling.compile=auto or off")
        need(self.failure.max_failures >= -1, "failure.max_failures must be >= 0 (or -1 for unlimited)")
        need(0 <= self.ema < 1, f"ema decay must be in [0, 1), got {self.ema}")
        need(self.data.shuffle_buffer >= 0, "data.shuffle_buffer must be >= 0")
        need(0 < self.data.read_cpus <= 64, f"data.read_cpus must be in (0, 64], got {self.data.read_cpus}")
        need(self.data.mode in ("", "wrap", "pad"), f"data.mode must be wrap, pad or empty, got {self.data.mode!r}")
        need(not self.data.source or self.data.source in KNOWN_SOURCES,
             f"data.source {self.data.source!r} is no named source; use one of {', '.join(KNOWN_SOURCES)} or leave it empty")
        need(self.run.clip_search_batches >= 1, "run.clip_search_batches must be >= 1")
        if self.distill.teacher:
            self._validate_distill(need)
        if self.acot.arm:
            validate_acot(self)
        return self

    def _validate_distill(self, need: Any) -> None:
        d = self.distill
        can = [k.name for k in KINDS.values() if k.distillable]
        need(KINDS[self.model.kind].distillable, f"distill: SDTT distils the ancestral sampler of {' or '.join(can)} "
             f"models, not {self.model.kind}; set model.kind to the teacher's")
        need(d.rounds >= 1 and d.steps_per_round >= 1 and d.substeps >= 2,
             "distill.rounds and distill.steps_per_round must be >= 1 and distill.substeps >= 2")
        need(d.teacher_steps % d.substeps ** d.rounds == 0,
             f"distill.teacher_steps {d.teacher_steps} must divide by substeps**rounds = {d.substeps ** d.rounds}; "
             f"e.g. teacher_steps {d.substeps ** d.rounds * max(1, d.teacher_steps // d.substeps ** d.rounds)}")
        need(d.divergence in DIVERGENCES, f"distill.divergence must be one of {', '.join(DIVERGENCES)}, "
             f"got {d.divergence!r}")
        need(self.run.init in ("", d.teacher),
             f"distill: the student starts from the teacher; run.init {self.run.init!r} names another model")
        need(self.run.max_steps == d.rounds * d.steps_per_round,
             f"distill: run.max_steps {self.run.max_steps} must be rounds x steps_per_round = "
             f"{d.rounds * d.steps_per_round}")
        need(self.scaling.strategy == "ddp", "distill: the teacher is a full copy of the student; use "
             "scaling.strategy=ddp")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["model"] = self.model.to_dict()
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"a training config must be a mapping of sections, got {type(raw).__name__}")
        refuse_unknown(raw, TOP_KEYS, "recipe")
        kw: dict[str, Any] = {"model": build_model_config(raw.get("model") or {})}
        for name, sec in SECTIONS.items():
            d = raw.get(name) or {}
            if not isinstance(d, dict):
                raise ConfigError(f"config section {name!r} must be a mapping, got {d!r}")
            kw[name] = validate(sec, d, name)
        if "ema" in raw:
            kw["ema"] = coerce(raw["ema"], float, "ema")
        if "ema_warmup" in raw:
            kw["ema_warmup"] = coerce(raw["ema_warmup"], bool, "ema_warmup")
        cfg = cls(**kw)
        if cfg.distill.teacher:  # a distillation: the student starts from the teacher, its length is its rounds'
            cfg.run.init = cfg.run.init or cfg.distill.teacher
            cfg.run.max_steps = cfg.distill.rounds * cfg.distill.steps_per_round
        if cfg.model.gamma_horizon == 0:  # the reference's K: the run's length
            cfg.model = cfg.model.replace(gamma_horizon=cfg.run.max_steps)
        return cfg.validate()

    def resolve_path(self, p: str, workdir: str) -> str:
        """Data paths: URIs and absolute paths as given, relative ones under the work directory."""
        if "://" in p:
            return p
        q = Path(os.path.expanduser(p))
        return str(q) if q.is_absolute() else join(workdir, p)


def recipe_keys() -> list[ConfigKey]:
    """Every key of a recipe with its type, default and description (``python -m pipelines.train --help-config``,
    the config reference page). The model's keys default to the ``tiny`` preset, a recipe's default model."""
    keys = config_keys(TrainConfig, TrainConfig())
    at = next(i for i, k in enumerate(keys) if k.name.startswith("model."))
    keys.insert(at, ConfigKey("model.preset", "str or none", "none", "Start from this preset ("
                              + ", ".join(PRESETS) + "; ``adlm_model.config.PRESETS``): the model section's other "
                              "keys override its fields. Without one, the fields of ``tiny``."))
    return keys


def build_model_config(d: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a ``model:`` section: optional ``preset`` name plus field overrides."""
    if not isinstance(d, dict):
        raise ConfigError(f"config section 'model' must be a mapping, got {d!r}")
    d = dict(d)
    name = d.pop("preset", None)
    if "kind" in d and d["kind"] not in MODEL_KINDS:
        raise ConfigError(f"unknown model kind {d['kind']!r}: use one of {', '.join(MODEL_KINDS)}")
    if name is not None and name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}: use one of {', '.join(PRESETS)}")
    refuse_unknown(d, ["preset", *(f.name for f in dataclasses.fields(ModelConfig))], "model")
    # The preset's fields, then the section's over them (as ``preset(name, **d)``), typed by the library.
    return validate(ModelConfig, {**(PRESETS[name] if name is not None else {}), **d}, "model").validate()


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one ``section.key=value`` (value parsed as YAML) to a raw recipe dict in place."""
    set_nested(raw, assignment, TOP_KEYS)


def load_raw(path: str | os.PathLike | None) -> dict[str, Any]:
    if path is None:
        return {}
    raw = read_yaml_file(path, "config file", "configs/*.yaml") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    return raw


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Load a YAML recipe, apply ``--set`` overrides, validate."""
    raw = load_raw(path)
    for a in overrides:
        apply_override(raw, a)
    return TrainConfig.from_dict(raw)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} (MLflow params)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
