"""The fast-sampling benchmark's figures (``benchmarks/fast_sampling.py``) as a pure function of its frontier JSON.

Definitions (every RESULT line of the benchmark is computed here, from the JSON it wrote, and nowhere else):

- **Rows.** Each point of a set (``selection`` or ``measurement``) holds the exact ``log p(row)`` of every row it
  drew (``None`` for a row the language cannot emit), ``repeats x samples`` rows in repeat order, and one wall
  time per repeat. Every method draws repeat ``r``'s batch with the same prefix (BOS and EOS given) and the same
  generator seed, so row ``i`` of a method is paired with row ``i`` of the baseline.
- **Every row counts.** A row's NLL is ``-log p(row) / L`` nats/token; an impossible row is scored at the
  language's unigram floor (``penalty``: what a model that knows neither context nor position pays a token). The
  NLL of a point is the mean over all its rows; no row is dropped.
- **NLL excess** of a point: ``NLL(point) / NLL(baseline) - 1`` over the paired rows, with a percentile bootstrap
  interval (rows resampled jointly). **Speedup**: ``median(baseline times) / median(point times)`` over the
  repeats, timed interleaved (repeat ``r`` of every method of a set runs before repeat ``r + 1`` of any), with a
  bootstrap interval (repeats resampled jointly).
- **Passes at 5%**: the excess interval's upper end is at most ``TOLERANCE`` and the point's impossible-row share
  is at most the baseline's plus ``IMPOSSIBLE_POINTS``.
- **A speedup is printed** (its RESULT line) only when its interval lies above 1; an interval that includes 1 is
  said as ``no detectable speedup`` with the interval, one below 1 as a slowdown, and neither gets a RESULT line.
- **Selection, then measurement.** On the selection set each method (``FAST_METHODS``) gets its fastest passing
  setting, and the fastest of those is the benchmark's choice; the distilled students' choice is the fewest steps
  that pass. The chosen settings are then drawn and timed again on fresh seeds (the measurement set), and a RESULT
  line is printed only when its setting passes there too, with the measurement set's figures.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

TOLERANCE = 0.05
"""The NLL excess's interval must end at or below 5% over the baseline."""
IMPOSSIBLE_POINTS = 0.05
"""A point's impossible-row share may exceed the baseline's by at most 5 points."""
LEVEL, DRAWS, BOOTSTRAP_SEED = 0.95, 2000, 0
"""The bootstrap: a 95% percentile interval from 2,000 resamples of a generator seeded 0."""
FAST_METHODS = ("threshold", "dual", "prefix")
"""The samplers of the threshold family; the distilled students and their teacher are read apart."""
STEP_METHODS = ("distilled", "teacher")
"""Points of fewer ancestral steps: SDTT students at their step counts, and the teacher at the same counts."""


def definitions() -> dict:
    """What the JSON records of these definitions (a reader recomputes the figures from it)."""
    return {"tolerance": TOLERANCE, "impossible_points": IMPOSSIBLE_POINTS,
            "bootstrap": {"level": LEVEL, "draws": DRAWS, "seed": BOOTSTRAP_SEED},
            "impossible_row_nll": "the unigram floor (nats/token), the model's 'penalty'",
            "baseline": "MDLM ancestral sampling at T = L, exact row cache, the final step drawn (not argmax)"}


def row_nll(row_logp: list[float | None], length: int, penalty: float) -> np.ndarray:
    """Nats/token of every row; an impossible row (``None`` or -inf) at ``penalty``."""
    lp = np.array([-math.inf if v is None else v for v in row_logp], dtype=np.float64)
    return np.where(np.isfinite(lp), -lp / length, penalty)


def bootstrap(stat: Callable[[np.ndarray], np.ndarray], n: int) -> tuple[float, float]:
    """The percentile interval of ``stat(idx)`` (``idx``: ``(DRAWS, n)`` resampled indices, one row a draw)."""
    idx = np.random.default_rng(BOOTSTRAP_SEED).integers(0, n, size=(DRAWS, n))
    lo, hi = np.quantile(stat(idx), [(1 - LEVEL) / 2, 1 - (1 - LEVEL) / 2])
    return float(lo), float(hi)


def _speedup(base_times: list[float], times: list[float]) -> tuple[float, tuple[float, float]]:
    b, t = np.asarray(base_times, dtype=np.float64), np.asarray(times, dtype=np.float64)
    if len(b) != len(t):
        raise ValueError("a speedup pairs repeats: the two points need the same number of times")
    ci = bootstrap(lambda i: np.median(b[i], axis=1) / np.median(t[i], axis=1), len(t))
    return float(np.median(b) / np.median(t)), ci


def summarize(points: list[dict], length: int, penalty: float) -> dict[str, dict]:
    """Each point's figures against the set's baseline (its first point), by label: ``nll`` (every row),
    ``nll_possible``, ``impossible``, ``excess`` and ``excess_ci``, ``speedup`` and ``speedup_ci``,
    ``speedup_vs_paper_T`` (when the set has a paper-T point) and ``passes``."""
    base = points[0]
    b = row_nll(base["row_logp"], length, penalty)
    paper = next((p for p in points if p["method"] == "paper-T"), None)
    out: dict[str, dict] = {}
    for p in points:
        a = row_nll(p["row_logp"], length, penalty)
        if len(a) != len(b):
            raise ValueError(f"{p['label']}: {len(a)} rows against the baseline's {len(b)}: rows are paired")
        possible = np.array([v is not None and math.isfinite(v) for v in p["row_logp"]])
        s: dict = {"nll": float(a.mean()), "impossible": float(1 - possible.mean()),
                   "nll_possible": float(a[possible].mean()) if possible.any() else math.inf,
                   "excess": float(a.mean() / b.mean() - 1),
                   "excess_ci": bootstrap(lambda i, a=a: a[i].mean(1) / b[i].mean(1) - 1, len(a))}
        s["speedup"], s["speedup_ci"] = _speedup(base["times"], p["times"])
        if paper is not None:
            s["speedup_vs_paper_T"], s["speedup_vs_paper_T_ci"] = _speedup(paper["times"], p["times"])
        out[p["label"]] = s
    base_impossible = out[base["label"]]["impossible"]
    for s in out.values():
        s["passes"] = s["excess_ci"][1] <= TOLERANCE and s["impossible"] <= base_impossible + IMPOSSIBLE_POINTS
    return out


def choose(points: list[dict], summary: dict[str, dict]) -> dict:
    """The selection set's choices: ``per_method`` (each fast method's fastest passing setting), ``fast`` (the
    fastest of them) and ``distilled`` (the passing student of the fewest steps, the faster on a tie)."""
    def speed(p: dict) -> float:
        return summary[p["label"]]["speedup"]

    ok = [p for p in points if summary[p["label"]]["passes"]]
    per_method = {m: max((p for p in ok if p["method"] == m), key=speed)["label"]
                  for m in FAST_METHODS if any(p["method"] == m for p in ok)}
    fast = max((p for p in ok if p["label"] in per_method.values()), key=speed, default=None)
    students = [p for p in ok if p["method"] == "distilled"]
    distilled = min(students, key=lambda p: (p["steps"], -speed(p)), default=None)
    return {"per_method": per_method, "fast": fast["label"] if fast else None,
            "distilled": distilled["label"] if distilled else None}


def _fmt(s: dict) -> str:
    lo, hi = s["excess_ci"]
    slo, shi = s["speedup_ci"]
    return (f"NLL {s['nll']:.4f} ({100 * s['excess']:+.2f}% [{100 * lo:+.2f}%, {100 * hi:+.2f}%]), impossible "
            f"{s['impossible']:.3f}, speedup {s['speedup']:.3f} [{slo:.3f}, {shi:.3f}]")


def speedup_items(name: str, what: str, result: str, speedup: float, ci: tuple[float, float]) -> list:
    """The lines of one speedup: its RESULT line when its interval lies above 1, else a line saying there is no
    detectable speedup (the interval includes 1) or a slowdown (it lies below 1), with the interval."""
    lo, hi = ci
    shown = f"{speedup:.3f} [{lo:.3f}, {hi:.3f}]"
    if lo > 1:
        return [("RESULT", result, speedup)]
    if hi >= 1:
        return [("say", f"{name}: no detectable speedup {what}: {shown}, an interval that includes 1")]
    return [("say", f"{name}: a slowdown {what}: {shown}, an interval below 1")]


def figures(name: str, model: dict) -> list[tuple[str, str | float]]:
    """One model's output lines in order: ``("RESULT", name, value)`` items and ``("say", text)`` items.

    ``model``: the frontier JSON's entry (``length``, ``penalty``, ``entropy``, ``refused``, ``selection`` and
    ``measurement`` with their ``points``, ``choice``)."""
    out: list = []
    if model.get("refused"):
        return [("say", f"NO SPEEDUP for {name}: {model['refused']}")]
    length, penalty = model["length"], model["penalty"]
    sel = model["selection"]["points"]
    choice = choose(sel, summarize(sel, length, penalty))
    if choice != model["choice"]:
        raise ValueError(f"{name}: the JSON's choice {model['choice']} is not what its selection set gives {choice}")
    meas = model["measurement"]["points"]
    m = summarize(meas, length, penalty)
    base = m[meas[0]["label"]]
    out.append(("RESULT", f"fast_sampling_sample_excess_{name}", base["nll"] - model["entropy"]))
    filled = meas[0].get("final_filled", 0)
    out.append(("say", f"{name}: baseline NLL {base['nll']:.4f} nats/token (impossible {base['impossible']:.3f}; its "
                       f"final step filled {filled} of {len(meas[0]['row_logp']) * (length - 2)} positions); the "
                       f"language's own rows {model['truth_nll']:.4f}; exact entropy {model['entropy']:.4f}"))
    fast = choice["fast"]
    if fast is None:
        out.append(("say", f"MISS for {name}: no threshold/dual/prefix setting passes at 5% on the selection set"))
    elif not m[fast]["passes"]:
        out.append(("say", f"MISS for {name}: the chosen setting {fast} does not pass at 5% on fresh seeds: "
                           f"{_fmt(m[fast])}"))
    else:
        out.append(("say", f"{name}: chosen {fast}: {_fmt(m[fast])}"))
        out += speedup_items(name, "over the baseline", f"fast_sampling_speedup_at_5pct_{name}", m[fast]["speedup"],
                             m[fast]["speedup_ci"])
        if "speedup_vs_paper_T" in m[fast]:
            lo, hi = m[fast]["speedup_vs_paper_T_ci"]
            out.append(("say", f"{name}: against the paper's T: {m[fast]['speedup_vs_paper_T']:.3f} "
                               f"[{lo:.3f}, {hi:.3f}]"))
            out += speedup_items(name, "over the paper's T", f"fast_sampling_speedup_vs_paper_T_at_5pct_{name}",
                                 m[fast]["speedup_vs_paper_T"], m[fast]["speedup_vs_paper_T_ci"])
    if any(p["method"] == "distilled" for p in sel):
        d = choice["distilled"]
        if d is None:
            out.append(("say", f"MISS for {name}: no distilled student passes at 5% on the selection set"))
        elif not m[d]["passes"]:
            out.append(("say", f"MISS for {name}: the chosen student {d} does not pass at 5% on fresh seeds: "
                               f"{_fmt(m[d])}"))
        else:
            steps = next(p["steps"] for p in meas if p["label"] == d)
            out.append(("say", f"{name}: chosen student {d}: {_fmt(m[d])}"))
            out.append(("RESULT", f"distilled_steps_at_5pct_{name}", float(steps)))
            out += speedup_items(name, f"of the student {d}", f"distilled_speedup_at_5pct_{name}", m[d]["speedup"],
                                 m[d]["speedup_ci"])
    return out
