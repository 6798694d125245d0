"""What a sweep shows: the trial table (Markdown) and the picture of the search (gamma against tau)."""

from __future__ import annotations

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


def plot_search(rows: list[TrialRow], out: Path, title: str) -> Path | None:
    """Gamma (log scale) against tau, coloured by validation PPL; stopped trials as crosses."""
    pts = [r for r in rows if r.val_ppl is not None and "gamma" in r.params and "tau" in r.params]
    if not pts:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    ppl = [r.val_ppl for r in pts]
    lo, hi = min(ppl), max(ppl)
    norm = matplotlib.colors.Normalize(vmin=lo, vmax=hi if hi > lo else lo + 1)
    for status, marker, label in (("finished", "o", "reached max_t"), ("stopped", "X", "stopped by ASHA"),
                                  ("error", "s", "error")):
        sel = [r for r in pts if r.status == status]
        if sel:
            sc = ax.scatter([float(r.params["gamma"]) for r in sel], [float(r.params["tau"]) for r in sel],
                            c=[r.val_ppl for r in sel], cmap="viridis_r", norm=norm, marker=marker, s=110,
                            edgecolors="black", label=label)
    best = min((r for r in pts if r.status == "finished"), key=lambda r: r.selection_ppl, default=None)
    if best is not None:
        ax.scatter([float(best.params["gamma"])], [float(best.params["tau"])], s=380, facecolors="none",
                   edgecolors="red", linewidths=2, label="best")
    fig.colorbar(sc, ax=ax, label="validation PPL bound (last report)")
    ax.set_xscale("log")
    ax.set_xlabel("gamma (anchor loss weight)")
    ax.set_ylabel("tau (anchor count threshold)")
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
