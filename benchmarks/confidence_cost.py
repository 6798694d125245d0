"""What one network call of the confidence sampler costs next to the exact sampler's.

At the same batch and length, with the fast-sampling benchmark's small architecture (untrained: the cost does
not depend on the weights, and threshold 1 makes every row take one token a call, so no row finishes early),
times interleaved runs of

- ``mdlm`` at ``T = L`` with its exact row cache (the benchmark's baseline: a call computes only the rows
  that changed since their last call, about 63% of the batch at ``T = L``), and without it (every row);
- ``confidence`` at threshold 1 (``L - 2`` calls, all rows live until the end).

and prints, per kind and length, seconds per call and per row pass (a row through the network once) for each,
and ``RESULT confidence_per_call_ratio_<kind>_L<L>`` (confidence / cached mdlm, per call),
``..._uncached_...`` (against mdlm without its cache: the same rows a call) and
``RESULT confidence_per_row_ratio_<kind>_L<L>`` (per row pass: the sampler's own overhead, what it can change).
The ratios are of **CPU time** of this process (``time.process_time``), which a machine shared with other work
disturbs far less than wall time; wall times are printed beside them.

    python benchmarks/confidence_cost.py [--threads 1] [--lengths 32,128] [--batch 128] [--repeats 3]
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
from _util import result

from adlm_model import build_model, preset, sample
from adlm_model.testbed.language import BOS_ID, EOS_ID, MASK_ID, Testbed, TestbedConfig


def small_model(kind: str, vocab: int, length: int) -> tuple[torch.nn.Module, object]:
    """The fast-sampling benchmark's architecture, weights perturbed from the init (its output layers are zero)."""
    cfg = preset("tiny", kind=kind, vocab_size=vocab, mask_id=MASK_ID, seq_len=length, hidden=128, heads=4,
                 n_blocks=2, denoiser_blocks=1, cond_dim=64, dropout=0.0)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model, cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lengths", default="32,128")
    p.add_argument("--kinds", default="mdlm,adlm")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the median is reported")
    add_argument(p)
    args = p.parse_args(argv)
    with recording("confidence_cost", args.record):
        return measure(args)


def measure(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    print(f"batch {args.batch}, {torch.get_num_threads()} torch threads, {args.repeats} interleaved rounds",
          flush=True)
    for kind in args.kinds.split(","):
        for length in (int(v) for v in args.lengths.split(",")):
            vocab = Testbed(TestbedConfig(length=length)).vocab_size
            model, cfg = small_model(kind, vocab, length)
            rows: list[int] = []
            inner = model.denoiser_logits

            def counted(z, sigma, _inner=inner, _rows=rows, **kw):
                _rows.append(z.shape[0])
                return _inner(z, sigma, **kw)

            model.denoiser_logits = counted
            tokens = torch.full((1, length), MASK_ID, dtype=torch.long)
            tokens[0, 0], tokens[0, -1] = BOS_ID, EOS_ID
            runs = {"mdlm": ("mdlm", {}), "mdlm-uncached": ("mdlm", {"cache": False}),
                    "confidence": ("confidence", {"threshold": 1.0})}
            times: dict[str, list[float]] = {k: [] for k in runs}
            cpu: dict[str, list[float]] = {k: [] for k in runs}
            shape: dict[str, tuple[int, int]] = {}
            for _ in range(args.repeats):
                for name, (sampler, opts) in runs.items():
                    rows.clear()
                    stats: dict = {}
                    t0, c0 = time.perf_counter(), time.process_time()
                    sample(model, cfg, batch_size=args.batch, length=length, steps=length, sampler=sampler,
                           nucleus_p=1.0, generator=torch.Generator().manual_seed(7), prefix=(tokens, tokens != MASK_ID),
                           stats=stats, **opts)
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
                    shape[name] = (int(stats["network_calls"]), sum(rows))
            per_call, per_row = {}, {}
            for name in runs:
                sec, wall = statistics.median(cpu[name]), statistics.median(times[name])
                calls, row_passes = shape[name]
                per_call[name], per_row[name] = sec / calls, sec / row_passes
                print(f"{kind} L={length} {name:14s} CPU {sec:7.3f} s (wall {wall:7.3f} s)  {calls:4d} calls  "
                      f"{row_passes / calls / args.batch:5.1%} of the batch a call  CPU "
                      f"{1e3 * per_call[name]:7.2f} ms/call  {1e6 * per_row[name]:7.1f} us/row pass "
                      f"(wall {1e3 * wall / calls:7.2f} ms/call)", flush=True)
            result(f"confidence_per_call_ratio_{kind}_L{length}", per_call["confidence"] / per_call["mdlm"])
            result(f"confidence_per_call_ratio_uncached_{kind}_L{length}",
                   per_call["confidence"] / per_call["mdlm-uncached"])
            result(f"confidence_per_row_ratio_{kind}_L{length}", per_row["confidence"] / per_row["mdlm"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
