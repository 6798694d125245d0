"""The fast-sampling benchmark's models (benchmarks/fast_sampling.py): trained seeded end to end (two runs, the
same weights, whatever state the global RNG is in or whichever process draws the rows), cached by the recipe's
hash, and a run killed after a checkpoint resumes to exactly the weights of an uninterrupted one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from adlm_model.testbed import Testbed, TestbedConfig
from tests.conftest import load_script

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "fast_sampling.py"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH.parent))
    try:
        yield load_script(BENCH, "fast_sampling_bench")
    finally:
        sys.path.remove(str(BENCH.parent))


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
    # A second call reuses the cached model (no training: the loss is never computed).
    calls = []
    real = bench.compute_loss
    monkeypatch.setattr(bench, "compute_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    c, _, _ = bench.train("mdlm", tb, 6, tmp_path / "a", checkpoint_every=3)
    assert not calls and all(torch.equal(x, y) for x, y in zip(_weights(a), _weights(c), strict=True))

    # Killed at step 5 (after the checkpoint at 3), then rerun: resumes at 3 and ends with the same weights.
    def dies(*args, step=0, **kw):
        if step == 4:
            raise KeyboardInterrupt
        return real(*args, step=step, **kw)

    monkeypatch.setattr(bench, "compute_loss", dies)
    with pytest.raises(KeyboardInterrupt):
        bench.train("mdlm", tb, 6, tmp_path / "killed", checkpoint_every=3)
    (run,) = (tmp_path / "killed").iterdir()
    assert (run / "state.safetensors").is_file() and not (run / "meta.json").exists()
    monkeypatch.setattr(bench, "compute_loss", lambda *a, step=0, **k: calls.append(step) or real(*a, step=step, **k))
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


@pytest.mark.slow
def test_the_whole_benchmark_runs_tiny_with_a_distillation_round_on_both_presets(bench, tmp_path, capsys):
    """The benchmark end to end at toy size so that it cannot rot: both presets, MDLM (ADLM's distillation: tests/test_distill.py), one SDTT round, a few
    rows; a model of 4 steps let through the distance gate (``--max-excess``). Its RESULT lines come out, the distilled student and its control
    appear in the frontier's points, and a rerun reuses the cached student. With the gate (``--sweep-far-models``), every method is still timed on
    the far model but it gets no speedup and no student."""
    import json

    tiny = ["--length", "8", "--kinds", "mdlm", "--train-steps", "4", "--batch", "8", "--samples", "4", "--repeats", "1",
            "--skip-paper-t", "--distill-rounds", "1", "--distill-steps", "2", "--workdir", str(tmp_path / "w"),
            "--plot", str(tmp_path / "frontier.png"), "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    args = [*tiny, "--max-excess", "1e9"]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "RESULT fast_sampling_speedup_at_5pct_mdlm=" in out and "RESULT fast_sampling_sample_excess_mdlm=" in out
    # the anchored toy's samples are all impossible (true NLL inf): refused even at this gate, and said why
    assert ("RESULT fast_sampling_speedup_at_5pct_mdlm_anchored=" in out) != ("NO SPEEDUP for mdlm_anchored" in out)
    # distilled on the natural preset only (--distill-presets)
    assert "RESULT distilled_steps_at_5pct_mdlm=" in out and "RESULT distilled_speedup_at_5pct_mdlm=" in out
    points = json.loads((tmp_path / "frontier.json").read_text())["points"]
    methods = [(p["method"], p["steps"]) for p in points["mdlm"] if p["method"] in bench.STEP_METHODS]
    assert methods == [("distilled", 4), ("teacher", 4)], methods  # T0 = L = 8, one round: 4 steps
    assert not any(p["method"] == "distilled" for p in points["mdlm_anchored"])
    assert (tmp_path / "frontier.png").stat().st_size > 10_000
    import mlflow  # the run's params are every flag, the recipe's batch among them

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("adlm-fast-sampling").experiment_id])
    assert run.data.params["batch"] == "8" and run.data.params["max_excess"] == "1000000000.0", run.data.params
    students = sorted(p.name for p in (tmp_path / "w").iterdir() if "-sdtt1-" in p.name)
    assert len(students) == 1
    assert bench.main(args) == 0 and "cached SDTT round 1 student" in capsys.readouterr().out
    assert bench.main([*tiny, "--sweep-far-models", "--presets", "natural"]) == 0  # the default gate, 0.3
    out = capsys.readouterr().out
    assert "NO SPEEDUP for mdlm: mdlm is farther from the truth than 0.3" in out, out[-2000:]
    assert "RESULT fast_sampling_speedup_at_5pct_mdlm=" not in out and "RESULT distilled_steps" not in out
    points = json.loads((tmp_path / "frontier.json").read_text())["points"]["mdlm"]
    assert {p["method"] for p in points} == {"baseline", "paper-T", "threshold", "dual", "prefix"}  # all timed
    # the samples' half of the distance, printed beside every result, refuses only when asked to
    assert bench.main([*tiny, "--sweep-far-models", "--presets", "natural", "--max-excess", "1e9",
                       "--max-samples-excess", "1e-6"]) == 0
    out = capsys.readouterr().out
    assert "samples at T = L score" in out and "(--max-samples-excess 1e-06)" in out, out[-2000:]
    assert "RESULT fast_sampling_speedup_at_5pct_mdlm=" not in out


@pytest.mark.parametrize("args, message", [(["--train-device", "cuda"], "this machine has no CUDA device"),
                                           (["--train-device", "tpu"], "use cpu or cuda"),
                                           (["--hidden", "12"], "the width must be a multiple of 8"),
                                           (["--batch", "0"], "train on at least one row a step"),
                                           (["--max-samples-excess", "0"], "a positive number of nats/token")])
def test_a_device_or_network_the_benchmark_cannot_use_is_refused_in_one_line(bench, tmp_path, capsys, args, message):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as e:
        bench.main([*args, "--train-only", "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and message in err, err
    assert not (tmp_path / "w").exists()  # refused before any work
