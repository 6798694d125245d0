"""SDTT as a training recipe mode (``distill:``, pipelines/training/distill.py) on real local Ray (local mode),
real shards and a real sqlite MLflow store: a distilled MDLM and ADLM become registered versions with their
teacher as lineage and their step count as the sampler's default; a distillation killed mid-round (the
``ADLM_FAULT`` switch, in its own process) resumes in that round with that round's teacher and ends exactly as
the uninterrupted run."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pipelines.training.trainer as train_mod
from adlm_model import load_checkpoint
from pipelines.core.faults import ENV as FAULT_ENV
from pipelines.training.config import load_config
from tests.support.data import TINY_MODEL, data_overrides

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ["batch.global_batch=8", "batch.micro_batch=4", "run.val_every=100", "run.val_batches=1",
         "run.log_every=1", "optim.warmup_steps=1", "optim.lr=3e-3", "ema=0.5", "scaling.num_workers=0",
         "mlflow.experiment=test-distill"]


def _sets(data: Path, name: str, *extra: str) -> list[str]:
    return [*data_overrides(data), *TINY_MODEL, *LOCAL, f"run.name={name}", *extra]


def _cfg(data: Path, name: str, *extra: str):
    return load_config(ROOT / "configs" / "demo.yaml", _sets(data, name, *extra))


def _history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    import mlflow

    return sorted((m.step, m.value) for m in mlflow.MlflowClient(uri).get_metric_history(run_id, key))


DISTIL = ["model.kind=mdlm", "distill.rounds=2", "distill.steps_per_round=3", "distill.teacher_steps=8",
          "run.ckpt_every=4"]
"""Rounds of 3 steps, checkpoints every 4 (mid-round 2): the student samples with 8 / 2**2 = 2 steps."""


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, tiny_data: Path, ray_session):
    """One work directory and sqlite store for the module: an MDLM teacher (2 steps) and its uninterrupted
    distillation, pinned through the alias."""
    wd = tmp_path_factory.mktemp("distill-work")
    uri = f"sqlite:///{wd / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADLM_WORKDIR", str(wd))
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        src = train_mod.train(_cfg(tiny_data, "teacher-mdlm", "model.kind=mdlm", "run.max_steps=2"))
        full = train_mod.train(_cfg(tiny_data, "full", *DISTIL, "distill.teacher=models:/adlm@candidate"))
        yield {"wd": wd, "uri": uri, "data": tiny_data, "teacher": f"models:/adlm/{src.registered_version}",
               "full": full}


@pytest.fixture()
def env(shared, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ADLM_WORKDIR", str(shared["wd"]))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", shared["uri"])
    return shared


def _check_version(uri: str, res, pinned: str, kind: str, steps: int) -> dict:
    import mlflow

    mv = mlflow.MlflowClient(uri).get_model_version("adlm", res.registered_version)
    assert mv.tags["teacher"] == mv.tags["init_from"] == pinned  # the alias, pinned
    assert mv.tags["sampler_steps"] == "2" and mv.tags["distill_rounds"] == "2" and mv.tags["kind"] == kind
    assert res.checkpoint == "latest" and res.best_step == res.step == steps  # the last round's student
    _, _, meta = load_checkpoint(res.checkpoint_dir)
    assert meta["sampler_steps"] == 2 and meta["teacher"] == pinned
    loss = _history(uri, res.run_id, "train/loss")
    assert [s for s, _ in loss] == list(range(1, steps + 1)) and all(math.isfinite(v) for _, v in loss)
    return meta


def test_a_distilled_mdlm_and_adlm_are_versions_with_their_teacher_and_step_count(env) -> None:
    uri, data = env["uri"], env["data"]
    meta = _check_version(uri, env["full"], env["teacher"], "mdlm", 6)
    assert [r for _, r in _history(uri, env["full"].run_id, "distill/round")] == [0, 0, 0, 1, 1, 1]
    dts = dict(_history(uri, env["full"].run_id, "distill/dt"))
    assert dts[4] == pytest.approx(2 * dts[1]) and dts[1] == pytest.approx((1 - 1e-5) / 8)
    # Generation's default step count is the version's (textgen reads the checkpoint's sampler_steps).
    from adlm_model.inference.textgen import DEFAULT_STEPS, TextGenerator

    assert TextGenerator.default_steps_of(meta) == 2 and TextGenerator.default_steps_of({}) == DEFAULT_STEPS

    src = train_mod.train(_cfg(data, "teacher-adlm", "model.kind=adlm", "run.max_steps=1"))
    res = train_mod.train(_cfg(data, "student-adlm", "model.kind=adlm", "distill.rounds=2",
                               "distill.steps_per_round=1", "distill.teacher_steps=8", "run.ckpt_every=1",
                               f"distill.teacher=models:/adlm/{src.registered_version}"))
    _check_version(uri, res, f"models:/adlm/{src.registered_version}", "adlm", 2)


@pytest.mark.slow
def test_a_distillation_killed_mid_round_resumes_in_that_round_and_ends_as_the_uninterrupted_one(env) -> None:
    """The process is killed at step 5 (round 2, its teacher promoted at step 3); the rerun resumes from step 4
    with round 2's teacher, and every loss and the final weights equal the uninterrupted run's."""
    uri, data, full = env["uri"], env["data"], env["full"]
    distil = [*DISTIL, f"distill.teacher={env['teacher']}"]
    sets = [a for s in _sets(data, "killed", *distil) for a in ("--set", s)]
    import ray

    # The killed command joins the test session's Ray (a Ray of its own costs ~20 s to start on 2 cores).
    environ = {**os.environ, FAULT_ENV: "train.crash_at_step=5", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0",
               "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    killed = subprocess.run([sys.executable, "-m", "pipelines.train", "--config", str(ROOT / "configs" / "demo.yaml"),
                             *sets, "-q"], env=environ, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert killed.returncode != 0, killed.stderr[-2000:]
    assert (env["wd"] / "ray_results" / "killed" / ".crashed_once").read_text() == "5"
    resumed = train_mod.train(_cfg(data, "killed", *distil))
    assert resumed.step == 6 and resumed.registered_version != full.registered_version
    assert [int(v) for _, v in _history(uri, resumed.run_id, "train/resumed_from")] == [4]
    a, b = dict(_history(uri, full.run_id, "train/loss")), _history(uri, resumed.run_id, "train/loss")
    assert [s for s, _ in b] == list(range(1, 7))
    assert all(v == a[s] for s, v in b), (a, b)  # bit for bit: the same teacher, data, noise and dropout
    assert [r for _, r in _history(uri, resumed.run_id, "distill/round")] == [0, 0, 0, 1, 1, 1]
    for ema in (True, False):
        wa = load_checkpoint(full.checkpoint_dir, use_ema=ema)[0].state_dict()
        wb = load_checkpoint(resumed.checkpoint_dir, use_ema=ema)[0].state_dict()
        assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.usefixtures("one_torch_thread")
def test_a_checkpoint_mid_round_carries_that_round_teacher_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    """The loop's steps without Ray: ADLM (dropout, masking noise, the teacher's draws), rounds of 2 steps; the
    student becomes the teacher at step 2; a checkpoint at step 3 (mid round 2) read back by a fresh worker holds
    that teacher and round, and the next step equals the uninterrupted one."""
    import dataclasses

    from pipelines.training.distill import advance
    from pipelines.training.loop import optimiser_step, write_checkpoint
    from pipelines.training.worker import resume
    from tests.pipelines.test_loop_steps import _cfg as loop_cfg
    from tests.pipelines.test_loop_steps import _params, _stream, _worker

    def cfg():
        c = loop_cfg("adlm", "distill.teacher=models:/adlm/1", "distill.rounds=2", "distill.steps_per_round=2",
                     "distill.teacher_steps=8")
        return dataclasses.replace(c, run=dataclasses.replace(c.run, init=""))  # the seeded init: no registry

    def step(w) -> None:
        advance(w)
        optimiser_step(w, _stream(w, 4))

    a = _worker(cfg())
    start = _params(a)
    for _ in range(2):
        step(a)
    assert a.teacher.round == 0 and all(torch.equal(start[k], v) for k, v in a.teacher.net.state_dict().items())
    step(a)  # step index 2 opens round 2: the student's weights after 2 steps teach
    assert a.teacher.round == 1 and not all(torch.equal(start[k], v) for k, v in a.teacher.net.state_dict().items())
    write_checkpoint(a, tmp_path, {"val_ppl": 1.0})
    step(a)

    torch.manual_seed(123)
    b = _worker(cfg())
    assert resume(b, str(tmp_path), 3) == 3 and b.teacher.round == 1
    ta = a.teacher.net.state_dict()
    assert all(torch.equal(ta[k], v) for k, v in b.teacher.net.state_dict().items())
    step(b)
    pa, pb = _params(a), _params(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
