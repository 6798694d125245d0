"""The fast-sampling benchmark (benchmarks/fast_sampling.py): its models trained seeded end to end (two runs, the
same weights, whatever state the global RNG is in or whichever process draws the rows), cached by the recipe's
hash, resumed exactly after a kill; its figures (benchmarks/_fast_sampling_figures.py) equal to a recomputation
written here from the definitions alone, on hand-built frontiers whose answers are known and on the frontier JSON
a real run wrote; and the distance gate's refusal on the default path."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from adlm_model.testbed.language import Testbed, TestbedConfig
from tests.conftest import load_script

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "fast_sampling.py"
TOLERANCE, IMPOSSIBLE_POINTS = 0.05, 0.05  # the definitions' 5% and 5 points, written here on purpose
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH.parent))
    try:
        yield load_script(BENCH, "fast_sampling_bench", register=True)
    finally:
        sys.path.remove(str(BENCH.parent))
        sys.modules.pop("fast_sampling_bench", None)


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_training_is_seeded_cached_and_resumes_exactly(bench, tmp_path, monkeypatch):
    tb = Testbed(TestbedConfig(length=8, seed=1))
    torch.rand(17)  # the global RNG in some state: the weights must not depend on it
    a, _, meta = bench.train("mdlm", tb, 6, tmp_path / "a", checkpoint_every=3)
    torch.rand(5)
    b, _, _ = bench.train("mdlm", tb, 6, tmp_path / "b", checkpoint_every=3)
    assert all(torch.equal(x, y) for x, y in zip(_weights(a), _weights(b), strict=True))
    # Rows drawn ahead by loader processes are the same rows: the same weights.
    w, _, _ = bench.train("mdlm", tb, 6, tmp_path / "w", checkpoint_every=3, loader_workers=2)
    assert all(torch.equal(x, y) for x, y in zip(_weights(a), _weights(w), strict=True))
    assert meta["done"] and len(list((tmp_path / "a").iterdir())) == 1
    # A second call reuses the cached model (no training: no step is taken).
    calls = []
    real = bench.TrainStep.__call__  # the pipeline's step, which the benchmark trains with
    monkeypatch.setattr(bench.TrainStep, "__call__", lambda self, b, **k: calls.append(1) or real(self, b, **k))
    c, _, _ = bench.train("mdlm", tb, 6, tmp_path / "a", checkpoint_every=3)
    assert not calls and all(torch.equal(x, y) for x, y in zip(_weights(a), _weights(c), strict=True))

    # Killed at step 5 (after the checkpoint at 3), then rerun: resumes at 3 and ends with the same weights.
    def dies(self, batches, *, step, **kw):
        if step == 4:
            raise KeyboardInterrupt
        return real(self, batches, step=step, **kw)

    monkeypatch.setattr(bench.TrainStep, "__call__", dies)
    with pytest.raises(KeyboardInterrupt):
        bench.train("mdlm", tb, 6, tmp_path / "killed", checkpoint_every=3)
    (run,) = (tmp_path / "killed").iterdir()
    assert (run / "checkpoint" / "trainer_state.safetensors").is_file() and not (run / "meta.json").exists()
    monkeypatch.setattr(bench.TrainStep, "__call__",
                        lambda self, b, *, step, **k: calls.append(step) or real(self, b, step=step, **k))
    d, _, _ = bench.train("mdlm", tb, 6, tmp_path / "killed", checkpoint_every=3, loader_workers=1)
    assert calls == [3, 4, 5]  # resumed with the rows drawn ahead from step 3 on
    assert all(torch.equal(x, y) for x, y in zip(_weights(a), _weights(d), strict=True))
    # Another recipe is another model.
    e, _, _ = bench.train("mdlm", tb, 6, tmp_path / "a", seed=1, checkpoint_every=3)
    assert len(list((tmp_path / "a").iterdir())) == 2
    assert not all(torch.equal(x, y) for x, y in zip(_weights(a), _weights(e), strict=True))
    # So is another network size (--hidden, --blocks): its own folder, its own width.
    f, cfg, _ = bench.train("mdlm", tb, 6, tmp_path / "a", checkpoint_every=3, hidden=16, blocks=1)
    assert len(list((tmp_path / "a").iterdir())) == 3 and (cfg.hidden, cfg.n_blocks) == (16, 1)


# ------------------------------------------------------------------------------------------------------------
# The figures, recomputed here from the definitions alone (every row counted, paired rows, a 95% percentile
# bootstrap of 2,000 draws seeded 0, the upper end at 5%, impossible rows within 5 points, chosen on the selection
# set, printed from the measurement set)


def _nll(row_logp: list, length: int, penalty: float) -> np.ndarray:
    return np.array([penalty if v is None else -v / length for v in row_logp])


def _upper(a: np.ndarray, b: np.ndarray) -> float:
    idx = np.random.default_rng(0).integers(0, len(a), size=(2000, len(a)))
    return float(np.quantile(a[idx].mean(1) / b[idx].mean(1) - 1, 0.975))


def _speedup_ci(base: list[float], times: list[float]) -> tuple[float, float]:
    """The speedup's 95% interval: the repeats resampled jointly, the ratio of the medians."""
    b, t = np.asarray(base), np.asarray(times)
    idx = np.random.default_rng(0).integers(0, len(t), size=(2000, len(t)))
    lo, hi = np.quantile(np.median(b[idx], axis=1) / np.median(t[idx], axis=1), [0.025, 0.975])
    return float(lo), float(hi)


def _set(points: list[dict], length: int, penalty: float) -> dict[str, dict]:
    b, bt = _nll(points[0]["row_logp"], length, penalty), np.median(points[0]["times"])
    paper = [p["times"] for p in points if p["method"] == "paper-T"]
    out = {}
    for p in points:
        a = _nll(p["row_logp"], length, penalty)
        out[p["label"]] = {"method": p["method"], "steps": p["steps"], "nll": a.mean(), "upper": _upper(a, b),
                           "impossible": sum(v is None for v in p["row_logp"]) / len(a),
                           "speedup": bt / np.median(p["times"]),
                           "speedup_ci": _speedup_ci(points[0]["times"], p["times"]),
                           "vs_paper": np.median(paper[0]) / np.median(p["times"]) if paper else None,
                           "vs_paper_ci": _speedup_ci(paper[0], p["times"]) if paper else None}
    base_impossible = out[points[0]["label"]]["impossible"]
    for f in out.values():
        f["ok"] = f["upper"] <= TOLERANCE and f["impossible"] <= base_impossible + IMPOSSIBLE_POINTS
    return out


def _recompute(name: str, m: dict) -> dict[str, float]:
    """The RESULT lines one model's entry of the frontier JSON implies."""
    if m.get("refused"):
        return {}
    sel = _set(m["selection"]["points"], m["length"], m["penalty"])
    meas = _set(m["measurement"]["points"], m["length"], m["penalty"])
    out = {f"fast_sampling_sample_excess_{name}": meas[m["measurement"]["points"][0]["label"]]["nll"] - m["entropy"]}
    fast = [(f["speedup"], k) for k, f in sel.items() if f["method"] in ("threshold", "dual", "prefix") and f["ok"]]
    # a speedup is a RESULT only when its interval lies above 1
    if fast and meas[max(fast)[1]]["ok"]:
        chosen = meas[max(fast)[1]]
        if chosen["speedup_ci"][0] > 1:
            out[f"fast_sampling_speedup_at_5pct_{name}"] = chosen["speedup"]
        if chosen["vs_paper"] is not None and chosen["vs_paper_ci"][0] > 1:
            out[f"fast_sampling_speedup_vs_paper_T_at_5pct_{name}"] = chosen["vs_paper"]
    students = [(f["steps"], -f["speedup"], k) for k, f in sel.items() if f["method"] == "distilled" and f["ok"]]
    if students and meas[min(students)[2]]["ok"]:
        out[f"distilled_steps_at_5pct_{name}"] = float(min(students)[0])
        if meas[min(students)[2]]["speedup_ci"][0] > 1:
            out[f"distilled_speedup_at_5pct_{name}"] = meas[min(students)[2]]["speedup"]
    return out


def _results(items: list) -> dict[str, float]:
    return {it[1]: it[2] for it in items if it[0] == "RESULT"}


def _printed(out: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"^RESULT (\S+)=(\S+)$", out, flags=re.M)}


def _same(a: dict[str, float], b: dict[str, float], rel: float = 1e-9) -> bool:
    return a.keys() == b.keys() and all(math.isclose(a[k], b[k], rel_tol=rel) for k in a)


# A hand-built frontier whose answers are known. L = 10, impossible rows at 5 nats/token, 4 batches of 10 rows; the
# baseline's rows at 3.0-3.4 nats/token (mean 3.2), one second a batch.
L10, PENALTY = 10, 5.0
BASE = [3.0 + 0.1 * (i % 5) for i in range(40)]


def _point(label: str, method: str, nll: list[float | None], times: list[float], steps: int = 1) -> dict:
    return {"label": label, "method": method, "steps": steps, "times": times,
            "row_logp": [None if v is None else -v * L10 for v in nll]}


def _scaled(f: float) -> list[float]:
    return [f * v for v in BASE]


def _frontier(measured_threshold: float = 1.03, threshold_times: list[float] | None = None) -> dict:
    sel = [
        _point("baseline", "baseline", BASE, [1.0] * 4, 10),
        _point("A", "threshold", _scaled(1.03), [0.5] * 4),  # +3% on every row: passes, 2x
        # +4% on average but noisy: the interval ends above 5% (passes only on its point estimate), 4x
        _point("B", "dual", [v * 1.04 + (0.6 if i % 2 else -0.6) for i, v in enumerate(BASE)], [0.25] * 4),
        # one impossible row (2.5%, within 5 points): +4% on the possible rows, over 5% with every row counted, 3x
        _point("C", "prefix", [None if i == 7 else 1.04 * v for i, v in enumerate(BASE)], [1 / 3] * 4),
        # 15% impossible rows (over 5 points) with better rows: -7.8% with every row counted, 2.5x
        _point("D", "dual", [None if i % 5 == 0 and i < 30 else 0.8 * v for i, v in enumerate(BASE)], [0.4] * 4),
        _point("distilled T=8", "distilled", _scaled(1.02), [0.4] * 4, 8),  # the fewest steps that pass: 8
        _point("teacher T=8", "teacher", _scaled(1.01), [0.3] * 4, 8),  # passes and is faster: never a fast method
        _point("distilled T=4", "distilled", _scaled(1.06), [0.2] * 4, 4),
        _point("distilled T=2", "distilled", _scaled(1.2), [0.1] * 4, 2),
    ]
    meas = [
        _point("baseline", "baseline", BASE, [1.0, 1.1, 0.9, 1.0], 10),
        _point("A", "threshold", _scaled(measured_threshold), threshold_times or [0.6] * 4),  # 1 / 0.6 on fresh seeds
        _point("distilled T=8", "distilled", _scaled(1.02), [0.5] * 4, 8),
        _point("teacher T=8", "teacher", _scaled(1.01), [0.4] * 4, 8),
        _point("paper-T", "paper-T", BASE, [10.0] * 4, 1024),
    ]
    return {"length": L10, "penalty": PENALTY, "entropy": 2.5, "truth_nll": 2.5, "refused": None,
            "selection": {"points": sel}, "measurement": {"points": meas},
            "choice": {"per_method": {"threshold": "A"}, "fast": "A", "distilled": "distilled T=8"}}


def test_the_figures_are_the_definitions_on_a_frontier_whose_answers_are_known(bench):
    m = _frontier()
    want = {"fast_sampling_sample_excess_x": 0.7, "fast_sampling_speedup_at_5pct_x": 1.0 / 0.6,
            "fast_sampling_speedup_vs_paper_T_at_5pct_x": 10.0 / 0.6, "distilled_steps_at_5pct_x": 8.0,
            "distilled_speedup_at_5pct_x": 2.0}
    assert _same(_recompute("x", m), want)  # the recomputation above is itself right
    assert _same(_results(bench.figures("x", m)), want), bench.figures("x", m)
    for points in (m["selection"]["points"], m["measurement"]["points"]):  # every interval, from its definition
        ours, theirs = _set(points, L10, PENALTY), bench.summarize(points, L10, PENALTY)
        for label, f in ours.items():
            assert np.allclose(theirs[label]["speedup_ci"], f["speedup_ci"], rtol=1e-12), label
            assert math.isclose(theirs[label]["excess_ci"][1], f["upper"], rel_tol=1e-12), label
            if f["vs_paper_ci"] is not None:
                assert np.allclose(theirs[label]["speedup_vs_paper_T_ci"], f["vs_paper_ci"], rtol=1e-12), label
    lo, hi = _set(m["measurement"]["points"], L10, PENALTY)["A"]["speedup_ci"]
    assert 1.0 / 0.6 - hi > 0.1 or lo - 1.0 / 0.6 < -0.1 or hi - lo > 0.2 + 1e-9  # not a fixed +-0.1 by chance
    assert any(f"speedup 1.667 [{lo:.3f}, {hi:.3f}]" in it[1] for it in bench.figures("x", m) if it[0] == "say")
    s = bench.summarize(m["selection"]["points"], L10, PENALTY)
    c = s["C"]  # every row counted: the impossible row at the floor, in the mean
    assert math.isclose(c["nll"], (sum(1.04 * v for i, v in enumerate(BASE) if i != 7) + PENALTY) / 40)
    assert c["excess"] > TOLERANCE and c["nll_possible"] < c["nll"] and not c["passes"]
    assert s["B"]["excess"] <= TOLERANCE < s["B"]["excess_ci"][1] and not s["B"]["passes"]
    assert s["D"]["excess_ci"][1] <= TOLERANCE and s["D"]["impossible"] > IMPOSSIBLE_POINTS and not s["D"]["passes"]
    # chosen on fresh seeds, where the setting no longer passes: no speedup line, the reason said
    items = bench.figures("x", _frontier(measured_threshold=1.08))
    assert "fast_sampling_speedup_at_5pct_x" not in _results(items)
    assert "fast_sampling_speedup_vs_paper_T_at_5pct_x" not in _results(items)
    assert any("does not pass at 5% on fresh seeds" in it[1] for it in items if it[0] == "say")
    # a chosen setting that passes on fresh seeds but whose speedup interval includes 1: no speedup is claimed
    slow = _frontier(threshold_times=[0.9, 1.1, 1.0, 0.95])
    items = bench.figures("x", slow)
    assert _same(_results(items), _recompute("x", slow))
    assert "fast_sampling_speedup_at_5pct_x" not in _results(items) and "distilled_speedup_at_5pct_x" in _results(items)
    lo, hi = _set(slow["measurement"]["points"], L10, PENALTY)["A"]["speedup_ci"]
    assert lo <= 1 <= hi
    assert any(it[1].startswith("x: no detectable speedup over the baseline: ") and f"[{lo:.3f}, {hi:.3f}]" in it[1]
               for it in items if it[0] == "say"), items
    # no paper-T point measured (--skip-paper-t): no line against it
    m = _frontier()
    m["measurement"]["points"] = m["measurement"]["points"][:-1]
    assert "fast_sampling_speedup_vs_paper_T_at_5pct_x" not in _results(bench.figures("x", m))
    # a model the distance gate refused: its reason, and nothing else
    m["refused"] = "x is farther from the truth than 0.3 nats/token"
    assert bench.figures("x", m) == [("say", "NO SPEEDUP for x: x is farther from the truth than 0.3 nats/token")]


def test_the_printed_result_lines_are_the_figures(bench, capsys):
    """What the benchmark prints (``report``, the run's last step) on a frontier whose answers are known: every
    RESULT line the definitions imply, to the 4 significant digits it prints, and no other; the chosen setting's
    line with its intervals. (The toy run below prints no speedup line: its models pass nothing.)"""
    from _record import Recording

    m = _frontier()
    m["distance"] = {"bound_excess": 0.1, "sample_excess": 0.7}
    rec = Recording("fast_sampling")
    bench.report({"x": m}, [("x", bench.figures("x", m))], rec)
    out = capsys.readouterr().out
    want = _recompute("x", m)
    assert "fast_sampling_speedup_at_5pct_x" in want and _same(_printed(out), want, rel=1e-3), (out, want)
    lo, hi = _set(m["measurement"]["points"], L10, PENALTY)["A"]["speedup_ci"]
    assert "x: chosen A: " in out and f"speedup 1.667 [{lo:.3f}, {hi:.3f}]" in out
    assert any("chosen A" in n for n in rec.notes)


def test_the_baseline_draws_its_final_step(bench, monkeypatch):
    """The baseline is ancestral sampling whose last step draws the positions still masked from p_x0 (the
    reference's argmax there would make it another sampler). At T = L that step fills about one position in
    100,000 (T_MIN = 1e-5), too rare to see in a test's rows, so the call itself is checked: every ancestral draw
    of the benchmark (baseline, paper-T, students, teacher) asks the sampler for ``final="draw"``, and gives the
    rows of that call."""
    from adlm_model.sampling.samplers import diffusion_sample, resolve_prefix
    from adlm_model.testbed.language import BOS_ID, EOS_ID, MASK_ID
    from tests.support.models import randomized

    tb = Testbed(TestbedConfig(length=8, seed=1))
    cfg = bench.network_config("mdlm", tb, hidden=16, blocks=1)
    model = randomized(cfg, seed=2, std=0.5)
    finals = []

    def spy(*args, **kw):
        finals.append(kw.get("final", "greedy"))  # the sampler's own default is the greedy step
        return diffusion_sample(*args, **kw)

    monkeypatch.setattr(bench, "diffusion_sample", spy)
    for method, steps in (("baseline", tb.length), ("paper-T", 12), ("distilled", 2), ("teacher", 2)):
        rows, _, _ = bench.draw(bench._spec(method, model, "mdlm", steps), cfg, tb, 16, seed=3)
    assert finals == ["draw"] * 4
    tokens = torch.full((1, tb.length), MASK_ID, dtype=torch.long)
    tokens[0, 0], tokens[0, -1] = BOS_ID, EOS_ID
    z, k = resolve_prefix((tokens, tokens != MASK_ID), 16, tb.length, cfg, torch.device("cpu"))
    with torch.no_grad():
        want = diffusion_sample(model, cfg, z, k, steps=2, sampler="mdlm", nucleus_p=1.0,
                                generator=torch.Generator().manual_seed(3), progress=None, cache=True, final="draw")
    assert torch.equal(rows, want)


@pytest.mark.slow
def test_the_whole_benchmark_runs_tiny_and_its_results_are_recomputed_from_its_json(bench, tmp_path, capsys,
                                                                                   monkeypatch):
    """The benchmark end to end at toy size so that it cannot rot: the natural preset, MDLM (ADLM's distillation:
    tests/model/test_distill.py), one SDTT round, a few rows, a model of 4 steps let through the distance gate
    (``--max-excess``), the paper's T cut to 12 steps. Every RESULT line it prints is what the frontier JSON it wrote
    implies (recomputed above), its record lists them, and the selection and measurement sets are drawn at disjoint
    seeds. On the default path the same far model gets the gate's reason and nothing else; with
    ``--sweep-far-models`` every method is timed on it, still without a figure."""
    monkeypatch.setattr(bench, "PAPER_T", {"mdlm": 12, "adlm": 12})
    tiny = ["--length", "8", "--kinds", "mdlm", "--train-steps", "4", "--batch", "8", "--samples", "16",
            "--repeats", "2", "--measure-repeats", "2", "--distill-rounds", "1", "--distill-steps", "2",
            "--workdir", str(tmp_path / "w"), "--plot", str(tmp_path / "frontier.png"),
            "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    assert bench.main([*tiny, "--presets", "natural", "--max-excess", "1e9", "--record", str(tmp_path / "rec")]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "frontier.json").read_text())
    assert doc["definitions"]["tolerance"] == TOLERANCE and doc["definitions"]["impossible_points"] == IMPOSSIBLE_POINTS
    assert doc["definitions"]["bootstrap"] == {"level": 0.95, "draws": 2000, "seed": 0}
    m = doc["models"]["mdlm"]
    want = _recompute("mdlm", m)
    assert _same(_printed(out), want, rel=1e-3), (out[-3000:], want)  # printed to 4 significant digits
    assert "fast_sampling_sample_excess_mdlm" in want  # the toy passes the gate at 1e9
    assert not set(m["selection"]["seeds"]) & set(m["measurement"]["seeds"])
    assert (m["measurement"]["points"][-1]["method"], m["measurement"]["points"][-1]["steps"]) == ("paper-T", 12)
    methods = {p["method"] for p in m["selection"]["points"]}
    assert methods == {"baseline", "threshold", "dual", "prefix", "distilled", "teacher"}, methods
    (record,) = (tmp_path / "rec").glob("*_fast_sampling.md")
    text = record.read_text()
    assert "frontier.json" in text and all(f"RESULT {k}=" in text for k in want), text
    import mlflow  # the run's params are every flag, the recipe's batch among them

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("adlm-fast-sampling").experiment_id])
    assert run.data.params["batch"] == "8" and run.data.params["max_excess"] == "1000000000.0", run.data.params
    # a second distillation of the same teacher reuses the cached student
    tb = Testbed(TestbedConfig.natural(length=8))
    teacher, cfg, meta = bench.train("mdlm", tb, 4, tmp_path / "w", batch=8)
    bench.distill("mdlm", teacher, cfg, tb, tmp_path / "w", meta["key"], rounds=1, steps_per_round=2)
    assert "cached SDTT round 1 student" in capsys.readouterr().out
    # the default path, the default gate (0.3): the reason, no figure, nothing timed after the gate's baseline
    assert bench.main([*tiny, "--presets", "natural", "--no-tracking"]) == 0
    out = capsys.readouterr().out
    assert "NO SPEEDUP for mdlm: mdlm is farther from the truth than 0.3" in out, out[-2000:]
    assert "RESULT" not in out
    m = json.loads((tmp_path / "frontier.json").read_text())["models"]["mdlm"]
    assert m["refused"] and "selection" not in m and "measurement" not in m
    # --sweep-far-models times every method on it, and the samples' half refuses when asked to; still no figure
    assert bench.main([*tiny, "--sweep-far-models", "--presets", "natural", "--max-samples-excess", "1e-6",
                       "--skip-paper-t", "--no-tracking"]) == 0
    out = capsys.readouterr().out
    assert "samples at T = L score" in out and "(--max-samples-excess 1e-06)" in out, out[-2000:]
    assert "RESULT" not in out
    m = json.loads((tmp_path / "frontier.json").read_text())["models"]["mdlm"]
    assert {p["method"] for p in m["selection"]["points"]} == {"baseline", "threshold", "dual", "prefix"}
    assert "measurement" not in m


@pytest.mark.parametrize("args, message", [(["--train-device", "cuda"], "this machine has no CUDA device"),
                                           (["--train-device", "tpu"], "use cpu or cuda"),
                                           (["--hidden", "12"], "the width must be a multiple of 8"),
                                           (["--batch", "0"], "train on at least one row a step"),
                                           (["--max-samples-excess", "0"], "a positive number of nats/token"),
                                           (["--repeats", "1"], "two batches a setting")])
def test_a_device_or_network_the_benchmark_cannot_use_is_refused_in_one_line(bench, tmp_path, capsys, args, message):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as e:
        bench.main([*args, "--train-only", "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and message in err, err
    assert not (tmp_path / "w").exists()  # refused before any work
