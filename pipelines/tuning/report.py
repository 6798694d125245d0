"""What a sweep shows: the trial table (Markdown) and the picture of the search (gamma against tau)."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class TrialRow:
    trial_id: str
    params: dict[str, Any]
    status: str
    """``finished`` (reached max_t), ``stopped`` (by ASHA), ``error`` or ``unfinished``."""
    step: int | None
    """The last step reported (ASHA's time attribute)."""
    val_ppl: float | None
    """The last validation bound reported (what ASHA compares at its rungs)."""
    mlflow_run_id: str | None
    best_step: int | None = None
    """A finished trial: the step of the checkpoint its training run exported (its best by validation bound,
    docs/design/method.md, section 7), which is what the sweep registers."""
    best_val_ppl: float | None = None
    checkpoint: str | None = None
    """``best`` or ``latest``: which checkpoint the trial's run exported."""

    @property
    def selection_ppl(self) -> float | None:
        """The bound the best trial is chosen by: that of the checkpoint that would be registered."""
        return self.best_val_ppl if self.best_val_ppl is not None else self.val_ppl


def table_markdown(rows: list[TrialRow], best: TrialRow | None) -> str:
    """One row per trial: its last report (step, bound) and, for a finished trial, its best checkpoint (what
    the best trial is chosen by and what is registered)."""
    names = list(rows[0].params) if rows else []
    head = "| trial | " + " | ".join(names) + " | status | step | val PPL | best step | best val PPL |"
    out = [head, "|" + "---|" * (len(names) + 6)]

    def fmt(v: Any) -> str:
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    for r in rows:
        vals = " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.params.values())
        mark = " (best)" if best is not None and r.trial_id == best.trial_id else ""
        out.append(f"| {r.trial_id}{mark} | {vals} | {r.status} | {fmt(r.step)} | {fmt(r.val_ppl)} | "
                   f"{fmt(r.best_step)} | {fmt(r.best_val_ppl)} |")
    return "\n".join(out) + "\n"


def _pyplot() -> Any:
    # lazy: keeps matplotlib out of this module's import
    import matplotlib

    matplotlib.use("Agg")
    # lazy: keeps matplotlib out of this module's import
    import matplotlib.pyplot as plt

    return plt


def plot_search(rows: list[TrialRow], out: Path, title: str, *, best: TrialRow | None = None,
                best_label: str = "best trial") -> Path | None:
    """The search's response: the bound against gamma (log) and tau, a surface interpolated between the trials
    that reached max_t (coloured by the bound of the checkpoint each would register), trials stopped by ASHA as
    grey crosses at their place, ``best`` (default: the best finished trial) ringed; and the bound against each
    other searched parameter (a learning rate) in a panel of its own."""
    names = list(rows[0].params) if rows else []
    pts = [r for r in rows if r.status in ("finished", "stopped") and r.selection_ppl is not None]
    if not pts:
        return None
    plt = _pyplot()
    # lazy: keeps matplotlib out of this module's import
    import matplotlib

    anchored = "gamma" in names and "tau" in names
    others = [n for n in names if not (anchored and n in ("gamma", "tau"))]
    panels = int(anchored) + len(others)
    fig, axes = plt.subplots(1, panels, figsize=(6.2 * panels if anchored else 4.8 * panels, 4.6), squeeze=False)
    finished = [r for r in pts if r.status == "finished"]
    stopped = [r for r in pts if r.status == "stopped"]
    if best is None:
        best = min(finished, key=lambda r: r.selection_ppl, default=None)
    bounds = [r.selection_ppl for r in finished] or [r.selection_ppl for r in pts]
    lo, hi = min(bounds), max(bounds)
    norm = matplotlib.colors.Normalize(vmin=lo, vmax=hi if hi > lo else lo + 1)
    cmap = "viridis_r"

    def num(v: Any) -> float:
        return float(v)

    k = 0
    if anchored:
        ax = axes[0][0]
        k = 1
        xs, ys = [math.log10(num(r.params["gamma"])) for r in finished], [num(r.params["tau"]) for r in finished]
        if len(finished) >= 4 and len(set(xs)) >= 2 and len(set(ys)) >= 2:
            try:  # the surface between the finished trials (linear on log gamma x tau)
                cs = ax.tricontourf([10 ** x for x in xs], ys, [r.selection_ppl for r in finished], levels=12,
                                    cmap=cmap, norm=norm, alpha=0.35)
                del cs
            except (ValueError, RuntimeError):  # collinear points: no triangulation, the points alone
                pass
        sc = ax.scatter([num(r.params["gamma"]) for r in finished], ys, c=[r.selection_ppl for r in finished],
                        cmap=cmap, norm=norm, marker="o", s=110, edgecolors="black", label="reached max_t", zorder=3)
        if stopped:
            ax.scatter([num(r.params["gamma"]) for r in stopped], [num(r.params["tau"]) for r in stopped], c="grey",
                       marker="X", s=90, label="stopped by ASHA", zorder=3)
            for r in stopped:
                ax.annotate(f"{r.step}", (num(r.params["gamma"]), num(r.params["tau"])), fontsize=7,
                            xytext=(5, -9), textcoords="offset points", color="grey")
        if best is not None:
            ax.scatter([num(best.params["gamma"])], [num(best.params["tau"])], s=420, facecolors="none",
                       edgecolors="red", linewidths=2.2, label=best_label, zorder=4)
        fig.colorbar(sc, ax=ax, label="validation bound (PPL) of the finished trials")
        ax.set_xscale("log")
        ax.set_xlabel("gamma (anchor loss weight)")
        ax.set_ylabel("tau (anchor count threshold)")
        ax.set_title(title + (f"\n(the surface ignores {', '.join(others)}: see the next panel)" if others else ""),
                     fontsize=10)
        ax.legend(loc="best", fontsize=7)
        ax.grid(alpha=0.3)
    for j, n in enumerate(others):
        ax = axes[0][k + j]
        vals = [num(r.params[n]) for r in pts]
        ax.scatter([num(r.params[n]) for r in finished], [r.selection_ppl for r in finished],
                   c=[r.selection_ppl for r in finished], cmap=cmap, norm=norm, s=70, edgecolors="black",
                   label="reached max_t", zorder=3)
        if stopped:
            ax.scatter([num(r.params[n]) for r in stopped], [r.selection_ppl for r in stopped], c="grey", marker="X",
                       s=60, label="stopped by ASHA (its last report)", zorder=3)
        if best is not None:
            ax.scatter([num(best.params[n])], [best.selection_ppl], s=320, facecolors="none", edgecolors="red",
                       linewidths=2.2, label=best_label, zorder=4)
        if min(vals) > 0 and max(vals) / min(vals) > 5:
            ax.set_xscale("log")
        ax.set_xlabel(n)
        ax.set_ylabel("validation bound (PPL)")
        ax.set_title(title if not anchored and j == 0 else f"the bound against {n}", fontsize=10)
        ax.legend(loc="best", fontsize=7)
        ax.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_confirmation(result: Any, out: Path) -> Path | None:
    """Each reading's bounds per seed (nats/token; one line a seed across the arms: the pairing) and, last, every
    contrast's difference with its 95% interval, the primary one in red."""
    # lazy: keeps pydantic out of this module's import
    from pipelines.studies.comparisons import nats

    plan = result.plan
    readings = [r for r in plan.readings if any(result.bounds[r.key].get(a) for a in r.step)]
    if not readings:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(readings) + 1, figsize=(3.6 * len(readings) + 5.2, 4.4), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    arm_colour = {a.name: colours[i % len(colours)] for i, a in enumerate(plan.arms)}
    for ax, r in zip(axes[0], readings, strict=False):
        arms = list(r.step)
        for seed in plan.seeds:
            ys = [nats(result.bounds[r.key][a][seed]) if seed in result.bounds[r.key].get(a, {}) else math.nan
                  for a in arms]
            ax.plot(range(len(arms)), ys, color="grey", alpha=0.5, lw=1, zorder=1)
        for i, a in enumerate(arms):
            ys = [nats(v) for v in result.bounds[r.key].get(a, {}).values()]
            ax.scatter([i] * len(ys), ys, color=arm_colour[a], s=36, zorder=2)
            if ys:
                ax.scatter([i], [sum(ys) / len(ys)], color=arm_colour[a], marker="_", s=700, lw=2.5, zorder=3)
        ax.set_xticks(range(len(arms)), [f"{a}\n(step {r.step[a]:,})" for a in arms], fontsize=8)
        ax.set_xlim(-0.5, len(arms) - 0.5)
        ax.set_ylabel("validation bound, nats/token")
        ax.set_title(r.text, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    ax = axes[0][-1]
    shown = [c for c in result.contrasts if c.difference is not None and c.difference.n >= 2]
    for i, c in enumerate(shown):
        d = c.difference
        colour = "red" if c.primary else "black"
        ax.errorbar([d.mean], [i], xerr=[[d.mean - d.lo], [d.hi - d.mean]], fmt="o", color=colour, capsize=4)
    ax.axvline(0, color="grey", lw=1, ls="--")
    ax.set_yticks(range(len(shown)), [f"{c.arm} vs {c.against}\n{c.reading}" for c in shown], fontsize=8)
    ax.set_ylim(-0.7, len(shown) - 0.3)
    ax.invert_yaxis()
    ax.set_xlabel("d = bound(against) - bound(arm), nats/token\n(> 0: the arm is lower; 95% interval)")
    ax.set_title(f"paired over fresh seeds {plan.seeds}", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    fig.suptitle("\n".join(textwrap.wrap(result.summary, width=int(12 * fig.get_figwidth()))), fontsize=9)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
