"""The study's table (Markdown, CSV) and curves (validation bound against steps and against FLOPs)."""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.studies.stats import Summary


@dataclass
class ArmResult:
    name: str
    kind: str
    sets: dict[str, Any]
    params: int
    flops_per_step: int
    equal_flops: bool
    curves: dict[int, dict[int, float]]
    """seed -> step -> validation bound (PPL)."""
    at_steps: dict[int, float]
    """seed -> bound at the equal-steps budget."""
    steps_summary: Summary | None
    flops_step: int | None = None
    """The step read at the equal-FLOPs budget."""
    at_flops: dict[int, float] = field(default_factory=dict)
    flops_summary: Summary | None = None
    gain_steps: Summary | None = None
    """Percent lower than the baseline at equal steps, paired by seed."""
    gain_flops: Summary | None = None

    def as_dict(self) -> dict[str, Any]:
        def s(x: Summary | None) -> dict | None:
            return None if x is None else {k: getattr(x, k) for k in ("n", "mean", "sd", "lo", "hi")}

        return {"name": self.name, "kind": self.kind, "set": self.sets, "params": self.params,
                "flops_per_step": self.flops_per_step, "equal_flops": self.equal_flops,
                "curves": {str(k): {str(st): v for st, v in c.items()} for k, c in self.curves.items()},
                "at_steps": self.at_steps, "steps_summary": s(self.steps_summary), "flops_step": self.flops_step,
                "at_flops": self.at_flops, "flops_summary": s(self.flops_summary),
                "gain_steps_pct": s(self.gain_steps), "gain_flops_pct": s(self.gain_flops)}


def _gain(g: Summary | None) -> str:
    if g is None:
        return "—"
    if g.n < 2:
        return f"{g.mean:+.1f}%"
    return f"{g.mean:+.1f}% [{g.lo:+.1f}, {g.hi:+.1f}]"


def _bound(s: Summary | None) -> str:
    return "—" if s is None else s.text(1)


def table_markdown(spec: Any, arms: list[ArmResult], budget_flops: float | None, seconds: float) -> str:
    """Two tables: the arms at equal steps (every arm) and at equal FLOPs (the arms that take part)."""
    base = spec.baseline or "the baseline"
    lines = [f"### Study `{spec.name}`: validation bound (PPL, lower is better) over seeds",
             "",
             f"Mean ± sd [95% t interval] over seeds; gain = how much lower than {base}, in percent, paired by "
             f"seed [95% interval]. {len(arms)} arms, {sum(len(a.curves) for a in arms)} runs, "
             f"{seconds / 60:.1f} min.",
             "",
             f"**Equal optimiser steps ({spec.steps})**",
             "",
             "| arm | kind | params | GFLOP/step | seeds | bound at equal steps | gain vs " + base + " |",
             "|---|---|---|---|---|---|---|"]
    for a in arms:
        lines.append(f"| {a.name} | {a.kind} | {a.params / 1e6:.2f} M | {a.flops_per_step / 1e9:.2f} | "
                     f"{len(a.at_steps)} | {_bound(a.steps_summary)} | {_gain(a.gain_steps)} |")
    if budget_flops:
        lines += ["", f"**Equal training FLOPs ({budget_flops / 1e12:.2f} TFLOP: {spec.flops_reference} at "
                      f"{spec.steps} steps)**", "",
                  "| arm | steps at the budget | seeds | bound at equal FLOPs | gain vs " + base + " |",
                  "|---|---|---|---|---|"]
        for a in arms:
            if a.equal_flops:
                lines.append(f"| {a.name} | {a.flops_step} | {len(a.at_flops)} | {_bound(a.flops_summary)} | "
                             f"{_gain(a.gain_flops)} |")
    return "\n".join(lines) + "\n"


def results_csv(arms: list[ArmResult]) -> str:
    """One row per (arm, seed): both readings."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["arm", "kind", "seed", "params", "flops_per_step", "bound_equal_steps", "flops_step",
                "bound_equal_flops"])
    for a in arms:
        for seed in sorted(a.curves):
            w.writerow([a.name, a.kind, seed, a.params, a.flops_per_step, a.at_steps.get(seed, ""),
                        a.flops_step or "", a.at_flops.get(seed, "")])
    return buf.getvalue()


def _mean_curve(a: ArmResult) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps every seed has, with the mean, min and max bound there."""
    common = sorted(set.intersection(*(set(c) for c in a.curves.values()))) if a.curves else []
    vals = [[a.curves[s][st] for s in a.curves] for st in common]
    ok = [(st, v) for st, v in zip(common, vals, strict=True) if all(math.isfinite(x) for x in v)]
    return ([st for st, _ in ok], [sum(v) / len(v) for _, v in ok], [min(v) for _, v in ok],
            [max(v) for _, v in ok])


def plot_curves(spec: Any, arms: list[ArmResult], out: Path) -> Path | None:
    """Left: bound against steps (every arm); right: against training FLOPs (the equal-FLOPs arms). Mean over
    seeds, band = min..max over seeds; dashed lines mark the two budgets."""
    if not any(a.curves for a in arms):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12.5, 4.8))
    for a in arms:
        steps, mean, lo, hi = _mean_curve(a)
        if not steps:
            continue
        style = "-" if a.equal_flops else ":"
        (line,) = ax1.plot(steps, mean, style, label=f"{a.name} ({len(a.curves)} seeds)")
        ax1.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
        if a.equal_flops:
            f = [s * a.flops_per_step / 1e12 for s in steps]
            ax2.plot(f, mean, style, color=line.get_color(), label=a.name)
            ax2.fill_between(f, lo, hi, color=line.get_color(), alpha=0.15)
    ax1.axvline(spec.steps, color="grey", ls="--", lw=1)
    budget = next((a.flops_per_step * spec.steps for a in arms if a.name == spec.flops_reference), None)
    if budget:
        ax2.axvline(budget / 1e12, color="grey", ls="--", lw=1)
    for ax, xl in ((ax1, "optimiser steps"), (ax2, "training FLOPs (TFLOP)")):
        ax.set_yscale("log")
        ax.set_xlabel(xl)
        ax.set_ylabel("validation bound (PPL)")
        ax.grid(alpha=0.3, which="both")
    ax1.set_title(f"{spec.name}: equal steps (dashed: {spec.steps})")
    ax2.set_title("equal FLOPs (dashed: the budget)")
    ax1.legend(fontsize=7, loc="upper right")
    ax2.legend(fontsize=7, loc="upper right")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
