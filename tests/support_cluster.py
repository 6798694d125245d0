"""What a cluster is made of, on this one machine (ENVIRONMENT.md): an S3 server on loopback, an MLflow
tracking server whose artifacts live in it, and a Ray cluster of a 0-CPU head and worker nodes.

Nodes of a real cluster share nothing but the object store and the MLflow server; here they share this
machine's disk too, so the tests that use these assert that nothing of a run lands on the local disk.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import free_port


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether ``url`` answers 200 now (a server's health or ping route)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class S3:
    """A moto S3 server: its endpoint, a bucket, and the environment every client needs."""

    endpoint: str
    bucket: str
    env: dict[str, str]
    server: object = field(repr=False, default=None)

    def keys(self, prefix: str = "") -> list[str]:
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.endpoint)
        out, token = [], None
        while True:
            kw = {"Bucket": self.bucket, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
            page = s3.list_objects_v2(**kw)
            out += [o["Key"] for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return out
            token = page["NextContinuationToken"]

    def new_bucket(self, name: str) -> S3:
        """Another bucket on the same server (a test of its own on a server shared by a module)."""
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=name)
        return S3(self.endpoint, name, self.env, self.server)

    def read(self, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist (yet)."""
        import boto3

        try:
            return boto3.client("s3", endpoint_url=self.endpoint).get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except Exception:  # noqa: BLE001 - a missing key (or one being written) reads as not there yet
            return None


@contextlib.contextmanager
def s3_server(bucket: str = "adlm") -> Iterator[S3]:
    """A moto S3 server on a free loopback port with ``bucket`` created; its settings are put into this
    process's environment (and removed afterwards), so that pyarrow, boto3 and MLflow all reach it."""
    import boto3
    from moto.server import ThreadedMotoServer

    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "MLFLOW_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        yield S3(endpoint, bucket, env, srv)
    finally:
        srv.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class MLflowServer:
    """``mlflow server`` on a free loopback port (sqlite store, artifacts where ``artifacts`` says), which a
    test can stop and start again on the same port and store (a tracking outage)."""

    def __init__(self, store: Path, artifacts: str, log: Path, extra_env: dict[str, str] | None = None) -> None:
        self.store, self.artifacts, self.log = store, artifacts, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(extra_env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> MLflowServer:
        import requests

        cmd = [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{self.store}",
               "--artifacts-destination", self.artifacts, "--serve-artifacts", "--host", "127.0.0.1",
               "--port", str(self.port), "--workers", "1"]
        fh = self.log.open("a")
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout
        while True:
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"mlflow server did not come up:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None


@contextlib.contextmanager
def mlflow_server(store: Path, artifacts: str, log: Path) -> Iterator[MLflowServer]:
    server = MLflowServer(store, artifacts, log).start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def models_serve(model_uri: str, log: Path, cwd: Path, timeout: float = 120.0) -> Iterator[str]:
    """``mlflow models serve -m model_uri`` (this environment, one worker) on a free loopback port, up within
    ``timeout`` (or the test fails with its log); yields its URL; the server's process group is stopped on exit."""
    import pytest

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "NO_PROXY": "127.0.0.1,localhost"}
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager",
                                 "local", "-h", "127.0.0.1", "-p", str(port), "--workers", "1"],
                                env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not http_ok(f"{url}/ping"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow models serve did not come up; its log:\n{log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.5)
        yield url
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # mlflow and its uvicorn worker; SIGKILL if it lingers
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=20)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue


def invocations(url: str, payload: dict) -> tuple[int, dict]:
    """POST ``payload`` to a scoring server's /invocations; (HTTP status, the JSON it answered)."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{url}/invocations", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@dataclass
class RayCluster:
    """A Ray cluster on this machine: a head with 0 CPUs (nothing runs there) and ``nodes`` worker nodes."""

    cluster: object
    address: str
    """GCS address (``ray.init(address=...)``)."""
    dashboard: str
    """Job API (``ray job submit --address ...``)."""
    workers: list = field(default_factory=list)

    def remove(self, node: object) -> None:
        """Kill a worker node (all its processes), as a cloud node that disappears."""
        self.cluster.remove_node(node, allow_graceful=False)
        self.workers.remove(node)


@contextlib.contextmanager
def ray_cluster(nodes: int = 2, cpus: int = 1, head_resources: dict[str, float] | None = None) -> Iterator[RayCluster]:
    """Head (0 CPUs, dashboard and job API on loopback) plus ``nodes`` nodes of ``cpus`` CPUs. The nodes are
    started from this process: they inherit its environment (the S3 settings and credentials, as nodes of a
    real cluster take them from their own environment or instance role), with the venv first on PATH so
    that a job's ``python`` is this interpreter. ``head_resources``: custom resources of the head (cluster.yaml's
    ``adlm_driver``, which keeps Tune trial drivers on the never-preempted head). Each node gets its own runtime-env folder: nodes that share
    one (as on one machine) garbage-collect each other's job working directories."""
    from ray.cluster_utils import Cluster

    from pipelines.runtime import LOCAL_SYSTEM_CONFIG  # idle workers reused, as in a local Ray

    saved_path = os.environ["PATH"]
    os.environ["PATH"] = f"{BIN}{os.pathsep}{saved_path}"
    try:
        for attempt in (1, 2):
            dash = free_port()
            cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 0, "resources": dict(head_resources or {}), "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": dash,
                "_system_config": LOCAL_SYSTEM_CONFIG, **_free_ports()})
            try:
                workers = [cluster.add_node(num_cpus=cpus, runtime_env_dir_name=f"runtime_resources_node{i}",
                                            **_free_ports()) for i in range(nodes)]
                break
            except Exception as e:  # a raylet that missed Ray's 30 s start-up window on 2 busy cores: once more
                cluster.shutdown()
                if attempt == 2 or "timed out during startup" not in str(e):
                    raise
        try:
            cluster.wait_for_nodes()
            _wait_for_job_api(f"http://127.0.0.1:{dash}")
            yield RayCluster(cluster, cluster.address, f"http://127.0.0.1:{dash}", workers)
        finally:
            cluster.shutdown()
    finally:
        os.environ["PATH"] = saved_path


@dataclass
class ClusterProcess:
    """A Ray cluster run by ``tests/cluster_process.py``: its addresses and the head's session folder."""

    address: str
    """GCS address."""
    dashboard: str
    """Job API."""
    session_dir: Path


@contextlib.contextmanager
def ray_cluster_process(env: dict[str, str], log: Path, **kwargs: object) -> Iterator[ClusterProcess]:
    """``ray_cluster(**kwargs)`` in a process of its own with ``env`` (a cluster with token authentication:
    ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH``), stopped on exit."""
    import json
    import threading

    fh = log.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "tests.cluster_process", json.dumps(kwargs)], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fh, text=True,
                            start_new_session=True)
    try:
        first: list[str] = []
        ready = threading.Event()

        def read() -> None:  # the first line, then whatever else it prints (a full pipe would block it)
            first.append(proc.stdout.readline())
            ready.set()
            for _ in proc.stdout:
                pass

        threading.Thread(target=read, daemon=True).start()
        ready.wait(timeout=300)
        if not first or not first[0].strip():
            raise RuntimeError(f"the cluster did not come up:\n{log.read_text(errors='replace')[-3000:]}")
        info = json.loads(first[0])
        yield ClusterProcess(info["address"], info["dashboard"], Path(info["session_dir"]))
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()  # the process shuts its cluster down
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left in its group
        proc.wait(timeout=30)
        fh.close()


def _free_ports() -> dict[str, int]:
    """A node's agent and metrics ports, free now: Ray's defaults collide with any other Ray on the machine
    (the test session's own, a cluster a crashed test left behind)."""
    return {k: free_port() for k in ("dashboard_agent_listen_port", "metrics_export_port", "metrics_agent_port",
                                     "runtime_env_agent_port")}


def _wait_for_job_api(dashboard: str, timeout: float = 120.0) -> None:
    """Until the head's job agent takes jobs (the dashboard answers before it does)."""
    from ray.job_submission import JobSubmissionClient

    deadline = time.time() + timeout
    while True:
        try:
            JobSubmissionClient(dashboard).list_jobs()
            return
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(1)


def job_submit_command(dashboard: str, entrypoint: list[str], runtime_env: Path) -> list[str]:
    """``ray job submit --working-dir <repo> --runtime-env <file> -- <entrypoint>``, as README.md submits."""
    return [str(BIN / "ray"), "job", "submit", "--address", dashboard, "--working-dir", str(ROOT),
            "--runtime-env", str(runtime_env), "--", *entrypoint]


def submit_job(dashboard: str, entrypoint: list[str], runtime_env: Path, cwd: Path, log: Path,
               timeout: float = 900.0, env: dict[str, str] | None = None) -> tuple[str, str]:
    """``job_submit_command`` run from ``cwd`` (with ``env``, else this process's environment), waited on;
    returns (final status, the job's logs)."""
    cmd = job_submit_command(dashboard, entrypoint, runtime_env)
    env = env or {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    for _ in range(30):  # the head's job agent may still be starting: "No available agent to submit job"
        with log.open("w") as fh:
            r = subprocess.run(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout, env=env)
        text = log.read_text(errors="replace")
        if "No available agent to submit job" not in text:
            break
        time.sleep(2)
    status = "SUCCEEDED" if r.returncode == 0 and "succeeded" in text else "FAILED"
    return status, text


@dataclass
class Outage:
    """When a tracking server was down (``start``/``end``: epoch seconds), filled in by ``tracking_outage``."""

    seconds: float
    start: float | None = None
    end: float | None = None
    thread: object = field(repr=False, default=None)


def tracking_outage(server: MLflowServer, run_name: str, seconds: float, after_windows: int = 5) -> Outage:
    """In the background: once the MLflow run tagged ``adlm.run_name = run_name`` has ``after_windows`` logged
    loss windows, stop ``server`` for ``seconds``, then start it again on the same port and store."""
    import threading

    import mlflow

    client = mlflow.MlflowClient(server.url)
    outage = Outage(seconds)

    def run() -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            exps = client.search_experiments()
            runs = client.search_runs([e.experiment_id for e in exps], f"tags.`adlm.run_name` = '{run_name}'") \
                if exps else []
            if runs and len(client.get_metric_history(runs[0].info.run_id, "train/loss")) >= after_windows:
                break
            time.sleep(1)
        outage.start = time.time()
        server.stop()
        time.sleep(seconds)
        server.start()
        outage.end = time.time()

    outage.thread = threading.Thread(target=run, daemon=True)
    outage.thread.start()
    return outage


def outage_step_rates(tracking_uri: str, run_id: str, outage: Outage) -> tuple[list[float], list[float]]:
    """Tokens/s of the windows the training loop measured while the server was up (before the outage, the
    first window left out as warm-up, and after it) and while it was down (from 5 s in)."""
    import mlflow

    rate = mlflow.MlflowClient(tracking_uri).get_metric_history(run_id, "train/tokens_per_s")
    rate = sorted(rate, key=lambda m: m.step)[1:]
    up = [m.value for m in rate if not outage.start - 1 < m.timestamp / 1000 < outage.end + 5]
    down = [m.value for m in rate if outage.start + 5 < m.timestamp / 1000 < outage.end]
    return up, down


RAY_OWN_ACTORS = ("_StatsActor", "_StatsSummaryActor", "AutoscalingRequester", "_AutoscalingCoordinatorActor",
                  "ActorLocationTracker", "_UsageCollectionActor", "JobSupervisor")
"""Actors Ray keeps for the cluster itself (Ray Data's detached statistics, usage and autoscaling-coordination
actors, one each per cluster; the job API's supervisors, which end with their jobs): not work of the pipeline's."""


def leftovers(dashboard: str, token: str | None = None, timeout: float = 60.0) -> tuple[list[dict], list[dict]]:
    """The placement groups not removed and the live actors of the pipeline's work on the cluster whose state API
    is at ``dashboard`` (``token``: a token-authenticated cluster's), once both are empty or after ``timeout``
    seconds (a finished driver's groups and actors go within seconds: its job's end removes them)."""
    import requests

    headers = {"authorization": f"Bearer {token}"} if token else {}

    def rows(kind: str) -> list[dict]:
        r = requests.get(f"{dashboard}/api/v0/{kind}", params={"limit": 10000, "detail": "1"}, headers=headers,
                         timeout=30)
        r.raise_for_status()
        return r.json()["data"]["result"]["result"]

    deadline = time.time() + timeout
    while True:
        groups = [g for g in rows("placement_groups") if g.get("state") != "REMOVED"]
        actors = [a for a in rows("actors") if a.get("state") != "DEAD"
                  and not str(a.get("class_name", "")).endswith(RAY_OWN_ACTORS)]
        if (not groups and not actors) or time.time() > deadline:
            return groups, actors
        time.sleep(2)


def describe_leftovers(groups: list[dict], actors: list[dict]) -> str:
    """One line per leftover (for an assertion's message): a group's job, state, bundles and whether detached; an
    actor's class, job, state, node and whether detached."""
    rows = [f"group {g.get('placement_group_id', '')[:12]} job {g.get('creator_job_id')} {g.get('state')} detached="
            f"{g.get('is_detached')} bundles={[b.get('unit_resources') for b in g.get('bundles') or []]}"
            for g in groups]
    rows += [f"actor {a.get('class_name')} job {a.get('job_id')} {a.get('state')} detached={a.get('is_detached')} "
             f"node {str(a.get('node_id'))[:12]} pid {a.get('pid')}" for a in actors]
    return "\n".join(rows)
