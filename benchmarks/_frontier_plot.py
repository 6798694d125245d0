"""The fast-sampling benchmark's speed-vs-quality frontier plot (``benchmarks/fast_sampling.py``): one panel per
model, every method's points as wall-time speedup against the true-NLL increase, each method's frontier drawn."""

from __future__ import annotations

from pathlib import Path

STEP_METHODS = ("distilled", "teacher")
"""Points of fewer ancestral steps: SDTT students at their step counts, and the teacher itself at the same counts
(what distillation is measured against); not samplers of the threshold family."""


def plot(all_points: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(all_points), figsize=(6 * len(all_points), 4.5), squeeze=False)
    for ax, (kind, pts) in zip(axes[0], all_points.items(), strict=True):
        for method in ("threshold", "dual", "prefix", "paper-T", *STEP_METHODS):
            mp = sorted((p for p in pts if p["method"] == method), key=lambda p: p["speedup"])
            if not mp:
                continue
            ax.scatter([p["speedup"] for p in mp], [100 * p["nll_increase"] for p in mp], label=method, s=18)
            front, best = [], float("inf")  # the frontier: no faster point is better
            for p in sorted(mp, key=lambda p: -p["speedup"]):
                if p["nll_increase"] < best:
                    best = p["nll_increase"]
                    front.append(p)
            ax.plot([p["speedup"] for p in front], [100 * p["nll_increase"] for p in front], lw=1)
        ax.axhline(5, ls="--", c="grey", lw=0.8)
        ax.axvline(1, ls=":", c="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("wall-time speedup over the exact sampler at T=L (row cache)")
        ax.set_ylabel("true NLL/token increase (%)")
        ax.set_title(f"{kind.upper()} on the testbed (L={pts[0].get('L', '')})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
