"""Fast sampling measured against the truth (issues 29, 36): speed vs true NLL on the ground-truth testbed.

Trains (or reuses, from ``--workdir``) a small MDLM and a small ADLM on each testbed preset (``adlm_model.testbed``:
synthetic languages whose ``log p(row)`` is exact; ``natural``, calibrated to natural text's confidence, and
``anchored``), then samples ``--samples`` rows of the testbed's length (BOS
and EOS given, the ``L - 2`` positions between generated; nucleus off, so the samplers' own error is measured)
with, in one run, at the same length and batch:

- the **baseline**: the kind's MDLM-style ancestral sampler (``mdlm``) with its exact cache, ``T = L`` steps;
  also the same at the paper profile's ``T`` (1024 for MDLM, 4096 for ADLM);
- **threshold**: confidence-threshold parallel decoding, one block, no cache, swept over the threshold;
- **dual** / **prefix**: the same with semi-autoregressive blocks and the approximate KV cache, swept over
  threshold, block and refresh.

For each: wall time (median of ``--repeats``), network calls, speedup over the baseline, the **true NLL per token**
of the samples (exact, from the testbed; rows the language cannot emit are counted apart as ``impossible``) and
their mean unigram entropy. Writes a speed-vs-quality frontier plot per kind (``--plot``, default
``benchmarks/fast_sampling_frontier.png``) and a JSON of every point, logs both to MLflow when a tracking store
is reachable, and prints ``RESULT fast_sampling_speedup_at_5pct_<kind>=<x>`` (natural preset; ``..._<kind>_anchored``
for the other): the largest speedup whose true-NLL increase over the baseline is at most 5% (and whose
impossible-row share is at most 5 points above it).

**Models close to the truth, reproducibly.** Training is seeded end to end: the initial weights
(``torch.manual_seed`` before the model is built; before issue 36 MDLM's came from the unseeded global RNG), every
batch (``Testbed.sample(seed=1000 + step)``), the loss's noise (its own generator) and the thread count (one
intra-op thread while training: reductions split over threads may round differently). A model is cached under
``--workdir`` by the hash of everything that determines it (kind, model config, testbed config, steps, batch,
learning-rate schedule, seed) as safetensors + JSON, with a checkpoint (weights, AdamW state, the loss generator's
state, the step) every ``--checkpoint-every`` steps: a killed run resumes where it stopped and ends with the same
weights. Before any speed is read, the model's **distance from the truth** is measured: its bound's excess over the
exact entropy (nats/token on all L positions, 512 held-out rows: issue 36's figure, the testbed study's measure)
and the true NLL excess of its exact sampler's samples at ``T = L``; a model whose bound is farther than
``--max-excess`` (0.3 nats/token, the testbed study's MDLM) gets no speedup printed, only the reason (train it
longer: ``--train-steps``). The samples' excess is printed beside each result; ``--max-samples-excess`` gates on it
too (off by default: README, issue 36). A model whose samples are all impossible is always refused.

    python benchmarks/fast_sampling.py [--train-steps 18000] [--batch 256] [--workdir work/fast_sampling]

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
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _frontier_plot import STEP_METHODS, plot
from _testbed_rows import step_rows
from _util import result

from adlm_model import build_model, compute_loss, preset, sample, unigram_entropy
from adlm_model.testbed import BOS_ID, EOS_ID, MASK_ID, Testbed, TestbedConfig

PAPER_T = {"mdlm": 1024, "adlm": 4096}
MAX_EXCESS = 0.3
"""Nats/token: the testbed study's MDLM (0.284 at 1,200 steps); a model farther from the truth gets no speedup."""
TRAIN_FORMAT = 3
"""Bumped when the training recipe below changes (part of the cache key). 3: peak ``LR``, a cosine to a tenth of it."""
LR, COSINE_FLOOR = 5e-4, 0.1  # 3e-3 (formats 1-2) held the natural preset's MDLM at the unigram level (README)


def _save_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def _write_json(obj: dict, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _adamw_step(model: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor, step: int, lr: float,
                horizon: int = 0) -> float:
    """One AdamW step: ``lr`` after 20 warm-up steps, then (given a ``horizon``) a cosine to ``COSINE_FLOOR * lr``."""
    f = COSINE_FLOOR  # (1 + f) / 2 and (1 - f) / 2 are exactly the 0.55 and 0.45 that format 3's models trained with
    decay = (1 + f) / 2 + (1 - f) / 2 * math.cos(math.pi * min(step / horizon, 1.0)) if horizon else 1.0
    for group in opt.param_groups:
        group["lr"] = lr * min(1.0, (step + 1) / 20) * decay
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


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
        model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        g = torch.Generator(device=device).manual_seed(seed)
        start, state_path = 0, d / "state.safetensors"
        info = json.loads((d / "state.json").read_text()) if (d / "state.json").is_file() else {}
        if info and info.get("device", "cpu") != device:  # a random stream does not carry across devices
            print(f"  {kind}: {d.name}'s checkpoint is from {info.get('device', 'cpu')}: starting over", flush=True)
            info = {}
        if state_path.is_file() and info:
            st = load_file(str(state_path))  # on the CPU: AdamW keeps its step counts there
            model.load_state_dict({k[6:]: v for k, v in st.items() if k.startswith("model.")})
            params = list(model.parameters())
            opt.state.clear()
            for i, p in enumerate(params):
                if f"opt.{i}.exp_avg" in st:
                    opt.state[p] = {"step": st[f"opt.{i}.step"], "exp_avg": st[f"opt.{i}.exp_avg"].to(device),
                                    "exp_avg_sq": st[f"opt.{i}.exp_avg_sq"].to(device)}
            g.set_state(st["generator"].cpu())
            start = int(info["step"])
            print(f"  {kind}: resuming {d.name} at step {start}/{steps}", flush=True)
        model.train()
        t0, losses = time.perf_counter(), []
        for step, rows in zip(range(start, steps), step_rows(tb, batch, start, steps, loader_workers), strict=True):
            x = rows.to(device)
            loss = compute_loss(model, x, None, cfg, step=step, train=True, generator=g).loss
            losses.append(_adamw_step(model, opt, loss, step, lr, horizon=steps))
            if (step + 1) % 100 == 0:
                print(f"  {kind} step {step + 1}/{steps} loss {statistics.fmean(losses[-100:]):.4f} (mean of the last "
                      f"100; {time.perf_counter() - t0:.0f} s)", flush=True)
            if (step + 1) % checkpoint_every == 0 and step + 1 < steps:
                st = {f"model.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
                for i, p in enumerate(model.parameters()):
                    if p in opt.state:
                        for name in ("step", "exp_avg", "exp_avg_sq"):
                            st[f"opt.{i}.{name}"] = torch.as_tensor(opt.state[p][name]).cpu().clone()
                st["generator"] = g.get_state()
                _save_atomic(st, state_path)
                _write_json({"step": step + 1, "device": device}, d / "state.json")
        model.cpu()
        _save_atomic({k: v.detach().clone() for k, v in model.state_dict().items()}, d / "model.safetensors")
        meta = {"done": True, "recipe": recipe, "key": key, "final_loss_mean_100": statistics.fmean(losses[-100:])
                if losses else None, "trained_on": device, "seconds": round(time.perf_counter() - t0, 1)}
        _write_json(meta, d / "meta.json")
        for f in (state_path, d / "state.json"):
            f.unlink(missing_ok=True)
        return model.eval(), cfg, meta
    finally:
        torch.set_num_threads(threads)


DISTILL_FORMAT = 1
"""Bumped when the distillation recipe below changes (part of each round's cache key)."""


def distill(kind: str, teacher: torch.nn.Module, cfg, tb: Testbed, workdir: Path, teacher_key: str, *, rounds: int,
            steps_per_round: int, lr: float = 1e-4, batch: int = 32, seed: int = 0,
            substeps: int = 2, device: str = "cpu") -> list[tuple[int, torch.nn.Module]]:
    """Self-distillation through time (``adlm_model.distill``, METHOD.md section 4) from ``teacher`` at ``T0 = L``
    sampling steps: round ``r``'s student starts from the weights of round ``r - 1``'s (the teacher's first) and
    learns to take in one step what that model takes in ``substeps`` steps of size ``dt_r``; it then becomes the
    teacher. For ADLM the composed network is the student (anchor network and denoiser both learn). Seeded end to
    end like ``train``; each round's student is cached by the hash of the chain of recipes that made it (a rerun
    skips the rounds done). Returns ``[(student's sampling steps, student)]``, one per round, on the CPU;
    ``device``: where the rounds train (as ``train``'s, not part of the key)."""
    from adlm_model.distill import round_dt, sdtt_objective, student_steps

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
                opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
                g = torch.Generator(device=device).manual_seed(seed * 1000 + r)
                t0, losses = time.perf_counter(), []
                for step in range(steps_per_round):
                    x = tb.sample(batch, seed=5_000_000 + r * steps_per_round + step).to(device)
                    loss = sdtt_objective(student, current, x, None, cfg, dt=round_dt(t0_steps, r, substeps),
                                          substeps=substeps, generator=g).loss
                    losses.append(_adamw_step(student, opt, loss, step, lr))
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


def measure(model, cfg, tb: Testbed, n: int, repeats: int, sampler: str, steps: int, **opts) -> dict:
    L = tb.length
    tokens = torch.full((1, L), MASK_ID, dtype=torch.long)
    tokens[0, 0], tokens[0, -1] = BOS_ID, EOS_ID
    keep = tokens != MASK_ID
    times, out, stats = [], None, {}
    for _ in range(repeats):
        stats = {}
        t0 = time.perf_counter()
        out = sample(model, cfg, batch_size=n, length=L, steps=steps, sampler=sampler, nucleus_p=1.0,
                     generator=torch.Generator().manual_seed(7), prefix=(tokens, keep), stats=stats, **opts)
        times.append(time.perf_counter() - t0)
    lp = tb.log_prob(out)
    ok = torch.isfinite(lp)
    nll = float((-lp[ok]).mean() / L) if bool(ok.any()) else float("inf")
    ent = statistics.fmean(unigram_entropy(r[1:-1]) for r in out)
    return {"sampler": sampler, "steps": steps, **opts, "seconds": statistics.median(times),
            "calls": int(stats.get("network_calls", 0)), "nll": nll, "impossible": float((~ok).float().mean()),
            "entropy": ent}


def sweep(kind: str, model, cfg, tb: Testbed, n: int, repeats: int, paper_t: bool = True,
          gate=None) -> list[dict]:
    """Every method's point; ``gate(baseline point)`` returning a reason stops after the baseline."""
    L = tb.length
    span = L - 2
    blocks = [b for b in (span // 5, span // 3, span // 2) if b >= 2 and span % b == 0] or [span]
    points = []

    def run(method: str, sampler: str, steps: int, **opts) -> None:
        p = {"method": method, **measure(model, cfg, tb, n, repeats, sampler, steps, **opts)}
        points.append(p)
        print(f"  {kind} {method:9s} {json.dumps(opts, sort_keys=True):58s} {p['seconds']:7.3f} s {p['calls']:5d} calls "
              f"NLL {p['nll']:.4f} impossible {p['impossible']:.3f} entropy {p['entropy']:.3f}", flush=True)

    run("baseline", "mdlm", L)
    reason = gate(points[0]) if gate is not None else None
    if reason:
        points[0].update(speedup=1.0, speedup_vs_paper_T=float("nan"), nll_increase=0.0, refused=reason)
        return points
    run("paper-T", "mdlm", PAPER_T[kind] if paper_t else L)
    for th in (1.0, 0.95, 0.9, 0.8, 0.7, 0.5, 0.3):
        run("threshold", "confidence", 1, threshold=th)
    for kv in ("dual", "prefix"):
        for th in (0.9, 0.7, 0.5):
            for b in blocks:
                for r in (2, 4) if kv == "dual" else (4,):
                    run(kv, "confidence", 1, threshold=th, block=b, refresh=r, kv_cache=kv)
    base = points[0]
    for p in points:
        p["speedup"] = base["seconds"] / p["seconds"]
        p["speedup_vs_paper_T"] = points[1]["seconds"] / p["seconds"]
        p["nll_increase"] = p["nll"] / base["nll"] - 1.0
    return points


def best_within(points: list[dict], tol: float = 0.05) -> float:
    base = points[0]
    ok = [p["speedup"] for p in points if p["method"] not in ("baseline", "paper-T", *STEP_METHODS)
          and p["nll_increase"] <= tol and p["impossible"] <= base["impossible"] + 0.05]
    return max(ok, default=float("nan"))


def distilled_within(points: list[dict], tol: float = 0.05) -> tuple[float, float]:
    """The fewest steps a distilled student needs to stay within ``tol`` of the teacher's true NLL at ``T = L``
    (and within 5 points of its impossible-row share), and that student's wall-time speedup; NaN if none does."""
    base = points[0]
    ok = [p for p in points if p["method"] == "distilled" and p["nll_increase"] <= tol
          and p["impossible"] <= base["impossible"] + 0.05]
    if not ok:
        return float("nan"), float("nan")
    best = min(ok, key=lambda p: p["steps"])
    return float(best["steps"]), best["speedup"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=32, help="testbed row length L (BOS, EOS included; default 32)")
    p.add_argument("--train-steps", type=int, default=18000, help="default 18000 (hours on a CPU: resumable; "
                   "benchmarks/gpu_fast_sampling.sh trains on a GPU)")
    p.add_argument("--presets", default="natural,anchored", help="testbed presets (default natural,anchored)")
    p.add_argument("--natural", action="append", default=[], metavar="KEY=VALUE",
                   help="a field of the natural preset (adlm_model.testbed.TestbedConfig), e.g. n_words=128")
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
                   "exact sampler's samples at T = L are farther from the entropy (default: printed, not gated)")
    p.add_argument("--sweep-far-models", action="store_true",
                   help="time every method even on a model too far from the truth (still no speedup printed)")
    p.add_argument("--samples", type=int, default=128, help="rows per sampling batch (default 128)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kinds", default="mdlm,adlm")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared, loaded CPU two threads spin-wait for each other)")
    p.add_argument("--skip-paper-t", action="store_true", help="do not time the paper profile's T (slow on a CPU)")
    p.add_argument("--workdir", default="work/fast_sampling", help="where the trained models are kept (reused)")
    p.add_argument("--plot", default=str(Path(__file__).with_name("fast_sampling_frontier.png")))
    p.add_argument("--tracking-uri", default=None, help="MLflow store (default: the workdir's; skipped if none)")
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
    torch.set_num_threads(args.threads)
    all_points: dict[str, list[dict]] = {}
    distance: dict[str, dict] = {}
    for preset_name in args.presets.split(","):
        overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.natural)}
        tcfg = TestbedConfig.natural(**{**overrides, "length": args.length}) if preset_name == "natural" else \
            TestbedConfig(length=args.length, preset=preset_name).validate()
        tb = Testbed(tcfg)
        h = tb.entropy_per_token().mean
        print(f"testbed {preset_name} L={tb.length}, vocabulary {tb.vocab_size}, exact entropy {h:.4f} nats/token; "
              f"{args.samples} samples a batch, nucleus off, {torch.get_num_threads()} threads", flush=True)
        for kind in args.kinds.split(","):
            name = kind if preset_name == "natural" else f"{kind}_{preset_name}"
            model, cfg, meta = train(kind, tb, args.train_steps, Path(args.workdir), seed=args.seed,
                                     checkpoint_every=args.checkpoint_every, device=args.train_device,
                                     hidden=args.hidden, blocks=args.blocks, batch=args.batch,
                                     loader_workers=args.loader_workers)
            b = bound_excess(model, cfg, tb)
            distance[name] = {"bound": b["bound"], "bound_excess": b["excess"], "entropy": h}
            print(f"  {name}: bound {b['bound']:.4f} nats/token, excess over the exact entropy {b['excess']:.4f}",
                  flush=True)
            if args.train_only:
                if args.distill_rounds and preset_name in args.distill_presets.split(",") \
                        and b["excess"] <= args.max_excess:
                    distill(kind, model, cfg, tb, Path(args.workdir), meta["key"], rounds=args.distill_rounds,
                            steps_per_round=args.distill_steps, seed=args.seed, device=args.train_device)
                continue

            def gate(base: dict, name: str = name, b: dict = b, h: float = h) -> str | None:
                distance[name]["sample_excess"] = base["nll"] - h
                distance[name]["impossible"] = base["impossible"]
                far = []
                if b["excess"] > args.max_excess:
                    far.append(f"its bound is {b['excess']:.3f} nats/token above the exact entropy")
                if not math.isfinite(base["nll"]):
                    far.append("its exact sampler's samples at T = L are all impossible under the language")
                elif args.max_samples_excess is not None and abs(base["nll"] - h) > args.max_samples_excess:
                    far.append(f"its exact sampler's samples at T = L score {base['nll'] - h:+.3f} nats/token "
                               f"from the exact entropy (--max-samples-excess {args.max_samples_excess})")
                if not far:
                    return None
                return (f"{name} is farther from the truth than {args.max_excess} nats/token ({'; '.join(far)}): "
                        "a speedup read on it is not a speedup of a sampler anyone uses; train it longer "
                        "(--train-steps)")

            all_points[name] = sweep(kind, model, cfg, tb, args.samples, args.repeats, paper_t=not args.skip_paper_t,
                                     gate=None if args.sweep_far_models else gate)
            if args.sweep_far_models and (reason := gate(all_points[name][0])):
                all_points[name][0]["refused"] = reason  # timed, but neither distilled nor given a speedup
            if args.distill_rounds and preset_name in args.distill_presets.split(",") \
                    and "refused" not in all_points[name][0]:
                students = distill(kind, model, cfg, tb, Path(args.workdir), meta["key"], rounds=args.distill_rounds,
                                   steps_per_round=args.distill_steps, seed=args.seed, device=args.train_device)
                base = all_points[name][0]
                for steps, student in students:  # the student at its steps, and the teacher at the same steps
                    for method, m in (("distilled", student), ("teacher", model)):
                        q = {"method": method, **measure(m, cfg, tb, args.samples, args.repeats, "mdlm", steps)}
                        q.update(speedup=base["seconds"] / q["seconds"], speedup_vs_paper_T=float("nan"),
                                 nll_increase=q["nll"] / base["nll"] - 1.0)
                        all_points[name].append(q)
                        print(f"  {kind} {method:9s} T={steps:<4d} {q['seconds']:7.3f} s {q['calls']:5d} calls NLL "
                              f"{q['nll']:.4f} ({100 * q['nll_increase']:+.1f}%) impossible {q['impossible']:.3f} "
                              f"entropy {q['entropy']:.3f}", flush=True)
            for q in all_points[name]:
                q["L"], q["preset"] = tb.length, preset_name
    if args.train_only:
        print(json.dumps({"distance": distance}, indent=1))
        return 0
    out_json = Path(args.plot).with_suffix(".json")
    out_json.write_text(json.dumps({"points": all_points, "distance": distance}, indent=1))
    plot(all_points, Path(args.plot))
    try:
        import mlflow

        from pipelines.tracking import resolve_tracking_uri

        mlflow.set_tracking_uri(args.tracking_uri or resolve_tracking_uri(None))
        mlflow.set_experiment("adlm-fast-sampling")
        with mlflow.start_run(run_name="fast-sampling-frontier"):
            mlflow.log_params(vars(args))  # every flag: batch, network and gates included, not a hand-kept subset
            for name, pts in all_points.items():
                mlflow.log_metrics({f"{k}_{name}": distance[name][k] for k in ("bound_excess", "sample_excess")})
                if "refused" not in pts[0]:
                    mlflow.log_metric(f"speedup_at_5pct_{name}", best_within(pts))
            mlflow.log_artifact(args.plot)
            mlflow.log_artifact(str(out_json))
    except Exception as e:  # noqa: BLE001 - the figures are printed and written anyway
        print(f"(MLflow logging skipped: {e})")
    for name, pts in all_points.items():
        base, dist = pts[0], distance[name]
        print(f"{name}: bound excess {dist['bound_excess']:.4f}, baseline NLL {base['nll']:.4f} nats/token "
              f"(excess {dist.get('sample_excess', float('nan')):+.4f}, impossible {base['impossible']:.3f}), "
              f"{base['calls']} calls, {base['seconds']:.3f} s")
        if "refused" in base:
            print(f"NO SPEEDUP for {name}: {base['refused']}", flush=True)
            continue
        result(f"fast_sampling_sample_excess_{name}", dist["sample_excess"])  # the gate's unenforced half, shown
        result(f"fast_sampling_speedup_at_5pct_{name}", best_within(pts))
        if any(q["method"] == "distilled" for q in pts):
            steps, speedup = distilled_within(pts)
            if steps != steps:
                print(f"MISS for {name}: no distilled student stays within 5% of the teacher's true NLL at T = L")
            result(f"distilled_steps_at_5pct_{name}", steps)
            result(f"distilled_speedup_at_5pct_{name}", speedup)
        ok = [q for q in pts if q["nll_increase"] <= 0.05 and q["method"] not in ("baseline", "paper-T")]
        result(f"fast_sampling_speedup_vs_paper_T_at_5pct_{name}",
               max((q["speedup_vs_paper_T"] for q in ok), default=float("nan")))
    return 0

if __name__ == "__main__":
    sys.exit(main())
