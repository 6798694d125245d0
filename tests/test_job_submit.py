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
import uuid
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


TOKEN = "0123456789abcdef0123456789abcdef"


def _env(**extra: str) -> dict[str, str]:
    """This machine's environment without any Ray setting (a fresh shell), the venv first on PATH (the job's
    `python` is whatever the head's PATH finds: ENVIRONMENT.md), plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_") and k not in ("MLFLOW_TRACKING_URI", "ADLM_WORKDIR")}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", RAY_USAGE_STATS_ENABLED="0", **extra)
    return env


def readme_client_env() -> dict[str, str]:
    """The client settings README.md's cluster steps export, exactly: each ``export NAME=...`` line of the
    block that submits the first job. The token's value is what its command prints (the secret: ``TOKEN``)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Running on a cluster"):]
    block = next(b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "ray job submit" in b)
    exports = dict(re.findall(r"^export (\w+)=(.*)$", block, re.M))
    assert set(exports) == {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}, exports
    assert exports["RAY_AUTH_TOKEN"].startswith("$(aws secretsmanager get-secret-value --secret-id adlm/ray-auth-token")
    return {"RAY_AUTH_MODE": exports["RAY_AUTH_MODE"], "RAY_AUTH_TOKEN": TOKEN}


@pytest.fixture()
def ray_head(tmp_path: Path):
    token_file = tmp_path / "auth_token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    head_env = _env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
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
        yield {"dashboard": address, "gcs": f"127.0.0.1:{port}"}
    finally:
        # `ray start --block` stops its processes one by one on SIGTERM, with timeouts (about 35 s here): a few
        # seconds' grace, then the whole process group (head, raylet, workers) is killed.
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # whatever is left in the group
        except ProcessLookupError:
            pass
        head.wait(timeout=30)
        log.close()
        # `ray start` names its head in /tmp/ray/ray_current_cluster; a later bare ray.init() would try it.
        current = Path("/tmp/ray/ray_current_cluster")
        if current.exists() and current.read_text().strip().endswith(f":{port}"):
            current.unlink()


@pytest.mark.slow
def test_ray_job_submit_runs_the_pipeline_and_registers_a_champion(ray_head: dict, tmp_path: Path) -> None:
    """The client environment is exactly README.md's; less of it is refused: no token, or the token without
    RAY_AUTH_MODE=token (Ray's client then sends no token); a driver without the token fails in one line."""
    import mlflow

    client = readme_client_env()
    wd = tmp_path / "job-work"
    cmd = [str(BIN / "ray"), "job", "submit", "--address", ray_head["dashboard"], "--working-dir", str(ROOT),
           "--runtime-env", str(ROOT / "runtime_env.yaml"), "--", "python", "-m", "pipelines.run_all",
           "--profile", "smoke", "--skip-sweep", "--workdir", str(wd)]
    for partial in ({"RAY_AUTH_MODE": client["RAY_AUTH_MODE"]}, {"RAY_AUTH_TOKEN": client["RAY_AUTH_TOKEN"]}):
        refused = subprocess.run(cmd, cwd=ROOT, env=_env(**partial), capture_output=True, text=True, timeout=120)
        out = refused.stdout + refused.stderr
        assert refused.returncode != 0 and re.search(r"(?i)auth|401|unauthori", out), (partial.keys(), out[-3000:])
    assert not wd.exists()
    # A driver (not a job) that joins the cluster without the token: one line naming what to set, exit 2.
    driver = subprocess.run([sys.executable, "-m", "pipelines.run_all", "--profile", "smoke", "--skip-sweep",
                             "--workdir", str(tmp_path / "driver-work")], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env=_env(RAY_ADDRESS=ray_head["gcs"], RAY_AUTH_MODE="token",
                                                  PYTHONPATH=str(ROOT)))
    err = [line for line in driver.stderr.splitlines() if line.startswith("error: ")]
    assert driver.returncode == 2 and len(err) == 1, driver.stderr[-3000:]
    assert err[0].startswith("error: the Ray cluster at") and "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN" in err[0]
    # Submitted under an id of ours and waited on with `ray job status`: on a busy machine the head's job agent can
    # start after the job API answers, or the dashboard can drop the connection after taking the job; a try
    # again is then either accepted or told the id exists (the lost reply's job), never a second job.
    sid = f"readme-{uuid.uuid4().hex[:12]}"
    submit = [*cmd[:3], "--submission-id", sid, "--no-wait", *cmd[3:]]
    for _ in range(30):
        r = subprocess.run(submit, cwd=ROOT, env=_env(**client), capture_output=True, text=True, timeout=300)
        out = r.stdout + r.stderr
        if r.returncode == 0 or "already exists" in out or not re.search(
                r"No available agent|Connection aborted|RemoteDisconnected|ConnectionError", out):
            break
        time.sleep(2)
    assert r.returncode == 0 or "already exists" in out, out[-5000:]
    deadline, status = time.time() + 600, ""
    while time.time() < deadline and not re.search(rf"Job '{sid}' (succeeded|failed|was stopped)", status):
        time.sleep(3)
        st = subprocess.run([str(BIN / "ray"), "job", "status", "--address", ray_head["dashboard"], sid], cwd=ROOT,
                            env=_env(**client), capture_output=True, text=True, timeout=120)
        status = st.stdout + st.stderr
    if f"Job '{sid}' succeeded" not in status:
        logs = subprocess.run([str(BIN / "ray"), "job", "logs", "--address", ray_head["dashboard"], sid], cwd=ROOT,
                              env=_env(**client), capture_output=True, text=True, timeout=120)
        pytest.fail(f"{status[-2000:]}\n{(logs.stdout + logs.stderr)[-5000:]}")
    # The job's summary and the registry it wrote (sqlite under the job's work directory).
    assert (wd / "summary.md").exists() and "Champion: adlm v1" in (wd / "summary.md").read_text()
    client = mlflow.MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    mv = client.get_model_version_by_alias("adlm", "champion")
    assert str(mv.version) == "1" and mv.tags["kind"] == "adlm" and mv.tags["run_name"] == "smoke-adlm"
    assert mv.tags["eval.status"] == "promoted" and float(mv.tags["val_ppl"]) > 1
    run = client.get_run(mv.run_id)
    assert int(run.data.params["run.max_steps"]) == 8
    assert [m.step for m in client.get_metric_history(mv.run_id, "val/ppl")] == [4, 8]
