"""The loop every Ray Train worker runs (or the driver, in local mode), as named steps.

``train_loop_per_worker`` reads top to bottom: ``build`` (model, EMA, optimiser, schedule, DDP/FSDP),
``resume`` (from Ray's checkpoint of this run or the driver's scan), ``batch_stream`` (this worker's
shard of the training split), then per optimiser step ``optimiser_step``; every ``log_every`` steps
``log_window``, every ``val_every`` steps ``validate``, every ``ckpt_every`` steps ``write_checkpoint``
and a report to Ray Train. Each step is a function of a ``Worker`` (the live objects) and plain
arguments, so it can run and be tested without Ray.

Data order and exact resume. The training split is read with Ray Data (its shards, read from the manifest by
``pipelines.data.ray_source``, a seeded block order) and split across workers by ``get_dataset_shard`` with
``preserve_order=True``: Ray's output splitter then hands blocks to workers deterministically and
equally, so every worker sees the same number of rows and batches, and the same rows on every rerun.
Each worker iterates its shard with ``iter_torch_batches`` and a local shuffle buffer seeded by
(seed, epoch, rank). So a worker's batch sequence is a pure function of (seed, epoch, position); the
checkpoint stores (epoch, batches consumed) and a resumed worker replays its stream up to that position
(reading and dropping the consumed batches), which makes a resumed run equal to an uninterrupted one.
Validation rows are ``val_batches * micro_batch * workers`` rows spread over the validation split
(``validation_rows``), the same rows every time, with a fixed noise draw, so validation curves are
comparable across steps and runs.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adlm_model import gamma_at
from adlm_model.baselines.bd3lm import block_loss_moments, choose_clip, clip_intervals
from adlm_model.interop.checkpoint import atomic_safetensors, save_checkpoint, save_state
from adlm_model.kinds import model_kind
from adlm_model.objectives.losses import LossOutput
from pipelines.core.logs import get_logger
from pipelines.core.seeds import TRAIN_DATA_ORDER, TRAIN_VALIDATION, derive_seed
from pipelines.core.storage import (
    delete_dir,
    exists,
    get_fs,
    join,
    publish_dir,
    read_bytes,
    temp_dir,
    write_text,
)
from pipelines.data.reader import read_subset
from pipelines.tracking.spool import SPOOL, ResilientLogger
from pipelines.training import distill
from pipelines.training.checkpoints import (
    TRAINER_STATE,
    checkpoint_name,
    gather_state,
    list_checkpoints,
    publish_best,
    step_of,
)
from pipelines.training.distill import advance, save_teacher, version_facts
from pipelines.training.worker import LoopConfig, Worker, build, reset_window, resume, set_training_clip

log = get_logger(__name__)

# ------------------------------------------------------------------------------------------------------
# The steps


def batch_stream(w: Worker, shard: Any) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
    """(epoch, index in epoch, batch) of this worker's shard from the resumed position on, forever. Only full
    micro-batches (a compiled step has one shape); on a GPU worker Ray's prefetch threads pin them, so that
    ``to_device``'s copies run asynchronously."""
    cfg = w.cfg
    micro, buf = cfg.batch.micro_batch, cfg.data.shuffle_buffer
    epoch, skip = w.epoch, w.position
    while True:
        it = shard.iter_torch_batches(
            batch_size=micro, drop_last=True, device="cpu", prefetch_batches=2, local_shuffle_buffer_size=buf or None,
            local_shuffle_seed=derive_seed(cfg.run.seed, TRAIN_DATA_ORDER, epoch, w.rank) if buf else None,
            pin_memory=w.use_gpu)
        n = 0
        for i, b in enumerate(it):
            n += 1
            if i >= skip:
                yield epoch, i, b
        if n == 0:
            raise RuntimeError(f"worker {w.rank} got no full batch of {micro} rows from its training shard")
        epoch, skip = epoch + 1, 0


def to_device(b: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input_ids as int64, attention mask or None) of a batch on ``device``: a non-blocking copy (from pinned
    memory on a GPU worker, so the host queues it and goes on), the cast on the device."""
    x = b["input_ids"].to(device, non_blocking=True).long()
    am = b["attention_mask"].to(device, non_blocking=True) if "attention_mask" in b else None
    return x, am


def optimiser_step(w: Worker, stream: Iterator[tuple[int, int, dict[str, torch.Tensor]]]) -> None:
    """One optimiser step (``adlm_model.train.train_step.TrainStep``: ``accumulation`` micro-batches, gradient sync on
    the last only, clipping, AdamW, the schedule, the EMA) on the next micro-batches of ``stream``, all copied to
    the device before the first runs; its figures go into the log window. gamma_k uses this step's index k
    (docs/design/method.md, section 2)."""
    batches = []
    for _ in range(w.accumulation):
        ep, i, b = next(stream)
        batches.append(to_device(b, w.device))
        w.epoch, w.position = ep, i + 1
    out = w.train_step(batches, step=w.step, generator=w.noise)
    win = w.window
    win.loss += out.loss
    win.nll += out.nll_sum
    win.ntok += out.n_tokens
    if out.anchor_sum is not None:
        win.anc += out.anchor_sum
        win.nanc += out.n_anchor
    win.gnorm += out.grad_norm
    if out.group_norms is not None:
        win.gnorm_groups = out.group_norms if win.gnorm_groups is None else win.gnorm_groups + out.group_norms
    win.lr = out.lr
    if w.train_step.compile_s is not None and not w.compile_logged:  # the first compiled step: its compilation
        w.compile_logged = True
        win.compile_s = w.train_step.compile_s
        if w.rank == 0:
            log.info(f"[{w.cfg.run.name}] step {w.step + 1}: the compiled objective's first step took "
                     f"{win.compile_s:.1f} s (compilation included)")
    w.step += 1
    win.steps += 1


def log_window(w: Worker) -> dict[str, float]:
    """The window's metrics pooled over workers (one host sync), then a fresh window."""
    win, world = w.window, w.world
    dt = time.perf_counter() - win.t
    tot = w.all_sum(win.sums()).tolist()
    n = max(win.steps, 1)
    metrics = {"train/loss": tot[0] / (n * world), "train/nll": tot[1] / max(tot[2], 1.0),
               "train/grad_norm": tot[5] / (n * world), "train/lr": win.lr,
               "train/tokens_per_s": tot[2] / max(dt, 1e-9), "train/epoch": w.epoch}
    if win.compile_s is not None:  # the window of the first compiled step
        metrics["train/compile_s"] = win.compile_s
    if win.gnorm_groups is not None:  # e.g. train/grad_norm_anchor, _denoiser, _anchor_out (ADLM)
        for name, total in zip(w.train_step.groups or {}, tot[6:], strict=True):
            metrics[f"train/grad_norm_{name}"] = total / (n * world)
    mc = w.cfg.model
    if model_kind(mc.kind).anchored:
        metrics["train/anchor_loss"] = tot[3] / max(tot[2], 1.0)
        metrics["train/anchor_frac"] = tot[4] / max(tot[2], 1.0)
        metrics["train/gamma_k"] = gamma_at(w.step - 1, mc.gamma, mc.gamma_beta, mc.gamma_horizon)
    if w.teacher is not None:  # a distillation: train/loss is SDTT's divergence; its round, dt, step count
        metrics.update(distill.metrics(w))
    reset_window(w)
    return metrics


VALIDATION_NOISE_SEED = 0
"""The validation noise's seed (``validate``): fixed, not ``run.seed``."""


def validation_rows(w: Worker) -> dict[str, torch.Tensor]:
    """This worker's slice of the fixed validation rows (``run.val_batches`` micro-batches per worker, spread
    over the split: ``reader.spread_indices``)."""
    cfg, lc = w.cfg, w.lc
    micro, world = cfg.batch.micro_batch, w.world
    whole = (lc.val_rows // (micro * world)) * micro * world
    n_val = min(cfg.run.val_batches * micro * world, whole) if cfg.run.val_batches else whole
    ids, mask = read_subset(lc.val_split, n_val if n_val < lc.val_rows else 0, 0, n_val)
    per = n_val // world
    rows = {"input_ids": torch.from_numpy(ids[w.rank * per:(w.rank + 1) * per].copy())}
    if mask is not None:
        rows["attention_mask"] = torch.from_numpy(mask[w.rank * per:(w.rank + 1) * per].copy())
    return rows


def validate(w: Worker, rows: dict[str, torch.Tensor]) -> float:
    """The NELBO bound with EMA weights on the fixed validation rows, tokens pooled over workers.

    The noise (times and masks) is one fixed draw, the same at every validation and for every run whatever
    its ``run.seed``: common random numbers, so that two runs' bounds differ by their weights, not by the
    Monte Carlo draw (a study's seeds then measure training's variability alone)."""
    g = torch.Generator(device=w.device)
    g.manual_seed(derive_seed(VALIDATION_NOISE_SEED, TRAIN_VALIDATION, w.rank))
    micro = w.cfg.batch.micro_batch
    sums = torch.zeros(2, dtype=torch.float64, device=w.device)
    w.net.eval()
    with w.ema.applied(w.raw), torch.no_grad():
        for i in range(0, rows["input_ids"].shape[0], micro):
            x = rows["input_ids"][i:i + micro].to(w.device).long()
            am = rows["attention_mask"][i:i + micro].to(w.device) if "attention_mask" in rows else None
            noise = w.objective.draw(x, am, g, False)
            with w.autocast():  # the eager objective: validation's few batches are not worth a second graph
                out: LossOutput = w.net(x, am, noise, w.step, False)
            sums += torch.stack([out.nll_sum, out.n_tokens.double()])
    w.net.train()
    nll, ntok = w.all_sum(sums).tolist()
    mean = nll / max(ntok, 1.0)
    # A diverged run's bound overflows a float: infinity is its honest PPL and still compares as the worst.
    return math.exp(mean) if mean < 709.0 else math.inf


def search_clip(w: Worker, rows: dict[str, torch.Tensor]) -> tuple[float, float]:
    """BD3-LM's data-driven schedule (docs/design/method.md, section 3): score every interval of the reference grid on the
    first ``run.clip_search_batches`` validation micro-batches of every worker (EMA weights, common random
    numbers), pool the moments of the per-block mean loss over workers, take the interval of lowest variance,
    and train on it until the next search."""
    cfg, micro = w.cfg, w.cfg.batch.micro_batch
    intervals = clip_intervals(eps=cfg.model.sampling_eps)
    n = min(rows["input_ids"].shape[0], cfg.run.clip_search_batches * micro)
    batches = [(rows["input_ids"][i:i + micro].to(w.device).long(),
                rows["attention_mask"][i:i + micro].to(w.device) if "attention_mask" in rows else None)
               for i in range(0, n, micro)]
    with w.ema.applied(w.raw):
        moments = block_loss_moments(w.raw, batches, cfg.model, intervals,
                                     seed=derive_seed(cfg.run.seed, TRAIN_VALIDATION, w.rank, w.step))
    pooled = w.all_sum(moments.to(w.device)).cpu()
    choice = choose_clip(pooled, intervals)
    set_training_clip(w, (choice.beta, choice.omega))
    return w.clip


def _write_weights(w: Worker, directory: Path, model_sd: dict | None, ema_sd: dict, meta: dict[str, Any]) -> None:
    """Rank 0: config (with the run's provenance in its meta), weights, EMA weights and tokenizer."""
    lc, cfg = w.lc, w.cfg
    meta = {"step": w.step, "mlflow_run_id": lc.run_id, "run_name": cfg.run.name, "tokenizer": lc.tokenizer_spec,
            "tokenizer_hash": lc.tokenizer_hash, "data_manifest_hash": lc.manifest_hash, "train_config": cfg.to_dict(),
            "world": w.world, "ema_updates": w.ema.num_updates, **meta}
    if cfg.run.init:  # the lineage (pipelines/training/init.py): what the run started from, pinned
        meta["init_from"] = cfg.run.init
    if cfg.distill.teacher:  # a distillation's teacher (lineage) and the student's default step count
        meta.update(version_facts(cfg))
    save_checkpoint(directory, w.raw, cfg.model, ema_state=ema_sd, meta=meta)
    if model_sd is not None:
        atomic_safetensors(directory / "model.safetensors", model_sd)
    if lc.tokenizer_path:
        (directory / "tokenizer.json").write_bytes(read_bytes(lc.tokenizer_path))


def keep_if_best(w: Worker, ppl: float) -> bool:
    """After a validation: when ``ppl`` beats the run's best, its weights become ``<run_dir>/best`` (docs/design/method.md
    section 7: the reference keeps the best checkpoint by validation NLL besides the latest). Every rank takes
    part (FSDP gathers the weights); rank 0 writes. Returns whether it was the best."""
    if not ppl < w.best_val:
        return False
    w.best_val = ppl
    model_sd, ema_sd, _ = gather_state(w.raw, w.ema, w.opt, w.fsdp)
    if w.rank == 0:
        d = temp_dir("adlm-best-")
        _write_weights(w, d, model_sd, ema_sd, {"val_ppl": ppl, "checkpoint": "best"})
        publish_best(d, w.lc.run_dir, w.step, crash_at=w.lc.crash_writing_best)  # atomic: a new folder, then the pointer (checkpoints.py)
    return True


def write_checkpoint(w: Worker, directory: Path, metrics: dict[str, Any]) -> None:
    """All ranks write into one checkpoint folder: rank 0 the weights and trainer state, every rank its
    RNG streams. safetensors + JSON only (``adlm_model.interop.checkpoint``)."""
    model_sd, ema_sd, opt_sd = gather_state(w.raw, w.ema, w.opt, w.fsdp)
    if w.rank == 0:
        _write_weights(w, directory, model_sd, ema_sd, {"val_ppl": metrics.get("val_ppl"), "checkpoint": "latest"})
        save_state(directory, {"optimizer": opt_sd, "scheduler": w.sched.state_dict(), "step": w.step,
                               "world": w.world, "data": {"epoch": w.epoch, "position": w.position},
                               "ema_updates": w.ema.num_updates, "best_val": w.best_val,
                               "clip": list(w.clip) if w.clip else None}, TRAINER_STATE)
        if w.teacher is not None:
            save_teacher(w, directory)
    rng = {"torch": torch.get_rng_state(), "noise": w.noise.get_state().cpu(),
           "cuda": torch.cuda.get_rng_state() if w.use_gpu else None}
    save_state(directory, rng, f"rng_rank{w.rank}")


# ------------------------------------------------------------------------------------------------------
# The loop


class TrialSession:
    """The ``ray.train`` calls the loop makes, answered in this process, for a local-mode run (``num_workers: 0``)
    inside a Ray Tune trial: Ray Train refuses its own API there ("use the ray.tune API"), so the trial's process
    is the one worker (rank 0 of 1), the dataset is read whole, the run folder is the checkpoint history (as in
    Ray's local mode) and every report goes to Tune, as ``TuneReportCallback`` forwards a worker's reports."""

    def __init__(self, datasets: dict[str, Any]) -> None:
        self.datasets = datasets
        self.last: dict[str, Any] = {}
        """The last metrics reported (the run's result, as Ray Train's ``Result.metrics``)."""

    def get_context(self) -> TrialSession:
        return self

    def get_world_rank(self) -> int:
        return 0

    def get_world_size(self) -> int:
        return 1

    def get_checkpoint(self) -> None:
        return None  # the loop resumes from LoopConfig.resume_dir (the run folder's latest), as in local mode

    def get_dataset_shard(self, name: str) -> Any:
        return self.datasets[name]

    def report(self, metrics: dict[str, Any], checkpoint: Any = None, checkpoint_dir_name: str | None = None) -> None:
        # lazy: keeps ray out of this module's import
        from ray import tune
        from ray.tune.integration.ray_train import CHECKPOINT_PATH_KEY

        self.last = dict(metrics)
        tune.report({**metrics, **({CHECKPOINT_PATH_KEY: checkpoint.path} if checkpoint is not None else {})})


def _report_checkpoint(w: Worker, metrics: dict[str, Any], api: Any) -> None:
    """Write this step's checkpoint and hand it to Ray Train with the metrics (kept only with a checkpoint);
    Ray persists it to its storage (local or an object store) through the Checkpoint API. ``api``: ``ray.train``
    or a ``TrialSession``."""
    # lazy: keeps ray out of this module's import
    from ray.train import Checkpoint

    lc, name = w.lc, checkpoint_name(w.step)
    if lc.local_mode:  # Ray's local mode keeps no checkpoint history of its own: the run folder is ours
        d = temp_dir("adlm-ckpt-")
        write_checkpoint(w, d, metrics)
        dest = publish_dir(d, join(lc.run_dir, name))
        for _, old in list_checkpoints(lc.run_dir)[:-w.cfg.run.num_to_keep]:
            delete_dir(old)
        fs, inner = get_fs(dest)
        api.report(metrics, checkpoint=Checkpoint(path=inner, filesystem=fs))
        return
    d = temp_dir("adlm-ckpt-")
    try:
        write_checkpoint(w, d, metrics)
        api.report(metrics, checkpoint=Checkpoint.from_directory(str(d)), checkpoint_dir_name=name)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _maybe_crash(w: Worker) -> None:
    lc = w.lc
    if lc.crash_at_step is None or w.step != lc.crash_at_step or w.rank != w.world - 1 or not lc.crash_marker:
        return
    if exists(lc.crash_marker):
        return
    write_text(lc.crash_marker, str(w.step))
    # A real failure comes well after the last report; Ray Train's controller registers reported checkpoints when
    # it polls the workers (every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by default). Waiting out two polls makes
    # the fault test "resumes from the last checkpoint", not a race between a fast tiny model and the poll.
    time.sleep(2 * float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2.0")) + 1)
    log.warning(f"[rank {w.rank}] fault train.crash_at_step: killing this worker at step {w.step}")
    os._exit(1)


@dataclass
class Progress:
    """Where this run of the loop started (for the ETA: a resumed run counts from its resume step)."""

    t_start: float
    start_step: int


def log_step(w: Worker, tracker: ResilientLogger | None, progress: Progress) -> dict[str, Any]:
    """Every ``log_every`` steps: the window's metrics to MLflow (rank 0, asynchronous) and a progress line;
    returns what the next report to Ray Train carries."""
    r, step = w.cfg.run, w.step
    metrics = log_window(w)
    if tracker is not None:
        tracker.log_metrics(metrics, step)
    if w.rank == 0:
        eta = (time.perf_counter() - progress.t_start) / max(step - progress.start_step, 1) * (r.max_steps - step)
        log.info(f"[{r.name}] step {step}/{r.max_steps} loss {metrics['train/loss']:.4f} "
                 f"nll {metrics['train/nll']:.4f} tok/s {metrics['train/tokens_per_s']:,.0f} "
                 f"ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}")
    return {"step": step, "train_loss": metrics["train/loss"], "train_nll": metrics["train/nll"]}


def validation_step(w: Worker, rows: dict[str, torch.Tensor], tracker: ResilientLogger | None) -> dict[str, Any]:
    """Every ``val_every`` steps: the EMA bound (``validate``), the best checkpoint (``keep_if_best``), BD3-LM's
    interval search before training goes on (``search_clip``), each logged; returns what the next report to
    Ray Train carries."""
    cfg, r, step = w.cfg, w.cfg.run, w.step
    ppl = validate(w, rows)
    keep_if_best(w, ppl)
    if model_kind(cfg.model.kind).clipped_schedule and r.clip_search and step < r.max_steps:
        lo, hi = search_clip(w, rows)
        if tracker is not None:
            tracker.log_metrics({"train/clip_low": lo, "train/clip_high": hi}, step)
        if w.rank == 0:
            log.info(f"[{r.name}] step {step}: block times from [{lo:g}, {hi:g}] (clipped schedule)")
    if tracker is not None:
        tracker.log_metrics({"val/ppl": ppl, "val/nll": math.log(ppl)}, step)
    if w.rank == 0:
        log.info(f"[{r.name}] step {step} validation PPL <= {ppl:.3f} (EMA)")
    return {"step": step, "val_ppl": ppl, "epoch": w.epoch, "best_val_ppl": w.best_val}


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """The training loop every Ray Train worker runs (or the driver, in local mode; or a Tune trial's process, with
    ``config["session"]`` a ``TrialSession``)."""
    # lazy: keeps ray out of this module's import
    import ray.train

    lc: LoopConfig = config["loop"]
    api: Any = config.get("session") or ray.train
    cfg, r = lc.cfg, lc.cfg.run
    ctx = api.get_context()
    torch.set_num_threads(lc.threads)
    use_gpu = cfg.scaling.use_gpu and torch.cuda.is_available()
    device = (ray.train.torch.get_device() if api is ray.train else torch.device("cuda")) if use_gpu else torch.device("cpu")
    w = build(lc, ctx.get_world_rank(), ctx.get_world_size(), device)

    ckpt = api.get_checkpoint()
    with ckpt.as_directory() if ckpt is not None else contextlib.nullcontext(None) as ck_dir:
        # The local copy may be a temporary folder: the step comes from the checkpoint's storage path.
        resumed_from = resume(w, ck_dir, step_of(ckpt.path) if ckpt is not None else -1)
    stream = batch_stream(w, api.get_dataset_shard("train"))
    val_rows = validation_rows(w)

    tracker = None
    if w.rank == 0:  # asynchronous: a tracking outage never stalls the loop (no run id: everything is spooled)
        tracker = ResilientLogger(lc.tracking_uri, lc.run_id, spool_dir=join(lc.run_dir, SPOOL))
        if resumed_from is not None:
            tracker.log_metrics({"train/resumed_from": resumed_from}, step=resumed_from, force=True)

    w.net.train()
    progress = Progress(time.perf_counter(), w.step)
    last: dict[str, Any] = {"step": w.step}
    if w.step >= r.max_steps:  # a finished run rerun: report its validation once more, train nothing
        last = {"step": w.step, "val_ppl": validate(w, val_rows), "epoch": w.epoch}
        api.report(last)
    while w.step < r.max_steps:
        _maybe_crash(w)
        if w.teacher is not None:  # a distillation: a new round's first step promotes the student to teacher
            advance(w)
        optimiser_step(w, stream)
        if lc.step_pause_ms:
            time.sleep(lc.step_pause_ms / 1000)
        step = w.step
        if step % r.log_every == 0 or step == r.max_steps:
            last.update(log_step(w, tracker, progress))
        do_val = step % r.val_every == 0 or step == r.max_steps
        if do_val:
            last.update(validation_step(w, val_rows, tracker))
        if step % r.ckpt_every == 0 or step == r.max_steps:
            if tracker is not None:  # a restart from this checkpoint replays only later steps: keep these
                tracker.persist()
            _report_checkpoint(w, dict(last), api)
        elif do_val:
            api.report(dict(last))
    if tracker is not None:
        tracker.close(timeout=lc.cfg.mlflow.drain_timeout_s)

