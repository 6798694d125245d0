"""The tracking server as a cluster runs it, for real: ``mlflow/server.sh`` on a throwaway PostgreSQL, artifacts in S3
(moto on loopback), basic authentication on, one for the session (``pg_tracking``, tests/support/postgres.py).
Nothing is mocked between the client, the server and the database.

- the recipe serves from PostgreSQL: the schema and the users live there, artifacts in the bucket, no secret on a
  command line or in the log;
- a sweep (4 trials, 2 at a time, every step logged) and a training run log to it at once, through a database
  outage longer than the client's retry window and then a server killed and restarted: afterwards every metric
  point, param, tag, artifact and registered version is there, once, nested runs and aliases are consistent, and
  the staged evaluation decides every version;
- a store made by the previous MLflow minor version is refused in one line, upgraded by ``mlflow/server.sh upgrade``
  and then served with everything it held.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.support.cluster import command_lines
from tests.support.data import TINY_MODEL, data_overrides
from tests.support.postgres import RecipeServer, TrackingStack

ROOT = Path(__file__).resolve().parents[2]
OLD_STORE = ROOT / "tests" / "fixtures" / "mlflow-3.16.1-store.sql"

WINDOW_KEYS = {"train/loss", "train/nll", "train/grad_norm", "train/lr", "train/tokens_per_s", "train/epoch",
               "train/anchor_loss", "train/anchor_frac", "train/gamma_k"}
"""What an ADLM run logs every ``run.log_every`` steps at least (pipelines/training/loop.py, ``log_window``; every
``train/`` key is a window's, the per-network gradient norms included)."""
VAL_KEYS = {"val/ppl", "val/nll"}
CHECKPOINT_FILES = {"config.json", "model.safetensors", "ema.safetensors", "tokenizer.json"}

RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
           "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
"""The clients' retry window: a call gives up after about 3 s of 503s (two retries, waits of 0 and 2 s), so that
the outage below outlasts it many times over and every component's give-up path runs, in seconds (MLflow's
defaults wait about 4 minutes; tests/e2e/test_tracking_outage.py runs those against a gate)."""
OUTAGE_S = 20.0
"""How long PostgreSQL is down."""
KILLED_S = 5.0
"""How long the killed server stays down before the recipe starts it again (its start-up adds 10-30 s)."""
TRIAL_STEPS, STEP_PAUSE_MS = 40, 500
"""Each trial: 40 steps of half a second of idle each (``ADLM_FAULT=train.step_pause_ms``), 20-30 s, so that the
two waves of trials span the outage and the restart without keeping a core busy."""
TRAIN_STEPS, HOLD_AT, PACE_S = 400, 50, 0.25
"""The training run: it waits at step HOLD_AT for the database to go down (so that it trains through both outages,
whenever the sweep's trials start), then takes PACE_S a step (four times that in its last 50 steps) until both
outages are over, and its last steps wait for that: it ends with everything up."""


def _client(stack: TrackingStack):
    from pipelines.tracking.runs import client

    return client(stack.url)


def _wait(what: str, check: Callable[[], object], timeout: float, poll: float = 1.0,
          abort: threading.Event | None = None) -> object:
    """``check()``'s first truthy value within ``timeout`` (its errors count as not yet: an outage); ``abort`` set
    ends the wait at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (abort and abort.is_set()):
        try:
            got = check()
        except Exception:  # noqa: BLE001 - the store is down or busy: ask again
            got = None
        if got:
            return got
        if abort is not None:
            abort.wait(poll)
        else:
            time.sleep(poll)
    raise AssertionError(f"{'gave up' if abort and abort.is_set() else f'timed out after {timeout:.0f} s'} waiting "
                         f"for {what}")


# ----------------------------------------------------------------------------------------------------------------
# The recipe on PostgreSQL


def test_the_recipe_serves_from_postgresql_with_artifacts_in_s3_and_users_authenticated(
        pg_tracking: TrackingStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import requests

    # private: MLflow has no public reader of its newest schema revision
    from mlflow.store.db.utils import _get_latest_schema_revision

    stack = pg_tracking
    api = f"{stack.url}/api/2.0/mlflow/experiments/search"
    assert requests.get(api, params={"max_results": 1}, timeout=30).status_code == 401
    assert requests.get(api, params={"max_results": 1}, auth=(stack.user, "wrong"), timeout=30).status_code == 401
    assert requests.get(api, params={"max_results": 1}, auth=(stack.user, stack.password), timeout=30).ok

    # The store's schema (this MLflow's newest) and the users are in PostgreSQL.
    assert stack.pg.psql("SELECT version_num FROM alembic_version", db="mlflow") == _get_latest_schema_revision()
    assert {"experiments", "runs", "metrics", "registered_models"} <= set(
        stack.pg.psql("SELECT tablename FROM pg_tables WHERE schemaname = 'public'", db="mlflow").split())
    assert {"admin", stack.user} <= set(stack.pg.psql("SELECT username FROM users", db="mlflow_auth").split())

    # A run of the pipeline's user: its artifact goes through the server into the bucket.
    for k, v in stack.client_env.items():
        monkeypatch.setenv(k, v)
    from pipelines.tracking.runs import ensure_experiment, find_or_create_run

    run_id, _ = find_or_create_run(stack.url, ensure_experiment("recipe", stack.url, tmp_path), "recipe-run")
    note = tmp_path / "note.txt"
    note.write_text("stored in S3")
    _client(stack).log_artifact(run_id, str(note))
    assert any(k.endswith(f"/{run_id}/artifacts/note.txt") for k in stack.s3.keys("artifacts/"))
    assert not (stack.server.workdir / "mlartifacts-server").exists()

    # No password on a command line of the server's processes (what `ps` shows every user), nor in its log.
    secrets = [stack.store_uri.split(":")[2].split("@")[0], stack.admin_password]
    lines = command_lines(stack.server.proc.pid)
    assert lines and not any(s in c for s in secrets for c in lines), lines
    assert not any(s in stack.server.log.read_text(errors="replace") for s in secrets)


# ----------------------------------------------------------------------------------------------------------------
# A sweep and a training run at once, through a database outage and a server crash


@dataclass
class Outages:
    """When each outage happened (epoch seconds), filled in by ``_outages`` as it goes."""

    db_down: float = 0.0
    db_up: float = 0.0
    server_killed: float = 0.0
    server_up: float = 0.0
    started: threading.Event = field(default_factory=threading.Event)
    """Set when the database goes down."""
    done: threading.Event = field(default_factory=threading.Event)
    abort: threading.Event = field(default_factory=threading.Event)
    """Set by the test when it fails: the outages end at once (everything is started again)."""
    error: BaseException | None = None


def _outages(stack: TrackingStack, out: Outages) -> None:
    """In the background, once the training run and a trial both log: PostgreSQL stopped for OUTAGE_S and started
    again; once a point measured after that is stored, the server killed, and started again by the recipe after
    KILLED_S. Whatever happens, both are up again at the end."""

    def logging_runs() -> int:
        return int(stack.pg.psql("SELECT count(DISTINCT run_uuid) FROM metrics WHERE key = 'train/loss'",
                                 db="mlflow") or 0)

    try:
        _wait("the training run and a trial to log", lambda: logging_runs() >= 2, timeout=600, abort=out.abort)
        out.db_down = time.time()
        out.started.set()
        stack.pg.stop()
        out.abort.wait(OUTAGE_S)
        stack.pg.start()
        out.db_up = time.time()
        _wait("a point measured after the database came back", lambda: stack.pg.psql(
            f"SELECT count(*) FROM metrics WHERE timestamp > {int(out.db_up * 1000)}", db="mlflow") != "0",
              timeout=180, abort=out.abort)
        out.server_killed = time.time()
        stack.server.kill()
        out.abort.wait(KILLED_S)
        stack.server.start()
        out.server_up = time.time()
    except BaseException as e:  # noqa: BLE001 - re-raised by the test's thread
        out.error = e
    finally:
        try:
            if not stack.pg.running():
                stack.pg.start()
            if stack.server.proc is None:
                stack.server.start()
        finally:
            out.started.set()
            out.done.set()


SWEEP = """
import json, sys
from pipelines.tuning.space import load_space
from pipelines.tuning.sweep import sweep
r = sweep(load_space(sys.argv[1]), sys.argv[2], sys.argv[3:])
print("SWEEP-RESULT " + json.dumps({"parent": r.parent_run_id, "version": r.registered_version,
    "interrupted": r.interrupted, "unregistered": r.unregistered, "best": r.best.trial_id if r.best else None,
    "trials": [{"trial_id": t.trial_id, "run_id": t.mlflow_run_id, "step": t.step, "status": t.status,
                "params": t.params} for t in r.trials]}))
"""
"""The sweep (pipelines.tuning.sweep, what ``python -m pipelines.tune`` runs) in a process of its own, whose own
local Ray hands its trials this process's environment: the user's credentials, as a node's environment does."""


def _sweep_result(proc: subprocess.Popen, log: Path, timeout: float = 900) -> dict:
    """What the sweep process reported (its last SWEEP-RESULT line) once it ended, successfully."""
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0 and "SWEEP-RESULT " in text, text[-5000:]
    return json.loads(text.rsplit("SWEEP-RESULT ", 1)[1].splitlines()[0])


def _space(path: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "name": "pg-sweep",
        "params": {"gamma": {"distribution": "loguniform", "low": 1e-3, "high": 1e-2},
                   "tau": {"distribution": "grid", "values": [2, 5]}},
        "search": {"algorithm": "random", "seed": 0}, "scheduler": {"type": "fifo"},
        "num_samples": 2, "max_concurrent": 2,
        "overrides": {"run.max_steps": TRIAL_STEPS, "run.val_every": 10, "run.ckpt_every": 10, "run.log_every": 1,
                      "run.val_batches": 1, "scaling.num_workers": 0, "scaling.threads": 1, "batch.global_batch": 8,
                      "batch.micro_batch": 8, "optim.warmup_steps": 2}}))
    return path


def _check_metrics(c, run_id: str, steps: int, what: str) -> list:
    """Every window and validation key of a run at every step it logs, once; returns every point."""
    run = c.get_run(run_id)
    keys = set(run.data.metrics)
    assert WINDOW_KEYS | VAL_KEYS <= keys and keys - VAL_KEYS == {k for k in keys if k.startswith("train/")}, \
        (what, sorted(keys))
    points = []
    for key in sorted(keys):
        hist = c.get_metric_history(run_id, key)
        want = list(range(10, steps + 1, 10)) if key in VAL_KEYS else list(range(1, steps + 1))
        got = sorted(m.step for m in hist)
        assert got == want, (what, key, f"{len(got)} points, {len(set(got))} steps, want {len(want)}",
                             sorted(set(want) - set(got))[:10], [s for s in set(got) if got.count(s) > 1][:10])
        points += hist
    return points


def _check_artifacts(c, stack: TrackingStack, run_id: str, folders: dict[str, set[str]], what: str) -> None:
    """The run's artifacts are listed through the server and stored in the bucket, byte for byte."""
    keys = {}
    for key in stack.s3.keys("artifacts/"):
        if f"/{run_id}/artifacts/" in key:
            keys[key.split(f"/{run_id}/artifacts/", 1)[1]] = key
    s3 = stack.s3.client()
    for folder, names in folders.items():
        listed = {Path(a.path).name: a for a in c.list_artifacts(run_id, folder)}
        assert set(listed) == names, (what, folder, sorted(listed))
        for a in listed.values():
            head = s3.head_object(Bucket=stack.s3.bucket, Key=keys[a.path])
            assert head["ContentLength"] == a.file_size, (what, a.path)


@pytest.mark.slow
def test_a_sweep_and_a_training_run_lose_nothing_through_a_database_outage_and_a_server_crash(
        pg_tracking: TrackingStack, tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    from pipelines.evaluation.config import EvalConfig
    from pipelines.evaluation.promotion import PromotionConfig, stage_all, waiting_versions
    from pipelines.training import loop as loop_mod
    from pipelines.training.config import flatten, load_config
    from pipelines.training.trainer import train
    from pipelines.tuning.space import load_space
    from pipelines.tuning.sweep import plan_sweep
    from pipelines.tuning.trials import trial_config

    stack = pg_tracking
    wd = tmp_path / "work"
    env = {**stack.client_env, **RETRIES, "ADLM_WORKDIR": str(wd)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    c = _client(stack)
    sets = [*data_overrides(tiny_data), *TINY_MODEL]

    # The sweep, in its own process (and Ray); ADLM_FAULT paces its trials' steps.
    space = _space(tmp_path / "space.yaml")
    sweep_log = tmp_path / "sweep.log"
    sweep_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
                 "ADLM_FAULT": f"train.step_pause_ms={STEP_PAUSE_MS}"}
    sweep_env.pop("RAY_ADDRESS", None)
    t0 = time.time()
    sweep_cmd = [sys.executable, "-c", SWEEP, str(space), str(ROOT / "configs" / "demo.yaml"), *sets]
    with sweep_log.open("w") as fh:
        proc = subprocess.Popen(sweep_cmd, cwd=tmp_path, env=sweep_env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    out = Outages()
    controller = threading.Thread(target=_outages, args=(stack, out), daemon=True)
    controller.start()
    try:
        # The training run, in this process at once: paced until both outages are over, its last steps waiting for
        # that (so it trains through both and ends with everything up).
        real_step = loop_mod.optimiser_step

        def paced(w, *args, **kwargs):
            res = real_step(w, *args, **kwargs)
            if w.step == HOLD_AT:
                out.started.wait(timeout=900)
            if w.step >= TRAIN_STEPS - 5:
                out.done.wait(timeout=900)
            elif not out.done.is_set():
                time.sleep(PACE_S * (4 if w.step > TRAIN_STEPS - 50 else 1))
            return res

        monkeypatch.setattr(loop_mod, "optimiser_step", paced)
        cfg = load_config(ROOT / "configs" / "demo.yaml", [
            *sets, "run.name=pg-train", f"run.max_steps={TRAIN_STEPS}", "run.log_every=1", "run.val_every=10",
            "run.ckpt_every=50", "run.val_batches=1", "batch.global_batch=8", "batch.micro_batch=8",
            "optim.warmup_steps=2", "scaling.num_workers=0", "scaling.threads=1", "mlflow.experiment=pg-train",
            "mlflow.drain_timeout_s=60"])
        trained = train(cfg, workdir=str(wd), tracking_uri=stack.url)
        monkeypatch.setattr(loop_mod, "optimiser_step", real_step)
        controller.join(timeout=900)
        if out.error is not None:
            raise out.error
        assert out.done.is_set() and out.server_up, "the outages never finished"
        proc.wait(timeout=900)
    finally:
        out.abort.set()  # a failure above: the database and the server are started again before the next test
        controller.join(timeout=300)
        if proc.poll() is None:  # the sweep and its Ray
            os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
    swept = _sweep_result(proc, sweep_log)
    if swept["unregistered"]:
        # The sweep ended while MLflow was down (it said so, and how to finish): the same command again, everything
        # up, trains nothing, finishes the trials' runs and registers the best.
        assert "rerun the same command to register it" in swept["unregistered"]
        with sweep_log.open("a") as fh:
            proc = subprocess.Popen(sweep_cmd, cwd=tmp_path, env=sweep_env, stdout=fh, stderr=subprocess.STDOUT)
        swept = _sweep_result(proc, sweep_log, timeout=600)  # (a trial rerun would log train/resumed_from: below)
    assert not swept["interrupted"] and swept["unregistered"] is None and swept["version"], swept
    assert trained.step == TRAIN_STEPS and trained.registered_version and trained.unregistered is None

    # Every point of every run, once: each trial's TRIAL_STEPS steps and the training run's TRAIN_STEPS.
    trials = swept["trials"]
    assert len(trials) == 4 and all(t["status"] == "finished" and t["step"] == TRIAL_STEPS for t in trials), trials
    points = {t["trial_id"]: _check_metrics(c, t["run_id"], TRIAL_STEPS, t["trial_id"]) for t in trials}
    points["training"] = _check_metrics(c, trained.run_id, TRAIN_STEPS, "training")
    keys = {k: {p.key for p in v} for k, v in points.items()}
    assert all(k == keys["training"] for k in keys.values()), keys  # the same keys in every run
    # ... among them what was measured while the database was down and while the server was: the training run
    # (and trials) trained on through both, and the points waited and arrived.
    during_db = {k: sum(out.db_down < p.timestamp / 1000 < out.db_up for p in v) for k, v in points.items()}
    during_kill = {k: sum(out.server_killed < p.timestamp / 1000 < out.server_up for p in v) for k, v in points.items()}
    assert during_db["training"] > 0 and during_kill["training"] > 0, (during_db, during_kill)
    assert sum(during_db[t["trial_id"]] for t in trials) > 0, during_db
    n_points = int(stack.pg.psql("SELECT count(*) FROM metrics m JOIN runs r ON m.run_uuid = r.run_uuid WHERE "
                                 f"r.run_uuid IN ({', '.join(repr(x['run_id']) for x in trials)}, '{trained.run_id}')",
                                 db="mlflow"))
    assert n_points == sum(map(len, points.values())), "duplicate rows in the metrics table"

    # Nested runs: one parent, its four trials (their params and tags), the training run on its own.
    exp = c.get_experiment_by_name("adlm-demo")
    parents = c.search_runs([exp.experiment_id], "tags.`adlm.sweep_parent` = 'true'")
    assert [p.info.run_id for p in parents] == [swept["parent"]]
    children = {r.info.run_id: r for r in c.search_runs([exp.experiment_id],
                                                          f"tags.`mlflow.parentRunId` = '{swept['parent']}'")}
    assert set(children) == {t["run_id"] for t in trials}
    planned = plan_sweep(load_space(space), ROOT / "configs" / "demo.yaml", sets, check_data=False)
    for t in trials:
        run = children[t["run_id"]]
        tcfg, tags = trial_config(planned.base_raw, planned.space, t["trial_id"], t["params"])
        assert set(run.data.params) == set(flatten(tcfg.to_dict())) | {"data_manifest_hash", "accumulation",
                                                                         "tokenizer", "gamma", "tau"}
        assert run.data.params["run.name"] == tcfg.run.name and int(run.data.params["tau"]) == t["params"]["tau"]
        assert {**tags, "tune.status": "finished", "adlm.run_name": tcfg.run.name}.items() <= run.data.tags.items()
        assert run.info.status == "FINISHED"
        _check_artifacts(c, stack, t["run_id"], {"checkpoint": CHECKPOINT_FILES, "plots": {"loss_curve.png"}},
                         t["trial_id"])
    assert "mlflow.parentRunId" not in c.get_run(trained.run_id).data.tags
    _check_artifacts(c, stack, trained.run_id, {"checkpoint": CHECKPOINT_FILES, "plots": {"loss_curve.png"}},
                     "training")
    _check_artifacts(c, stack, swept["parent"], {"sweep": {"trials.csv", "trials.md", "search.png", "space.yaml"}},
                     "sweep")

    # The registry: the sweep's best and the training run, each once; the later one holds the candidate alias.
    versions = {str(v.version): v for v in c.search_model_versions("name='adlm'")}
    assert set(versions) == {swept["version"], trained.registered_version}
    best = next(t for t in trials if t["trial_id"] == swept["best"])
    assert versions[swept["version"]].run_id == best["run_id"] and versions[swept["version"]].tags["sweep"] == "pg-sweep"
    assert versions[trained.registered_version].run_id == trained.run_id
    latest = max(versions, key=int)
    assert dict(c.get_registered_model("adlm").aliases) == {"candidate": latest}
    assert {v: c.get_model_version("adlm", v).aliases for v in versions} == {  # (a search leaves aliases out)
        v: ["candidate"] * (v == latest) for v in versions}

    # The staged evaluation after the outages sees both versions and decides each; the aliases stay consistent.
    assert {str(v.version) for v in waiting_versions(c, "adlm")} == set(versions)
    outcomes = stage_all(PromotionConfig(model_name="adlm", stage1_rows=8, stage2_suite=("ppl",)),
                         EvalConfig(data=str(tiny_data), batch_size=8), workdir=str(wd), tracking_uri=stack.url,
                         in_process=True)
    assert sorted(o.version for o in outcomes) == sorted(versions, key=int)
    promoted = [o.version for o in outcomes if o.status == "promoted"]
    aliases = dict(c.get_registered_model("adlm").aliases)
    assert promoted and aliases == {"champion": promoted[-1]}, (aliases, outcomes)
    assert not waiting_versions(c, "adlm")
    with capfd.disabled():
        print(f"\nthe database down {out.db_down - t0:.0f}-{out.db_up - t0:.0f} s, the server "
              f"{out.server_killed - t0:.0f}-{out.server_up - t0:.0f} s after the sweep started; points measured while "
              f"the database was down: {during_db}; while the server was: {during_kill}; {n_points} points in all")


# ----------------------------------------------------------------------------------------------------------------
# A store of the previous MLflow minor version


@pytest.mark.slow
def test_a_store_of_the_previous_mlflow_is_refused_then_upgraded_by_the_recipe_and_served(
        pg_tracking: TrackingStack, tmp_path: Path) -> None:
    import mlflow

    # private: MLflow has no public reader of its newest schema revision
    from mlflow.store.db.utils import _get_latest_schema_revision

    from tests.fixtures.mlflow_old_store import CONTENT

    pg = pg_tracking.pg
    store = pg.create_database("old_store", "old_owner", "old-owner-password")
    pg.psql("", db="old_store", file=OLD_STORE, user=("old_owner", "old-owner-password"))
    old = pg.psql("SELECT version_num FROM alembic_version", db="old_store")
    assert old != _get_latest_schema_revision()
    server = RecipeServer(tmp_path, {"MLFLOW_BACKEND_STORE_URI": store,
                                     "MLFLOW_ARTIFACTS_DESTINATION": str(tmp_path / "artifacts")})

    # Served as it is, MLflow would refuse it: the recipe says so in one line, naming the command.
    r = server.run()
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"mlflow/server.sh: the store's schema ({old}) is older than this MLflow's ({_get_latest_schema_revision()}): "
        "back the database up, then run `mlflow/server.sh upgrade` with the same environment, once"), r.stderr
    up = server.run("upgrade")
    assert up.returncode == 0, up.stderr[-3000:]
    assert up.stderr.strip().splitlines()[-1] == f"mlflow/server.sh upgrade: the store's schema {old} -> " \
                                                f"{_get_latest_schema_revision()}"
    assert "old-owner-password" not in up.stdout + up.stderr

    server.start()
    try:
        c = mlflow.MlflowClient(server.url, registry_uri=server.url)
        exp = c.get_experiment_by_name(CONTENT["experiment"])
        runs = {r.info.run_name: r for r in c.search_runs([exp.experiment_id])}
        parent = runs["sweep-" + CONTENT["sweep"]]
        assert parent.data.tags["adlm.sweep_parent"] == "true" and len(runs) == 1 + len(CONTENT["trials"])
        for t in CONTENT["trials"]:
            run = runs[t["name"]]
            assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id and run.info.status == "FINISHED"
            assert float(run.data.params["gamma"]) == t["gamma"] and int(run.data.params["tau"]) == t["tau"]
            loss = c.get_metric_history(run.info.run_id, "train/loss")
            assert sorted((m.step, m.value) for m in loss) == [(s, 1.0 / s) for s in range(1, CONTENT["steps"] + 1)]
        model = c.get_registered_model(CONTENT["model"])
        assert {k: int(v) for k, v in model.aliases.items()} == CONTENT["aliases"]
        v1 = c.get_model_version(CONTENT["model"], "1")
        assert v1.run_id == runs[CONTENT["trials"][0]["name"]].info.run_id and v1.tags["sweep"] == CONTENT["sweep"]
        # ... and it takes new work: a run, a version, an alias moved.
        rid = c.create_run(exp.experiment_id, run_name="after-upgrade").info.run_id
        c.log_metric(rid, "train/loss", 0.5, step=1)
        v3 = c.create_model_version(CONTENT["model"], f"runs:/{rid}/checkpoint", run_id=rid)
        c.set_registered_model_alias(CONTENT["model"], "candidate", v3.version)
        assert c.get_model_version_by_alias(CONTENT["model"], "candidate").run_id == rid
    finally:
        server.stop()
