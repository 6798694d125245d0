"""A training worker's live objects (``Worker``) and the first two steps of its loop: ``build`` (model, EMA,
optimiser, schedule, DDP or FSDP) and ``resume`` (weights, optimiser, schedule, data position, RNG streams,
the EMA's update count, the best validation bound and BD3-LM's training interval from a checkpoint).

Everything here runs without Ray: ``LoopConfig`` is what the driver hands every worker."""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from adlm_model import EMA, build_model
from adlm_model.compat.torch import register_dataclass
from adlm_model.interop.checkpoint import load_state
from adlm_model.nn.backbone import DiTBlock
from adlm_model.objectives.losses import LossOutput
from adlm_model.train.train_step import Objective, TrainStep
from pipelines.core.logs import get_logger
from pipelines.core.seeds import TRAIN_DROPOUT, TRAIN_NOISE, derive_seed
from pipelines.core.storage import (
    download_dir,
    local_path,
)
from pipelines.training.checkpoints import (
    load_weights_and_optimizer,
    step_of,
)
from pipelines.training.config import TrainConfig
from pipelines.training.distill import DistillLoss, load_teacher, make_teacher
from pipelines.training.init import load_init
from pipelines.training.optim import build_optimizer, build_schedule

log = get_logger(__name__)

# DDP and FSDP find the tensors of a module's output by flattening it: make LossOutput's fields visible.
with contextlib.suppress(ValueError):  # already registered (a re-import)
    register_dataclass(LossOutput)


@dataclass
class LoopConfig:
    """What the driver hands every worker (pickled by Ray): the recipe and the facts about the run."""

    cfg: TrainConfig
    run_id: str | None
    """MLflow run id (rank 0 logs metrics into it); None when tracking was unavailable at start."""
    tracking_uri: str
    val_split: str
    val_rows: int
    manifest_hash: str
    tokenizer_spec: str
    tokenizer_path: str | None
    tokenizer_hash: str
    """The data's tokenizer identity (manifest): stored in every checkpoint, checked on resume and evaluation."""
    threads: int
    """torch intra-op threads of each worker."""
    local_mode: bool
    """``scaling.num_workers == 0``: the loop runs in the driver and writes checkpoints to ``run_dir`` itself."""
    run_dir: str
    """The run's folder in Ray Train's storage (local or an object store)."""
    resume_dir: str | None
    """The driver's latest checkpoint of this run (used when Ray Train hands none, or an older one); a local
    path or a URI."""
    crash_at_step: int | None = None
    """Fault injection (``pipelines.core.faults``): the last worker exits at this step, once."""
    crash_marker: str | None = None
    crash_writing_best: int | None = None
    """Fault injection (``ADLM_FAULT=train.crash_writing_best=N``): rank 0 dies mid-upload of step N's best."""
    step_pause_ms: int | None = None
    """Fault injection (``ADLM_FAULT=train.step_pause_ms=N``): each optimiser step waits N ms."""


@dataclass
class Window:
    """Running sums of one log interval, kept on the device as float64 tensors: ``log_window`` reads them
    with one host sync per interval (a ``float()`` per micro-batch would sync the GPU every time)."""

    t: float
    """``time.perf_counter()`` when the window started."""
    loss: torch.Tensor
    """Sum over steps of the mean training loss of each step."""
    nll: torch.Tensor
    """Sum of the per-token NELBO terms (docs/design/method.md, section 1)."""
    ntok: torch.Tensor
    """Tokens those terms count."""
    anc: torch.Tensor
    """ADLM: sum of the anchor loss's per-token terms (docs/design/method.md, section 2)."""
    nanc: torch.Tensor
    """ADLM: tokens the anchor loss counts."""
    gnorm: torch.Tensor
    """Sum over steps of the gradient norm (before clipping)."""
    gnorm_groups: torch.Tensor | None = None
    """Sum over steps of each gradient group's norm (``TrainStep.groups``, in their order), if any."""
    steps: int = 0
    lr: float = 0.0
    """The learning rate of the window's last step."""
    compile_s: float | None = None
    """Seconds of the first compiled step, in the window that holds it (``train/compile_s``)."""

    @classmethod
    def fresh(cls, device: torch.device) -> Window:
        def z() -> torch.Tensor:
            return torch.zeros((), dtype=torch.float64, device=device)

        return cls(t=time.perf_counter(), loss=z(), nll=z(), ntok=z(), anc=z(), nanc=z(), gnorm=z())

    def sums(self) -> torch.Tensor:
        """The running sums as one tensor (loss, nll, ntok, anc, nanc, gnorm, then the groups' norms): one all-reduce,
        one sync."""
        head = torch.stack([self.loss, self.nll, self.ntok, self.anc, self.nanc, self.gnorm])
        return head if self.gnorm_groups is None else torch.cat([head, self.gnorm_groups])


@dataclass
class Worker:
    """The live objects of one worker and its position in the run."""

    lc: LoopConfig
    rank: int
    world: int
    device: torch.device
    raw: torch.nn.Module
    """The model itself (checkpoints, EMA)."""
    net: torch.nn.Module
    """The objective (``objective``), wrapped in DDP or sharded by FSDP when distributed: what validation calls."""
    objective: torch.nn.Module
    """``adlm_model.train.train_step.Objective`` (a distillation's ``DistillLoss``): draws the noise, computes the loss."""
    train_step: TrainStep
    """The optimiser step (compiled objective, accumulation, clipping, AdamW, schedule, EMA)."""
    ema: EMA
    opt: torch.optim.Optimizer
    sched: Any
    noise: torch.Generator
    distributed: bool
    fsdp: bool
    use_gpu: bool
    step: int = 0
    epoch: int = 0
    position: int = 0
    """Micro-batches of the current epoch already consumed by this worker."""
    best_val: float = math.inf
    """The best validation bound so far (its checkpoint is ``<run_dir>/best``: what the run registers)."""
    clip: tuple[float, float] | None = None
    """BD3-LM: the masking-rate interval training draws block times from (the last search's choice)."""
    teacher: Any = None
    """A distillation run's ``training.distill.Teacher`` (None: an ordinary run)."""
    compile_logged: bool = False
    """The first compiled step's time has been logged."""
    window: Window = field(init=False)
    """Running sums since the last log line (a fresh one after each, ``reset_window``)."""

    def __post_init__(self) -> None:
        self.window = Window.fresh(self.device)

    @property
    def cfg(self) -> TrainConfig:
        return self.lc.cfg

    @property
    def accumulation(self) -> int:
        return self.cfg.batch.global_batch // (self.cfg.batch.micro_batch * self.world)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The training step's autocast (bf16 on GPU workers; the loss's log-softmax is float32 regardless)."""
        return self.train_step.autocast(self.device)

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t)
        return t


# ------------------------------------------------------------------------------------------------------
# The first steps


def reset_window(w: Worker) -> None:
    w.window = Window.fresh(w.device)


def build(lc: LoopConfig, rank: int, world: int, device: torch.device) -> Worker:
    """Model (identical init on every rank: seeded, or the EMA weights of the version ``run.init`` names), EMA,
    AdamW, the learning-rate schedule, DDP or FSDP."""
    cfg = lc.cfg
    r, o = cfg.run, cfg.optim
    distributed = world > 1 and dist.is_available() and dist.is_initialized()
    use_gpu = device.type == "cuda"
    torch.manual_seed(r.seed)
    raw = build_model(cfg.model).to(device)
    if r.init and lc.resume_dir is None:  # a fresh run starts from the version's weights (a resume has its own)
        load_init(raw, r.init, lc.tracking_uri)
    teacher = None
    if cfg.distill.teacher:  # SDTT (training/distill.py): the round-0 teacher is the student as initialised
        teacher = make_teacher(raw)
        module: torch.nn.Module = DistillLoss(raw, cfg.model, teacher, cfg.distill)
    else:
        module = Objective(raw, cfg.model)
    fsdp = distributed and cfg.scaling.strategy == "fsdp"
    if fsdp:
        # lazy: keeps torch.distributed.fsdp out of this module's import
        from torch.distributed.fsdp import fully_shard

        for blk in [m for m in raw.modules() if isinstance(m, DiTBlock)]:
            fully_shard(blk)
        fully_shard(module)
        net: torch.nn.Module = module
    elif distributed:
        # lazy: keeps torch.nn.parallel out of this module's import
        from torch.nn.parallel import DistributedDataParallel as DDP

        # The only buffers are rotary caches, identical on every rank: synced once at init, never per forward.
        net = DDP(module, device_ids=[device.index] if use_gpu else None, forward_sync_buffers=False)
    else:
        net = module
    ema = EMA(raw, cfg.ema, warmup=cfg.ema_warmup)
    opt = build_optimizer(raw.parameters(), o)
    sched = build_schedule(opt, o, r.max_steps)
    bf16 = use_gpu and cfg.scaling.bf16  # bf16 autocast on GPU only: ~19x slower on a CPU
    step = TrainStep(module, raw, opt, sched=sched, ema=ema, clip=o.clip, net=net,
                     sync="fsdp" if fsdp else ("ddp" if distributed else None),
                     autocast=torch.bfloat16 if bf16 else None, compile=cfg.compiles(device.type),
                     groups=raw.gradient_groups() if hasattr(raw, "gradient_groups") else None)
    noise = torch.Generator(device=device)
    noise.manual_seed(derive_seed(r.seed, TRAIN_NOISE, rank))
    torch.manual_seed(derive_seed(r.seed, TRAIN_DROPOUT, rank))  # dropout differs per rank, reproducibly
    w = Worker(lc=lc, rank=rank, world=world, device=device, raw=raw, net=net, objective=module, train_step=step,
               ema=ema, opt=opt, sched=sched, noise=noise, distributed=distributed, fsdp=fsdp, use_gpu=use_gpu, teacher=teacher)
    return w


def resume(w: Worker, ray_checkpoint_dir: str | None, ray_checkpoint_step: int = -1) -> int | None:
    """Continue from the newer of Ray's checkpoint of this run (a restart; its local copy and the step in
    its storage name) and the driver's scan (a rerun); returns the step resumed from, or None."""
    d = ray_checkpoint_dir
    fallback = w.lc.resume_dir
    if d is None or (fallback and step_of(fallback) > ray_checkpoint_step):
        d = fallback
    if not d:
        return None
    if local_path(d) is None:  # the driver's scan of an object store: this node reads a copy
        with tempfile.TemporaryDirectory(prefix="adlm-resume-") as tmp:
            return resume(w, str(download_dir(d, tmp)), step_of(d))
    d = Path(d)
    state = load_weights_and_optimizer(d, w.raw, w.ema, w.opt, w.fsdp, w.device)
    w.sched.load_state_dict(state["scheduler"])
    # The EMA's update count (its warm-up position); checkpoints from before it was stored: one per step.
    w.ema.num_updates = int(state.get("ema_updates", state["step"]))
    w.best_val = float(state.get("best_val", math.inf))
    if state.get("clip"):
        set_training_clip(w, tuple(state["clip"]))
    w.step, w.epoch, w.position = int(state["step"]), int(state["data"]["epoch"]), int(state["data"]["position"])
    if w.teacher is not None:  # a distillation: the teacher of the round the checkpoint is in
        load_teacher(w, d)
    rng_file = d / f"rng_rank{w.rank}.json"
    if rng_file.is_file() and int(state.get("world", w.world)) == w.world:
        rng = load_state(d, f"rng_rank{w.rank}")
        torch.set_rng_state(rng["torch"])
        w.noise.set_state(rng["noise"].to(w.noise.get_state().device) if w.use_gpu else rng["noise"])
        if w.use_gpu and rng.get("cuda") is not None:
            torch.cuda.set_rng_state(rng["cuda"])
    else:  # another world size: data position and RNG streams cannot continue exactly
        log.warning(f"[rank {w.rank}] checkpoint written with another worker count: continuing with fresh RNG "
                    "streams (not bit-exact)")
    return w.step


def set_training_clip(w: Worker, clip: tuple[float, float]) -> None:
    """Train BD3-LM on block times drawn from ``clip`` = (beta, omega) from the next step on."""
    w.clip = (float(clip[0]), float(clip[1]))
    w.objective.cfg = w.objective.cfg.replace(clip_low=w.clip[0], clip_high=w.clip[1])
