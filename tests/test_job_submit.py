"""`ray job submit` against a real local head with Ray's token authentication on, as on the cluster
(cluster.yaml): a submission without the token is refused; with it, the smoke pipeline (prepare -> train ->
staged evaluation -> promotion) runs as a job with the project's runtime_env.yaml (no credential in it), and
the MLflow registry it wrote is checked. The head reads its token from a file (never a command line), is
started on loopback with free ports and stopped (only it: never `ray stop`, which would kill every Ray on
the machine) afterwards. The multi-node, object-storage version of this is tests/test_cluster.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


TOKEN = "0123456789abcdef0123456789abcdef"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "ADLM_WORKDIR", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    # The job's `python` is whatever the head's PATH finds: the venv first (ENVIRONMENT.md).
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", RAY_AUTH_MODE="token", RAY_USAGE_STATS_ENABLED="0",
               **extra)
    return env


@pytest.fixture()
def ray_head(tmp_path: Path):
    token_file = tmp_path / "auth_token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    head_env = _env(RAY_AUTH_TOKEN_PATH=str(token_file))
    port, dash = free_port(), free_port()
    log = (tmp_path / "head.log").open("w")
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus", "2", "--node-ip-address", "127.0.0.1",
           "--port", str(port), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
           "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
           "--metrics-export-port", str(free_port()), "--disable-usage-stats"]
    head = subprocess.Popen(cmd, env=head_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.time() + 120
        while True:  # the job API answers once the dashboard is up
            r = subprocess.run([str(BIN / "ray"), "job", "list", "--address", address], env=head_env,
                               capture_output=True, text=True)
            if r.returncode == 0:
                break
            if head.poll() is not None or time.time() > deadline:
                pytest.fail(f"the Ray head did not come up:\n{(tmp_path / 'head.log').read_text()[-3000:]}")
            time.sleep(2)
        yield address
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        time.sleep(2)
        try:
            os.killpg(head.pid, signal.SIGKILL)  # any worker left in the group
        except ProcessLookupError:
            pass
        log.close()
        # `ray start` names its head in /tmp/ray/ray_current_cluster; a later bare ray.init() would try it.
        current = Path("/tmp/ray/ray_current_cluster")
        if current.exists() and current.read_text().strip().endswith(f":{port}"):
            current.unlink()


@pytest.mark.slow
def test_ray_job_submit_runs_the_pipeline_and_registers_a_champion(ray_head: str, tmp_path: Path) -> None:
    import mlflow

    wd = tmp_path / "job-work"
    cmd = [str(BIN / "ray"), "job", "submit", "--address", ray_head, "--working-dir", str(ROOT),
           "--runtime-env", str(ROOT / "runtime_env.yaml"), "--", "python", "-m", "pipelines.run_all",
           "--profile", "smoke", "--skip-sweep", "--workdir", str(wd)]
    refused = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and re.search(r"(?i)auth|401|unauthori", refused.stdout + refused.stderr), \
        (refused.stdout + refused.stderr)[-3000:]
    assert not wd.exists()
    r = subprocess.run(cmd, cwd=ROOT, env=_env(RAY_AUTH_TOKEN=TOKEN), capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    job_id = re.search(r"Job '(raysubmit_\w+)' succeeded", out)
    assert job_id, out[-5000:]
    # The job's summary and the registry it wrote (sqlite under the job's work directory).
    assert (wd / "summary.md").exists() and "Champion: adlm v1" in (wd / "summary.md").read_text()
    client = mlflow.MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    mv = client.get_model_version_by_alias("adlm", "champion")
    assert str(mv.version) == "1" and mv.tags["kind"] == "adlm" and mv.tags["run_name"] == "smoke-adlm"
    assert mv.tags["eval.status"] == "promoted" and float(mv.tags["val_ppl"]) > 1
    run = client.get_run(mv.run_id)
    assert int(run.data.params["run.max_steps"]) == 8
    assert [m.step for m in client.get_metric_history(mv.run_id, "val/ppl")] == [4, 8]
