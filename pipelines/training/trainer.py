"""Distributed training of ADLM and its baselines with Ray Train (METHOD.md sections 2, 7).

    python -m pipelines.train --config configs/demo.yaml [--set run.max_steps=200 --set model.kind=mdlm ...]

What happens, in order:

1. The recipe is loaded and validated; both splits' manifests are read; the data must fit the model
   (``Manifest.check_fits``) and every shard must exist. All of this fails with one line before Ray
   starts.
2. The MLflow run of this run name is found (run id from the latest checkpoint, else by the run-name
   tag) or created; the full config and the data manifest hash are its params.
3. A Ray Train ``TorchTrainer`` runs ``train_loop_per_worker`` on ``scaling.num_workers`` workers
   (DDP: gloo on CPU, nccl on GPU; or FSDP), or in the driver process with ``num_workers: 0``.
4. At the end the final EMA checkpoint is logged as the run artifact ``checkpoint`` and registered
   (alias ``candidate``), with a loss-curve plot.

Data order and exact resume. The training split is read with Ray Data (``read_parquet`` of the
shards, a seeded block order) and split across workers by ``get_dataset_shard`` with
``preserve_order=True``: Ray's output splitter then hands blocks to workers deterministically and
equally (``equal=True``), so every worker sees the same number of rows and batches, and the same
rows on every rerun. Each worker iterates its shard with ``iter_torch_batches`` and a local shuffle
buffer seeded by (seed, epoch, rank). So a worker's batch sequence is a pure function of
(seed, epoch, position); the checkpoint stores (epoch, batches consumed) and a resumed worker
replays its stream up to that position (reading and dropping the consumed batches), which makes a
resumed run equal to an uninterrupted one. Validation rows are read with pyarrow (the first
``val_batches * micro_batch * workers`` rows of the validation split), the same rows every time,
with a fixed noise seed, so validation curves are comparable across steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adlm_model.config import ConfigError

from .common import ensure_experiment, quiet_environment, resolve_tracking_uri, resolve_workdir
from .train_config import TrainConfig, flatten, load_config

CRASH_ENV = "ADLM_TEST_CRASH_AT_STEP"
"""Test-only switch: the last worker kills its own process (os._exit) at this step, once per run."""
CKPT_PREFIX = "checkpoint_"
EXPORT_FILES = ("config.json", "model.safetensors", "ema.safetensors", "tokenizer.json")


class TrainError(RuntimeError):
    """Training failed after it started (the message names the run and where its logs are)."""


@dataclass
class TrainResult:
    """What one training run produced."""

    run_id: str
    """MLflow run id."""
    run_name: str
    step: int
    """Steps trained (== run.max_steps)."""
    val_ppl: float | None
    """Final validation NELBO perplexity bound (EMA weights)."""
    checkpoint_dir: Path
    """Local folder of the final checkpoint (model + EMA + config + tokenizer)."""
    registered_version: str | None = None
    """Version of the registered model that received the checkpoint, if registered."""
    model_name: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    """The last metrics the workers reported."""


# ------------------------------------------------------------------------------------------------------
# Driver-side preparation (no Ray yet)


@dataclass
class DataPlan:
    train_uris: list[str]
    val_uris: list[str]
    columns: list[str]
    manifest_hash: str
    tokenizer_spec: str
    tokenizer_path: str | None
    train_rows: int
    val_rows: int


def plan_data(cfg: TrainConfig, workdir: Path) -> DataPlan:
    """Read both manifests and refuse data that does not fit the model; one-line errors."""
    from .manifest import ManifestError, exists, read_manifest  # noqa: PLC0415

    manifests = {}
    for split in ("train", "validation"):
        d = cfg.resolve_path(getattr(cfg.data, split), workdir)
        try:
            m = read_manifest(d)
        except ManifestError as e:
            raise ConfigError(f"data.{split}: {e}") from None
        m.check_fits(cfg.model)
        missing = [u for u in m.shard_uris() if not exists(u)]
        if missing or not m.shards:
            raise ConfigError(f"data.{split}: shard {missing[0] if missing else '(none listed)'} is missing; "
                              "rerun pipelines.prepare_data for this split")
        manifests[split] = m
    tr, va = manifests["train"], manifests["validation"]
    if tr.tokenizer.get("hash") != va.tokenizer.get("hash"):
        raise ConfigError("data.train and data.validation were tokenized differently; prepare both with one tokenizer")
    need = cfg.batch.micro_batch * cfg.world
    if tr.rows < need:
        raise ConfigError(f"data.train has {tr.rows} rows, fewer than micro_batch x workers = {need}; "
                          "use more data or a smaller batch.micro_batch")
    if va.rows < need:
        raise ConfigError(f"data.validation has {va.rows} rows, fewer than micro_batch x workers = {need}; "
                          "use more data or a smaller batch.micro_batch")
    cols = ["input_ids"] + (["attention_mask"] if tr.mode == "pad" else [])
    tok_path = tr.tokenizer.get("path")
    return DataPlan(train_uris=tr.shard_uris(), val_uris=va.shard_uris(), columns=cols,
                    manifest_hash=tr.content_hash(), tokenizer_spec=str(tok_path or tr.tokenizer.get("name")),
                    tokenizer_path=tok_path if tok_path and Path(tok_path).is_file() else None,
                    train_rows=tr.rows, val_rows=va.rows)


def storage_root(cfg: TrainConfig, workdir: Path) -> str:
    return cfg.run.storage_path or str(workdir / "ray_results")


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, dir) of the complete checkpoints of a run folder, oldest first."""
    out = []
    if run_dir.is_dir():
        for p in run_dir.glob(f"{CKPT_PREFIX}*"):
            try:
                step = int(p.name[len(CKPT_PREFIX):])
            except ValueError:
                continue
            if (p / "config.json").is_file() and (p / "trainer_state.json").is_file():
                out.append((step, p))
    return sorted(out)


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    cks = list_checkpoints(run_dir)
    return cks[-1] if cks else None


# ------------------------------------------------------------------------------------------------------
# Worker side


def build_optimizer(params: Any, o: Any) -> Any:
    """AdamW from the ``optim`` section (fused kernel unless ``optim.fused`` is off)."""
    import torch  # noqa: PLC0415 - the driver never imports torch

    kw = {"fused": True} if o.fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, **kw)


def lr_factor(step: int, warmup: int, schedule: str, max_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then constant (reference) or cosine down to ``min_ratio``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, max_steps - warmup)
    prog = min(1.0, (step - warmup) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))


def _mix(*xs: int) -> int:
    """A 31-bit seed from integers (data order and noise seeds per seed/epoch/rank)."""
    h = 1469598103934665603
    for x in xs:
        h = ((h ^ (int(x) & 0xFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h % (2**31 - 1)


def _read_validation(uris: list[str], columns: list[str], n_rows: int, length: int) -> dict[str, Any]:
    """The first ``n_rows`` rows of the validation shards as numpy arrays (pyarrow; local or URIs)."""
    import numpy as np  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    from .manifest import get_fs  # noqa: PLC0415

    got: dict[str, list] = {c: [] for c in columns}
    have = 0
    for uri in uris:
        fs, p = get_fs(uri)
        t = pq.read_table(p, columns=columns, filesystem=fs)
        for c in columns:
            got[c].append(t.column(c).combine_chunks().flatten().to_numpy().reshape(-1, length))
        have += t.num_rows
        if have >= n_rows:
            break
    return {c: np.concatenate(v)[:n_rows] for c, v in got.items()}


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """The training loop every Ray Train worker runs (or the driver, in local mode)."""
    import numpy as np  # noqa: PLC0415
    import ray.train  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415

    from adlm_model import EMA, build_model, compute_loss, gamma_at  # noqa: PLC0415
    from adlm_model.checkpoint import load_state, save_checkpoint, save_state  # noqa: PLC0415

    from .tracking import ResilientLogger  # noqa: PLC0415

    cfg = TrainConfig.from_dict(config["cfg"])
    mc, r = cfg.model, cfg.run
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    distributed = world > 1 and dist.is_available() and dist.is_initialized()
    torch.set_num_threads(int(config["threads"]))
    use_gpu = cfg.scaling.use_gpu and torch.cuda.is_available()
    device = ray.train.torch.get_device() if use_gpu else torch.device("cpu")
    # bf16 autocast on GPU only: on CPU it is ~19x slower (ENVIRONMENT.md); the loss does its
    # log-softmax/SUBS in float32 regardless (METHOD.md section 1).
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if use_gpu and cfg.scaling.bf16
                else contextlib.nullcontext())

    # ---- model, EMA, optimiser, schedule (identical init on every rank) ----
    torch.manual_seed(r.seed)
    raw = build_model(mc).to(device)
    accum = cfg.batch.global_batch // (cfg.batch.micro_batch * world)

    class LossModule(torch.nn.Module):
        """Runs the objective inside forward so DDP/FSDP see the forward pass (gradient sync)."""

        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, x, attention_mask, step: int, train: bool, generator):  # noqa: ANN001
            out = compute_loss(self.model, x, attention_mask, mc, step=step, train=train, generator=generator)
            zero = torch.zeros((), dtype=torch.float64, device=x.device)
            return (out.loss, out.nll_sum, out.n_tokens.to(torch.float64),
                    out.anchor_sum if out.anchor_sum is not None else zero,
                    out.n_anchor.to(torch.float64) if out.n_anchor is not None else zero)

    module = LossModule(raw)
    fsdp = distributed and cfg.scaling.strategy == "fsdp"
    if fsdp:
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        for blk in [m for m in raw.modules() if type(m).__name__ == "DiTBlock"]:
            fully_shard(blk)
        fully_shard(module)
        net = module
    elif distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

        # The only buffers are rotary caches, identical on every rank: synced once at init, never per forward.
        net = DDP(module, device_ids=[device.index] if use_gpu else None, forward_sync_buffers=False)
    else:
        net = module
    ema = EMA(raw, cfg.ema)
    o = cfg.optim
    opt = build_optimizer(raw.parameters(), o)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, o.warmup_steps, o.schedule, r.max_steps, o.min_lr_ratio))

    # ---- resume: Ray's checkpoint of this run (restart / rerun) or the driver's scan ----
    step, epoch, pos = 0, 0, 0
    noise = torch.Generator(device=device)
    noise.manual_seed(_mix(r.seed, 1, rank))
    torch.manual_seed(_mix(r.seed, 2, rank))  # dropout differs per rank, reproducibly
    ckpt = ray.train.get_checkpoint()

    def _step_of(path: str) -> int:
        return int(Path(path).name[len(CKPT_PREFIX):]) if Path(path).name.startswith(CKPT_PREFIX) else -1

    resume_ctx: contextlib.AbstractContextManager = contextlib.nullcontext(None)
    if ckpt is not None:
        resume_ctx = ckpt.as_directory()
    with resume_ctx as ck_dir:
        fallback = config.get("resume_dir")
        if ck_dir is None or (fallback and _step_of(fallback) > _step_of(str(ckpt.path))):
            ck_dir = fallback
        resumed_from = None
        if ck_dir:
            d = Path(ck_dir)
            state = load_state(d, "trainer_state")
            model_sd = load_file(str(d / "model.safetensors"))
            ema_sd = load_file(str(d / "ema.safetensors"))
            if fsdp:
                from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
                    StateDictOptions,
                    set_model_state_dict,
                    set_optimizer_state_dict,
                )

                opts = StateDictOptions(full_state_dict=True)
                set_model_state_dict(raw, model_sd, options=opts)
                with ema.applied(raw):  # EMA shards: load the full EMA weights into the model, copy shards
                    set_model_state_dict(raw, {**model_sd, **ema_sd}, options=opts)
                    ema.shadow = {k: p.detach().clone() for k, p in raw.named_parameters() if k in ema.shadow}
                set_optimizer_state_dict(raw, opt, state["optimizer"], options=opts)
            else:
                raw.load_state_dict(model_sd)
                ema.load_state_dict({k: v.to(device) for k, v in ema_sd.items()})
                opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            step, epoch, pos = int(state["step"]), int(state["data"]["epoch"]), int(state["data"]["position"])
            rng_file = d / f"rng_rank{rank}.json"
            if rng_file.is_file() and int(state.get("world", world)) == world:
                rng = load_state(d, f"rng_rank{rank}")
                torch.set_rng_state(rng["torch"])
                noise.set_state(rng["noise"].to(noise.get_state().device) if use_gpu else rng["noise"])
                if use_gpu and rng.get("cuda") is not None:
                    torch.cuda.set_rng_state(rng["cuda"])
            else:  # another world size: data position and RNG streams cannot continue exactly
                print(f"[rank {rank}] checkpoint written with another worker count: continuing with fresh RNG "
                      "streams (not bit-exact)", flush=True)
            resumed_from = step

    # ---- data ----
    shard = ray.train.get_dataset_shard("train")
    micro, buf = cfg.batch.micro_batch, cfg.data.shuffle_buffer

    def batches(epoch: int, skip: int):
        while True:
            it = shard.iter_torch_batches(batch_size=micro, drop_last=True, device="cpu", prefetch_batches=2,
                                          local_shuffle_buffer_size=buf or None,
                                          local_shuffle_seed=_mix(r.seed, 3, epoch, rank) if buf else None)
            n = 0
            for i, b in enumerate(it):
                n += 1
                if i >= skip:
                    yield epoch, i, b
            if n == 0:
                raise RuntimeError(f"worker {rank} got no full batch of {micro} rows from its training shard")
            epoch, skip = epoch + 1, 0

    n_val = (r.val_batches * micro * world) if r.val_batches else (config["val_rows"] // (micro * world)) * micro * world
    n_val = min(n_val, (config["val_rows"] // (micro * world)) * micro * world)
    val = _read_validation(config["val_uris"], config["columns"], n_val, mc.seq_len)
    per = n_val // world
    val = {k: torch.from_numpy(np.ascontiguousarray(v[rank * per:(rank + 1) * per])) for k, v in val.items()}

    def all_sum(vals: list[float]) -> list[float]:
        t = torch.tensor(vals, dtype=torch.float64, device=device)
        if distributed:
            dist.all_reduce(t)
        return t.tolist()

    def validate() -> float:
        """NELBO bound with EMA weights on the fixed validation rows, tokens pooled over workers."""
        g = torch.Generator(device=device)
        g.manual_seed(_mix(r.seed, 4, rank))  # same t and masks every time: comparable curves
        nll, ntok = 0.0, 0.0
        net.eval()
        with ema.applied(raw), torch.no_grad():
            for i in range(0, per, micro):
                x = val["input_ids"][i:i + micro].to(device).long()
                am = val["attention_mask"][i:i + micro].to(device) if "attention_mask" in val else None
                with autocast:
                    out = net(x, am, step, False, g)
                nll += float(out[1])
                ntok += float(out[2])
        net.train()
        nll, ntok = all_sum([nll, ntok])
        return math.exp(nll / max(ntok, 1.0))

    # ---- tracking (rank 0 only) ----
    tracker = None
    if rank == 0 and config.get("run_id"):
        tracker = ResilientLogger(config["tracking_uri"], config["run_id"])
        if resumed_from is not None:
            tracker.log_metrics({"train/resumed_from": resumed_from}, step=resumed_from, force=True)
            tracker.flush()

    def save(step: int, metrics: dict[str, Any]) -> None:
        """All ranks write into one checkpoint folder: rank 0 the weights and trainer state, every
        rank its RNG streams. safetensors + JSON only (adlm_model.checkpoint)."""
        from ray.train import Checkpoint  # noqa: PLC0415

        name = f"{CKPT_PREFIX}{step:08d}"
        local_mode = config["local_mode"]
        tmp = Path(config["local_ckpt_root"]) / name if local_mode else Path(tempfile.mkdtemp(prefix="adlm-ckpt-"))
        if fsdp:
            from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_sd = get_model_state_dict(raw, options=opts)
            with ema.applied(raw):
                ema_full = get_model_state_dict(raw, options=opts)
            ema_sd = {k: v for k, v in ema_full.items() if k in ema.shadow}
            opt_sd = get_optimizer_state_dict(raw, opt, options=opts)
        else:
            model_sd, ema_sd, opt_sd = None, ema.state_dict(), opt.state_dict()
        if rank == 0:
            meta = {"step": step, "mlflow_run_id": config.get("run_id"), "run_name": r.name,
                    "tokenizer": config["tokenizer_spec"], "data_manifest_hash": config["manifest_hash"],
                    "train_config": cfg.to_dict(), "val_ppl": metrics.get("val_ppl"), "world": world}
            save_checkpoint(tmp, raw, mc, ema_state=ema_sd, meta=meta)
            if model_sd is not None:
                from adlm_model.checkpoint import _atomic_safetensors  # noqa: PLC0415

                _atomic_safetensors(tmp / "model.safetensors", model_sd)
            if config.get("tokenizer_path"):
                shutil.copyfile(config["tokenizer_path"], tmp / "tokenizer.json")
            save_state(tmp, {"optimizer": opt_sd, "scheduler": sched.state_dict(), "step": step, "world": world,
                             "data": {"epoch": epoch, "position": pos}}, "trainer_state")
        rng = {"torch": torch.get_rng_state(), "noise": noise.get_state().cpu(),
               "cuda": torch.cuda.get_rng_state() if use_gpu else None}
        save_state(tmp, rng, f"rng_rank{rank}")
        if local_mode:
            kept = list_checkpoints(Path(config["local_ckpt_root"]))
            for _, old in kept[:-r.num_to_keep]:
                shutil.rmtree(old, ignore_errors=True)
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(str(tmp)))
        else:
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(str(tmp)), checkpoint_dir_name=name)
            shutil.rmtree(tmp, ignore_errors=True)

    # ---- the loop ----
    crash_at = config.get("crash_at_step")
    marker = Path(config["crash_marker"]) if config.get("crash_marker") else None
    stream = batches(epoch, pos)
    net.train()
    win = {"t": time.perf_counter(), "steps": 0, "loss": 0.0, "nll": 0.0, "ntok": 0.0, "anc": 0.0, "nanc": 0.0,
           "gnorm": 0.0}
    t_start = time.perf_counter()
    start_step = step
    last: dict[str, Any] = {"step": step}
    if step >= r.max_steps:  # a finished run rerun: report its validation once more, train nothing
        last = {"step": step, "val_ppl": validate(), "epoch": epoch}
        ray.train.report(last)
    while step < r.max_steps:
        if crash_at is not None and step == crash_at and rank == world - 1 and marker and not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(str(step))
            print(f"[rank {rank}] {CRASH_ENV}: killing this worker at step {step}", flush=True)
            os._exit(1)
        k = step  # gamma_k of this optimiser step (METHOD.md section 2)
        opt.zero_grad(set_to_none=True)
        for m in range(accum):
            ep, i, b = next(stream)
            x = b["input_ids"].to(device).long()
            am = b["attention_mask"].to(device) if "attention_mask" in b else None
            sync = net.no_sync() if (distributed and not fsdp and m < accum - 1) else contextlib.nullcontext()
            if fsdp:
                net.set_requires_gradient_sync(m == accum - 1)
            with sync:
                with autocast:
                    out = net(x, am, k, True, noise)
                (out[0] / accum).backward()
            win["loss"] += float(out[0].detach()) / accum
            win["nll"] += float(out[1])
            win["ntok"] += float(out[2])
            win["anc"] += float(out[3])
            win["nanc"] += float(out[4])
            epoch, pos = ep, i + 1
        if o.clip > 0:
            gn = torch.nn.utils.clip_grad_norm_(raw.parameters(), o.clip)
        else:
            gn = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in raw.parameters() if p.grad is not None]))
        win["gnorm"] += float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
        lr_now = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        ema.update(raw)
        step += 1
        win["steps"] += 1

        if step % r.log_every == 0 or step == r.max_steps:
            dt = time.perf_counter() - win["t"]
            tot = all_sum([win["loss"], win["nll"], win["ntok"], win["anc"], win["nanc"], win["gnorm"]])
            n = win["steps"]
            tok_s = tot[2] / max(dt, 1e-9)
            metrics = {"train/loss": tot[0] / (n * world), "train/nll": tot[1] / max(tot[2], 1.0),
                       "train/grad_norm": tot[5] / (n * world), "train/lr": lr_now, "train/tokens_per_s": tok_s,
                       "train/epoch": epoch}
            if mc.kind == "adlm":
                metrics["train/anchor_loss"] = tot[3] / max(tot[2], 1.0)
                metrics["train/anchor_frac"] = tot[4] / max(tot[2], 1.0)
                metrics["train/gamma_k"] = gamma_at(k, mc.gamma, mc.gamma_ramp_steps)
            if tracker is not None:
                tracker.log_metrics(metrics, step)
                tracker.flush()
            if rank == 0:
                rate = (time.perf_counter() - t_start) / max(step - start_step, 1)
                eta = rate * (r.max_steps - step)
                print(f"[{r.name}] step {step}/{r.max_steps} loss {metrics['train/loss']:.4f} "
                      f"nll {metrics['train/nll']:.4f} tok/s {tok_s:,.0f} "
                      f"ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}", flush=True)
            last.update({"step": step, "train_loss": metrics["train/loss"], "train_nll": metrics["train/nll"]})
            win = {k2: 0.0 for k2 in win} | {"t": time.perf_counter(), "steps": 0}

        do_val = step % r.val_every == 0 or step == r.max_steps
        do_ckpt = step % r.ckpt_every == 0 or step == r.max_steps
        if do_val:
            ppl = validate()
            last.update({"step": step, "val_ppl": ppl, "epoch": epoch})
            if tracker is not None:
                tracker.log_metrics({"val/ppl": ppl, "val/nll": math.log(ppl)}, step)
                tracker.flush(block=True)
            if rank == 0:
                print(f"[{r.name}] step {step} validation PPL <= {ppl:.3f} (EMA)", flush=True)
        if do_ckpt:
            save(step, dict(last))
        elif do_val:
            ray.train.report(dict(last))
    if tracker is not None:
        tracker.flush(block=True)


# ------------------------------------------------------------------------------------------------------
# Driver


def _export_checkpoint(src: Path, dst: Path) -> Path:
    """The registered artifact: config + model + EMA weights + tokenizer (no optimizer/RNG state)."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in EXPORT_FILES:
        if (src / f).is_file():
            shutil.copyfile(src / f, dst / f)
    return dst


def _ensure_ray(num_cpus: int | None = None) -> None:
    from .common import init_ray  # noqa: PLC0415

    init_ray(num_cpus)


def train(cfg: TrainConfig, *, workdir: str | os.PathLike | None = None, tracking_uri: str | None = None,
          callbacks: list | None = None, parent_run_id: str | None = None, extra_tags: dict[str, str] | None = None,
          register: bool | None = None, quiet: bool = False) -> TrainResult:
    """Train ``cfg`` with Ray Train, track it in MLflow and register the final checkpoint.

    Rerunning with the same ``run.name`` (and storage) resumes the run from its latest checkpoint.
    ``callbacks`` go to the trainer's ``RunConfig`` (e.g. Tune's ``TuneReportCallback``);
    ``parent_run_id`` nests the MLflow run (Tune trials).
    """
    quiet_environment()
    cfg.validate()
    wd = resolve_workdir(workdir)
    uri = tracking_uri or resolve_tracking_uri(wd)
    plan = plan_data(cfg, wd)  # every data error before Ray starts
    storage = storage_root(cfg, wd)
    run_dir = Path(storage) / cfg.run.name
    local_mode = cfg.scaling.num_workers == 0
    local_root = run_dir  # local mode writes its checkpoints straight into the run folder
    prev = latest_checkpoint(run_dir) if "://" not in storage else None

    # ---- MLflow: one run per run name, reopened on resume ----
    from .tracking import find_or_create_run, log_params_once  # noqa: PLC0415

    run_id = None
    try:
        exp_id = ensure_experiment(cfg.mlflow.experiment, uri, wd)
        prev_id = None
        if prev is not None:
            prev_id = json.loads((prev[1] / "config.json").read_text()).get("meta", {}).get("mlflow_run_id")
        tags = {"kind": cfg.model.kind, "data_manifest_hash": plan.manifest_hash, **(extra_tags or {})}
        run_id, created = find_or_create_run(uri, exp_id, cfg.run.name, run_id=prev_id, tags=tags,
                                             parent_run_id=parent_run_id)
        params = {**flatten(cfg.to_dict()), "data_manifest_hash": plan.manifest_hash,
                  "accumulation": cfg.accumulation, "tokenizer": plan.tokenizer_spec,
                  "gamma": cfg.model.gamma, "tau": cfg.model.tau}
        log_params_once(uri, run_id, params)
    except Exception as e:  # noqa: BLE001 - a tracking outage must not stop training
        print(f"WARNING: MLflow unavailable at start ({type(e).__name__}: {str(e)[:200]}); training without "
              "a run id", flush=True)
    if not quiet:
        print(f"[{cfg.run.name}] {cfg.model.kind} model, {cfg.world} worker(s) x micro-batch {cfg.batch.micro_batch} "
              f"x accumulation {cfg.accumulation} = global batch {cfg.batch.global_batch}; data {plan.train_rows} "
              f"train rows; storage {run_dir}; MLflow run {run_id} at {uri}"
              + (f"; resuming from step {prev[0]}" if prev else ""), flush=True)

    import ray  # noqa: PLC0415
    import ray.data  # noqa: PLC0415
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig  # noqa: PLC0415
    from ray.train.torch import TorchConfig, TorchTrainer  # noqa: PLC0415

    _ensure_ray()
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # deterministic order (the driver's context: local mode)
    ctx.enable_progress_bars = False
    exec_opts = ray.data.ExecutionOptions(preserve_order=True)
    train_ds = ray.data.read_parquet(plan.train_uris, num_cpus=cfg.data.read_cpus,
                                     override_num_blocks=max(len(plan.train_uris), 2 * cfg.world))
    train_ds = train_ds.select_columns(plan.columns)
    train_ds = train_ds.randomize_block_order(seed=cfg.run.seed)

    crash_at = os.environ.get(CRASH_ENV)
    loop_cfg = {
        "cfg": cfg.to_dict(), "run_id": run_id, "tracking_uri": uri, "val_uris": plan.val_uris,
        "val_rows": plan.val_rows, "columns": plan.columns, "manifest_hash": plan.manifest_hash,
        "tokenizer_spec": plan.tokenizer_spec, "tokenizer_path": plan.tokenizer_path,
        # torch threads = the worker's CPUs rounded half up (0.5 -> 1, 1.5 -> 2).
        "threads": max(1, int(cfg.scaling.cpus_per_worker + 0.5)) if not local_mode else max(1, os.cpu_count() or 1),
        "local_mode": local_mode, "local_ckpt_root": str(local_root),
        "resume_dir": str(prev[1]) if prev else None,
        "crash_at_step": int(crash_at) if crash_at else None,
        "crash_marker": str(run_dir / ".crashed_once") if crash_at else None,
    }
    resources = {"CPU": cfg.scaling.cpus_per_worker}
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_cfg,
        torch_config=TorchConfig(backend="nccl" if cfg.scaling.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=cfg.scaling.num_workers, use_gpu=cfg.scaling.use_gpu,
                                     resources_per_worker=resources),
        run_config=RunConfig(name=cfg.run.name, storage_path=storage,
                             failure_config=FailureConfig(max_failures=cfg.failure.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=cfg.run.num_to_keep),
                             callbacks=callbacks or None),
        datasets={"train": train_ds},
        dataset_config=DataConfig(datasets_to_split=["train"], execution_options=exec_opts),
    )
    try:
        result = trainer.fit()
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()
        raise TrainError(f"training run {cfg.run.name!r} failed: {type(e).__name__}: "
                         f"{msg[-1] if msg else ''} (worker logs: {run_dir} and the Ray session logs)") from e
    metrics = dict(result.metrics or {})

    final = latest_checkpoint(run_dir)
    if final is None and result.checkpoint is not None:
        final = (int(metrics.get("step", cfg.run.max_steps)), Path(result.checkpoint.path))
    if final is None:
        raise TrainError(f"training run {cfg.run.name!r} finished without a checkpoint in {run_dir}")
    export = _export_checkpoint(final[1], wd / "checkpoints" / cfg.run.name)
    val_ppl = metrics.get("val_ppl")
    if val_ppl is None:
        val_ppl = json.loads((final[1] / "config.json").read_text()).get("meta", {}).get("val_ppl")

    version = None
    do_register = cfg.mlflow.register if register is None else register
    if run_id is not None:
        from .tracking import log_artifact_safely, plot_loss_curve  # noqa: PLC0415

        try:
            png = plot_loss_curve(uri, run_id, wd / "plots" / cfg.run.name / "loss_curve.png")
            if png is not None:
                log_artifact_safely(uri, run_id, png, "plots")
        except Exception as e:  # noqa: BLE001
            print(f"WARNING: loss-curve plot failed: {e}", flush=True)
        logged = log_artifact_safely(uri, run_id, export, "checkpoint")
        if do_register and logged:
            from .registry import register_checkpoint  # noqa: PLC0415

            try:
                mv = register_checkpoint(run_id, cfg.mlflow.registered_model, {
                    "kind": cfg.model.kind, "gamma": cfg.model.gamma, "tau": cfg.model.tau,
                    "data_manifest_hash": plan.manifest_hash, "val_ppl": val_ppl, "run_name": cfg.run.name,
                    "step": final[0], **(extra_tags or {})}, tracking_uri=uri)
                version = str(mv.version)
            except Exception as e:  # noqa: BLE001
                print(f"WARNING: registration failed ({type(e).__name__}: {e}); the checkpoint is at {export}",
                      flush=True)
        try:
            import mlflow  # noqa: PLC0415

            mlflow.MlflowClient(uri).set_terminated(run_id, "FINISHED")
        except Exception:  # noqa: BLE001
            pass
    if not quiet:
        print(f"[{cfg.run.name}] done: step {final[0]}, validation PPL <= {val_ppl}, checkpoint {export}"
              + (f", registered {cfg.mlflow.registered_model} v{version} @candidate" if version else ""), flush=True)
    return TrainResult(run_id=run_id or "", run_name=cfg.run.name, step=final[0], val_ppl=val_ppl,
                       checkpoint_dir=export, registered_version=version,
                       model_name=cfg.mlflow.registered_model if version else None, metrics=metrics)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.train",
        description="Train ADLM / MDLM / AR / BD3-LM with Ray Train from prepared Parquet shards; track and "
                    "register in MLflow. Rerunning the same run name resumes it from its latest checkpoint.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Config sections and keys (see pipelines/train_config.py for every field): model (preset + "
               "ModelConfig fields), data (train, validation: split dirs, relative = under the workdir; "
               "shuffle_buffer), optim (lr, betas, eps, weight_decay, warmup_steps, schedule constant|cosine, "
               "min_lr_ratio, clip), batch (global_batch, micro_batch), run (name, max_steps, val_every, "
               "val_batches, ckpt_every, num_to_keep, log_every, seed, storage_path), scaling (num_workers, "
               "use_gpu, cpus_per_worker, strategy ddp|fsdp, bf16), failure (max_failures), ema, mlflow "
               "(experiment, registered_model, register).\n\nExample:\n  python -m pipelines.train --config "
               "configs/demo.yaml --set run.max_steps=50 --set model.kind=mdlm --set run.name=demo-mdlm")
    p.add_argument("--config", required=True, help="YAML recipe (configs/*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value, e.g. run.max_steps=100 or model.gamma=0.01 (repeatable)")
    p.add_argument("--workdir", default=None, help="work directory (default: $ADLM_WORKDIR or ./work); holds "
                   "data, ray_results, checkpoints and the default sqlite MLflow store")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            import yaml  # noqa: PLC0415

            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            return 0
        res = train(cfg, workdir=args.workdir)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"run_id": res.run_id, "step": res.step, "val_ppl": res.val_ppl,
                      "checkpoint_dir": str(res.checkpoint_dir), "registered_version": res.registered_version}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
