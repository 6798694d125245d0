"""Network-size and batch pilots for the fast-sampling benchmark's natural-preset models (benchmarks/preregistrations/).

The fast-sampling benchmark's recipe (benchmarks/fast_sampling.py: the same batches, loss generator, AdamW, clip, 20
warm-up steps) at a constant peak lr, like the earlier lr pilots, for one network size; every ``--every`` steps the
bound's excess over the exact entropy (256 held-out rows, 4 noise draws) and the exact sampler's samples at T = L
(128 rows, seed 7, nucleus off): their true NLL excess and impossible-row share, the two halves of the 0.3 gate.

    python benchmarks/runs/2026-11-27_cpu_network_pilot/pilot.py --hidden 256 --blocks 4 --steps 3000
    python benchmarks/runs/2026-11-27_cpu_network_pilot/pilot.py --batch 128 --steps 2000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _testbed_rows import step_rows
from fast_sampling import LR, _adamw_step, bound_excess, measure, network_config

from adlm_model import build_model, compute_loss
from adlm_model.testbed import Testbed, TestbedConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", default="mdlm")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=32, help="rows a step (the benchmark's 32)")
    p.add_argument("--every", type=int, default=500)
    p.add_argument("--samples-every", type=int, default=1000)
    p.add_argument("--lr", type=float, default=LR)
    args = p.parse_args()
    torch.set_num_threads(1)
    tb = Testbed(TestbedConfig.natural(length=32))
    h = tb.entropy_per_token().mean
    cfg = network_config(args.kind, tb, args.hidden, args.blocks)
    torch.manual_seed(0)
    model = build_model(cfg)
    print(f"{args.kind} hidden {args.hidden} blocks {args.blocks} batch {args.batch}: "
          f"{sum(q.numel() for q in model.parameters()):,} parameters; exact entropy {h:.4f}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    losses = []
    for step, x in enumerate(step_rows(tb, args.batch, 0, args.steps)):
        model.train()
        losses.append(_adamw_step(model, opt, compute_loss(model, x, None, cfg, step=step, train=True,
                                                          generator=g).loss, step, args.lr))
        if (step + 1) % args.every == 0:
            model.eval()
            with torch.no_grad():
                b = bound_excess(model, cfg, tb, rows=256)
                line = f"step {step + 1} loss {sum(losses[-100:]) / 100:.3f} excess {b['excess']:.3f}"
                if (step + 1) % args.samples_every == 0:
                    s = measure(model, cfg, tb, 128, 1, "mdlm", tb.length)
                    line += f" samples {s['nll'] - h:+.3f} impossible {s['impossible']:.3f}"
            print(f"{line} {time.perf_counter() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
