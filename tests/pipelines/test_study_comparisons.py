"""Pre-registered comparisons of a study (pipelines/studies/comparisons.py): the verdict follows the paired
interval, the excess over the exact entropy uses the entropy of each kind's scored positions, and a study file
that names a comparison the runner cannot read fails in one line; the shipped testbed study validates."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from adlm_model.config import ConfigError
from pipelines.studies.comparisons import Comparison, compare, comparisons_markdown, excess_curves
from pipelines.studies.spec import load_study, parse_study

ROOT = Path(__file__).resolve().parents[2]
BASE = {"name": "s", "config": "configs/testbed_adlm.yaml", "steps": 100, "seeds": [0, 1, 2],
        "arms": [{"name": "adlm"}, {"name": "g0", "set": {"model.gamma": 0.0}},
                 {"name": "x", "set": {"model.kind": "mdlm"}, "equal_flops": False}]}


def _readings(a: list[float], b: list[float]) -> dict:
    return {"steps": {"adlm": dict(enumerate(a)), "g0": dict(enumerate(b))}, "flops": {}}


def test_verdict_follows_the_paired_interval():
    e = math.e
    lower = compare(Comparison("adlm", "g0"), _readings([e ** 2.0, e ** 2.01, e ** 2.02], [e ** 2.1, e ** 2.1, e ** 2.13]),
                    {"adlm": 1.5, "g0": 1.5})
    assert lower.verdict == "adlm lower" and lower.difference.mean == pytest.approx(0.1, abs=1e-9)
    assert lower.excess_reduction_pct.mean == pytest.approx(100 * (0.1 / 0.6 + 0.09 / 0.6 + 0.11 / 0.63) / 3)
    same = compare(Comparison("adlm", "g0"), _readings([10, 11, 10], [10.5, 10.2, 10.1]), None)
    assert same.verdict == "no detectable difference" and same.excess_reduction_pct is None
    higher = compare(Comparison("adlm", "g0"), _readings([11, 12, 13], [10, 11, 12]), None)
    assert higher.verdict == "adlm higher"
    assert compare(Comparison("adlm", "g0", "flops"), _readings([1], [1]), None).verdict == "no shared seeds"
    md = "\n".join(comparisons_markdown([lower], "H: anchoring helps."))
    assert "> H: anchoring helps." in md and "adlm vs g0 | equal steps | 3 |" in md


def test_excess_curves_subtract_the_entropy_in_nats():
    assert excess_curves({0: {10: math.e ** 3.0}}, 2.5) == {0: {10: pytest.approx(0.5)}}


@pytest.mark.parametrize("comparisons,message", [
    ([{"arm": "adlm", "against": "nope"}], "names 'nope', which is no arm"),
    ([{"arm": "adlm", "against": "g0", "budget": "tokens"}], "budget must be steps or flops"),
    ([{"arm": "adlm", "against": "x", "budget": "flops"}], "has equal_flops: false"),
    ([{"arm": "adlm", "against": "g0", "primary": True}, {"arm": "g0", "against": "adlm", "primary": True}],
     "at most one comparison may be primary"),
    ([{"arm": "adlm", "against": "g0", "why": 1}], "comparisons[0]: unknown key(s) why"),
])
def test_bad_comparisons_fail_in_one_line(comparisons, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_study({**BASE, "comparisons": comparisons}, "s.yaml")


def test_the_shipped_testbed_study_is_preregistered():
    spec = load_study(ROOT / "studies" / "testbed.yaml")
    primary = [c for c in spec.comparisons if c.primary]
    assert len(primary) == 1 and (primary[0].arm, primary[0].against, primary[0].budget) == ("adlm", "adlm-gamma0", "steps")
    assert "PRIMARY" in spec.hypothesis and "PRECONDITION" in spec.hypothesis
    seeds = {a.name: len(a.seeds) for a in spec.arms}
    assert all(seeds[a] >= 5 for a in ("adlm", "mdlm", "mdlm-params", "adlm-gamma0"))
    assert seeds["ar"] >= 3 and seeds["bd3lm"] >= 3 and spec.data.source == ["testbed"]
