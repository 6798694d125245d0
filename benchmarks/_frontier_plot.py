"""The fast-sampling benchmark's speed-vs-quality frontier plot (``benchmarks/fast_sampling.py``): one panel per
model, the selection set's points as wall-time speedup against the NLL excess (every row counted), each method's
frontier drawn, and the chosen settings as measured on fresh seeds with their bootstrap intervals."""

from __future__ import annotations

from pathlib import Path

from _fast_sampling_figures import FAST_METHODS, STEP_METHODS, TOLERANCE, summarize


def plot(doc: dict, path: Path) -> None:
    """Writes the plot of the frontier JSON ``doc`` (``fast_sampling.py``) to ``path``; models refused by the
    distance gate without ``--sweep-far-models`` have no points and no panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    panels = {name: m for name, m in doc["models"].items() if "selection" in m}
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6 * max(1, len(panels)), 4.5), squeeze=False)
    for ax, (name, m) in zip(axes[0], panels.items(), strict=False):
        pts = m["selection"]["points"]
        s = summarize(pts, m["length"], m["penalty"])
        for method in (*FAST_METHODS, *STEP_METHODS):
            mp = sorted((p for p in pts if p["method"] == method), key=lambda p: s[p["label"]]["speedup"])
            if not mp:
                continue
            ax.scatter([s[p["label"]]["speedup"] for p in mp], [100 * s[p["label"]]["excess"] for p in mp],
                       label=method, s=18)
            front, best = [], float("inf")  # the frontier: no faster point is better
            for p in sorted(mp, key=lambda p: -s[p["label"]]["speedup"]):
                if s[p["label"]]["excess"] < best:
                    best = s[p["label"]]["excess"]
                    front.append(p)
            ax.plot([s[p["label"]]["speedup"] for p in front], [100 * s[p["label"]]["excess"] for p in front], lw=1)
        if "measurement" in m:
            meas = m["measurement"]["points"]
            ms = summarize(meas, m["length"], m["penalty"])
            for p in meas[1:]:
                q = ms[p["label"]]
                ax.errorbar(q["speedup"], 100 * q["excess"], fmt="k+" if q["passes"] else "kx",
                            xerr=[[q["speedup"] - q["speedup_ci"][0]], [q["speedup_ci"][1] - q["speedup"]]],
                            yerr=[[100 * (q["excess"] - q["excess_ci"][0])], [100 * (q["excess_ci"][1] - q["excess"])]],
                            lw=0.8, ms=7)
            ax.plot([], [], "k+", label="chosen, fresh seeds (x: fails at 5%)")
        ax.axhline(100 * TOLERANCE, ls="--", c="grey", lw=0.8)
        ax.axvline(1, ls=":", c="grey", lw=0.8)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # the minor ticks' labels overlap on a short log axis
        ax.set_xlabel("wall-time speedup over ancestral sampling at T=L (row cache)")
        ax.set_ylabel("NLL/token excess, every row counted (%)")
        ax.set_title(f"{name} on the testbed (L={m['length']})" + ("; refused" if m.get("refused") else ""))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
