"""Fast sampling measured against the truth: speed against exact NLL on the ground-truth testbed.

Trains (or reuses, from ``--workdir``) a small MDLM and a small ADLM on each testbed preset (``adlm_model.testbed.language``:
synthetic languages whose ``log p(row)`` is exact; ``natural``, calibrated to natural text's confidence, and
``anchored``), then draws rows of the testbed's length (BOS and EOS given, the ``L - 2`` positions between
generated; nucleus off, so the samplers' own error is measured) with:

- the **baseline**: MDLM ancestral sampling at ``T = L`` with its exact row cache, the final step a draw from
  ``p_x0`` (``samplers.diffusion_sample(final="draw")``), not the reference's argmax; the language's own rows
  (``Testbed.sample``) are scored beside it;
- **threshold**: confidence-threshold parallel decoding, one block, no cache, over the threshold;
- **dual** / **prefix**: the same with semi-autoregressive blocks and the approximate KV cache, over threshold,
  block and refresh;
- the **distilled** SDTT students (``--distill-presets``) and, as their control, the **teacher** at the same steps;
- the paper profile's ``T`` (1024 for MDLM, 4096 for ADLM; ``--skip-paper-t``: not timed).

The figures (``_fast_sampling_figures``: every row counted, impossible rows at the unigram floor; rows paired
across methods; bootstrap intervals; a setting passes at 5% when its NLL excess's interval ends at or below 5% and
its impossible-row share is within 5 points of the baseline's) are read in two stages: every setting is drawn and
timed on the **selection** set (``--repeats`` batches at seeds ``7, 8, ...``), each method's best passing setting
is chosen there, and the chosen settings are drawn and timed again on the **measurement** set (``--measure-repeats``
batches at fresh seeds, interleaved with the baseline). The RESULT lines come from the measurement set only, each
printed only when its setting passes there (and a speedup only when its interval lies above 1; otherwise "no
detectable speedup" with the interval): ``fast_sampling_speedup_at_5pct_<kind>`` (natural preset;
``..._<kind>_anchored`` for the other), ``..._vs_paper_T_at_5pct_<kind>``, ``distilled_steps_at_5pct_<kind>`` and
``distilled_speedup_at_5pct_<kind>``, with ``fast_sampling_sample_excess_<kind>``. Everything is written to the
frontier JSON (every row's ``log p``, every time), from which the figures are recomputed; a plot beside it.

**Models close to the truth, reproducibly.** Training is the plain loop's (``adlm_model/train/plain_loop.py``: the
pipeline's step, no EMA, this benchmark's learning rate), seeded end to end: the initial weights
(``torch.manual_seed`` before the model is built), every batch (``Testbed.sample(seed=1000 + step)``), the loss's
noise (its own generator) and the thread count (one intra-op thread while training: reductions split over threads
may round differently). A model is cached under ``--workdir`` by the hash of everything that determines it (kind,
model config, testbed config, steps, batch, learning-rate schedule, seed) as safetensors + JSON, with a checkpoint
(weights, AdamW state, the loss generator's state, the step) every ``--checkpoint-every`` steps: a killed run
resumes where it stopped and ends with the same weights. Before any speed is read, the model's **distance from the
truth** is measured: its bound's excess over the exact entropy (nats/token on all L positions, 512 held-out rows)
and the true NLL excess of its baseline samples; a model whose bound is farther than ``--max-excess`` (0.3
nats/token, the testbed study's MDLM) gets no speedup printed and nothing else timed, only the reason (train it
longer: ``--train-steps``). ``--max-samples-excess`` gates on the samples' excess too (off by default). A model
whose samples are all impossible is always refused.

    python benchmarks/fast_sampling.py [--train-steps 18000] [--batch 256] [--workdir work/fast_sampling] [--record]

Longer than 500 lines because it is one benchmark's whole run in the order it runs (training, the gate, the
selection set, distillation, the measurement set, the RESULT lines); the figures' definitions live in
``_fast_sampling_figures.py``.

Not measured here: the demo corpus's gen-PPL (it needs the evaluation LM; run ``pipelines.evaluate --suite
gen_ppl --set sampler=confidence --set sampler.threshold=...`` on a demo model for that).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _fast_sampling_figures import choose, definitions, figures, row_nll, summarize
from _frontier_plot import plot
from _record import Recording, add_argument, machine_slug, recording
from _testbed_rows import step_rows
from _util import result

from adlm_model import build_model, compute_loss, preset, sample, unigram_entropy
from adlm_model.interop.checkpoint import read_config
from adlm_model.sampling.samplers import check_sample_args, diffusion_sample, resolve_prefix
from adlm_model.testbed.language import BOS_ID, EOS_ID, MASK_ID, Testbed, TestbedConfig
from adlm_model.train.plain_loop import PlainConfig, Run, saved_step
from adlm_model.train.plain_loop import train as plain_train
from adlm_model.train.train_step import TrainStep

PAPER_T = {"mdlm": 1024, "adlm": 4096}
SELECTION_SEED, MEASUREMENT_SEED, TRUTH_SEED = 7, 100_007, 30_000_000
"""Generator seeds of the selection set's batches (7, 8, ...), the measurement set's (fresh: 100,007, ...) and the
language's own rows scored beside the baseline."""
MAX_EXCESS = 0.3
"""Nats/token: the testbed study's MDLM (0.284 at 1,200 steps); a model farther from the truth gets no speedup."""
TRAIN_FORMAT = 3
"""Bumped when the training recipe below changes (part of the cache key). 3: peak ``LR``, a cosine to a tenth of it."""
LR, COSINE_FLOOR = 5e-4, 0.1  # 3e-3 (formats 1-2) held the natural preset's MDLM at the unigram level


def _save_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def _write_json(obj: dict, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _lr(step: int, lr: float, horizon: int = 0) -> float:
    """The learning rate of ``step``: ``lr`` after 20 warm-up steps, then (given a ``horizon``) a cosine to
    ``COSINE_FLOOR * lr``."""
    f = COSINE_FLOOR  # (1 + f) / 2 and (1 - f) / 2 are exactly the 0.55 and 0.45 that format 3's models trained with
    decay = (1 + f) / 2 + (1 - f) / 2 * math.cos(math.pi * min(step / horizon, 1.0)) if horizon else 1.0
    return lr * min(1.0, (step + 1) / 20) * decay


def _set_lr(opt: torch.optim.Optimizer, step: int, lr: float, horizon: int = 0) -> None:
    """``_lr`` of ``step`` set on every parameter group of ``opt``."""
    for group in opt.param_groups:
        group["lr"] = _lr(step, lr, horizon)


def _trainer(objective: torch.nn.Module, model: torch.nn.Module, lr: float) -> TrainStep:
    """The pipeline's step (``adlm_model.train.train_step.TrainStep``: the noise drawn from the caller's generator, the
    objective, backward, clipping to 1, AdamW) on ``objective``; ``_set_lr`` sets each step's learning rate."""
    return TrainStep(objective, model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0), clip=1.0)


def network_config(kind: str, tb: Testbed, hidden: int = 128, blocks: int = 2):
    """The benchmark's network of ``kind`` for ``tb``: ``hidden`` wide, ``blocks`` deep (ADLM's denoiser half as
    deep, at least one block; the time conditioning half as wide); 128 x 2 is the model every earlier run cached."""
    return preset("tiny", kind=kind, vocab_size=tb.vocab_size, mask_id=MASK_ID, seq_len=tb.length, hidden=hidden,
                  heads=4, n_blocks=blocks, denoiser_blocks=max(1, blocks // 2), cond_dim=hidden // 2, dropout=0.0)


def train(kind: str, tb: Testbed, steps: int, workdir: Path, seed: int = 0, batch: int = 32, lr: float = LR,
          checkpoint_every: int = 200, device: str = "cpu", hidden: int = 128, blocks: int = 2,
          loader_workers: int = 0) -> tuple[torch.nn.Module, object, dict]:
    """A small model of ``kind`` trained ``steps`` AdamW steps on fresh testbed rows, seeded end to end and cached
    by the hash of its recipe (module docstring); resumes from the last checkpoint. Returns (model, cfg, meta), the
    model on the CPU. ``device``: where it trains (``--train-device``); not part of the recipe's key, so a model
    trained on a GPU is the cached model of a CPU run of the same recipe (the device is recorded in its meta; the
    two devices' random streams differ, so their weights do too), and a checkpoint resumes on its own device only.
    ``hidden`` / ``blocks``: the network's width and depth (``network_config``).
    ``loader_workers``: processes that draw the rows ahead (``_testbed_rows``; the same rows, not in the key)."""
    cfg = network_config(kind, tb, hidden, blocks)
    recipe = {"format": TRAIN_FORMAT, "kind": kind, "model": cfg.to_dict(), "testbed": tb.to_dict(), "steps": steps,
              "batch": batch, "lr": lr, "warmup": 20, "seed": seed, "clip": 1.0, "cosine_to": lr * COSINE_FLOOR}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    d = workdir / f"{kind}-{tb.config.preset}-L{tb.length}-{key}"
    d.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)  # the initial weights: never from whatever state the global RNG is in
        model = build_model(cfg)
        meta = json.loads((d / "meta.json").read_text()) if (d / "meta.json").is_file() else {}
        if meta.get("done"):
            model.load_state_dict(load_file(str(d / "model.safetensors")))
            print(f"  {kind}: cached model {d.name} ({steps} steps)", flush=True)
            return model.eval(), cfg, meta
        ckpt = d / "checkpoint"  # the plain loop's checkpoint: weights, AdamW's state, the loss generator, the step
        done = saved_step(ckpt)
        was = read_config(ckpt)[1].get("device", "cpu") if done is not None else None
        if done is not None and was != torch.device(device).type:
            print(f"  {kind}: {d.name}'s checkpoint is from {was}: starting over", flush=True)  # the loop starts over
        elif done is not None:
            print(f"  {kind}: resuming {d.name} at step {done}/{steps}", flush=True)
        t0 = time.perf_counter()

        def progress(run: Run) -> None:
            if run.step % 100 == 0:
                print(f"  {kind} step {run.step}/{steps} loss {statistics.fmean(run.losses[-100:]):.4f} (mean of the "
                      f"last 100; {time.perf_counter() - t0:.0f} s)", flush=True)

        # AdamW's foreach kernel: the updates of torch.optim.AdamW's default, which every cached model trained with.
        run = plain_train(cfg, PlainConfig(max_steps=steps, lr=lr, weight_decay=0.0, fused=False,
                                           lr_at=lambda step: _lr(step, lr, horizon=steps), clip=1.0, ema=None,
                                           seed=seed, noise_seed=seed, device=device, out_dir=str(ckpt),
                                           ckpt_every=checkpoint_every),
                          lambda start: step_rows(tb, batch, start, steps, loader_workers), on_step=progress)
        model, losses = run.model, run.losses
        model.cpu()
        _save_atomic({k: v.detach().clone() for k, v in model.state_dict().items()}, d / "model.safetensors")
        meta = {"done": True, "recipe": recipe, "key": key, "final_loss_mean_100": statistics.fmean(losses[-100:])
                if losses else None, "trained_on": device, "seconds": round(time.perf_counter() - t0, 1)}
        _write_json(meta, d / "meta.json")
        shutil.rmtree(ckpt, ignore_errors=True)
        return model.eval(), cfg, meta
    finally:
        torch.set_num_threads(threads)


DISTILL_FORMAT = 1
"""Bumped when the distillation recipe below changes (part of each round's cache key)."""


def distill(kind: str, teacher: torch.nn.Module, cfg, tb: Testbed, workdir: Path, teacher_key: str, *, rounds: int,
            steps_per_round: int, lr: float = 1e-4, batch: int = 32, seed: int = 0,
            substeps: int = 2, device: str = "cpu") -> list[tuple[int, torch.nn.Module]]:
    """Self-distillation through time (``adlm_model.train.distill``, docs/design/method.md, section 4) from ``teacher`` at ``T0 = L``
    sampling steps: round ``r``'s student starts from the weights of round ``r - 1``'s (the teacher's first) and
    learns to take in one step what that model takes in ``substeps`` steps of size ``dt_r``; it then becomes the
    teacher. For ADLM the composed network is the student (anchor network and denoiser both learn). Seeded end to
    end like ``train``; each round's student is cached by the hash of the chain of recipes that made it (a rerun
    skips the rounds done). Returns ``[(student's sampling steps, student)]``, one per round, on the CPU;
    ``device``: where the rounds train (as ``train``'s, not part of the key)."""
    from adlm_model.train.distill import student_steps
    from pipelines.training.config import DistillSection
    from pipelines.training.distill import DistillLoss, Teacher

    t0_steps = tb.length
    out, current, chain = [], teacher.eval(), teacher_key
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for r in range(rounds):
            recipe = {"format": DISTILL_FORMAT, "from": chain, "round": r, "T0": t0_steps, "substeps": substeps,
                      "steps": steps_per_round, "lr": lr, "batch": batch, "seed": seed, "divergence": "kl-bwd"}
            chain = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
            d = workdir / f"{kind}-{tb.config.preset}-L{tb.length}-sdtt{r + 1}-{chain}"
            d.mkdir(parents=True, exist_ok=True)
            student = build_model(cfg)
            steps = student_steps(t0_steps, r + 1, substeps)
            if (d / "meta.json").is_file():
                student.load_state_dict(load_file(str(d / "model.safetensors")))
                print(f"  {kind}: cached SDTT round {r + 1} student ({steps} steps) {d.name}", flush=True)
            else:
                student.load_state_dict(current.state_dict())
                student.to(device).train()
                current.to(device)
                section = DistillSection(rounds=rounds, steps_per_round=steps_per_round, teacher_steps=t0_steps,
                                         substeps=substeps)
                step_fn = _trainer(DistillLoss(student, cfg, Teacher(current, r), section), student, lr)
                g = torch.Generator(device=device).manual_seed(seed * 1000 + r)
                t0, losses = time.perf_counter(), []
                for step in range(steps_per_round):
                    x = tb.sample(batch, seed=5_000_000 + r * steps_per_round + step).to(device)
                    _set_lr(step_fn.opt, step, lr)
                    losses.append(float(step_fn([(x, None)], step=step, generator=g).loss))
                    if (step + 1) % 100 == 0:
                        print(f"  {kind} SDTT round {r + 1}/{rounds} step {step + 1}/{steps_per_round} divergence "
                              f"{statistics.fmean(losses[-100:]):.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
                student.cpu(), current.cpu()
                _save_atomic({k: v.detach().clone() for k, v in student.state_dict().items()}, d / "model.safetensors")
                _write_json({"done": True, "recipe": recipe, "student_steps": steps, "trained_on": device,
                             "final_divergence_mean_100": statistics.fmean(losses[-100:]) if losses else None},
                            d / "meta.json")
            current = student.eval()
            out.append((steps, current))
        return out
    finally:
        torch.set_num_threads(threads)


def bound_excess(model, cfg, tb: Testbed, rows: int = 512, draws: int = 4, seed: int = 99) -> dict:
    """The model's NELBO on ``rows`` held-out rows (``draws`` noise draws each, fixed seeds) per token on all L
    positions, and its excess over the exact entropy per token (what the model's distance from the truth bounds)."""
    x = tb.sample(rows, seed=10_000_000 + seed)
    g = torch.Generator().manual_seed(seed)
    total, n = 0.0, 0.0
    with torch.no_grad():
        for _ in range(draws):
            for i in range(0, rows, 128):
                out = compute_loss(model.eval(), x[i:i + 128], None, cfg, train=False, generator=g)
                total, n = total + float(out.nll_sum), n + float(out.n_tokens)
    h = tb.entropy_per_token().mean
    return {"bound": total / n, "entropy": h, "excess": total / n - h}


@dataclass(frozen=True)
class Spec:
    """One setting of one method: ``model`` sampled with ``sampler`` at ``steps`` and ``opts``."""

    label: str
    method: str
    model: torch.nn.Module
    sampler: str
    steps: int
    opts: tuple[tuple[str, object], ...] = ()


def _spec(method: str, model, sampler: str, steps: int, **opts) -> Spec:
    shown = json.dumps(opts, sort_keys=True) if opts else ""
    return Spec(f"{method} T={steps} {shown}".strip(), method, model, sampler, steps, tuple(sorted(opts.items())))


def draw(spec: Spec, cfg, tb: Testbed, n: int, seed: int) -> tuple[torch.Tensor, float, dict]:
    """``n`` rows of the testbed's length (BOS and EOS given, nucleus off) at generator ``seed``: (rows, wall
    seconds, the sampler's stats). The ancestral sampler (baseline, paper-T, students, teacher) draws its final
    step (``final="draw"``: the chain's own last transition, not an argmax)."""
    L = tb.length
    tokens = torch.full((1, L), MASK_ID, dtype=torch.long)
    tokens[0, 0], tokens[0, -1] = BOS_ID, EOS_ID
    keep = tokens != MASK_ID
    g, stats = torch.Generator().manual_seed(seed), {}
    t0 = time.perf_counter()
    if spec.sampler == "mdlm":
        check_sample_args(cfg, n, L, spec.steps, 1.0, g)
        z, k = resolve_prefix((tokens, keep), n, L, cfg, torch.device("cpu"))
        with torch.no_grad():
            out = diffusion_sample(spec.model.eval(), cfg, z, k, steps=spec.steps, sampler="mdlm", nucleus_p=1.0,
                                   generator=g, progress=None, cache=True, stats=stats, final="draw")
    else:
        out = sample(spec.model, cfg, batch_size=n, length=L, steps=spec.steps, sampler=spec.sampler, nucleus_p=1.0,
                     generator=g, prefix=(tokens, keep), stats=stats, **dict(spec.opts))
    return out, time.perf_counter() - t0, stats


def run_set(specs: list[Spec], cfg, tb: Testbed, n: int, seeds: list[int], tag: str) -> list[dict]:
    """Every spec drawn at every seed, interleaved (seed ``r`` of every spec before seed ``r + 1`` of any): one
    point a spec with its wall times, calls, rows' exact ``log p`` (``None``: impossible) and unigram entropy."""
    points = [{"label": s.label, "method": s.method, "sampler": s.sampler, "steps": s.steps, "opts": dict(s.opts),
               "times": [], "calls": [], "row_logp": [], "entropy": [], "final_filled": 0} for s in specs]
    t_set = time.perf_counter()
    for r, seed in enumerate(seeds):
        for s, p in zip(specs, points, strict=True):
            rows, seconds, stats = draw(s, cfg, tb, n, seed)
            lp = tb.log_prob(rows)
            p["times"].append(seconds)
            p["calls"].append(int(stats.get("network_calls", 0)))
            p["row_logp"] += [float(v) if math.isfinite(v) else None for v in lp.tolist()]
            p["entropy"].append(statistics.fmean(unigram_entropy(row[1:-1]) for row in rows))
            p["final_filled"] += int(stats.get("final_filled", 0))
        print(f"  {tag}: seed {seed} ({r + 1}/{len(seeds)}) drawn by {len(specs)} setting(s), "
              f"{time.perf_counter() - t_set:.0f} s", flush=True)
    for p in points:
        p["entropy"] = statistics.fmean(p["entropy"])
        ok = [v for v in p["row_logp"] if v is not None]
        print(f"  {tag} {p['label']:72s} {statistics.median(p['times']):7.3f} s {max(p['calls']):5d} calls NLL "
              f"(possible rows) {-statistics.fmean(ok) / tb.length if ok else math.inf:.4f} impossible "
              f"{1 - len(ok) / len(p['row_logp']):.3f} entropy {p['entropy']:.3f}", flush=True)
    return points


def fast_specs(model, tb: Testbed) -> list[Spec]:
    """The threshold family's settings: threshold alone (one block, no cache), and with blocks and the dual or
    prefix approximate KV cache."""
    span = tb.length - 2
    blocks = [b for b in (span // 5, span // 3, span // 2) if b >= 2 and span % b == 0] or [span]
    out = [_spec("threshold", model, "confidence", 1, threshold=th) for th in (1.0, 0.95, 0.9, 0.8, 0.7, 0.5, 0.3)]
    for kv in ("dual", "prefix"):
        for th in (0.9, 0.7, 0.5):
            for b in blocks:
                for r in (2, 4) if kv == "dual" else (4,):
                    out.append(_spec(kv, model, "confidence", 1, threshold=th, block=b, refresh=r, kv_cache=kv))
    return out


def _default_plot(args: argparse.Namespace) -> Path:
    """``--plot``'s default: beside the record (``--record``), else in the work directory (never a tracked file)."""
    if args.record is None:
        return Path(args.workdir) / "fast_sampling_frontier.png"
    stem = f"{time.strftime('%Y-%m-%d', time.gmtime())}_{machine_slug()}_fast_sampling_frontier"
    path, k = Path(args.record) / f"{stem}.png", 2
    while path.exists() or path.with_suffix(".json").exists():
        path, k = Path(args.record) / f"{stem}-{k}.png", k + 1
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=32, help="testbed row length L (BOS, EOS included; default 32)")
    p.add_argument("--train-steps", type=int, default=18000, help="default 18000 (hours on a CPU: resumable; "
                   "benchmarks/gpu_fast_sampling.sh trains on a GPU)")
    p.add_argument("--presets", default="natural,anchored", help="testbed presets (default natural,anchored)")
    p.add_argument("--natural", action="append", default=[], metavar="KEY=VALUE",
                   help="a field of the natural preset (adlm_model.testbed.language.TestbedConfig), e.g. n_words=128")
    p.add_argument("--seed", type=int, default=0, help="training seed (weights, noise); the data rows are fixed")
    p.add_argument("--hidden", type=int, default=128, help="the models' width (default 128; part of the cache key)")
    p.add_argument("--blocks", type=int, default=2,
                   help="the models' transformer blocks (default 2; ADLM's denoiser gets half, at least one)")
    p.add_argument("--batch", type=int, default=256, help="training rows a step (default 256; part of the cache "
                   "key; on a GPU a step of these models costs about the same at 256 rows as at 32)")
    p.add_argument("--checkpoint-every", type=int, default=200, help="training steps between checkpoints")
    p.add_argument("--loader-workers", type=int, default=0,
                   help="processes drawing the training rows ahead (default 0: in the loop; the same rows either way)")
    p.add_argument("--max-excess", type=float, default=MAX_EXCESS,
                   help="nats/token: farther from the truth, a model gets no speedup (default 0.3)")
    p.add_argument("--max-samples-excess", type=float, default=None, help="nats/token: also refuse a model whose "
                   "baseline samples at T = L are farther from the entropy (default: printed, not gated)")
    p.add_argument("--sweep-far-models", action="store_true",
                   help="time every method even on a model too far from the truth (still no speedup printed)")
    p.add_argument("--samples", type=int, default=128, help="rows per sampling batch (default 128)")
    p.add_argument("--repeats", type=int, default=3,
                   help="batches per setting on the selection set, each at its own seed (default 3)")
    p.add_argument("--measure-repeats", type=int, default=5,
                   help="batches per chosen setting on the measurement set, fresh seeds (default 5)")
    p.add_argument("--kinds", default="mdlm,adlm")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared, loaded CPU two threads spin-wait for each other)")
    p.add_argument("--skip-paper-t", action="store_true",
                   help="do not time the paper profile's T (slow on a CPU; no ..._vs_paper_T line then)")
    p.add_argument("--workdir", default="work/fast_sampling", help="where the trained models are kept (reused)")
    p.add_argument("--plot", default=None, help="the frontier plot (its points: the same name, .json); default: "
                   "beside the record with --record, else in --workdir")
    p.add_argument("--tracking-uri", default=None, help="MLflow store (default: the workdir's; skipped if none)")
    p.add_argument("--no-tracking", action="store_true", help="do not log to MLflow (the JSON and plot are written)")
    p.add_argument("--distill-rounds", type=int, default=4,
                   help="SDTT rounds from T0 = L (each halves the steps: 16, 8, 4, 2 at L = 32; 0: none)")
    p.add_argument("--distill-steps", type=int, default=300, help="training steps per SDTT round")
    p.add_argument("--distill-presets", default="natural", help="presets whose models are distilled")
    p.add_argument("--train-device", default="cpu",
                   help="where the models train and distil (e.g. cuda; default cpu); sampling is always timed on the "
                        "CPU, so a GPU-trained --workdir is carried back and read by a CPU run of the same flags")
    p.add_argument("--train-only", action="store_true",
                   help="train each model, print its distance from the truth, distil the ones whose bound is within "
                        "--max-excess, and stop: no timing (a GPU machine's part of the run)")
    add_argument(p)
    args = p.parse_args(argv)
    if args.train_device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", args.train_device):
        p.error(f"--train-device {args.train_device!r}: use cpu or cuda[:N]")
    if args.train_device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--train-device cuda: this machine has no CUDA device; train on the CPU (the default)")
    if args.batch < 1:
        p.error(f"--batch {args.batch}: train on at least one row a step")
    if args.max_excess <= 0 or (args.max_samples_excess is not None and args.max_samples_excess <= 0):
        p.error("--max-excess / --max-samples-excess: a distance gate must be a positive number of nats/token")
    if args.hidden < 8 or args.hidden % 8 or args.blocks < 1:
        p.error(f"--hidden {args.hidden} --blocks {args.blocks}: the width must be a multiple of 8 (4 heads, and half "
                "of it the time conditioning) and the depth at least 1")
    if args.samples < 1 or args.repeats < 2 or args.measure_repeats < 2:
        p.error(f"--samples {args.samples} --repeats {args.repeats} --measure-repeats {args.measure_repeats}: draw at "
                "least one row a batch and two batches a setting (a speedup's interval resamples the batches)")
    torch.set_num_threads(args.threads)
    plot_path = Path(args.plot) if args.plot else _default_plot(args)
    with recording("fast_sampling", args.record) as rec:
        code = _run(args, plot_path, rec)
    return code


def _gate(args: argparse.Namespace, name: str, b: dict, base_nll: float, all_impossible: bool,
          h: float) -> str | None:
    """Why ``name`` is too far from the truth for a speedup read on it to mean anything, or None."""
    far = []
    if b["excess"] > args.max_excess:
        far.append(f"its bound is {b['excess']:.3f} nats/token above the exact entropy")
    if all_impossible:
        far.append("its baseline samples at T = L are all impossible under the language")
    elif args.max_samples_excess is not None and abs(base_nll - h) > args.max_samples_excess:
        far.append(f"its baseline samples at T = L score {base_nll - h:+.3f} nats/token from the exact entropy "
                   f"(--max-samples-excess {args.max_samples_excess})")
    if not far:
        return None
    return (f"{name} is farther from the truth than {args.max_excess} nats/token ({'; '.join(far)}): a speedup read "
            "on it is not a speedup of a sampler anyone uses; train it longer (--train-steps)")


def _run(args: argparse.Namespace, plot_path: Path, rec: Recording) -> int:
    models: dict[str, dict] = {}
    sel_seeds = [SELECTION_SEED + r for r in range(args.repeats)]
    meas_seeds = [MEASUREMENT_SEED + r for r in range(args.measure_repeats)]
    for preset_name in args.presets.split(","):
        overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.natural)}
        tcfg = TestbedConfig.natural(**{**overrides, "length": args.length}) if preset_name == "natural" else \
            TestbedConfig(length=args.length, preset=preset_name).validate()
        tb = Testbed(tcfg)
        h, L = tb.entropy_per_token().mean, tb.length
        penalty = tb.floors()["unigram"]
        truth = tb.log_prob(tb.sample(args.samples * args.measure_repeats, seed=TRUTH_SEED))
        truth_nll = float(-truth.mean() / L)
        print(f"testbed {preset_name} L={L}, vocabulary {tb.vocab_size}, exact entropy {h:.4f} nats/token (the "
              f"language's own rows: {truth_nll:.4f}), impossible rows scored at the unigram floor {penalty:.4f}; "
              f"{args.samples} samples a batch, nucleus off, {torch.get_num_threads()} threads", flush=True)
        for kind in args.kinds.split(","):
            name = kind if preset_name == "natural" else f"{kind}_{preset_name}"
            model, cfg, meta = train(kind, tb, args.train_steps, Path(args.workdir), seed=args.seed,
                                     checkpoint_every=args.checkpoint_every, device=args.train_device,
                                     hidden=args.hidden, blocks=args.blocks, batch=args.batch,
                                     loader_workers=args.loader_workers)
            b = bound_excess(model, cfg, tb)
            print(f"  {name}: bound {b['bound']:.4f} nats/token, excess over the exact entropy {b['excess']:.4f}",
                  flush=True)
            distill_here = args.distill_rounds and preset_name in args.distill_presets.split(",")
            if args.train_only:
                if distill_here and b["excess"] <= args.max_excess:
                    distill(kind, model, cfg, tb, Path(args.workdir), meta["key"], rounds=args.distill_rounds,
                            steps_per_round=args.distill_steps, seed=args.seed, device=args.train_device)
                models[name] = {"distance": {"bound": b["bound"], "bound_excess": b["excess"], "entropy": h}}
                continue
            base_spec = _spec("baseline", model, "mdlm", L)
            gate_pts = run_set([base_spec], cfg, tb, args.samples, sel_seeds, f"{name} gate")
            nll = row_nll(gate_pts[0]["row_logp"], L, penalty)
            all_impossible = all(v is None for v in gate_pts[0]["row_logp"])
            reason = _gate(args, name, b, float(nll.mean()), all_impossible, h)
            entry = {"preset": preset_name, "kind": kind, "length": L, "penalty": penalty, "entropy": h,
                     "truth_nll": truth_nll, "refused": reason,
                     "distance": {"bound": b["bound"], "bound_excess": b["excess"], "entropy": h,
                                  "sample_excess": float(nll.mean()) - h},
                     "gate": {"seeds": sel_seeds, "points": gate_pts}}
            models[name] = entry
            if reason and not args.sweep_far_models:
                print(f"  {name}: refused by the distance gate; nothing else is timed", flush=True)
                continue
            specs = [base_spec, *fast_specs(model, tb)]
            if distill_here and not reason:
                students = distill(kind, model, cfg, tb, Path(args.workdir), meta["key"], rounds=args.distill_rounds,
                                   steps_per_round=args.distill_steps, seed=args.seed, device=args.train_device)
                for steps, student in students:  # the student at its steps, and the teacher at the same steps
                    specs += [_spec("distilled", student, "mdlm", steps), _spec("teacher", model, "mdlm", steps)]
            sel_pts = run_set(specs, cfg, tb, args.samples, sel_seeds, f"{name} selection")
            choice = choose(sel_pts, summarize(sel_pts, L, penalty))
            entry.update(selection={"seeds": sel_seeds, "points": sel_pts}, choice=choice)
            if reason:
                continue
            by_label = {s.label: s for s in specs}
            chosen = [by_label[lab] for lab in dict.fromkeys([*choice["per_method"].values(), choice["distilled"]])
                      if lab is not None]
            if choice["distilled"] is not None:  # the control: the teacher itself at the student's steps
                chosen.append(_spec("teacher", model, "mdlm", by_label[choice["distilled"]].steps))
            if not args.skip_paper_t:
                chosen.append(_spec("paper-T", model, "mdlm", PAPER_T[kind]))
            meas_pts = run_set([base_spec, *chosen], cfg, tb, args.samples, meas_seeds, f"{name} measurement")
            entry["measurement"] = {"seeds": meas_seeds, "points": meas_pts}
    if args.train_only:
        print(json.dumps({"distance": {k: v["distance"] for k, v in models.items()}}, indent=1))
        return 0
    doc = {"format": 2, "definitions": definitions(), "args": {k: v for k, v in vars(args).items()},
           "models": models}
    out_json = plot_path.with_suffix(".json")
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(doc, indent=None, separators=(",", ":")))
    rec.add_raw(out_json)
    plotted = any("selection" in m for m in models.values())  # a model refused at the gate has no points
    if plotted:
        plot(doc, plot_path)
        rec.add_raw(plot_path)
    said: list[tuple[str, list]] = [(name, figures(name, m)) for name, m in models.items()]
    if not args.no_tracking:
        _log_mlflow(args, doc, said, [out_json, *([plot_path] if plotted else [])])
    report(models, said, rec)
    print(f"frontier: {out_json}" + (f" and {plot_path}" if plotted else ""), flush=True)
    return 0


def report(models: dict[str, dict], said: list[tuple[str, list]], rec: Recording) -> None:
    """Print each model's distance from the truth and its figures (``figures``' items: RESULT lines through
    ``_util.result``, the rest as lines), noting the lines in the record."""
    for name, items in said:
        dist = models[name]["distance"]
        line = (f"{name}: bound excess {dist['bound_excess']:.4f}, baseline samples' excess "
                f"{dist['sample_excess']:+.4f} nats/token (gate set)")
        print(line, flush=True)
        rec.note(f"- {line}")
        for item in items:
            if item[0] == "RESULT":
                result(item[1], item[2])
            else:
                print(item[1], flush=True)
                rec.note(f"- {item[1]}")


def _log_mlflow(args: argparse.Namespace, doc: dict, said: list, files: list[Path]) -> None:
    try:
        import mlflow

        from pipelines.tracking.runs import resolve_tracking_uri

        mlflow.set_tracking_uri(args.tracking_uri or resolve_tracking_uri(None))
        mlflow.set_experiment("adlm-fast-sampling")
        with mlflow.start_run(run_name="fast-sampling-frontier"):
            mlflow.log_params(vars(args))  # every flag: batch, network and gates included, not a hand-kept subset
            for name, m in doc["models"].items():
                mlflow.log_metrics({f"{k}_{name}": m["distance"][k] for k in ("bound_excess", "sample_excess")})
            mlflow.log_metrics({item[1]: item[2] for _, items in said for item in items if item[0] == "RESULT"})
            for f in files:
                mlflow.log_artifact(str(f))
    except Exception as e:  # noqa: BLE001 - the figures are printed and written anyway
        print(f"(MLflow logging skipped: {e})")


if __name__ == "__main__":
    sys.exit(main())
