"""The study's table (Markdown, CSV) and curves (validation bound against steps and against FLOPs)."""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.studies.stats import Summary


def _scores_every_position(kind: str) -> bool:
    """A diffusion kind whose bound counts all L positions (the floor line drawn is theirs; the kinds table decides,
    not kind names)."""
    # lazy: keeps torch out of this module's import
    from adlm_model.kinds import model_kind

    k = model_kind(kind)
    return k.diffusion and not k.skips_bos


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
    steps_at: int | None = None
    """The step read at the equal-steps budget."""
    at_flops: dict[int, float] = field(default_factory=dict)
    flops_summary: Summary | None = None
    gain_steps: Summary | None = None
    """Percent lower than the baseline at equal steps, paired by seed."""
    gain_flops: Summary | None = None
    entropy: float | None = None
    """Testbed data: the exact entropy per token on the positions this kind scores (else None)."""
    floor_excess: float | None = None
    """Testbed data: the unigram + position floor's excess over that entropy (nats per token)."""
    excess_curves: dict[int, dict[int, float]] = field(default_factory=dict)
    """Testbed data: seed -> step -> excess of the bound over the exact entropy (nats per token)."""
    excess_steps: Summary | None = None
    excess_flops: Summary | None = None

    def as_dict(self) -> dict[str, Any]:
        def s(x: Summary | None) -> dict | None:
            return None if x is None else {k: getattr(x, k) for k in ("n", "mean", "sd", "lo", "hi")}

        return {"name": self.name, "kind": self.kind, "set": self.sets, "params": self.params,
                "flops_per_step": self.flops_per_step, "equal_flops": self.equal_flops,
                "curves": {str(k): {str(st): v for st, v in c.items()} for k, c in self.curves.items()},
                "at_steps": self.at_steps, "steps_summary": s(self.steps_summary), "flops_step": self.flops_step,
                "at_flops": self.at_flops, "flops_summary": s(self.flops_summary),
                "gain_steps_pct": s(self.gain_steps), "gain_flops_pct": s(self.gain_flops),
                "entropy": self.entropy, "floor_excess": self.floor_excess,
                "excess_curves": {str(k): {str(st): v for st, v in c.items()} for k, c in self.excess_curves.items()},
                "excess_steps": s(self.excess_steps), "excess_flops": s(self.excess_flops)}


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
                "bound_equal_flops", "excess_equal_steps", "excess_equal_flops"])

    def excess(a: ArmResult, seed: int, step: int | None) -> Any:
        return a.excess_curves.get(seed, {}).get(step, "") if step is not None else ""

    for a in arms:
        for seed in sorted(a.curves):
            w.writerow([a.name, a.kind, seed, a.params, a.flops_per_step, a.at_steps.get(seed, ""),
                        a.flops_step or "", a.at_flops.get(seed, ""), excess(a, seed, a.steps_at),
                        excess(a, seed, a.flops_step)])
    return buf.getvalue()


def _mean_curve(a: ArmResult, curves: dict[int, dict[int, float]] | None = None
                ) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps every seed has, with the mean, min and max bound (or of ``curves``) there."""
    curves = a.curves if curves is None else curves
    common = sorted(set.intersection(*(set(c) for c in curves.values()))) if curves else []
    vals = [[curves[s][st] for s in curves] for st in common]
    ok = [(st, v) for st, v in zip(common, vals, strict=True) if all(math.isfinite(x) for x in v)]
    return ([st for st, _ in ok], [sum(v) / len(v) for _, v in ok], [min(v) for _, v in ok],
            [max(v) for _, v in ok])


def plot_curves(spec: Any, arms: list[ArmResult], out: Path) -> Path | None:
    """Left: bound against steps (every arm); right: against training FLOPs (the equal-FLOPs arms). Mean over
    seeds, band = min..max over seeds; dashed lines mark the two budgets."""
    if not any(a.curves for a in arms):
        return None
    # lazy: keeps matplotlib out of this module's import
    import matplotlib

    matplotlib.use("Agg")
    # lazy: keeps matplotlib out of this module's import
    import matplotlib.pyplot as plt

    truth = any(a.excess_curves for a in arms)
    fig, axes = plt.subplots(2 if truth else 1, 2, figsize=(12.5, 9.2 if truth else 4.8), squeeze=False)
    (ax1, ax2) = axes[0]
    budget = next((a.flops_per_step * spec.steps for a in arms if a.name == spec.flops_reference), None)
    rows = [(axes[0], None, "validation bound (PPL)")]
    if truth:  # testbed data: the excess over the exact entropy, the floor's own excess dotted
        rows.append((axes[1], "excess", "excess over the exact entropy (nats/token)"))
    for (left, right), which, ylabel in rows:
        for a in arms:
            steps, mean, lo, hi = _mean_curve(a, a.excess_curves if which else None)
            if not steps:
                continue
            style = "-" if a.equal_flops else ":"
            (line,) = left.plot(steps, mean, style, label=f"{a.name} ({len(a.curves)} seeds)")
            left.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
            if a.equal_flops:
                f = [s * a.flops_per_step / 1e12 for s in steps]
                right.plot(f, mean, style, color=line.get_color(), label=a.name)
                right.fill_between(f, lo, hi, color=line.get_color(), alpha=0.15)
        left.axvline(spec.steps, color="grey", ls="--", lw=1)
        if budget:
            right.axvline(budget / 1e12, color="grey", ls="--", lw=1)
        floor = next((a.floor_excess for a in arms if a.floor_excess is not None and _scores_every_position(a.kind)),
                     None)
        if which and floor:
            for ax in (left, right):
                ax.axhline(floor, color="black", ls=":", lw=1)
        for ax, xl in ((left, "optimiser steps"), (right, "training FLOPs (TFLOP)")):
            ax.set_yscale("linear" if which else "log")  # an excess can dip below 0 on one noise draw
            ax.set_xlabel(xl)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3, which="both")
        if which:
            left.set_title("excess over the exact entropy (dotted: the unigram + position floor's)")
            left.legend(fontsize=7, loc="upper right")
    ax1.set_title(f"{spec.name}: equal steps (dashed: {spec.steps})")
    ax2.set_title("equal FLOPs (dashed: the budget)")
    ax1.legend(fontsize=7, loc="upper right")
    ax2.legend(fontsize=7, loc="upper right")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
