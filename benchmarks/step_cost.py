"""Training step cost of ADLM, MDLM and AR, run by hand.

Forward+backward time per step at the ``tiny`` and ``small`` configs (L = 128 on CPU), tokens/s,
analytical FLOPs per token, and two goals measured in this one run:

- ``adlm_step_ratio_over_flop_ratio``: (ADLM step time / MDLM step time) / (ADLM FLOPs / MDLM FLOPs)
  at ``small``. ADLM costs more by construction (6 extra blocks, and the anchor output projection
  plus the denoiser's dense input are two vocabulary-sized matmuls); the goal (<= 1.05) is that it
  executes as efficiently as MDLM.
- ``cpu_flop_utilisation``: achieved training FLOP/s of ADLM ``small`` over this machine's fp32
  matmul FLOP/s (goal >= 0.5).

With ``--device cuda`` it runs ``small`` at L = 1024 in bf16 and reports MFU against ``--peak-tflops``.

    python benchmarks/step_cost.py [--batch 2] [--repeats 3] [--sizes tiny,small]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import add_argument, recording
from _util import matmul_flops, median_time, result

from adlm_model import build_model, compute_loss, preset
from adlm_model.config import ModelConfig
from pipelines.training.config import OptimSection
from pipelines.training.optim import build_optimizer


def forward_macs_per_token(cfg: ModelConfig) -> float:
    """Multiply-adds per token of one forward pass (matmuls and attention; elementwise ops ignored)."""
    h, L, w = cfg.hidden, cfg.seq_len, cfg.width
    block = 12 * h * h + 2 * L * h  # qkv 3h^2, out h^2, MLP 8h^2; QK^T and AV
    macs = cfg.n_blocks * block + h * w  # blocks + output projection (the embedding is a lookup)
    if cfg.kind == "adlm":
        macs += w * h + cfg.denoiser_blocks * block + h * w  # dense input, denoiser blocks, its output
    return float(macs)


def train_flops_per_token(cfg: ModelConfig) -> float:
    return 3 * 2 * forward_macs_per_token(cfg)  # forward + backward (2x), 2 FLOPs per multiply-add


def step_time(cfg: ModelConfig, batch: int, repeats: int, device: str, bf16: bool) -> float:
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    opt = build_optimizer(model.parameters(), OptimSection())  # pipelines.train's AdamW, reference settings
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device)
    g = torch.Generator(device=device).manual_seed(0)

    def step() -> None:
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
            out = compute_loss(model, x, None, cfg, step=10, generator=g)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()

    return median_time(step, repeats=repeats, warmup=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per model (median reported)")
    ap.add_argument("--sizes", default="tiny,small", help="comma-separated presets to time")
    ap.add_argument("--seq-len", type=int, default=None, help="sequence length (default 128 on CPU, 1024 on CUDA)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="GPU bf16 dense peak for MFU (H100 SXM: 989)")
    add_argument(ap)
    args = ap.parse_args()
    with recording("step_cost", args.record):
        measure(args)


def measure(args: argparse.Namespace) -> None:
    cuda = args.device == "cuda"
    seq_len = args.seq_len or (1024 if cuda else 128)
    print(f"device={args.device} batch={args.batch} L={seq_len} threads={torch.get_num_threads()}")
    peak = args.peak_tflops * 1e12 if cuda else matmul_flops()
    print(f"{'measured fp32 matmul' if not cuda else 'assumed bf16 peak'}: {peak / 1e9:.1f} GFLOP/s")
    times: dict[tuple[str, str], float] = {}
    flops: dict[tuple[str, str], float] = {}
    for size in args.sizes.split(","):
        for kind in ("mdlm", "adlm", "ar"):
            cfg = preset(size, kind=kind, seq_len=seq_len, dropout=0.0)
            t = step_time(cfg, args.batch, args.repeats, args.device, bf16=cuda)
            tokens = args.batch * seq_len
            f = train_flops_per_token(cfg)
            times[size, kind], flops[size, kind] = t, f
            print(f"{size:6s} {kind:5s} step {t * 1e3:9.1f} ms  {tokens / t:9.0f} tok/s  "
                  f"{f / 1e6:8.1f} MFLOP/token  {f * tokens / t / 1e9:7.1f} GFLOP/s")
    ref = "small" if "small" in args.sizes.split(",") else args.sizes.split(",")[0]
    flop_ratio = flops[ref, "adlm"] / flops[ref, "mdlm"]
    time_ratio = times[ref, "adlm"] / times[ref, "mdlm"]
    print(f"{ref}: ADLM/MDLM FLOP ratio {flop_ratio:.3f}, step-time ratio {time_ratio:.3f}")
    result("adlm_over_mdlm_flop_ratio", flop_ratio)
    result("adlm_step_ratio_over_flop_ratio", time_ratio / flop_ratio)
    achieved = flops[ref, "adlm"] * args.batch * seq_len / times[ref, "adlm"]
    result("gpu_mfu" if cuda else "cpu_flop_utilisation", achieved / peak)


if __name__ == "__main__":
    main()
