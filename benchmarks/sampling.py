"""Sampling speed, run by hand.

At ``tiny`` (L = 128, 8,192-entry vocabulary, random weights): tokens/s of every sampler, and
``RESULT`` lines measured in this one run (medians of ``--repeats`` runs):

- ``cached_over_uncached_speedup``: MDLM ancestral with T = 4L, batch 1, ``cache=True`` over
  ``cache=False`` (goal >= 3); ``remdm_cached_over_uncached_speedup`` the same for ReMDM-loop (its
  loop phase remasks tokens at most steps, so little is reusable);
- ``ar_kv_over_recompute_speedup``, ``a2r_kv_over_recompute_speedup``: the ``ar`` sampler with its KV cache over
  recomputing the prefix every token, on AR and on A2R (one cache through its anchor and AR model);
- ``bd3_kv_over_recompute_speedup``: BD3-LM block sampling with the KV cache over recomputing
  the prefix, tiny with b = 16 at L = 1024 (64 blocks; goal >= 5);

and at ``small`` (the paper's sizes, GPT-2 vocabulary, L = 128, batch 1), one denoising forward:

- ``adlm_fused_speedup``: unfused ADLM time over fused (goal >= 1.35; FLOP ratio about 1.46);
- ``adlm_over_mdlm_inference_ratio``: fused ADLM over MDLM (goal <= 1.42; FLOP ratio about 1.35).

    python benchmarks/sampling.py [--repeats 3] [--skip-tiny] [--causal-only] [--skip-bd3] [--skip-small]
        [--device cpu|cuda]

With ``--device cuda`` the ``small`` forward is also timed at L = 1024.
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
from adlm_model.config import ModelConfig


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights everywhere (the zero-initialised output layers would give uniform p_x0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def timed_runs(fns: dict[str, callable], repeats: int) -> dict[str, float]:
    """Median seconds per function; the functions are interleaved so that load drifts hit all."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def tiny_samplers(repeats: int, device: str, causal_only: bool = False) -> None:
    length = 128
    models: dict[str, tuple[torch.nn.Module, ModelConfig]] = {}
    for kind in ("ar", "a2r") if causal_only else ("mdlm", "adlm", "ar", "bd3lm", "a2r"):
        cfg = preset("tiny", kind=kind, dropout=0.0, block_size=4)
        models[kind] = (randomize(build_model(cfg)).to(device), cfg)

    def run(kind: str, sampler: str, steps: int, batch: int = 1, **kw):
        model, cfg = models[kind]
        stats: dict = {}

        def fn():
            sample(model, cfg, batch_size=batch, length=length, steps=steps, sampler=sampler, nucleus_p=0.9,
                   generator=torch.Generator(device).manual_seed(0), stats=stats, **kw)
        fn.stats = stats
        return fn

    print(f"== tiny: L = {length}, batch 1, nucleus 0.9, T = 4L = {4 * length} (BD3-LM: T = 4 per block)",
          flush=True)
    causal = {
        "ar kv-cache": run("ar", "ar", 1, bos_id=0),
        "ar recompute": run("ar", "ar", 1, bos_id=0, cache=False),
        "a2r kv-cache": run("a2r", "ar", 1, bos_id=0),
        "a2r recompute": run("a2r", "ar", 1, bos_id=0, cache=False),
    }
    fns = causal if causal_only else {
        "mdlm cached": run("mdlm", "mdlm", 4 * length),
        "mdlm uncached": run("mdlm", "mdlm", 4 * length, cache=False),
        "remdm-loop cached": run("mdlm", "remdm-loop", 4 * length),
        "remdm-loop uncached": run("mdlm", "remdm-loop", 4 * length, cache=False),
        "adlm (mdlm sampler) cached": run("adlm", "mdlm", 4 * length),
        "adlm (remdm-loop) cached": run("adlm", "remdm-loop", 4 * length),
        **causal,
    }
    t = timed_runs(fns, repeats)
    for k, v in t.items():
        calls = fns[k].stats.get("network_calls")
        extra = f", {calls} network calls" if calls is not None else ""
        print(f"  {k:28s} {v:7.3f} s  {length / v:8.1f} tokens/s{extra}", flush=True)
    if not causal_only:
        result("cached_over_uncached_speedup", t["mdlm uncached"] / t["mdlm cached"])
        result("remdm_cached_over_uncached_speedup", t["remdm-loop uncached"] / t["remdm-loop cached"])
    result("ar_kv_over_recompute_speedup", t["ar recompute"] / t["ar kv-cache"])
    result("a2r_kv_over_recompute_speedup", t["a2r recompute"] / t["a2r kv-cache"])


def bd3_blocks(repeats: int, device: str, length: int, block: int) -> None:
    """KV-cached block sampling vs recomputing the clean prefix at every denoising step.

    The cache turns the prefix's cost from O(prefix) per call into O(block): the gain grows with the
    number of blocks, so it is measured at ``length / block`` >= 16 blocks (default 1024 / 16 = 64).
    A finished block's keys/values are computed in the next block's first call (folded commits), so
    the cached path makes no network call for commits alone.
    """
    cfg = preset("tiny", kind="bd3lm", dropout=0.0, block_size=block, seq_len=length)
    model = randomize(build_model(cfg)).to(device)
    stats: dict[str, dict] = {"kv": {}, "re": {}}

    def run(kv: bool):
        def fn():
            sample(model, cfg, batch_size=1, length=length, steps=4, sampler="bd3lm", nucleus_p=0.9,
                   generator=torch.Generator(device).manual_seed(0), stats=stats["kv" if kv else "re"],
                   kv_cache=kv)
        return fn

    print(f"== BD3-LM block sampling: tiny, L = {length}, b = {block} ({length // block} blocks), T = 4 per block",
          flush=True)
    t = timed_runs({"kv-cache": run(True), "recompute": run(False)}, repeats)
    for k, v in t.items():
        st = stats["kv" if k == "kv-cache" else "re"]
        print(f"  bd3lm {k:22s} {v:7.3f} s  {length / v:8.1f} tokens/s, {st.get('network_calls')} network calls "
              f"in blocks + {st.get('commit_calls')} for commits alone", flush=True)
    result("bd3_kv_over_recompute_speedup", t["recompute"] / t["kv-cache"])


def small_forward(repeats: int, device: str, length: int) -> None:
    print(f"== small: one denoising forward, batch 1, L = {length} ({device})", flush=True)
    torch.manual_seed(0)
    adlm_cfg = preset("small", kind="adlm", dropout=0.0, seq_len=length)
    mdlm_cfg = preset("small", kind="mdlm", dropout=0.0, seq_len=length)
    adlm = build_model(adlm_cfg).to(device).eval()
    mdlm = build_model(mdlm_cfg).to(device).eval()
    z = torch.randint(0, adlm_cfg.vocab_size, (1, length), device=device)
    sigma = torch.zeros(1, device=device)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def fwd(fn):
        def f():
            with torch.no_grad():
                fn()
            sync()
        return f

    fns = {
        "adlm fused": fwd(lambda: adlm.denoiser_logits(z, sigma, fused=True)),
        "adlm unfused": fwd(lambda: adlm.denoiser_logits(z, sigma, fused=False)),
        "mdlm": fwd(lambda: mdlm.denoiser_logits(z, sigma)),
    }
    t = timed_runs(fns, repeats)
    for k, v in t.items():
        print(f"  {k:14s} {v * 1e3:9.1f} ms  {length / v:9.1f} tokens/s", flush=True)
    suffix = "" if length == 128 else f"_L{length}"
    result("adlm_fused_speedup" + suffix, t["adlm unfused"] / t["adlm fused"])
    result("adlm_over_mdlm_inference_ratio" + suffix, t["adlm fused"] / t["mdlm"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median; default 3)")
    ap.add_argument("--skip-small", action="store_true", help="skip the small-config forward timings")
    ap.add_argument("--skip-tiny", action="store_true", help="skip the tiny-config sampler timings")
    ap.add_argument("--skip-bd3", action="store_true", help="skip the BD3-LM KV-cache timing")
    ap.add_argument("--causal-only", action="store_true",
                    help="time only the causal samplers (AR, A2R) of the tiny section")
    ap.add_argument("--bd3-length", type=int, default=1024, help="BD3-LM sample length (default 1024)")
    ap.add_argument("--bd3-block", type=int, default=16, help="BD3-LM block size (default 16; >= 16 blocks)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="device (default cpu)")
    add_argument(ap)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible; use --device cpu")
    if not args.skip_bd3 and args.bd3_length % args.bd3_block:
        ap.error("--bd3-length must be a multiple of --bd3-block")
    with recording("sampling", args.record):
        measure(args)


def measure(args: argparse.Namespace) -> None:
    if not args.skip_tiny:
        tiny_samplers(args.repeats, args.device, args.causal_only)
    if not args.skip_bd3:
        bd3_blocks(args.repeats, args.device, args.bd3_length, args.bd3_block)
    if not args.skip_small:
        small_forward(max(args.repeats, 5), args.device, 128)
        if args.device == "cuda":
            small_forward(max(args.repeats, 5), args.device, 1024)


if __name__ == "__main__":
    main()
