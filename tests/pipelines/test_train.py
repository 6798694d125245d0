"""pipelines/train.py on real local Ray, real shards from prepare_data and a real sqlite MLflow store:
a 2-worker run trains, validates, checkpoints and registers; a killed worker is restarted and the run ends at
max_steps, and a resumed run equals an uninterrupted one; bad inputs fail before Ray."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pipelines.training.trainer as train_mod
from adlm_model import ConfigError, load_checkpoint
from pipelines.core.faults import ENV as FAULT_ENV
from pipelines.data.manifest import DataMismatchError
from pipelines.training.checkpoints import list_checkpoints
from pipelines.training.config import load_config
from pipelines.training.optim import lr_factor
from tests.conftest import free_port
from tests.support.data import TINY_MODEL, data_overrides

ROOT = Path(__file__).resolve().parents[2]


def _cfg(data: Path, name: str, *extra: str):
    return load_config(ROOT / "configs" / "demo.yaml", [
        *data_overrides(data), *TINY_MODEL, f"run.name={name}", "batch.global_batch=16", "batch.micro_batch=4",
        "run.val_every=10", "run.ckpt_every=5", "run.log_every=1", "run.val_batches=2", "run.num_to_keep=2",
        "optim.warmup_steps=5", "optim.lr=3e-3", "ema=0.9", "scaling.num_workers=2", "failure.max_failures=1",
        "mlflow.experiment=test-train", *extra])


def _history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    import mlflow

    return sorted((m.step, m.value) for m in mlflow.MlflowClient(uri).get_metric_history(run_id, key))


FULL = "full-é✓"
"""The reference run's name, not ASCII: Ray Train tags its metrics with it, and Ray's metrics take ASCII tags alone
(such a name failed the run in its controller)."""


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, tiny_data: Path, ray_session):
    """One work directory and sqlite store for the module; the uninterrupted 20-step reference run."""
    wd = tmp_path_factory.mktemp("train-work")
    uri = f"sqlite:///{wd / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADLM_WORKDIR", str(wd))
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        full = train_mod.train(_cfg(tiny_data, FULL, "run.max_steps=20"))
        yield {"wd": wd, "uri": uri, "full": full, "data": tiny_data}


@pytest.fixture()
def env(shared, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ADLM_WORKDIR", str(shared["wd"]))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", shared["uri"])
    return shared


@pytest.mark.slow
def test_two_worker_run_trains_validates_checkpoints_and_registers(env) -> None:
    import mlflow

    from pipelines.tracking.registry import get_version, resolve_model

    res, uri = env["full"], env["uri"]
    assert res.step == 20 and res.registered_version is not None
    # It learned: training loss at the end below the start, validation bound finite and improving.
    loss = _history(uri, res.run_id, "train/loss")
    assert [s for s, _ in loss] == list(range(1, 21))
    assert sum(v for _, v in loss[-5:]) / 5 < sum(v for _, v in loss[:5]) / 5 - 0.3
    val = _history(uri, res.run_id, "val/ppl")
    assert [s for s, _ in val] == [10, 20] and val[-1][1] < val[0][1] and math.isfinite(val[-1][1])
    assert res.val_ppl == pytest.approx(val[-1][1])
    for key in ("train/nll", "train/anchor_loss", "train/gamma_k", "train/lr", "train/grad_norm",
                "train/tokens_per_s"):
        assert _history(uri, res.run_id, key), key
    gk = dict(_history(uri, res.run_id, "train/gamma_k"))
    assert gk[1] == 0.0 and gk[20] == pytest.approx(3e-3)  # ramp over 5 steps (docs/design/method.md, section 2)
    # Checkpoints through Ray Train: num_to_keep=2 of every 5 steps, rank files of both workers.
    run_dir = env["wd"] / "ray_results" / FULL
    assert [s for s, _ in list_checkpoints(run_dir)] == [15, 20]
    ck = run_dir / "checkpoint_00000020"
    assert {"rng_rank0.json", "rng_rank1.json", "trainer_state.json", "ema.safetensors"} <= {p.name for p in ck.iterdir()}
    assert not list(ck.glob("*.pkl")) and not list(ck.glob("*.pt"))
    # MLflow: params = full config + manifest hash; plot and checkpoint artifacts; candidate alias.
    client = mlflow.MlflowClient(uri)
    run = client.get_run(res.run_id)
    assert run.data.params["model.kind"] == "adlm" and run.data.params["optim.lr"] == "0.003"
    assert len(run.data.params["data_manifest_hash"]) == 64
    arts = {a.path for a in client.list_artifacts(res.run_id)} | {a.path for a in client.list_artifacts(res.run_id, "checkpoint")}
    assert {"plots", "checkpoint/config.json", "checkpoint/ema.safetensors", "checkpoint/tokenizer.json"} <= arts
    mv = get_version("models:/adlm@candidate", uri)
    assert str(mv.version) == res.registered_version and mv.run_id == res.run_id
    for tag in ("kind", "gamma", "tau", "data_manifest_hash", "val_ppl", "run_name", "checkpoint_uri"):
        assert tag in mv.tags, tag
    assert mv.tags["data_manifest_hash"] == run.data.params["data_manifest_hash"]
    local = resolve_model("models:/adlm@candidate", uri, dst=env["wd"] / "dl")
    model, cfg, meta = load_checkpoint(local, expect={"kind": "adlm"})
    for key in ("step", "mlflow_run_id", "run_name", "tokenizer", "data_manifest_hash", "train_config"):
        assert key in meta, key
    assert meta["step"] == res.best_step == int(mv.tags["step"]) and meta["mlflow_run_id"] == res.run_id
    assert (local / "tokenizer.json").is_file()


@pytest.mark.slow
def test_a_killed_worker_and_a_resume_both_continue_exactly_as_the_uninterrupted_run(
        env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first 10 steps with the last worker killed at step 8: Ray Train restarts the group from step 5 and
    the run ends at max_steps; then the same run resumed to 20 steps; then rerun once finished. Every loss equals
    the uninterrupted run's (one fit serves both the restart and the resume: each fit is 20-30 s of start-up)."""
    import mlflow

    data, uri = env["data"], env["uri"]
    full = dict(_history(uri, env["full"].run_id, "train/loss"))
    monkeypatch.setenv(FAULT_ENV, "train.crash_at_step=8")
    first = train_mod.train(_cfg(data, "half", "run.max_steps=10"))
    monkeypatch.delenv(FAULT_ENV)
    assert first.step == 10
    assert (env["wd"] / "ray_results" / "half" / ".crashed_once").read_text() == "8"
    resumed = [int(v) for _, v in _history(uri, first.run_id, "train/resumed_from")]
    assert resumed == [5] and 8 - resumed[0] <= 5  # lost at most one checkpoint interval
    loss = _history(uri, first.run_id, "train/loss")
    assert [s for s, _ in loss] == list(range(1, 11))  # the replayed steps were not logged twice
    assert all(abs(v - full[s]) < 1e-5 for s, v in loss), loss  # the restart continued exactly

    second = train_mod.train(_cfg(data, "half", "run.max_steps=20"))
    assert first.run_id == second.run_id and second.step == 20
    runs = mlflow.MlflowClient(uri).search_runs(
        [mlflow.MlflowClient(uri).get_experiment_by_name("test-train").experiment_id],
        filter_string="tags.`adlm.run_name` = 'half'")
    assert len(runs) == 1
    resumed = _history(uri, second.run_id, "train/loss")
    assert [s for s, _ in resumed] == list(range(1, 21))  # no duplicated or missing steps
    for s1, a in resumed:
        assert abs(a - full[s1]) < 1e-5, (s1, a, full[s1])
    assert second.val_ppl == pytest.approx(env["full"].val_ppl, rel=1e-5)

    # Rerunning the finished run trains nothing (no Ray Train fit: its result is the final checkpoint's),
    # registers nothing new and moves no alias.
    client = mlflow.MlflowClient(uri)
    versions = sorted(v.version for v in client.search_model_versions("name='adlm'"))
    candidate = client.get_model_version_by_alias("adlm", "candidate").version
    monkeypatch.setattr(train_mod, "_fit", lambda *a, **k: pytest.fail("a finished run was fitted again"))
    third = train_mod.train(_cfg(data, "half", "run.max_steps=20"))
    assert (third.run_id, third.step, third.registered_version) == (second.run_id, 20, second.registered_version)
    assert third.val_ppl == pytest.approx(second.val_ppl, rel=1e-6)  # the final checkpoint's, with no fit
    assert sorted(v.version for v in client.search_model_versions("name='adlm'")) == versions
    assert client.get_model_version_by_alias("adlm", "candidate").version == candidate
    assert [s for s, _ in _history(uri, third.run_id, "train/loss")] == list(range(1, 21))


def _no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a, **k):
        raise AssertionError("Ray was started before the input was validated")

    monkeypatch.setattr(train_mod, "init_ray", boom)


@pytest.mark.parametrize("override, message", [
    (["model.vocab_size=600"], "tokenizer vocab 512 (data) vs vocab_size=600 (model)"),
    (["model.mask_id=7"], "mask id"),
    (["model.seq_len=64"], "length 32 (data) vs seq_len=64 (model)"),
])
def test_data_that_does_not_fit_the_model_is_refused(tiny_data, workdir, monkeypatch, override, message) -> None:
    _no_ray(monkeypatch)
    cfg = _cfg(tiny_data, "bad", *override)
    with pytest.raises(DataMismatchError, match="does not fit the model") as e:
        train_mod.train(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_data_inputs(tiny_data, workdir, monkeypatch, tmp_path) -> None:
    _no_ray(monkeypatch)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_data, broken)
    for p in (broken / "train").glob("part-*.parquet"):
        p.unlink()
    with pytest.raises(ConfigError, match=r"data.train: shard .*part-00000.parquet is missing; rerun pipelines.prepare_data"):
        train_mod.train(_cfg(broken, "bad"))
    with pytest.raises(ConfigError, match="data.validation: no manifest.json"):
        train_mod.train(_cfg(tiny_data, "bad", f"data.validation={tmp_path / 'nowhere'}"))
    # Validation tokenized by another tokenizer than train.
    other = tmp_path / "other"
    shutil.copytree(tiny_data, other)
    m = json.loads((other / "validation" / "manifest.json").read_text())
    m["tokenizer"]["hash"] = "0" * 64
    (other / "validation" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ConfigError, match="tokenized differently"):
        train_mod.train(_cfg(other, "bad"))


@pytest.mark.parametrize("override, message", [
    (["batch.global_batch=18"], "batch.global_batch 18 is not divisible by workers x micro_batch = 2 x 4"),
    (["model.gamma=-0.1"], "gamma must be >= 0, got -0.1"),
    (["model.tau=-1"], "tau must be >= 0, got -1"),
    (["model.kind=gpt"], "unknown model kind 'gpt': use one of mdlm, adlm, ar, bd3lm"),
    (["optim.learning_rate=1"], "optim: unknown key(s) learning_rate; known: lr, betas"),
    (["model.hiden=3"], "model: unknown key(s) hiden (did you mean 'hidden'?); known: preset, kind, vocab_size"),
    (["trainer.x=1"], "unknown key(s) trainer; known: model, data"),
    (["optim.schedule=linear"], "optim.schedule must be constant or cosine"),
    (["scaling.strategy=zero"], "scaling.strategy must be ddp or fsdp"),
])
def test_bad_config_values(tiny_data, override, message) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(tiny_data, "bad", *override)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_cli_help_and_one_line_error(tiny_data, workdir) -> None:
    out = subprocess.run([sys.executable, "-m", "pipelines.train", "--help"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    for flag in ("--config", "--set", "--workdir", "--print-config", "--init"):
        assert flag in out
    r = subprocess.run([sys.executable, "-m", "pipelines.train", "--config", "configs/demo.yaml",
                        *sum((["--set", a] for a in data_overrides(tiny_data)), []), "--set", "model.tau=-2"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.strip() == "error: tau must be >= 0, got -2"


def test_lr_schedule() -> None:
    f = lr_factor
    assert [f(s, 4, "constant", 100, 0.1) for s in (0, 1, 3, 4, 50, 99)] == [0.25, 0.5, 1.0, 1.0, 1.0, 1.0]
    assert f(4, 4, "cosine", 104, 0.1) == pytest.approx(1.0)
    assert f(54, 4, "cosine", 104, 0.1) == pytest.approx(0.55)
    assert f(104, 4, "cosine", 104, 0.1) == pytest.approx(0.1)


def test_tracker_never_waits_on_a_dead_server_and_the_spool_delivers_later(tmp_path) -> None:
    """A tracking server that is down, with MLflow's default retries (one call would wait about 4 minutes):
    queuing returns at once with nothing sent, closing spools the metrics instead of waiting, the spool
    delivers them once a store answers, and a restarted logger sends no stored step twice."""
    import mlflow

    from pipelines.tracking.runs import ensure_experiment, find_or_create_run
    from pipelines.tracking.spool import ResilientLogger, send_spool

    good = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id, created = find_or_create_run(good, ensure_experiment("outage", good, tmp_path), "r")
    assert created and find_or_create_run(good, ensure_experiment("outage", good, tmp_path), "r") == (run_id, False)
    dead = f"http://127.0.0.1:{free_port()}"
    spool = tmp_path / "run" / "tracking_spool"
    log = ResilientLogger(dead, run_id, spool_dir=str(spool), retry_s=0.05)
    for step in range(1, 4):
        log.log_metrics({"train/loss": 1.0 / step, "train/lr": 0.1}, step)
    assert log.pending() == 6  # queued, not sent: the caller never waited on the network
    assert log.flush(timeout=0.5) is False
    assert log.close(timeout=0.5) == 6 and log.pending() == 0
    assert len(list(spool.iterdir())) == 1
    client = mlflow.MlflowClient(good)
    assert not client.get_metric_history(run_id, "train/loss")
    assert send_spool(good, run_id, str(spool)) == 6 and not spool.exists()
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == [1, 2, 3]
    # A restarted logger skips steps that are already stored (no duplicated steps after a restart).
    again = ResilientLogger(good, run_id, spool_dir=str(spool))
    again.log_metrics({"train/loss": 9.0}, 3)
    again.log_metrics({"train/loss": 0.2}, 4)
    assert again.flush(timeout=60) is True and again.close() == 0
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == [1, 2, 3, 4]


def test_a_checkpoint_makes_the_queued_metrics_outlive_the_process(tmp_path, monkeypatch) -> None:
    """``persist`` (called at each checkpoint): with the store up, what is queued is sent before it returns; with
    the store down, it returns at once and the queue is in the spool, so a worker lost right after the
    checkpoint (a restart replays only later steps) loses no step: the spool sends them."""
    import mlflow

    from pipelines.tracking.runs import ensure_experiment, find_or_create_run
    from pipelines.tracking.spool import ResilientLogger, send_spool

    good = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id, _ = find_or_create_run(good, ensure_experiment("persist", good, tmp_path), "r")
    client = mlflow.MlflowClient(good)
    up = ResilientLogger(good, run_id, spool_dir=str(tmp_path / "spool-up"))
    for step in range(1, 4):
        up.log_metrics({"train/loss": 1.0 / step}, step)
    assert up.persist() == 0 and up.pending() == 0 and not (tmp_path / "spool-up").exists()
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == [1, 2, 3]
    up.close()  # (a process that dies here loses nothing)

    spool = tmp_path / "spool-down"
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # (no sender left retrying after the test)
    down = ResilientLogger(f"http://127.0.0.1:{free_port()}", run_id, spool_dir=str(spool), retry_s=0.05)
    for step in range(4, 7):
        down.log_metrics({"train/loss": 1.0 / step}, step)
    t0 = time.monotonic()
    assert down.persist(timeout=1.0) == 3 and time.monotonic() - t0 < 5  # in flight or queued again: spooled
    assert len(list(spool.iterdir())) == 1  # the process may die now: steps 4-6 are on disk
    down.close(timeout=0)
    assert send_spool(good, run_id, str(spool)) == 3
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == [1, 2, 3, 4, 5, 6]


def test_the_registered_checkpoint_is_the_best_by_validation_not_the_last(tiny_data: Path, workdir: Path) -> None:
    """A run whose validation bound gets worse at the end: the latest checkpoint stays for resuming, the best
    one is exported and registered, and says so. The run learns for 8 steps (a base rate of 10 scaled by a
    20,000-step warm-up: 5e-4 to 4e-3), then is resumed with the warm-up removed, so its last 4 steps take
    the full rate of 10 without clipping: weights jump by about 10 a step, which no model recovers from (a
    constant rate of 0.5 was tried first: its bound oscillates and sometimes ends at its best). The best
    checkpoint also survives the resume."""
    import mlflow

    sets = ("run.val_every=2", "run.ckpt_every=4", "optim.lr=10", "optim.clip=0", "ema=0.0", "scaling.num_workers=0")
    train_mod.train(_cfg(tiny_data, "diverges", "run.max_steps=8", "optim.warmup_steps=20000", *sets),
                    register=False)
    # The scheduler's base rate comes back from the checkpoint; its factor is the rerun's (no warm-up: 1).
    res = train_mod.train(_cfg(tiny_data, "diverges", "run.max_steps=12", "optim.warmup_steps=1", *sets))
    uri = os.environ["MLFLOW_TRACKING_URI"]
    val = _history(uri, res.run_id, "val/ppl")
    best_step, best = min(val, key=lambda sv: sv[1])
    assert best_step <= 8 and min(v for s, v in val if s > 8) > best, val  # it did get worse
    assert (res.best_step, res.step) == (best_step, 12) and res.best_val_ppl == pytest.approx(best)
    mv = mlflow.MlflowClient(uri).get_model_version("adlm", res.registered_version)
    assert mv.tags["checkpoint"] == "best" and mv.tags["step"] == str(best_step) and mv.tags["final_step"] == "12"
    assert float(mv.tags["val_ppl"]) == pytest.approx(best)
    _, _, meta = load_checkpoint(res.checkpoint_dir)
    assert meta["step"] == best_step and meta["checkpoint"] == "best"
    assert [s for s, _ in list_checkpoints(workdir / "ray_results" / "diverges")][-1] == 12  # for resuming


def test_bd3lm_training_searches_its_clipped_schedule_and_keeps_it_across_a_resume(tiny_data: Path,
                                                                                   workdir: Path) -> None:
    from adlm_model.interop.checkpoint import load_state

    uri = os.environ["MLFLOW_TRACKING_URI"]
    sets = ["model.kind=bd3lm", "model.block_size=4", "run.val_every=2", "run.ckpt_every=2", "scaling.num_workers=0",
            "run.clip_search_batches=1"]
    res = train_mod.train(_cfg(tiny_data, "blocks", "run.max_steps=4", *sets))
    lows, highs = _history(uri, res.run_id, "train/clip_low"), _history(uri, res.run_id, "train/clip_high")
    assert [s for s, _ in lows] == [2]  # searched at each validation before the end
    last = [s for s, _ in list_checkpoints(workdir / "ray_results" / "blocks")][-1]
    state = load_state(workdir / "ray_results" / "blocks" / f"checkpoint_{last:08d}", "trainer_state")
    assert state["clip"] == [lows[-1][1], highs[-1][1]] and state["ema_updates"] == 4
    # A longer rerun resumes with that interval (and the EMA's update count) and searches again at step 6.
    res2 = train_mod.train(_cfg(tiny_data, "blocks", "run.max_steps=8", *sets))
    assert res2.run_id == res.run_id
    assert [s for s, _ in _history(uri, res.run_id, "train/clip_low")] == [2, 6]  # step 4 ended the first run
    last = [s for s, _ in list_checkpoints(workdir / "ray_results" / "blocks")][-1]
    state = load_state(workdir / "ray_results" / "blocks" / f"checkpoint_{last:08d}", "trainer_state")
    assert state["ema_updates"] == 8


def test_a2r_trains_with_its_anchor_term_resumes_registers_and_generates(tiny_data: Path, workdir: Path) -> None:
    """The anchored AR kind through the training stage: the anchor term, its weight and both networks' gradient
    norms are logged, the validation PPL is the exact one (finite, below the uniform's), a rerun resumes the run,
    the registered version carries gamma and tau, and its checkpoint generates with the AR sampler."""
    import mlflow

    from pipelines.serving.generate import open_generator

    uri = os.environ["MLFLOW_TRACKING_URI"]
    sets = ["model.kind=a2r", "model.tau=2", "model.gamma=0.5", "run.val_every=2", "run.ckpt_every=2",
            "scaling.num_workers=0"]
    res = train_mod.train(_cfg(tiny_data, "anchored-ar", "run.max_steps=4", *sets), register=False)
    anchor = _history(uri, res.run_id, "train/anchor_loss")
    assert [s for s, _ in anchor] == [1, 2, 3, 4] and all(v > 0 for _, v in anchor)
    # The ramp min(gamma, k / K) at the steps k = 0..3 taken, K the run's max_steps (4)
    assert [v for _, v in _history(uri, res.run_id, "train/gamma_k")] == [0.0, 0.25, 0.5, 0.5]
    assert _history(uri, res.run_id, "train/grad_norm_ar") and _history(uri, res.run_id, "train/grad_norm_anchor")
    res2 = train_mod.train(_cfg(tiny_data, "anchored-ar", "run.max_steps=6", *sets))
    assert res2.run_id == res.run_id and res2.step == 6
    val = _history(uri, res.run_id, "val/ppl")
    cfg = load_config(ROOT / "configs" / "demo.yaml", [*data_overrides(tiny_data), *TINY_MODEL])
    assert [s for s, _ in val] == [2, 4, 6] and all(1.0 < v < cfg.model.vocab_size for _, v in val)
    mv = mlflow.MlflowClient(uri).get_model_version("adlm", res2.registered_version)
    assert (mv.tags["kind"], float(mv.tags["gamma"]), int(mv.tags["tau"])) == ("a2r", 0.5, 2)
    gen = open_generator(f"models:/adlm/{res2.registered_version}").generator
    out = gen.generate(gen.request(prompt="In the", length=5, seed=1))[0]
    assert out.sampler == "ar" and out.new_tokens == 5 and out.network_calls == 5 and out.text.startswith("In the")


def test_a_run_started_from_a_version_begins_with_its_ema_weights_and_records_the_lineage(
        tiny_data: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run.init (--init): a BD3-LM run starts from an MDLM version (the paper's fine-tuning; one network). Its
    step-0 weights (model and EMA) are the version's EMA weights exactly; the run, its checkpoints and its version
    name the pinned version; a resume keeps its weights and lineage; a network that does not fit, or no such
    version, is refused in one line before Ray starts."""
    import mlflow

    from pipelines.training.init import pin_init
    from pipelines.training.worker import LoopConfig, build

    uri = os.environ["MLFLOW_TRACKING_URI"]
    local = ("scaling.num_workers=0", "run.max_steps=2")
    src = train_mod.train(_cfg(tiny_data, "src", *local, "model.kind=mdlm", "run.seed=1"))
    version, _, _ = load_checkpoint(src.checkpoint_dir)  # its EMA weights
    want = version.state_dict()
    pinned = f"models:/adlm/{src.registered_version}"
    child = ("model.kind=bd3lm", "model.block_size=4")
    cfg = pin_init(_cfg(tiny_data, "child", *local, *child, "run.init=models:/adlm@candidate"), None, uri, None)
    assert cfg.run.init == pinned  # the alias, pinned: it moves when the child registers
    w = build(LoopConfig(cfg=cfg, run_id=None, tracking_uri=uri, val_split="", val_rows=0, manifest_hash="m",
                         tokenizer_spec="t", tokenizer_path=None, tokenizer_hash="h", threads=1, local_mode=True,
                         run_dir=str(workdir), resume_dir=None), rank=0, world=1, device=torch.device("cpu"))
    assert all(torch.equal(w.raw.state_dict()[k], v) for k, v in want.items())
    assert all(torch.equal(w.ema.state_dict()[k], v) for k, v in want.items() if k in w.ema.state_dict())

    res = train_mod.train(_cfg(tiny_data, "child", *local, *child, "run.init=models:/adlm@candidate"))
    mv = mlflow.MlflowClient(uri).get_model_version("adlm", res.registered_version)
    run = mlflow.MlflowClient(uri).get_run(res.run_id)
    assert mv.tags["init_from"] == run.data.tags["init_from"] == run.data.params["run.init"] == pinned
    trained, _, meta = load_checkpoint(res.checkpoint_dir, use_ema=False)
    assert meta["init_from"] == pinned and mv.tags["kind"] == "bd3lm"
    # two warm-up steps moved the weights a little from the version's (the seeded init, another seed, is far)
    assert max((trained.state_dict()[k] - v).abs().max().item() for k, v in want.items()) < 0.02
    # A resume keeps its own weights and lineage: another run.init (not even a version) is not applied.
    res2 = train_mod.train(_cfg(tiny_data, "child", "scaling.num_workers=0", "run.max_steps=4", *child,
                                "run.init=models:/adlm/99"))
    assert res2.run_id == res.run_id and load_checkpoint(res2.checkpoint_dir)[2]["init_from"] == pinned
    assert mlflow.MlflowClient(uri).get_model_version("adlm", res2.registered_version).tags["init_from"] == pinned

    _no_ray(monkeypatch)
    for sets, message in ((["model.hidden=64"], "hidden 32 there, 64 here; set model.hidden to the version's"),
                          (["model.kind=adlm"], "it is a mdlm model (network MDLM) and the recipe's is adlm"),
                          (["run.init=models:/adlm/99"], "run.init models:/adlm/99: registered model 'adlm' has no "
                                                         "version 99")):
        with pytest.raises(ConfigError) as e:
            train_mod.train(_cfg(tiny_data, "refused", *local, "model.kind=mdlm", f"run.init={pinned}", *sets))
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_same_size_tokenizer_is_refused_on_resume_and_in_evaluation(tiny_data: Path, workdir: Path,
                                                                       tmp_path_factory) -> None:
    """Data of another 512-entry BPE (trained on another slice of the corpus): the vocabulary size matches,
    the token ids mean other strings. Resuming on it and evaluating on it both fail in one line."""
    from pipelines.data.manifest import read_manifest
    from pipelines.evaluation.config import EvalConfig
    from pipelines.evaluation.plan import plan_evaluation
    from tests.support.data import make_tiny_data

    other = make_tiny_data(tmp_path_factory.mktemp("other-bpe"), train_chars=60_000, val_chars=8_000)
    mine, theirs = read_manifest(tiny_data / "train"), read_manifest(other / "train")
    assert mine.vocab_size == theirs.vocab_size and mine.tokenizer["hash"] != theirs.tokenizer["hash"]
    res = train_mod.train(_cfg(tiny_data, "tok", "run.max_steps=2", "scaling.num_workers=0"))
    with pytest.raises(ConfigError, match="trained on data of another tokenizer") as e:
        train_mod.train(_cfg(other, "tok", "run.max_steps=4", "scaling.num_workers=0"))
    assert "\n" not in str(e.value)
    with pytest.raises(DataMismatchError, match="not by the model's tokenizer") as e:
        plan_evaluation(str(res.checkpoint_dir), "ppl", EvalConfig(data=str(other)), workdir=str(workdir))
    assert "\n" not in str(e.value)
    # Its own data still plans.
    plan_evaluation(str(res.checkpoint_dir), "ppl", EvalConfig(data=str(tiny_data)), workdir=str(workdir))
    # Staged evaluation on the other tokenizer's data: the version is rejected at stage 1 with that reason,
    # never measured and never promoted.
    from pipelines.evaluation.promotion import PromotionConfig, stage_all

    uri = os.environ["MLFLOW_TRACKING_URI"]
    [out] = stage_all(PromotionConfig(model_name="adlm", stage1_rows=8, stage2_suite=("ppl",)),
                      EvalConfig(data=str(other), batch_size=8), workdir=str(workdir), tracking_uri=uri,
                      in_process=True)
    assert (out.version, out.status, out.stage) == (res.registered_version, "rejected", 1)
    assert "not by the model's tokenizer" in out.reasons[0] and not out.figures
