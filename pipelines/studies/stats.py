"""Statistics over seeds: mean, standard deviation and a Student-t 95% interval, plain and paired.

With three seeds the interval is wide (t_{0.975,2} = 4.30): that is the honest width, and the study's
write-up reports it rather than the standard deviation alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    """Of ``n`` values: mean, sample standard deviation (n - 1) and the t interval ``[lo, hi]`` for the mean
    at ``level`` (NaN for fewer than two values)."""

    n: int
    mean: float
    sd: float
    lo: float
    hi: float
    level: float = 0.95

    def text(self, digits: int = 1) -> str:
        """``mean ± sd [lo, hi]``, or the single value."""
        if self.n < 2:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.sd:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}]"


def t_quantile(p: float, dof: int) -> float:
    """The ``p`` quantile of Student's t with ``dof`` degrees of freedom."""
    # lazy: keeps scipy out of this module's import
    from scipy.stats import t

    return float(t.ppf(p, dof))


def summarise(values: Sequence[float], level: float = 0.95) -> Summary:
    """Mean, sd and the ``level`` t interval of ``values`` (finite floats)."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("summarise needs at least one value")
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return Summary(n, mean, math.nan, math.nan, math.nan, level)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return Summary(n, mean, sd, mean - half, mean + half, level)


def relative_gain(arm: dict[int, float], reference: dict[int, float], level: float = 0.95) -> Summary | None:
    """How much lower ``arm``'s bound is than ``reference``'s, in percent of the reference, paired by seed
    (same seed: same initialisation stream, data order and validation noise), summarised over the shared seeds;
    None when they share none."""
    seeds = sorted(set(arm) & set(reference))
    if not seeds:
        return None
    return summarise([100.0 * (reference[s] - arm[s]) / reference[s] for s in seeds], level)

