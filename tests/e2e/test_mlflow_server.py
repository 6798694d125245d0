"""mlflow/server.sh end to end: the recipe starts a real tracking server (sqlite store, served artifacts)
on a free loopback port; a tiny training logs to it over HTTP; the REST client finds the run's metrics,
its checkpoint artifacts (stored by the server, not by the client) and the registered version."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pipelines.training.trainer as train_mod
from adlm_model import load_checkpoint
from pipelines.training.config import load_config
from tests.conftest import free_port
from tests.support.cluster import command_lines, http_ok, stop_group
from tests.support.data import TINY_MODEL, data_overrides

ROOT = Path(__file__).resolve().parents[2]


def _healthy(url: str) -> bool:
    return http_ok(f"{url}/health")


@contextlib.contextmanager
def _server_sh(tmp_path: Path, **extra: str):
    """``bash mlflow/server.sh`` on a free 127.0.0.1 port; yields (url, artifact root, log, process); always
    stopped."""
    port = free_port()
    store, artifacts = tmp_path / "server" / "mlflow.db", tmp_path / "server" / "artifacts"
    store.parent.mkdir(exist_ok=True)
    env = {**os.environ,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # the venv's mlflow
           "ADLM_WORKDIR": str(tmp_path / "server"), "MLFLOW_HOST": "127.0.0.1", "MLFLOW_PORT": str(port),
           "MLFLOW_BACKEND_STORE_URI": f"sqlite:///{store}", "MLFLOW_ARTIFACTS_DESTINATION": str(artifacts), **extra}
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", str(ROOT / "mlflow" / "server.sh")], env=env, cwd=tmp_path,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                state = f"exited with {proc.returncode}" if proc.poll() is not None else "not healthy after 90 s"
                pytest.fail(f"mlflow/server.sh {state}; its log:\n{log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.5)
        yield url, artifacts, log, proc
    finally:
        stop_group(proc)


@pytest.fixture()
def server(tmp_path: Path):
    with _server_sh(tmp_path) as (url, artifacts, _, _):
        yield url, artifacts


@pytest.mark.slow
def test_the_server_recipe_can_require_authentication_and_keeps_secrets_off_command_lines(tmp_path: Path) -> None:
    import requests

    secret = "s3cr3t-admin-password"  # MLflow asks for at least 12 characters
    pw = tmp_path / "admin_password"
    pw.write_text(secret)
    with _server_sh(tmp_path, MLFLOW_AUTH="basic", MLFLOW_AUTH_ADMIN_PASSWORD_FILE=str(pw),
                    MLFLOW_ALLOWED_HOSTS="127.0.0.1:*,localhost:*") as (url, _, log, proc):
        api = f"{url}/api/2.0/mlflow/experiments/search"
        assert requests.get(api, params={"max_results": 1}, timeout=10).status_code == 401
        assert requests.get(api, params={"max_results": 1}, auth=("admin", "wrong"), timeout=10).status_code == 401
        ok = requests.get(api, params={"max_results": 1}, auth=("admin", secret), timeout=10)
        assert ok.status_code == 200, ok.text
        # The pipeline's client authenticates from the node's environment.
        env = {**os.environ, "MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": secret}
        code = ("import mlflow; c = mlflow.MlflowClient(); print(c.create_experiment('authed'))")
        r = subprocess.run([sys.executable, "-c", code], env={**env, "MLFLOW_TRACKING_URI": url},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        # A Host header the server was not told to answer is refused (DNS rebinding protection).
        evil = requests.get(api, params={"max_results": 1}, auth=("admin", secret), headers={"Host": "evil.example"},
                            timeout=10)
        assert evil.status_code == 403
        lines = command_lines(proc.pid)
        assert lines and not any(secret in c or "--backend-store-uri" in c for c in lines), lines
    assert secret not in log.read_text(errors="replace")


def test_the_server_recipe_names_a_missing_store_driver_in_one_line_and_no_password(tmp_path: Path) -> None:
    """A PostgreSQL URI with a password whose driver (the one SQLAlchemy loads for its scheme) this environment
    lacks: the recipe stops in one line naming it, before the server starts, and never prints the password."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "ADLM_WORKDIR": str(tmp_path), "MLFLOW_BACKEND_STORE_URI": "postgresql+pg8000://user:hunter2@db.internal/m"}
    r = subprocess.run(["bash", str(ROOT / "mlflow" / "server.sh")], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "hunter2" not in r.stdout + r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == ["mlflow/server.sh: the store (postgresql+pg8000://) needs the Python "
                                             "module 'pg8000': pip install -c requirements.lock -e '.[server]'"]


@pytest.mark.slow
def test_training_logs_and_registers_through_the_server(server, tiny_data: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow

    from pipelines.tracking.registry import get_version, resolve_model

    url, artifact_root = server
    wd = tmp_path / "work"
    monkeypatch.setenv("ADLM_WORKDIR", str(wd))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    cfg = load_config(ROOT / "configs" / "demo.yaml", [
        *data_overrides(tiny_data), *TINY_MODEL, "run.name=served", "run.max_steps=6", "run.log_every=2",
        "run.val_every=6", "run.ckpt_every=6", "run.val_batches=1", "batch.global_batch=4", "batch.micro_batch=4",
        "optim.warmup_steps=2", "scaling.num_workers=0", "mlflow.experiment=test-served"])
    res = train_mod.train(cfg)
    assert res.step == 6 and res.registered_version is not None and res.run_id

    client = mlflow.MlflowClient(url)  # the REST client: every call below is an HTTP request
    run = client.get_run(res.run_id)
    assert run.info.run_name == "served" and run.info.status == "FINISHED"
    assert run.data.params["model.kind"] == "adlm" and run.data.params["run.max_steps"] == "6"
    loss = sorted((m.step, m.value) for m in client.get_metric_history(res.run_id, "train/loss"))
    assert [s for s, _ in loss] == [2, 4, 6]
    for key in ("train/nll", "train/tokens_per_s", "val/ppl"):
        assert client.get_metric_history(res.run_id, key), key
    assert run.data.metrics["val/ppl"] == pytest.approx(res.val_ppl)

    # Artifacts went over HTTP: the run's URI is the server's proxy scheme, and the files sit in the
    # server's artifact root (the client never saw that folder).
    assert run.info.artifact_uri.startswith("mlflow-artifacts:"), run.info.artifact_uri
    listed = {a.path: a for a in client.list_artifacts(res.run_id, "checkpoint")}
    assert {"checkpoint/config.json", "checkpoint/model.safetensors", "checkpoint/ema.safetensors",
            "checkpoint/tokenizer.json"} <= set(listed)
    stored = {p.name: p for p in artifact_root.rglob("*") if p.parent.name == "checkpoint"}
    assert stored["ema.safetensors"].stat().st_size == listed["checkpoint/ema.safetensors"].file_size
    assert not (wd / "mlartifacts").exists()

    # The registry: the new version carries the alias and the contract's tags, and downloads over HTTP.
    mv = get_version("models:/adlm@candidate", url)
    assert str(mv.version) == res.registered_version and mv.run_id == res.run_id
    assert mv.tags["kind"] == "adlm" and mv.tags["run_name"] == "served"
    assert mv.tags["checkpoint_uri"].startswith("mlflow-artifacts:")
    assert client.get_model_version_by_alias("adlm", "candidate").version == mv.version
    local = resolve_model("models:/adlm@candidate", url, dst=tmp_path / "dl")
    _, mcfg, meta = load_checkpoint(local, expect={"kind": "adlm"})
    assert meta["step"] == 6 and meta["mlflow_run_id"] == res.run_id and mcfg.hidden == 32
