"""Training step cost of ADLM, MDLM, AR and A2R, run by hand.

The pipeline's own optimiser step (``adlm_model.train.train_step.TrainStep``: the noise drawn from a generator, the
objective, backward, clipping, AdamW, the learning-rate schedule and the EMA, built from the recipe's defaults;
compiled where ``scaling.compile`` says, bf16 autocast on CUDA) at the ``tiny`` and ``small`` configs (L = 128 on
CPU): step time, tokens/s, analytical FLOPs per token. The kinds are interleaved: each of ``--repeats`` rounds
times one step of every configuration in turn, so a change of the load hits them all, and every figure is the
median over the rounds with its spread (the range over the median). Two goals, measured in this one run:

- ``adlm_step_ratio_over_flop_ratio``: (ADLM step time / MDLM step time) / (ADLM FLOPs / MDLM FLOPs) at
  ``small``, the time ratio the median of the rounds' paired ratios (``adlm_step_ratio_spread``: their range over
  their median). ADLM costs more by construction (6 extra blocks, and the anchor output projection plus the
  denoiser's dense input are two vocabulary-sized matmuls); the goal (<= 1.05) is that it executes as efficiently
  as MDLM.
- ``a2r_step_ratio_over_flop_ratio``: the same reading of A2R against AR (``a2r_step_ratio_spread``): A2R runs a
  causal anchor of ``n_blocks`` and an AR model of ``denoiser_blocks`` with the anchor's output layer and the
  projection between them, two vocabulary-sized matmuls; the goal (<= 1.05) is that it executes as efficiently as
  AR.
- ``cpu_flop_utilisation``: achieved training FLOP/s of ADLM ``small`` over this machine's fp32 matmul FLOP/s
  (goal >= 0.5).

A configuration's network, optimiser and EMA stay in memory between rounds when all of them fit (a GPU); else each
round builds them again from the same seed and warms them up (``small`` ADLM with AdamW and its EMA is about 6 GB).

With ``--device cuda`` it runs ``small`` at L = 1024 in bf16 and reports MFU against ``--peak-tflops``.

    python benchmarks/step_cost.py [--batch 2] [--repeats 5] [--sizes tiny,small] [--compile auto|on|off]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import add_argument, recording
from _util import matmul_flops, result

from adlm_model import EMA, build_model, preset
from adlm_model.config import ModelConfig
from adlm_model.kinds import model_kind, parameter_count
from adlm_model.train.train_step import Objective, TrainStep
from pipelines.training.config import TrainConfig
from pipelines.training.optim import build_optimizer, build_schedule

KINDS = ("mdlm", "adlm", "ar", "a2r")
BYTES_PER_PARAMETER = 4 * 5 * 1.5
"""float32 weights, gradients, AdamW's two moments and the EMA, and half as much again for the activations."""


def forward_macs_per_token(cfg: ModelConfig) -> float:
    """Multiply-adds per token of one forward pass (matmuls and attention; elementwise ops ignored)."""
    h, L, w = cfg.hidden, cfg.seq_len, cfg.width
    block = 12 * h * h + 2 * L * h  # qkv 3h^2, out h^2, MLP 8h^2; QK^T and AV
    macs = cfg.n_blocks * block + h * w  # blocks + output projection (the embedding is a lookup)
    if model_kind(cfg.kind).anchored:  # ADLM's denoiser, A2R's AR model: dense input, its blocks, its output
        macs += w * h + cfg.denoiser_blocks * block + h * w
    return float(macs)


def train_flops_per_token(cfg: ModelConfig) -> float:
    return 3 * 2 * forward_macs_per_token(cfg)  # forward + backward (2x), 2 FLOPs per multiply-add


class Stepper:
    """One configuration stepped by ``TrainStep`` as ``pipelines.train`` builds it (the recipe's default optimiser,
    schedule, clipping and EMA), warmed up (the first step allocates the optimiser's state, and compiles)."""

    def __init__(self, cfg: ModelConfig, batch: int, device: str, train: TrainConfig) -> None:
        torch.manual_seed(0)
        self.device = device
        model = build_model(cfg).to(device)
        o = train.optim
        opt = build_optimizer(model.parameters(), o)
        self.step_fn = TrainStep(Objective(model, cfg), model, opt, sched=build_schedule(opt, o, train.run.max_steps),
                                 ema=EMA(model, train.ema, warmup=train.ema_warmup), clip=o.clip,
                                 autocast=torch.bfloat16 if device == "cuda" else None,
                                 compile=train.compiles(device))
        self.x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device)
        self.x[self.x == cfg.mask_id] = 0
        self.gen = torch.Generator(device=device).manual_seed(0)
        self.n = 0
        self.step()

    def step(self) -> None:
        self.step_fn([(self.x, None)], step=self.n, generator=self.gen)
        self.n += 1
        if self.device == "cuda":
            torch.cuda.synchronize()

    def timed_step(self) -> float:
        t0 = time.perf_counter()
        self.step()
        return time.perf_counter() - t0


def available_bytes(device: str) -> float:
    """Memory free for the benchmark's models: the GPU's free memory, or the host's MemAvailable (0 if unknown)."""
    if device == "cuda":
        return float(torch.cuda.mem_get_info()[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def interleaved_times(cfgs: dict[tuple[str, str], ModelConfig], batch: int, repeats: int, device: str,
                      train: TrainConfig) -> dict[tuple[str, str], list[float]]:
    """Step times of every configuration, one per round, the configurations in turn within each round."""
    need = sum(parameter_count(c) for c in cfgs.values()) * BYTES_PER_PARAMETER
    keep = need < 0.8 * available_bytes(device)
    print(f"{'keeping every configuration in memory' if keep else 'rebuilding each configuration every round'} "
          f"(about {need / 2**30:.1f} GiB for all of them)", flush=True)
    kept: dict[tuple[str, str], Stepper] = {}
    times: dict[tuple[str, str], list[float]] = {k: [] for k in cfgs}
    for r in range(repeats):
        for key, cfg in cfgs.items():
            st = kept.get(key) or Stepper(cfg, batch, device, train)
            times[key].append(st.timed_step())
            if keep:
                kept[key] = st
            del st
        print(f"round {r + 1}/{repeats}: " + ", ".join(f"{s} {k} {v[-1] * 1e3:.0f} ms" for (s, k), v in times.items()),
              flush=True)
    return times


def spread(values: list[float]) -> float:
    """The range over the median."""
    return (max(values) - min(values)) / statistics.median(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds, one timed step of every configuration each "
                                                           "(medians reported; default 5)")
    ap.add_argument("--sizes", default="tiny,small", help="comma-separated presets to time")
    ap.add_argument("--seq-len", type=int, default=None, help="sequence length (default 128 on CPU, 1024 on CUDA)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                    help="scaling.compile of the step (default auto: compiled on CUDA, eager on a CPU)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="GPU bf16 dense peak for MFU (H100 SXM: 989)")
    add_argument(ap)
    args = ap.parse_args()
    if args.repeats < 1 or args.batch < 1:
        ap.error("--repeats and --batch must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible; use --device cpu")
    with recording("step_cost", args.record):
        measure(args)


def measure(args: argparse.Namespace) -> None:
    cuda = args.device == "cuda"
    seq_len = args.seq_len or (1024 if cuda else 128)
    train = TrainConfig.from_dict({"scaling": {"compile": args.compile}})
    print(f"device={args.device} batch={args.batch} L={seq_len} threads={torch.get_num_threads()} "
          f"compiled={train.compiles(args.device)} rounds={args.repeats}")
    peak = args.peak_tflops * 1e12 if cuda else matmul_flops()
    print(f"{'measured fp32 matmul' if not cuda else 'assumed bf16 peak'}: {peak / 1e9:.1f} GFLOP/s")
    sizes = args.sizes.split(",")
    cfgs = {(size, kind): preset(size, kind=kind, seq_len=seq_len, dropout=0.0) for size in sizes for kind in KINDS}
    times = interleaved_times(cfgs, args.batch, args.repeats, args.device, train)
    tokens = args.batch * seq_len
    flops = {key: train_flops_per_token(cfg) for key, cfg in cfgs.items()}
    for (size, kind), ts in times.items():
        t, f = statistics.median(ts), flops[size, kind]
        print(f"{size:6s} {kind:5s} step {t * 1e3:9.1f} ms (spread {spread(ts):5.1%})  {tokens / t:9.0f} tok/s  "
              f"{f / 1e6:8.1f} MFLOP/token  {f * tokens / t / 1e9:7.1f} GFLOP/s")
    ref = "small" if "small" in sizes else sizes[0]
    flop_ratio = flops[ref, "adlm"] / flops[ref, "mdlm"]
    paired = [a / m for a, m in zip(times[ref, "adlm"], times[ref, "mdlm"], strict=True)]
    time_ratio = statistics.median(paired)
    print(f"{ref}: ADLM/MDLM FLOP ratio {flop_ratio:.3f}, step-time ratio {time_ratio:.3f} (median of the rounds; "
          f"{', '.join(f'{p:.3f}' for p in paired)})")
    result("adlm_over_mdlm_flop_ratio", flop_ratio)
    result("adlm_step_ratio_over_flop_ratio", time_ratio / flop_ratio)
    result("adlm_step_ratio_spread", spread(paired))
    a2r_flops = flops[ref, "a2r"] / flops[ref, "ar"]
    a2r_paired = [a / m for a, m in zip(times[ref, "a2r"], times[ref, "ar"], strict=True)]
    print(f"{ref}: A2R/AR FLOP ratio {a2r_flops:.3f}, step-time ratio {statistics.median(a2r_paired):.3f} (median of "
          f"the rounds; {', '.join(f'{p:.3f}' for p in a2r_paired)})")
    result("a2r_over_ar_flop_ratio", a2r_flops)
    result("a2r_step_ratio_over_flop_ratio", statistics.median(a2r_paired) / a2r_flops)
    result("a2r_step_ratio_spread", spread(a2r_paired))
    achieved = flops[ref, "adlm"] * tokens / statistics.median(times[ref, "adlm"])
    result("gpu_mfu" if cuda else "cpu_flop_utilisation", achieved / peak)


if __name__ == "__main__":
    main()
