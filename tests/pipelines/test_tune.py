"""pipelines/tune.py: the search-space schema (every shipped space validates; bad spaces give one line)
and a real sweep on local Ray + sqlite MLflow: ASHA stops trials, nested child runs carry gamma/tau,
the search plot and trial table are logged, the best trial is registered, and an interrupted sweep
resumes without rerunning finished trials."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from adlm_model import ConfigError
from pipelines.tune import main as tune_main
from pipelines.tuning.space import load_space, parse_space
from pipelines.tuning.sweep import plan_sweep, sweep
from tests.support.data import TINY_MODEL, data_overrides, set_args

ROOT = Path(__file__).resolve().parents[2]
SPACES = sorted((ROOT / "tune_spaces").glob("*.yaml"))


def test_every_shipped_space_validates_against_its_recipe() -> None:
    assert {p.name for p in SPACES} >= {"demo.yaml", "gamma_tau.yaml"}
    recipes = {"demo.yaml": "demo.yaml", "gamma_tau.yaml": "owt_adlm_small.yaml",
               "a2r_gamma_tau.yaml": "owt_a2r_small.yaml"}
    for path in SPACES:
        space = load_space(path)
        assert {p.name for p in space.params} >= {"gamma", "tau"}
        recipe = ROOT / space.config if space.config else ROOT / "configs" / recipes.get(path.name, "demo.yaml")
        plan = plan_sweep(space, recipe, check_data=False)
        assert plan.base.model.kind == ("a2r" if "a2r" in path.stem.split("_") else "adlm")
        assert plan.max_t <= plan.base.run.max_steps
        # The YAML form round-trips (the trial actors re-parse it).
        assert parse_space(space.to_raw(), str(path)) == space


def _space(**changes) -> dict:
    raw = yaml.safe_load((ROOT / "tune_spaces" / "demo.yaml").read_text())
    for k, v in changes.items():
        node, parts = raw, k.split("__")
        for p in parts[:-1]:
            node = node[p]
        if v is None:
            node.pop(parts[-1])
        else:
            node[parts[-1]] = v
    return raw


@pytest.mark.parametrize("changes, message", [
    ({"serch": {"algorithm": "random"}}, r"unknown key\(s\) serch \(did you mean 'search'\?\); known: .*search"),
    ({"params__gamma": {"distribution": "lognormal", "low": 1e-3, "high": 1e-2}}, "unknown distribution 'lognormal'"),
    ({"params__gamma": {"distribution": "loguniform", "low": 1e-2, "high": 1e-3}}, r"low \(0.01\) must be below high"),
    ({"params__gamma": {"distribution": "loguniform", "low": 0, "high": 1e-3}}, "loguniform needs low > 0"),
    ({"params__gamma": {"distribution": "uniform", "low": -0.1, "high": 0.1}}, r"params.gamma value -0.1 is invalid.*gamma"),
    ({"params__tau": {"distribution": "choice", "values": [3, -1]}}, r"params.tau value -1 is invalid.*tau"),
    ({"params__tau": {"distribution": "choice", "values": []}}, "non-empty list 'values'"),
    ({"params__tau": {"distribution": "randint", "low": 2, "high": 8, "values": [1]}}, r"unknown key\(s\) values"),
    ({"params__temperature": {"distribution": "uniform", "low": 0, "high": 1}}, "neither gamma/tau nor a dotted"),
    ({"params__optim.lrr": {"distribution": "choice", "values": [1e-3]}}, r"optim: unknown key\(s\) lrr \(did you mean 'lr'\?\); known: lr"),
    ({"metric": "val_loss"}, "metric 'val_loss' is not reported"),
    ({"scheduler__type": "hyperband"}, "scheduler.type 'hyperband' unknown"),
    ({"scheduler__grace_period": 8}, r"grace_period \(8\) must be below max_t \(8\)"),
    ({"scheduler__max_t": 400}, r"max_t \(400\) exceeds run.max_steps \(8\)"),
    ({"overrides__run.ckpt_every": 15}, "must be a multiple of run.val_every"),
    ({"name": "a b"}, "'name' must be a sweep name"),
    ({"name": ".."}, r"'name' must be a sweep name .*leading '\.'"),  # Tune's state would go above the sweeps' folder
    # Every draw a fraction that run.max_steps refuses: --check said ok, every trial failed, the command exited 0.
    ({"params__run.max_steps": {"distribution": "uniform", "low": 8, "high": 12}},
     r"params.run.max_steps: uniform draws fractions such as 9.528, which run.max_steps does not take .*use randint"),
])
def test_bad_spaces_fail_with_one_line(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        space = parse_space(_space(**changes), "bad.yaml")
        plan_sweep(space, ROOT / "configs" / "demo.yaml", check_data=False)
    assert "\n" not in str(e.value)


def test_missing_data_fails_before_ray(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = tune_main(["--space", str(ROOT / "tune_spaces" / "demo.yaml"), "--config", str(ROOT / "configs" / "demo.yaml"),
                        "--workdir", str(workdir)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and "prepare_data" in err
    assert not (workdir / "ray_results").exists()


def test_check_refuses_a_run_init_version_that_does_not_exist(tiny_data: Path, workdir: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``--check`` checks ``run.init`` as training would (it said ok for a version that does not exist, and every
    trial then failed): one line naming what the registry has, exit 2, no sweep folder."""
    args = ["--space", str(ROOT / "tune_spaces" / "demo.yaml"), "--config", str(ROOT / "configs" / "demo.yaml"),
            "--workdir", str(workdir), "--check", *set_args([*data_overrides(tiny_data), *TINY_MODEL])]
    assert tune_main(args) == 0 and capsys.readouterr().out.startswith("ok: sweep")
    assert tune_main([*args, "--set", "run.init=models:/adlm/99"]) == 2
    out = capsys.readouterr()
    err = [ln for ln in out.err.strip().splitlines() if "(pid=" not in ln[:40]]
    assert out.out == "" and len(err) == 1 and "does not exist yet, so no version is registered there" in err[0], err
    assert not (workdir / "mlflow.db").exists()  # asking did not create the store
    # a registry without that version: the line says what it has
    from mlflow import MlflowClient

    MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}").create_registered_model("adlm")
    capsys.readouterr()
    assert tune_main([*args, "--set", "run.init=models:/adlm/99"]) == 2
    out = capsys.readouterr()
    err = [ln for ln in out.err.strip().splitlines() if "(pid=" not in ln[:40]]
    assert out.out == "" and len(err) == 1, err
    assert err[0].startswith("error: run.init models:/adlm/99: registered model 'adlm' has no version 99"), err
    assert "(it has no versions)" in err[0] and not (workdir / "ray_results").exists()


def test_a_trial_still_pending_at_ctrl_c_is_not_counted_as_ended() -> None:
    """Tune hands back a trial that was still pending when Ctrl-C stopped it as TERMINATED, with a result that holds
    nothing but its id (seen with two trials, one at a time, stopped between them): the sweep counts the trials
    that ended from their results (a report of their own, or an error), so it says "interrupted" (exit 130) and
    registers nothing until a rerun has run the rest."""
    from ray.tune import Result

    from pipelines.tuning.sweep import _ended

    def result(metrics: dict, error: Exception | None = None) -> Result:
        return Result(metrics=metrics, checkpoint=None, error=error, path="/nowhere")

    finished = result({"trial_id": "a_00000", "step": 40, "val_ppl": 121.8})
    stopped = result({"trial_id": "a_00001", "step": 10, "val_ppl": 510.0})  # by ASHA: a report of its own
    failed = result({"trial_id": "a_00002"}, RuntimeError("the trial's driver died"))
    pending = result({"trial_id": "a_00003"})
    assert _ended([finished, stopped, failed]) == 3
    assert _ended([finished, pending]) == 1


def test_a_sweep_whose_every_trial_failed_is_not_a_success() -> None:
    """A sweep whose trials all failed exited 0 with an empty table: it is a TuneError (exit 1) naming the first
    trial's error; one trial that ended without an error is a sweep with a result."""
    from ray.tune import Result

    from pipelines.tuning.sweep import every_trial_failed

    def result(metrics: dict, error: Exception | None = None) -> Result:
        return Result(metrics=metrics, checkpoint=None, error=error, path="/nowhere")

    failed = [result({"trial_id": f"a_0000{i}"}, RuntimeError(f"Traceback ...\nConfigError: bad value {i}"))
              for i in range(2)]
    said = every_trial_failed(failed, "s")
    assert said == "every trial of sweep 's' failed (2 of 2); the first: ConfigError: bad value 0"
    assert every_trial_failed([*failed, result({"trial_id": "a_00002", "step": 10, "val_ppl": 5.0})], "s") is None
    assert every_trial_failed([], "s") is None


def _trial_runs(experiment: str = "adlm-demo") -> dict[str, object]:
    """The sweep's training runs (MLflow child runs) by trial id; a trial's run is FINISHED once its
    training ended, and it carries a ``train/resumed_from`` metric when it was ever restarted."""
    import mlflow

    c = mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    runs = c.search_runs([exp.experiment_id], "tags.`tune.trial_id` != ''")
    return {r.data.tags["tune.trial_id"]: r for r in runs}


def _finished_trials() -> set[str]:
    return {t for t, r in _trial_runs().items() if r.info.status == "FINISHED"}


def _completed_in_tune(log_path: Path) -> set[str]:
    """Trials Tune itself has recorded as complete (its console line), by trial id. The MLflow run is
    FINISHED a moment before: a Ctrl-C in between saves the trial as running, and a resume reruns it."""
    return set(re.findall(r"Trial run_trial_(\w+) completed after", log_path.read_text()))


@pytest.mark.slow
def test_sweep_stops_early_nests_runs_registers_best_and_resumes(tiny_data: Path, workdir: Path, tmp_path: Path,
                                                                  ray_session) -> None:
    import mlflow

    # 4 trials: a grid over tau x learning rate (a 1e-6 rate cannot learn in 40 steps, so ASHA has
    # something to stop whatever the arrival order), gamma log-uniform.
    space_file = tmp_path / "space.yaml"
    space_file.write_text(yaml.safe_dump({
        "name": "t-sweep",
        "params": {"gamma": {"distribution": "loguniform", "low": 1e-3, "high": 1e-2},
                   "tau": {"distribution": "grid", "values": [2, 5]},
                   "optim.lr": {"distribution": "grid", "values": [3e-3, 1e-6]}},
        "search": {"algorithm": "random", "seed": 0},
        "scheduler": {"type": "asha", "grace_period": 10, "reduction_factor": 2, "max_t": 40},
        "num_samples": 1, "max_concurrent": 1,
        "overrides": {"run.max_steps": 40, "run.val_every": 10, "run.ckpt_every": 10, "run.log_every": 10,
                      "run.val_batches": 2, "scaling.num_workers": 0,  # each trial trains in its own process
                      "batch.global_batch": 8, "batch.micro_batch": 8, "optim.warmup_steps": 2},
    }))
    sets = set_args([*data_overrides(tiny_data), *TINY_MODEL])
    # -v: Tune's own lines, among them the one that says a trial is complete (by default one bar over the trials)
    cmd = [sys.executable, "-m", "pipelines.tune", "--space", str(space_file), "--config",
           str(ROOT / "configs" / "demo.yaml"), *sets, "-v"]
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address,
           "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    # 1. Start the sweep and interrupt it (Ctrl-C) once a first trial has finished, in MLflow and in Tune.
    log_path = tmp_path / "sweep.log"  # a file, not a pipe: Tune's tables would fill a pipe and block
    with log_path.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 400
    while not _finished_trials() & _completed_in_tune(log_path):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"the sweep ended or hung before a trial finished:\n{log_path.read_text()[-4000:]}")
        time.sleep(1)
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=180)
    assert proc.returncode == 130, log_path.read_text()[-4000:]
    finished_before = _finished_trials() & _completed_in_tune(log_path)
    assert finished_before

    # 2. Rerun the same sweep: it resumes and completes without rerunning the finished trial(s).
    res = sweep(load_space(space_file), ROOT / "configs" / "demo.yaml",
                         [*data_overrides(tiny_data), *TINY_MODEL])
    assert not res.interrupted and len(res.trials) == 4
    # A rerun trial would resume its finished training run (logging train/resumed_from): none did.
    uri = os.environ["MLFLOW_TRACKING_URI"]
    for tid in finished_before:
        run = _trial_runs()[tid]
        assert not mlflow.MlflowClient(uri).get_metric_history(run.info.run_id, "train/resumed_from"), tid
    assert any(r.status == "stopped" for r in res.trials), [(r.trial_id, r.params, r.status) for r in res.trials]
    assert res.best is not None and res.best.status == "finished" and res.best.params["optim.lr"] == 3e-3
    finished = [r for r in res.trials if r.status == "finished"]
    assert res.best.selection_ppl == min(r.best_val_ppl for r in finished)
    assert all(r.best_step is not None and r.best_step <= r.step and r.best_val_ppl <= r.val_ppl for r in finished)

    # 3. MLflow: one parent, 4 nested children with params gamma and tau, artifacts, the best registered.
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("adlm-demo")
    parents = client.search_runs([exp.experiment_id], "tags.`adlm.sweep_parent` = 'true'")
    assert [p.info.run_id for p in parents] == [res.parent_run_id]
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{res.parent_run_id}'")
    assert len(children) == 4
    by_trial = {c.data.tags["tune.trial_id"]: c for c in children}
    for r in res.trials:
        c = by_trial[r.trial_id]
        assert float(c.data.params["gamma"]) == pytest.approx(r.params["gamma"])
        assert int(c.data.params["tau"]) == r.params["tau"]
        assert c.data.tags["tune.status"] == r.status
        steps = [m.step for m in client.get_metric_history(c.info.run_id, "train/loss")]
        assert len(steps) == len(set(steps))  # a resumed trial logs no step twice
    arts = {a.path for a in client.list_artifacts(res.parent_run_id, "sweep")}
    assert {"sweep/trials.csv", "sweep/trials.md", "sweep/search.png", "sweep/space.yaml"} <= arts
    assert Path(res.artifacts["search.png"]).stat().st_size > 10_000
    mv = client.get_model_version_by_alias("adlm", "candidate")
    assert str(mv.version) == res.registered_version and mv.run_id == res.best.mlflow_run_id
    assert mv.tags["sweep"] == "t-sweep" and mv.tags["tune.trial_id"] == res.best.trial_id
    assert float(mv.tags["gamma"]) == pytest.approx(res.best.params["gamma"])
    # The version's figures are those of the checkpoint it holds: the trial run's best, not its last report.
    assert (int(mv.tags["step"]), int(mv.tags["final_step"])) == (res.best.best_step, res.best.step)
    assert mv.tags["checkpoint"] == res.best.checkpoint == "best"
    assert float(mv.tags["val_ppl"]) == pytest.approx(res.best.best_val_ppl)
    held = client.download_artifacts(mv.run_id, "checkpoint/config.json", str(tmp_path / "held"))
    assert json.loads(Path(held).read_text())["meta"]["step"] == res.best.best_step

    # 4. A rerun of the finished sweep changes nothing and registers nothing new.
    again = sweep(load_space(space_file), ROOT / "configs" / "demo.yaml",
                           [*data_overrides(tiny_data), *TINY_MODEL])
    assert again.registered_version == res.registered_version
    assert len(client.search_model_versions("name='adlm'")) == 1


def _trial_training(config: dict, *, sets: list[str], workdir: str, uri: str) -> None:
    """A Tune trial that trains a local-mode run in its own process (pipelines.training.loop.TrialSession)."""
    from ray import tune

    from pipelines.training.config import load_config
    from pipelines.training.trainer import train

    res = train(load_config(ROOT / "configs" / "demo.yaml", [*sets, "run.name=in-trial"]), workdir=workdir,
                tracking_uri=uri, register=False)
    tune.report({"step": res.step, "val_ppl": res.val_ppl, "final": True})


@pytest.mark.slow
def test_a_local_mode_run_in_a_tune_trial_reports_each_validation_and_equals_the_run_outside_tune(
        tiny_data: Path, tmp_path: Path, ray_session) -> None:
    """Inside a trial, Ray Train refuses its own API; a num_workers=0 run trains in the trial's process instead,
    sends Tune every validation (what ASHA stops on) and ends with the numbers of the same run outside Tune."""
    from functools import partial

    import mlflow
    from ray import tune

    from pipelines.training.config import load_config
    from pipelines.training.trainer import train

    sets = [*data_overrides(tiny_data), *TINY_MODEL, "run.max_steps=6", "run.val_every=2", "run.ckpt_every=2",
            "run.log_every=2", "run.val_batches=1", "batch.global_batch=8", "batch.micro_batch=8",
            "optim.warmup_steps=1", "scaling.num_workers=0", "scaling.threads=1", "mlflow.experiment=in-trial"]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    alone = train(load_config(ROOT / "configs" / "demo.yaml", [*sets, "run.name=alone"]), workdir=str(tmp_path / "a"),
                  tracking_uri=uri, register=False)
    grid = tune.Tuner(
        tune.with_resources(partial(_trial_training, sets=sets, workdir=str(tmp_path / "t"), uri=uri), {"cpu": 0.5}),
        run_config=tune.RunConfig(name="in-trial", storage_path=str(tmp_path / "tune"), verbose=0)).fit()
    (result,) = list(grid)
    assert result.error is None, result.error
    reported = result.metrics_dataframe
    # Each validation reached Tune as it happened (2, 4, 6; the checkpoints' paths with them), then the trial's end.
    assert list(reported["step"]) == [2, 4, 6, 6] and reported["checkpoint_path"].notna().sum() == 3
    assert result.metrics["final"] and result.metrics["val_ppl"] == alone.val_ppl
    c = mlflow.MlflowClient(uri)
    runs = {r.info.run_name: r for r in c.search_runs([c.get_experiment_by_name("in-trial").experiment_id])}
    curves = {n: [(m.step, m.value) for m in c.get_metric_history(runs[n].info.run_id, "val/ppl")]
              for n in ("alone", "in-trial")}
    assert curves["in-trial"] == curves["alone"] and len(curves["alone"]) == 3
