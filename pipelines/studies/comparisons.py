"""A study's pre-registered comparisons and, on testbed data, its readings against the truth.

The study file names its comparisons before the first run (``comparisons:``), so that the write-up reports what
was decided in advance, not the contrast that came out best::

    comparisons:
      - {arm: adlm, against: adlm-gamma0, budget: steps, primary: true}
      - {arm: adlm, against: mdlm-params, budget: flops}

Each is read on the validation bound in nats per scored token, paired by seed (same seed: same initialisation
stream, data order and validation noise): ``d = bound(against) - bound(arm)``, positive when ``arm`` is lower. The
verdict is mechanical: the 95% t interval of the mean ``d`` above 0 -> ``arm lower``, below 0 -> ``arm higher``,
straddling 0 -> ``no detectable difference`` (its half-width is the study's resolution).

On testbed data (``manifest.truth``), every bound also reads as its **excess over the exact entropy**,
``ln(PPL) - H``, with ``H`` the entropy per token on the positions the kind scores (all L for MDLM/ADLM, 1..L-1
for AR and BD3-LM; ``pipelines.evaluation.truth``); a comparison then also gives the share of the comparator's
excess that ``arm`` removes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field

from pipelines.studies.stats import Summary, summarise

BUDGETS = ("steps", "flops")


@dataclass
class Comparison:
    """One pre-registered contrast: ``arm`` against ``against`` at the equal-``budget`` reading."""

    arm: str
    """The arm read (its bound lower: ``arm lower``)."""
    against: str
    """The arm it is compared with."""
    budget: Annotated[str, Field(json_schema_extra={"enum": list(BUDGETS)})] = "steps"
    """``steps`` (equal optimiser steps) or ``flops`` (equal training FLOPs; both arms need equal_flops)."""
    primary: bool = False
    """The one comparison that decides the hypothesis (at most one)."""


@dataclass
class ComparisonResult:
    comparison: Comparison
    difference: Summary | None
    """Paired ``bound(against) - bound(arm)`` in nats per token over the shared seeds."""
    excess_reduction_pct: Summary | None
    """Paired ``100 d / excess(against)``: the share of the comparator's excess over the entropy removed."""

    @property
    def verdict(self) -> str:
        d = self.difference
        if d is None:
            return "no shared seeds"
        if d.n < 2 or math.isnan(d.lo):
            return "one seed: no interval"
        if d.lo > 0:
            return f"{self.comparison.arm} lower"
        if d.hi < 0:
            return f"{self.comparison.arm} higher"
        return "no detectable difference"

    def as_dict(self) -> dict[str, Any]:
        def s(x: Summary | None) -> dict | None:
            return None if x is None else {k: getattr(x, k) for k in ("n", "mean", "sd", "lo", "hi")}

        c = self.comparison
        return {"arm": c.arm, "against": c.against, "budget": c.budget, "primary": c.primary,
                "difference_nats": s(self.difference), "excess_reduction_pct": s(self.excess_reduction_pct),
                "verdict": self.verdict}


def check_comparisons(comparisons: list[Comparison] | None, arms: dict[str, bool], fail: Any) -> list[Comparison]:
    """The study file's comparisons (typed by the library) checked against its arms (``arms``: name ->
    equal_flops); ``fail(msg)`` raises."""
    out = list(comparisons or [])
    for i, comp in enumerate(out):
        for name in (comp.arm, comp.against):
            if name not in arms:
                fail(f"comparisons[{i}] names {name!r}, which is no arm; arms: {', '.join(arms)}")
        if comp.budget not in BUDGETS:
            fail(f"comparisons[{i}].budget must be steps or flops, got {comp.budget!r}")
        if comp.budget == "flops" and not (arms[comp.arm] and arms[comp.against]):
            fail(f"comparisons[{i}] reads equal FLOPs, but {comp.arm!r} or {comp.against!r} has equal_flops: false")
    if sum(c.primary for c in out) > 1:
        fail("at most one comparison may be primary: true")
    return out


def nats(ppl: float) -> float:
    return math.log(ppl)


def excess_curves(curves: dict[int, dict[int, float]], entropy: float) -> dict[int, dict[int, float]]:
    """seed -> step -> excess over the exact entropy (nats per token), from bound curves in PPL."""
    return {s: {st: nats(v) - entropy for st, v in c.items() if v > 0 and math.isfinite(v)} for s, c in curves.items()}


def compare(c: Comparison, readings: dict[str, dict[str, dict[int, float]]],
            entropy: dict[str, float] | None) -> ComparisonResult:
    """``readings[budget][arm]``: seed -> bound (PPL); ``entropy``: arm -> H on its scored positions, or None."""
    a, b = readings[c.budget].get(c.arm, {}), readings[c.budget].get(c.against, {})
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return ComparisonResult(c, None, None)
    diffs = [nats(b[s]) - nats(a[s]) for s in seeds]
    red = None
    if entropy is not None:
        excess = [nats(b[s]) - entropy[c.against] for s in seeds]
        red = summarise([100.0 * d / e for d, e in zip(diffs, excess, strict=True)]) if all(e > 0 for e in excess) else None
    return ComparisonResult(c, summarise(diffs), red)


def comparisons_markdown(results: list[ComparisonResult], hypothesis: str | None) -> list[str]:
    if not results and not hypothesis:
        return []
    lines = ["", "**Pre-registered comparisons** (written into the study file before the first run)", ""]
    if hypothesis:
        lines += ["> " + line for line in hypothesis.strip().splitlines()] + [""]
    if results:
        lines += ["| comparison | budget | seeds | bound(against) - bound(arm), nats/token | share of the excess removed "
                  "| verdict (95% interval) |", "|---|---|---|---|---|---|"]
        for r in results:
            c = r.comparison
            d = "—" if r.difference is None else r.difference.text(4)
            e = "—" if r.excess_reduction_pct is None else r.excess_reduction_pct.text(1) + " %"
            lines.append(f"| {'**primary** ' if c.primary else ''}{c.arm} vs {c.against} | equal {c.budget} | "
                         f"{0 if r.difference is None else r.difference.n} | {d} | {e} | {r.verdict} |")
    return lines


def truth_markdown(truth: dict[str, Any], rows: list[tuple[str, Summary | None, Summary | None, float, float]]
                   ) -> list[str]:
    """The arms' excess over the exact entropy at both budgets. ``rows``: (arm, at steps, at flops, H used, the
    unigram + position floor's excess on the same positions)."""
    floors = truth["floors"]
    lines = ["", f"**Against the truth** (testbed: exact entropy {truth['entropy_per_token']:.4f} ± "
                 f"{truth['entropy_per_token_se']:.4f} nats/token over all L positions, "
                 f"{truth['entropy_per_token_skip_first']:.4f} over 1..L-1; unigram + position floor "
                 f"{floors['unigram_position']:.4f}, unigram {floors['unigram']:.4f})", "",
             "Excess = ln(bound) - exact entropy on the positions the kind scores, nats/token (0 = perfect). The "
             "floor column is the unigram + position floor's own excess on those positions: an arm above it has "
             "learned no context.", "",
             "| arm | H used | excess at equal steps | excess at equal FLOPs | floor's excess | below the floor (steps) |",
             "|---|---|---|---|---|---|"]
    for name, st, fl, h, floor_excess in rows:
        below = "—" if st is None else ("yes" if st.mean < floor_excess else "**no**")
        lines.append(f"| {name} | {h:.4f} | {'—' if st is None else st.text(4)} | {'—' if fl is None else fl.text(4)} "
                     f"| {floor_excess:.4f} | {below} |")
    return lines
