"""The fast-sampling benchmark's models (benchmarks/fast_sampling.py): trained seeded end to end (two runs, the
same weights, whatever state the global RNG is in), cached by the recipe's hash, and a run killed after a
checkpoint resumes to exactly the weights of an uninterrupted one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from adlm_model.testbed import Testbed, TestbedConfig

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "fast_sampling.py"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec = importlib.util.spec_from_file_location("fast_sampling_bench", BENCH)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
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
    d, _, _ = bench.train("mdlm", tb, 6, tmp_path / "killed", checkpoint_every=3)
    assert calls == [3, 4, 5]
    assert all(torch.equal(x, y) for x, y in zip(_weights(a), _weights(d), strict=True))
    # Another recipe is another model.
    e, _, _ = bench.train("mdlm", tb, 6, tmp_path / "a", seed=1, checkpoint_every=3)
    assert len(list((tmp_path / "a").iterdir())) == 2
    assert not all(torch.equal(x, y) for x, y in zip(_weights(a), _weights(e), strict=True))
