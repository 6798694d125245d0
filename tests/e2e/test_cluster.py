"""The pipeline where its users run it: nodes that share only object storage and the MLflow server.

On this machine (tests/support/cluster.py): an S3 server on loopback, an MLflow tracking server whose
artifacts live in that bucket, a Ray cluster of a 0-CPU head and two worker nodes. The whole smoke pipeline
runs as a `ray job submit` job with ADLM_WORKDIR=s3://... on a cluster with token authentication whose head does not
offer the trial-driver resource, submitted with the cluster docs' client settings (less of them is refused) from a copy
whose code differs from the nodes' (every process of the job runs the submitted copy), and leaves nothing reserved
or running; on a cluster whose nodes Ray's own autoscaler launches (the fake multi-node provider,
cluster.yaml's node types), a sweep job makes it launch workers from zero, a node killed under the sweep is
replaced (by a CPU node: no GPU node for CPU work) and the sweep completes from the bucket with the undisturbed
results, idle workers are retired and an evaluation asking for a GPU gets a GPU node; bad storage inputs fail in
one line before any work. Every S3 request the nodes send is one the shipped IAM policies allow
(tests/support/iam.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import away_from_session_ray, start_session_ray
from tests.support.cluster import (
    BIN,
    ROOT,
    describe_leftovers,
    job_folders,
    job_processes,
    job_submit_command,
    leftovers,
    mlflow_server,
    new_files,
    node_settings,
    ray_cluster_process,
    s3_server,
    submit_job,
    submitted_copy,
    tracked_files,
)
from tests.support.iam import assert_node_policies_allow

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def _module_s3():
    """One S3 server for the module (each test has a bucket of its own); the session's local Ray is stopped for
    the module's duration (its clusters are the Ray here) and brought back afterwards."""
    with away_from_session_ray(), s3_server("cloud") as s3:
        yield s3


def _bucket_name(request: pytest.FixtureRequest) -> str:
    """A bucket name of this test's own (S3's rules: lower case, digits, hyphens)."""
    return re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")


TOKEN = "0123456789abcdef0123456789abcdef"
NODE_KEY = "AKIACLUSTERNODEROLE1"
"""The access key the cluster's nodes sign their S3 requests with (an instance role's on AWS): the recorded
requests of the nodes, told apart from the MLflow server's and this test's own (tests/support/iam.py)."""


@pytest.fixture()
def auth_cloud(_module_s3, tmp_path: Path, request: pytest.FixtureRequest):
    """A 0-CPU head and two 1-CPU nodes with Ray's token authentication on, as cluster.yaml's nodes run: every node
    reads the token from a file (never a command line). Its head does NOT offer cluster.yaml's trial-driver
    resource, as on any cluster not started from this project's cluster.yaml or manifests: the trials' drivers
    then hold a sliver of a worker node's CPU, and every task must still find what it asks for (Ray
    Data's 1-CPU file sampling never started there). Run by a process of its own (tests/cluster_process.py): Ray
    reads its authentication settings once per process, and this one runs local Rays without."""
    token_file = tmp_path / "auth_token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    env = {**_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file)), **_module_s3.env,
           **node_settings(), "AWS_ACCESS_KEY_ID": NODE_KEY}
    with ray_cluster_process(env, tmp_path / "cluster.log", nodes=2) as rc:
        yield _module_s3.new_bucket(_bucket_name(request)), rc


def _env(**extra: str) -> dict[str, str]:
    """This machine's environment without any Ray setting (a fresh shell), the venv first on PATH, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_") and k not in ("MLFLOW_TRACKING_URI", "ADLM_WORKDIR")}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", RAY_USAGE_STATS_ENABLED="0", **extra)
    return env


CLUSTER_DOCS = ROOT / "docs" / "operations" / "cluster.md"


def docs_client_env() -> dict[str, str]:
    """The client settings the cluster docs' steps export, exactly: each ``export NAME=...`` line of the block that
    submits the first job (the region again, as in a fresh shell, and Ray's two settings). The token's value is
    what its command prints (the secret: ``TOKEN``); that command names the region itself."""
    docs = CLUSTER_DOCS.read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", docs, re.S) if "ray job submit" in b)
    exports = dict(re.findall(r"^export (\w+)=(.*)$", block, re.M))
    assert set(exports) == {"AWS_REGION", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}, exports
    assert exports["RAY_AUTH_TOKEN"].startswith("$(aws secretsmanager get-secret-value --secret-id adlm/ray-auth-token")
    assert '--region "$AWS_REGION"' in exports["RAY_AUTH_TOKEN"]
    return {"RAY_AUTH_MODE": exports["RAY_AUTH_MODE"], "RAY_AUTH_TOKEN": TOKEN}


def _job_env(tmp_path: Path, **env_vars: str) -> Path:
    """The project's runtime_env.yaml plus this run's (non-secret) settings."""
    env = yaml.safe_load((ROOT / "runtime_env.yaml").read_text())
    env["env_vars"].update(env_vars)
    path = tmp_path / "runtime_env.yaml"
    path.write_text(yaml.safe_dump(env))
    return path


def test_the_pipeline_as_a_job_on_a_cluster_keeps_everything_in_object_storage(tmp_path: Path, auth_cloud) -> None:
    """The client environment is exactly the cluster docs'; less of it is refused: no token, or the token without
    RAY_AUTH_MODE=token (Ray's client then sends no token); a driver without the token fails in one line. With
    it, the smoke pipeline runs as a job, keeps everything in the bucket, and a second run finds it all done.
    It is submitted from a copy that differs from the nodes' code (``submitted_copy``): its driver, Ray Train
    workers, Tune trials, Ray Data actors and evaluation tasks all run the submitted copy (the edited and the added
    module; the deleted one does not import, although the nodes' editable install still has it)."""
    import mlflow

    s3, rc = auth_cloud
    client_env = docs_client_env()
    with mlflow_server(tmp_path / "mlflow.db", f"s3://{s3.bucket}/mlartifacts", tmp_path / "mlflow.log") as ml:
        probe = tmp_path / "probe"
        probe.mkdir()
        env_file = _job_env(tmp_path, ADLM_WORKDIR=f"s3://{s3.bucket}/run", MLFLOW_TRACKING_URI=ml.url,
                            ADLM_CODE_PROBE=str(probe))
        submitted = tmp_path / "submitted"
        submitted_files = submitted_copy(submitted)
        empty = tmp_path / "empty"
        empty.mkdir()
        entry = ["python", "-m", "pipelines.run_all", "--profile", "smoke"]
        for partial in ({"RAY_AUTH_MODE": client_env["RAY_AUTH_MODE"]}, {"RAY_AUTH_TOKEN": client_env["RAY_AUTH_TOKEN"]}):
            refused = subprocess.run(job_submit_command(rc.dashboard, entry, env_file), cwd=empty,
                                     env=_env(**partial), capture_output=True, text=True, timeout=120)
            out = refused.stdout + refused.stderr
            assert refused.returncode != 0 and re.search(r"(?i)auth|401|unauthori", out), (partial.keys(), out[-3000:])
        # A driver (not a job) that joins the cluster without the token: one line naming what to set, exit 2. Its
        # HOME is a folder of its own: Ray also reads a token from ~/.ray/auth_token, and one a local Ray left there
        # would be sent instead (a wrong token: refused only after Ray's 20 s of connection retries).
        home = tmp_path / "driver-home"
        home.mkdir()
        driver = subprocess.run([sys.executable, "-m", "pipelines.run_all", "--profile", "smoke", "--skip-sweep",
                                 "--workdir", str(tmp_path / "driver-work")], cwd=ROOT, capture_output=True, text=True,
                                timeout=120, env=_env(RAY_ADDRESS=rc.address, RAY_AUTH_MODE="token",
                                                      PYTHONPATH=str(ROOT), HOME=str(home)))
        err = [line for line in driver.stderr.splitlines() if line.startswith("error: ")]
        assert driver.returncode == 2 and len(err) == 1, driver.stderr[-3000:]
        # Ray refuses it as an authentication error, or (seen under the suite's load) as a failure to connect: the
        # line then names both causes; either way it names what to set.
        assert err[0].startswith(("error: the Ray cluster at", "error: could not join the Ray cluster at")), err[0]
        assert "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN" in err[0], err[0]
        assert not s3.keys("run/")  # nothing ran

        status, log = submit_job(rc.dashboard, entry, env_file, empty, tmp_path / "job1.log", env=_env(**client_env),
                                 working_dir=submitted)
        assert status == "SUCCEEDED", log[-6000:]

        # Every process of the job ran the submitted copy: the edited module (its record), the added one, and not the
        # deleted one, which the nodes' editable install of this checkout still has.
        records = {int(p.stem): json.loads(p.read_text()) for p in probe.glob("*.json")}
        roles = job_processes(rc.dashboard, TOKEN)
        for role in ("driver", "Ray Train worker", "Tune trial", "Ray Data actor", "evaluation task"):
            assert roles.get(role), (role, roles)
            for pid in roles[role]:
                r = records.get(pid)
                assert r and "working_dir_files" in r["file"] and r["added"] == "submitted", (role, pid, r)
                assert not r["deleted_importable"], (role, pid, r)

        client = mlflow.MlflowClient(ml.url)
        champion = client.get_model_version_by_alias("adlm", "champion")
        versions = client.search_model_versions("name='adlm'")
        assert len(versions) == 2  # the ADLM run and the sweep's best
        assert champion.tags["eval.status"] == "promoted" and float(champion.tags["val_ppl"]) > 1
        adlm = next(v for v in versions if v.tags.get("run_name") == "smoke-adlm")
        assert adlm.tags["kind"] == "adlm" and int(client.get_run(adlm.run_id).data.params["run.max_steps"]) == 8
        assert [m.step for m in client.get_metric_history(adlm.run_id, "val/ppl")] == [4, 8]
        assert f"Champion: adlm v{champion.version}," in s3.read("run/summary.md").decode()

        # The bucket holds the run: shards and manifests, Ray Train checkpoints, the sweep's Tune state and
        # tables, the summary, and the registered version's files (the MLflow server's artifact store).
        keys = s3.keys()
        def has(pattern: str) -> bool:
            return any(re.fullmatch(pattern, k) for k in keys)
        for pattern in (r"run/data/smoke/train/part-\d+\.parquet", r"run/data/smoke/validation/manifest\.json",
                        r"run/data/smoke/tokenizer\.json",
                        r"run/ray_results/smoke-adlm/checkpoint_\d+/model\.safetensors",
                        r"run/ray_results/tune/smoke-gamma-tau/.+", r"run/sweeps/smoke-gamma-tau/trials\.csv",
                        r"run/sweeps/smoke-gamma-tau/search\.png", r"run/checkpoints/smoke-adlm/ema\.safetensors",
                        r"run/summary\.md", r"mlartifacts/.+/model\.safetensors"):
            assert has(pattern), f"nothing in the bucket matches {pattern}"
        # The version is an MLflow Model (models:/m-...) whose files live in the bucket, beside the run's.
        assert champion.source.startswith("models:/m-"), champion.source
        location = client.get_logged_model(champion.source.removeprefix("models:/")).artifact_location
        assert location.startswith(("mlflow-artifacts:", "s3:")), location

        # Nothing of the run landed on the local disk: not in the folder the job was submitted from, not in
        # the job's working directory on the head node (only the uploaded project files are there).
        assert not any(empty.iterdir())
        for folder in job_folders(rc.session_dir, log):
            assert not new_files(folder, submitted_files), folder

        # A second run of the same command finds everything done: no new version, no alias moves.
        status, log2 = submit_job(rc.dashboard, entry, env_file, empty, tmp_path / "job2.log", env=_env(**client_env),
                                  working_dir=submitted)
        assert status == "SUCCEEDED", log2[-6000:]
        assert len(client.search_model_versions("name='adlm'")) == 2
        assert client.get_model_version_by_alias("adlm", "champion").version == champion.version
        assert "already registered" in log2
        # Nothing of the finished jobs outlives them: no placement group still reserved, no actor of theirs alive.
        groups, actors = leftovers(rc.dashboard, TOKEN)
        assert not groups and not actors, describe_leftovers(groups, actors)
    # Every S3 request the nodes sent for both runs (the storage layer, Ray Data, Ray Train and Tune, over pyarrow)
    # is one the shipped node policies allow for s3://<bucket>/run, HeadBucket among them (tests/support/iam.py).
    assert_node_policies_allow(s3.calls, NODE_KEY, s3.bucket, "run")


@pytest.mark.parametrize("case, message", [
    ("unreachable", "does not answer"),
    ("no-bucket", "bucket 'nowhere' does not exist"),
    ("no-credentials", "no AWS credentials"),
    ("refused-credentials", "refused this node's credentials"),
    ("scheme", "no filesystem serves the scheme 'ftp'"),
])
def test_bad_storage_fails_in_one_line_before_any_work(case: str, message: str, tmp_path: Path) -> None:
    with s3_server() as s3:
        env = {**os.environ, **s3.env, "PYTHONPATH": str(ROOT)}
        workdir = f"s3://{s3.bucket}/run"
        if case == "unreachable":
            env["AWS_ENDPOINT_URL"] = env["MLFLOW_S3_ENDPOINT_URL"] = "http://127.0.0.1:9"
        elif case == "no-bucket":
            workdir = "s3://nowhere/run"
        elif case == "no-credentials":
            env.pop("AWS_ACCESS_KEY_ID")
            env.pop("AWS_SECRET_ACCESS_KEY")
            env["AWS_SHARED_CREDENTIALS_FILE"] = env["AWS_CONFIG_FILE"] = str(tmp_path / "none")
        elif case == "refused-credentials":  # moto checks keys from now on: "testing" is no known key
            import requests

            requests.post(f"{s3.endpoint}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()
        elif case == "scheme":
            workdir = "ftp://host/run"
        env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
        r = subprocess.run([sys.executable, "-m", "pipelines.train", "--config", str(ROOT / "configs" / "demo.yaml"),
                            "--workdir", workdir], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
        if case == "refused-credentials":  # moto's auth switch is global to this process: checks off again
            requests.post(f"{s3.endpoint}/moto-api/reset-auth", data=b"inf", timeout=10).raise_for_status()
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr.strip()
    assert err.startswith("error: ") and err.count("\n") == 0 and message in err, err
    assert "Ray" not in r.stdout and not (tmp_path / "work").exists()


CONTROL_ENV = "ADLM_AUTOSCALER_CONTROL"
"""The autoscaler test's controls, each of which must make it fail (docs/development/cluster-tests.md: what they printed):
``1``: the cluster is built without its ``cpu_worker`` type; ``gpu-for-cpu``: ``cpu_worker`` capped below the
cluster's ``max_workers`` (4 of 12, as cluster.yaml had it), where the autoscaler puts CPU work on a GPU node."""


def test_ray_autoscaler_launches_replaces_and_retires_the_nodes_of_a_sweep_and_a_gpu_evaluation(
        tmp_path: Path, tiny_data: Path, _module_s3, request: pytest.FixtureRequest) -> None:
    """Ray's own autoscaler (its monitor, with Ray's fake multi-node provider) on cluster.yaml's node types scaled to
    this machine: a 0-CPU head offering ``adlm_driver``, token authentication on, no worker node at first. A 2-trial
    sweep submitted as a job (the cluster docs' client settings; the work directory in the bucket) makes the autoscaler
    launch ``cpu_worker`` nodes; once both trials have a checkpoint in the bucket and one still trains, every
    ``cpu_worker`` node is killed (SIGKILL of its raylet and everything it started: preempted instances; all of them,
    so that no node freed by a trial that ends meanwhile can take the restarted one), the autoscaler launches a new
    ``cpu_worker`` (and no ``gpu_worker``: CPU work never gets a GPU node), and the sweep completes in the same job
    and registers its best:
    every trial equal to the same recipe trained undisturbed in this process (steps and validation bounds), each
    optimiser step taken once (its final checkpoint made exactly ``steps`` updates, the EMA counts them, on ``steps``
    batches of data: its data position), each step's loss logged once, the killed one resumed from a checkpoint;
    the trial drivers and Ray Train controllers all on the head. Then the idle workers are retired; an evaluation of
    the registered version that asks for a GPU launches a ``gpu_worker`` and its task runs there. Nothing of the
    jobs outlives them, nothing lands on the local disk, and no process of the cluster is left when it stops."""
    import csv
    import io
    import threading

    import mlflow
    import ray

    from adlm_model.interop.checkpoint import load_state
    from pipelines.core.runtime import NODE_KIND_LABEL
    from pipelines.core.storage import download_dir, upload_dir
    from pipelines.data.manifest import read_manifest
    from pipelines.training.config import load_config
    from pipelines.training.trainer import train
    from tests.support.cluster import autoscaling_cluster, node_type
    from tests.support.data import TINY_MODEL, set_args

    space_file = "tests/fixtures/autoscaler_sweep.yaml"
    overrides = yaml.safe_load((ROOT / space_file).read_text())["overrides"]
    steps = overrides["run.max_steps"]
    model = [f"model.{k}={v}" for k, v in read_manifest(tiny_data / "train").model_overrides().items()]
    # The undisturbed runs: each trial's recipe trained in this process on the local copy of the data (local mode
    # gives a one-worker Ray Train run's numbers: tests/pipelines/test_tune.py; here the comparison checks that too).
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    calm = {}
    if not ray.is_initialized():  # this module stopped the session's Ray: the same, for these runs (no dashboard)
        start_session_ray()
    for tau in (2, 5):
        cfg = load_config(ROOT / "configs" / "demo.yaml", [
            f"data.train={tiny_data / 'train'}", f"data.validation={tiny_data / 'validation'}", *model, *TINY_MODEL,
            *(f"{k}={v}" for k, v in overrides.items()), f"model.tau={tau}", f"run.name=calm-tau{tau}",
            "scaling.num_workers=0", "scaling.threads=1", "mlflow.experiment=calm"])
        # The job's tracking store too (made here once: its tables are not created again under the job's clock); an
        # experiment of their own, whose artifacts stay in this folder.
        calm[tau] = train(cfg, workdir=tmp_path / "calm", tracking_uri=uri, register=False)
    ray.shutdown()  # this process's Ray: the cluster below is the Ray here

    s3 = _module_s3.new_bucket(_bucket_name(request))
    bucket = f"s3://{s3.bucket}"
    upload_dir(tiny_data, f"{bucket}/run/data/tiny")
    token_file = tmp_path / "auth_token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    env = {**_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file)), **_module_s3.env,
           **node_settings(), "AWS_ACCESS_KEY_ID": NODE_KEY}
    sent_before = len(s3.calls)
    without = ("cpu_worker",) if os.environ.get(CONTROL_ENV) == "1" else ()
    recipe = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    if os.environ.get(CONTROL_ENV) == "gpu-for-cpu":
        recipe["available_node_types"]["cpu_worker"]["max_workers"] = 4
    client_env = _env(**docs_client_env())
    empty = tmp_path / "empty"
    empty.mkdir()
    with autoscaling_cluster(env, TOKEN, tmp_path / "ray-start.log", without=without, recipe=recipe) as ac:
        head = ac.head_id()
        assert not ac.workers(), ac.status()  # from zero: no worker node until a job asks for one
        env_file = _job_env(tmp_path, ADLM_WORKDIR=f"{bucket}/run", MLFLOW_TRACKING_URI=uri,
                            ADLM_PLACEMENT_TIMEOUT_S="120")
        entry = ["python", "-m", "pipelines.tune", "--space", space_file, "--config", "configs/demo.yaml",
                 *set_args([*model, *TINY_MODEL, "data.train=data/tiny/train", "data.validation=data/tiny/validation"])]
        job: dict = {}

        def run_job() -> None:  # `ray job submit` waits for the job's end; the waits below watch it meanwhile
            job["status"], job["log"] = submit_job(ac.dashboard, entry, env_file, empty, tmp_path / "sweep-job.log",
                                                   timeout=480, env=client_env)

        submitted = time.time()
        submitter = threading.Thread(target=run_job, daemon=True)
        submitter.start()

        def running() -> bool:
            if not submitter.is_alive():  # the job ended before what is waited for happened: no use waiting
                launched = sorted(node_type(n) for n in ac.nodes() if not n.get("is_head_node"))
                raise AssertionError(f"the sweep job ended first ({job.get('status')}), the autoscaler having launched "
                                     f"{launched or 'no node'}; the job's log:\n{job.get('log', '')[-3000:]}")
            return True

        def cpu_workers(since: float = 0.0) -> list[dict]:
            return [n for n in ac.workers() if node_type(n) == "cpu_worker" and n["start_time_ms"] / 1000 > since]

        # Both trials at once, a node each: the autoscaler launches two cpu_worker nodes.
        ac.wait_for("two cpu_worker nodes launched for the sweep", lambda: running() and len(cpu_workers()) >= 2,
                    timeout=180)
        # Once both trials have a checkpoint in the bucket and a training worker is still alive, kill every cpu_worker
        # node: whichever trial is unfinished resumes from a checkpoint, and only on a node launched after the kill.
        ac.wait_for("a checkpoint of each trial in the bucket", lambda: running() and len({
            k.split("/")[2] for k in s3.keys("run/ray_results/storm-")
            if re.search(r"/checkpoint_\d+/config\.json$", k)}) == 2, timeout=300, poll=0.5)
        training = ac.wait_for("a node running a trial's training worker", lambda: running() and sorted(
            {a["node_id"] for a in ac.actors() if a.get("state") == "ALIVE" and a.get("class_name") == "RayTrainWorker"}
            - {head}), timeout=30, poll=0.5)
        killed = [n["node_id"] for n in cpu_workers()]
        killed_at = time.time()
        for node in killed:  # its raylet and what it started; a node the autoscaler was retiring (its trial ended,
            # idle) may have none left by now (seen once under the suite's load): the training one must have
            assert ac.kill_node(node) >= 2 or node not in training, node
        replacement = ac.wait_for("a cpu_worker node launched after the kill", lambda: cpu_workers(since=killed_at)
                                  or (running() and None), timeout=180)
        submitter.join(timeout=max(1.0, 480 - (time.time() - submitted)))
        status, log = job.get("status"), job.get("log", "(the job's submission did not return)")
        assert status == "SUCCEEDED", f"{log[-5000:]}\n{ac.status()}"
        # CPU work only so far: no GPU node was launched for it, not even while the killed nodes still counted.
        assert not [n for n in ac.nodes() if node_type(n) == "gpu_worker"], f"a gpu_worker for the CPU sweep\n{ac.status()}"
        # Every node says what it is for, as cluster.yaml declares (the head too): the label CPU work selects on.
        kinds = {(node_type(n), (n.get("labels") or {}).get(NODE_KIND_LABEL)) for n in ac.nodes()}
        assert kinds == {("head", "cpu"), ("cpu_worker", "cpu")}, kinds
        cpu = {n["node_id"]: n for n in ac.nodes() if node_type(n) == "cpu_worker"}
        assert all(cpu[n]["state"] == "DEAD" for n in killed) and replacement[0]["node_id"] not in killed, (cpu, killed)
        # The trial drivers (Tune's function-trainable actors) and the Ray Train controllers ran on the head only.
        drivers = {(a["class_name"], a["node_id"]) for a in ac.actors()
                   if "TrainController" in a["class_name"] or "Func" in a["class_name"] or "run_trial" in a["class_name"]}
        assert {c for c, n in drivers if "TrainController" in c} and all(n == head for _, n in drivers), drivers
        # Nothing of the finished job outlives it: no trial's or Ray Train's placement group, no actor of it alive.
        groups, actors = leftovers(ac.dashboard, TOKEN)
        assert not groups and not actors, describe_leftovers(groups, actors)
        # Idle workers retired (idle_timeout_minutes, scaled down to seconds).
        ac.wait_for("the idle worker nodes retired", lambda: not ac.workers(), timeout=90)

        # The registered best, then its evaluation asking for a GPU (gpu_min_params 0: "a large model"), on no GPU
        # node: the autoscaler launches a gpu_worker and the task runs there.
        summary = json.loads(re.findall(r'^\{"sweep": .*\}$', log, re.M)[-1])
        version = summary["registered_version"]
        client = mlflow.MlflowClient(uri)
        assert version and str(client.get_model_version_by_alias("adlm", "candidate").version) == str(version)
        evaluated = time.time()
        status, elog = submit_job(ac.dashboard, [
            "python", "-m", "pipelines.evaluate", "--model", f"models:/adlm/{version}", "--suite", "ppl",
            *set_args(["gpu_min_params=0", "cpus_per_task=0.5", "max_rows=16", "batch_size=8"])],
            env_file, empty, tmp_path / "eval-job.log", timeout=300, env=client_env)
        gpu = [n for n in ac.nodes() if node_type(n) == "gpu_worker" and n["start_time_ms"] / 1000 > evaluated]
        assert status == "SUCCEEDED" and gpu, f"{elog[-5000:]}\n{ac.status()}"
        assert {(n.get("labels") or {}).get(NODE_KIND_LABEL) for n in gpu} == {"gpu"}, gpu
        tasks = [t for t in ac._get("tasks") if (t.get("required_resources") or {}).get("GPU")]
        assert tasks and {t["node_id"] for t in tasks} <= {n["node_id"] for n in gpu}, tasks
        assert client.get_model_version("adlm", version).tags.get("eval.run_id")
        groups, actors = leftovers(ac.dashboard, TOKEN)
        assert not groups and not actors, describe_leftovers(groups, actors)

        # Nothing of the run landed on the local disk: not in the folder the jobs were submitted from, not in the
        # jobs' working directory on the nodes (only the uploaded project files are there).
        assert not any(empty.iterdir())
        for folder in job_folders((ac.temp_dir / "session_latest").resolve(), log):
            assert not new_files(folder, tracked_files()), folder

    # Every trial equals the same run undisturbed.
    rows = list(csv.DictReader(io.StringIO(s3.read("run/sweeps/storm/trials.csv").decode())))
    before = {tau: ("finished", r.step, r.best_val_ppl) for tau, r in calm.items()}
    after = {int(float(r["tau"])): (r["status"], int(r["step"]), float(r["best_val_ppl"])) for r in rows}
    assert set(before) == set(after) == {2, 5}
    for tau, (status, step, ppl) in before.items():
        assert (status, step) == ("finished", steps) and after[tau][:2] == (status, step), (tau, after[tau])
        assert after[tau][2] == pytest.approx(ppl, rel=1e-5), (tau, after[tau], ppl)
    # Every trial took each optimiser step once, on its own batch, and logged it once; a restarted one resumed from
    # a checkpoint (train/resumed_from at a multiple of ckpt_every).
    per_epoch = read_manifest(tiny_data / "train").rows // 8  # one worker, 8 rows a step, the last part dropped
    resumed = []
    for r in rows:
        final = download_dir(f"{bucket}/run/ray_results/storm-{r['trial_id']}/checkpoint_{steps:08d}",
                             tmp_path / "final" / r["trial_id"])
        state = load_state(final, "trainer_state")
        assert state["step"] == steps and state["ema_updates"] == steps, r  # no update twice, none skipped
        assert state["data"]["epoch"] * per_epoch + state["data"]["position"] == steps  # each step's own batch
        logged = sorted(m.step for m in client.get_metric_history(r["mlflow_run_id"], "train/loss"))
        assert logged == list(range(1, steps + 1)), (r["trial_id"], logged)  # no step twice, none skipped
        resumed += [m.value for m in client.get_metric_history(r["mlflow_run_id"], "train/resumed_from")]
    assert resumed and all(v % 10 == 0 and v >= 10 for v in resumed), resumed
    # Every S3 request of the cluster's nodes is one the shipped node policies allow (tests/support/iam.py).
    assert_node_policies_allow(s3.calls[sent_before:], NODE_KEY, s3.bucket, "run")
    # The sweep's runs live in the bucket: nothing of them on this disk.
    assert not [q for q in tmp_path.rglob("*") if "storm-" in q.name or q.name == "tracking_spool"]
