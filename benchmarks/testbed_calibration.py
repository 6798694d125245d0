"""The testbed presets' confidence profile next to a real language model's on natural text.

Two figures per source: the share of positions whose conditional puts >= 0.9 on one token, and the histogram of
the conditionals' entropies (nats), over

- **SmolLM2-135M** (the offline evaluation LM, ``pipelines.evaluation.eval_lm``, loaded from its converted cache)
  on the embedded corpus's held-out text (the ``validation`` split: Wikipedia articles and Bible chapters,
  ``--windows`` windows of ``--window`` tokens from each part), **next-token** conditionals
  ``p(x^l | x^{<l})``: the model is causal, it has no other;
- each testbed preset (``anchored``, ``natural``), exactly, on ``--rows`` generated rows: the same next-token
  conditionals (the like-for-like comparison; the forward algorithm's one-step predictions, or the exact
  conditional with the future masked), and the **bidirectional** ones ``p(x^l | every other token)`` that a
  diffusion sampler meets at its last steps;
- each preset's conditionals at the **masked positions of partly masked rows** (each content position masked with
  probability ``--mask-rates``, exact conditionals given the visible tokens on both sides): what a diffusion
  sampler meets along the way. Natural text has no counterpart to compare them with (a causal model gives none),
  so these rows are reported, not calibrated.

Why next-token is the fair proxy: conditioning on more never raises the expected entropy
(``H(X_l | X_-l) <= H(X_l | X_<l)``), so natural text's bidirectional conditionals are at least as confident
as its next-token ones. Matching the natural preset's next-token figures to the real model's makes the preset
no more confident than natural text is bidirectionally (conservative for a sampler that bets on confidence);
the bidirectional rows show how much more confident its conditionals get with both sides seen. (SmolLM2's
figures are a 135M model's, not text's own: a larger model is more confident, which again errs on the side
of a less confident testbed.)

    python benchmarks/testbed_calibration.py [--length 64] [--rows 256] [--window 128] [--windows 16]

Ends with ``RESULT calibration_share_ge_0.9_<source>``, ``RESULT calibration_mean_entropy_<source>`` and
``RESULT calibration_tv_<preset>_next`` (the total variation between the preset's next-token entropy histogram and
SmolLM2's: the shapes, where the share and the mean compare single numbers). ``--record`` writes a dated record.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import add_argument, recording
from _util import result

from adlm_model.testbed.language import MASK_ID, Testbed, TestbedConfig

BINS = (0.0, 0.1, 0.5, 1.0, 2.0, 3.0, 4.0, float("inf"))
"""Entropy histogram bins (nats)."""


def profile(logp: torch.Tensor) -> dict:
    """Share of conditionals with top probability >= 0.9, mean entropy and the entropy histogram, from log
    conditionals (N, V) (-inf allowed)."""
    logp = logp.double()
    p = logp.exp()
    ent = -(p * logp.clamp_min(-1e30)).sum(-1)
    hist = np.histogram(ent.numpy(), bins=np.array(BINS))[0] / max(ent.numel(), 1)
    return {"share": float((p.max(-1).values >= 0.9).double().mean()), "entropy": float(ent.mean()),
            "hist": hist.tolist(), "n": int(ent.numel())}


def real_model(window: int, windows: int) -> dict:
    """SmolLM2's next-token conditionals on held-out embedded text (module docstring)."""
    import pyarrow.parquet as pq

    from pipelines.data.embedded import embedded_corpus, wikipedia_documents
    from pipelines.evaluation.eval_lm import load_eval_lm

    lm = load_eval_lm("smollm2", device="cpu")
    texts = pq.read_table(embedded_corpus()["validation"]).column("text").to_pylist()
    n_wiki = sum(1 for i in range(len(wikipedia_documents())) if i % 20 == 7)  # the split's first documents
    wins = []
    for part in (texts[:n_wiki], texts[n_wiki:]):  # Wikipedia, then the Bible: the same count from each
        got = 0
        for ids in lm.encode(part):
            for s in range(0, len(ids) - window + 1, window):
                if got < windows:
                    wins.append(ids[s:s + window])
                    got += 1
    x = torch.tensor(wins)
    out = []
    with torch.no_grad():
        for i in range(0, len(x), 4):
            logits = lm.logits(x[i:i + 4], torch.ones_like(x[i:i + 4]))[:, :-1].float()
            out.append(torch.log_softmax(logits, -1).reshape(-1, logits.shape[-1]))
    return profile(torch.cat(out))


def testbed_profiles(tb: Testbed, rows: int) -> tuple[dict, dict]:
    """(next-token, bidirectional) profiles of the testbed's exact conditionals at the content positions."""
    x = tb.sample(rows, seed=4242)
    L = tb.length
    if hasattr(tb, "next_token_conditionals"):
        nxt = tb.next_token_conditionals(x)[:, 1:-1]
    else:  # the exact conditional at l with l.. masked
        cols = []
        for pos in range(1, L - 1):
            z = x.clone()
            z[:, pos:-1] = MASK_ID
            cols.append(tb.conditionals(z)[:, pos])
        nxt = torch.stack(cols, 1)
    if hasattr(tb, "leave_one_out_conditionals"):
        both = tb.leave_one_out_conditionals(x)[:, 1:-1]
    else:  # the exact conditional at l with l alone masked
        cols = []
        for pos in range(1, L - 1):
            z = x.clone()
            z[:, pos] = MASK_ID
            cols.append(tb.conditionals(z)[:, pos])
        both = torch.stack(cols, 1)
    return profile(nxt.reshape(-1, nxt.shape[-1])), profile(both.reshape(-1, both.shape[-1]))


def masked_profile(tb: Testbed, rows: int, rate: float) -> dict:
    """The profile of the exact conditionals at the masked content positions of ``rows`` rows, each content
    position masked with probability ``rate`` (seeded)."""
    x = tb.sample(rows, seed=4243)
    g = torch.Generator().manual_seed(4244)
    masked = torch.rand(x.shape, generator=g) < rate
    masked[:, 0] = masked[:, -1] = False
    z = torch.where(masked, torch.full_like(x, MASK_ID), x)
    return profile(tb.conditionals(z)[masked])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=64, help="testbed row length (default 64)")
    p.add_argument("--rows", type=int, default=256, help="testbed rows (default 256)")
    p.add_argument("--window", type=int, default=128, help="tokens per window of real text (default 128)")
    p.add_argument("--windows", type=int, default=16, help="windows from each part of the corpus (default 16)")
    p.add_argument("--skip-real", action="store_true", help="the testbeds only (no SmolLM2)")
    p.add_argument("--mask-rates", default="0.25,0.5,0.75",
                   help="masking rates of the partly masked rows (comma-separated; default 0.25,0.5,0.75)")
    p.add_argument("--threads", type=int, default=1)
    add_argument(p)
    args = p.parse_args(argv)
    try:
        rates = [float(r) for r in args.mask_rates.split(",")]
    except ValueError:
        p.error(f"--mask-rates {args.mask_rates!r}: write rates in (0, 1) separated by commas, e.g. 0.25,0.5")
    if not all(0 < r < 1 for r in rates):
        p.error(f"--mask-rates {args.mask_rates!r}: every rate must be in (0, 1)")
    torch.set_num_threads(args.threads)
    with recording("testbed_calibration", args.record):
        return _run(args, rates)


def _run(args: argparse.Namespace, rates: list[float]) -> int:
    figures: dict[str, dict] = {}
    for preset in ("anchored", "natural"):
        t0 = time.perf_counter()
        cfg = TestbedConfig.natural(length=args.length) if preset == "natural" else TestbedConfig(length=args.length)
        tb = Testbed(cfg)
        figures[f"{preset}_next"], figures[f"{preset}_bidirectional"] = testbed_profiles(tb, args.rows)
        for rate in rates:
            figures[f"{preset}_masked_{rate:g}"] = masked_profile(tb, args.rows, rate)
        print(f"{preset}: {time.perf_counter() - t0:.1f} s", flush=True)
    if not args.skip_real:
        t0 = time.perf_counter()
        figures["smollm2_next"] = real_model(args.window, args.windows)
        print(f"smollm2: {time.perf_counter() - t0:.1f} s", flush=True)
    labels = [f"[{a:g},{b:g})" for a, b in zip(BINS[:-1], BINS[1:], strict=True)]
    print(f"\n{'source':24s} {'positions':>9s} {'>=0.9':>6s} {'mean H':>7s}  " + " ".join(f"{s:>8s}" for s in labels))
    for name, f in figures.items():
        print(f"{name:24s} {f['n']:9d} {f['share']:6.3f} {f['entropy']:7.3f}  "
              + " ".join(f"{h:8.3f}" for h in f["hist"]))
    for name, f in figures.items():
        result(f"calibration_share_ge_0.9_{name}", f["share"])
        result(f"calibration_mean_entropy_{name}", f["entropy"])
    if "smollm2_next" in figures:
        for preset in ("anchored", "natural"):
            tv = 0.5 * sum(abs(a - b) for a, b in zip(figures[f"{preset}_next"]["hist"],
                                                       figures["smollm2_next"]["hist"], strict=True))
            result(f"calibration_tv_{preset}_next", tv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
