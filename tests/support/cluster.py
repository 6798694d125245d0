"""What a cluster is made of, on this one machine: an S3 server on loopback, an MLflow
tracking server whose artifacts live in it, and a Ray cluster of a 0-CPU head and worker nodes.

Nodes of a real cluster share nothing but the object store and the MLflow server; here they share this
machine's disk too, so the tests that use these assert that nothing of a run lands on the local disk.

Longer than 500 lines because every part of the local stand-in for a cluster lives here (S3 that records every
request, MLflow's server, a static Ray cluster, one in a process of its own, Ray's autoscaler with its fake provider,
jobs and the submitted copy of their code, scoring servers): the cluster tests share them.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.core.runtime import environ
from tests.conftest import RAY_LATE, free_port, start_ray_once_more_if_late


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether ``url`` answers 200 now (a server's health or ping route)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False

def command_lines(pgid: int) -> list[str]:
    """The command lines of a process group's processes (what `ps` shows every user)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid:
                    out.append((d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except (ProcessLookupError, PermissionError, FileNotFoundError):
                continue
    return out


BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class S3:
    """A moto S3 server: its endpoint, a bucket, and the environment every client needs."""

    endpoint: str
    bucket: str
    env: dict[str, str]
    server: object = field(repr=False, default=None)
    calls: list = field(repr=False, default_factory=list)
    """Every signed request the server answered (tests/support/iam.py's ``Call``), in order."""

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
        return S3(self.endpoint, name, self.env, self.server, self.calls)

    def read(self, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist (yet)."""
        import boto3

        try:
            return boto3.client("s3", endpoint_url=self.endpoint).get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except Exception:  # noqa: BLE001 - a missing key (or one being written) reads as not there yet
            return None


@contextlib.contextmanager
def s3_server(bucket: str = "adlm") -> Iterator[S3]:
    """A moto S3 server on a free loopback port with ``bucket`` created, recording every request
    (tests/support/iam.py: what AWS would authorise for each); its settings are put into this process's environment
    (and removed afterwards), so that pyarrow, boto3 and MLflow all reach it."""
    import boto3

    from tests.support.iam import recording_moto_server

    with recording_moto_server(free_port()) as (srv, calls):
        host, port = srv.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        env = {"AWS_ENDPOINT_URL": endpoint, "MLFLOW_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}
        with environ(env):
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
            yield S3(endpoint, bucket, env, srv, calls)


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
        stop_group(self.proc, grace=30)
        self.proc = None


class Gate:
    """A loopback TCP forwarder to a server's port that can go down and come back at once: ``stop()`` refuses new
    connections (its port is closed: connection refused, as from a stopped server) and cuts the live ones;
    ``start()`` listens again on the same port. A tracking outage whose end is known to the tenth of a second,
    where restarting a real ``mlflow server`` takes 5-25 s under load (a run meant to end with the server up
    ended while it was still starting). The server behind it stays up: the client's side is what is under test."""

    def __init__(self, target_port: int) -> None:
        import socket
        import threading

        self._socket, self._lock = socket, threading.Lock()
        self.target_port, self.port = target_port, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._listener = None
        self._conns: set = set()
        self.start()

    def start(self) -> Gate:
        import threading

        sock = self._socket.socket()
        sock.setsockopt(self._socket.SOL_SOCKET, self._socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(64)
        sock.settimeout(0.1)  # the accept loop sees stop() within a tenth of a second
        self._listener = sock
        threading.Thread(target=self._accept, args=(sock,), daemon=True).start()
        return self

    def stop(self) -> None:
        sock, self._listener = self._listener, None
        if sock is not None:
            sock.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(self._socket.SHUT_RDWR)
            c.close()

    def _accept(self, sock) -> None:
        import threading

        while self._listener is sock:
            try:
                client, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = self._socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            with self._lock:
                self._conns |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a, b) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for c in (a, b):
                with contextlib.suppress(OSError):
                    c.shutdown(self._socket.SHUT_RDWR)
            with self._lock:
                self._conns -= {a, b}


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
        stop_group(proc)  # mlflow and its uvicorn worker


def stop_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """Stop a process started with ``start_new_session=True`` and everything in its group: SIGTERM, then SIGKILL
    if it lingers ``grace`` seconds (a server and its workers)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=grace)
        except ProcessLookupError:
            return
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


NODE_SETTINGS = ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER",
                 "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD")
"""The suite's Ray settings (tests/conftest.py, ``_ENV``) that the nodes of a cluster started with an environment
of its own take too (tests/e2e/test_cluster.py's ``_env`` leaves out every Ray setting, as a fresh shell): Ray Train's
faster polling, no preemption watcher (no test drains a node: the autoscaler test kills its nodes; 7 CPU-seconds
of watchers there), the log monitor's slower listing."""


def node_settings() -> dict[str, str]:
    return {k: os.environ[k] for k in NODE_SETTINGS}


# ----------------------------------------------------------------------------------------------------
# A job's code and processes: the copy a test submits, what of it each node unpacked, which process ran it.

def tracked_files() -> set[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return set(out.split())


def job_folders(session: Path, log: str) -> list[Path]:
    """Every node's unpacked copy of the job's working directory (the driver runs in the head's; the worker
    nodes unpack it too for the tasks and actors they run); ``session``: the head's session folder."""
    pkg = re.findall(r"gcs://(_ray_pkg_\w+)\.zip", log)[-1]
    found = sorted(session.glob(f"runtime_resources*/working_dir_files/{pkg}"))
    assert found, f"no unpacked job folder {pkg} under {session}"
    return found


def new_files(folder: Path, tracked: set[str]) -> list[str]:
    new = []
    for p in folder.rglob("*"):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and "__pycache__" not in rel and rel not in tracked:
            new.append(rel)
    return sorted(new)


PROBE = """

# --- Only in the copy tests/e2e/test_cluster.py submits: which code each process of the job imports. ---
import importlib.util as _util  # noqa: E402
import json as _json  # noqa: E402
import os as _os  # noqa: E402

if _os.environ.get("ADLM_CODE_PROBE"):
    from pipelines import _submitted_probe

    (_Path(_os.environ["ADLM_CODE_PROBE"]) / f"{_os.getpid()}.json").write_text(_json.dumps({
        "file": __file__, "added": _submitted_probe.MARK,
        "deleted_importable": _util.find_spec("pipelines.import_model") is not None}))
"""


def submitted_copy(dest: Path) -> set[str]:
    """The project as a submitter's checkout that differs from the nodes' code (their venv's editable install is
    this checkout): an edited module (``pipelines/__init__.py``, which then records, in every process of the job
    that imports it, its own path, the added module's mark and whether the deleted module still imports), an added
    one (``pipelines/_submitted_probe.py``) and a deleted one (``pipelines/import_model.py``, which the pipeline
    does not use). Returns the copy's files."""
    import shutil

    files = {f for f in tracked_files() if (ROOT / f).is_file()}
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)
    (dest / "pipelines" / "import_model.py").unlink()
    (dest / "pipelines" / "_submitted_probe.py").write_text('MARK = "submitted"\n')
    with (dest / "pipelines" / "__init__.py").open("a") as fh:
        fh.write(PROBE)
    return (files - {"pipelines/import_model.py"}) | {"pipelines/_submitted_probe.py"}


def job_processes(dashboard: str, token: str) -> dict[str, set[int]]:
    """The processes of the cluster's jobs by role, from the job and state APIs: each job's driver, Ray Train's
    workers, Tune's trials, Ray Data's actors and the evaluation's tasks."""
    import requests

    jobs = requests.get(f"{dashboard}/api/jobs/", headers={"authorization": f"Bearer {token}"}, timeout=30).json()
    roles: dict[str, set[int]] = {"driver": {int(j["driver_info"]["pid"]) for j in jobs if j.get("driver_info")}}
    for a in state_rows(dashboard, "actors", token):
        for role, cls in (("Ray Train worker", "RayTrainWorker"), ("Tune trial", "ImplicitFunc"),
                          ("Ray Data actor", "MapWorker")):
            if cls in str(a.get("class_name")) and a.get("pid"):
                roles.setdefault(role, set()).add(int(a["pid"]))
    for t in state_rows(dashboard, "tasks", token):
        if t.get("name") in ("ppl_job", "sample_job") and t.get("worker_pid"):
            roles.setdefault("evaluation task", set()).add(int(t["worker_pid"]))
    return roles


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


def _children() -> set[int]:
    import psutil

    return {c.pid for c in psutil.Process().children()}


def _kill_new_children(before: set[int]) -> None:
    """SIGKILL this process's children not in ``before``, and theirs: a node start that failed leaves its
    processes (GCS, raylet, dashboard) with no object to stop them through."""
    import psutil

    for child in psutil.Process().children():
        if child.pid not in before:
            with contextlib.suppress(psutil.Error):
                for p in [*child.children(recursive=True), child]:
                    with contextlib.suppress(psutil.Error):
                        p.kill()


@contextlib.contextmanager
def ray_cluster(nodes: int = 2, cpus: int = 1, head_resources: dict[str, float] | None = None,
                extra_nodes: tuple[dict, ...] = ()) -> Iterator[RayCluster]:
    """Head (0 CPUs, dashboard and job API on loopback) plus ``nodes`` nodes of ``cpus`` CPUs. The nodes are
    started from this process: they inherit its environment (the S3 settings and credentials, as nodes of a
    real cluster take them from their own environment or instance role), with the venv first on PATH so
    that a job's ``python`` is this interpreter. ``head_resources``: custom resources of the head (cluster.yaml's
    ``adlm_driver``, which keeps Tune trial drivers on the never-preempted head). ``extra_nodes``: more nodes after
    those, each with its own ``Cluster.add_node`` arguments (``num_cpus``, ``num_gpus``: a GPU Ray schedules on with
    no device behind it, ``labels``). Each node gets its own runtime-env folder: nodes that share
    one (as on one machine) garbage-collect each other's job working directories."""
    from ray.cluster_utils import Cluster

    from pipelines.core.runtime import LOCAL_SYSTEM_CONFIG, environ  # idle workers reused, as in a local Ray

    # A killed node found dead by the GCS's health checks every second (default 3 s; 5 missed in a row), as the
    # autoscaler's cluster below: with the default, the node-loss test waited about 25 s doing nothing.
    system_config = {**LOCAL_SYSTEM_CONFIG, "health_check_period_ms": 1000}
    # A temp folder of its own: a job's driver finds its cluster through <temp>/ray/ray_current_cluster, which
    # names the cluster started last on the machine; with a shared /tmp/ray, a job of this cluster joined another
    # test's cluster started meanwhile (and was refused its token).
    with environ({"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
                  "RAY_TMPDIR": tempfile.mkdtemp(prefix="rc-", dir="/tmp")}):
        def start() -> tuple[Cluster, list, int]:
            dash = free_port()
            before, cluster = _children(), None
            try:
                cluster = Cluster(initialize_head=True, head_node_args={
                    "num_cpus": 0, "resources": dict(head_resources or {}), "include_dashboard": True,
                    "dashboard_host": "127.0.0.1", "dashboard_port": dash, "_system_config": system_config,
                    **_free_ports()})
                specs = [{"num_cpus": cpus} for _ in range(nodes)] + [dict(n) for n in extra_nodes]
                return cluster, [cluster.add_node(**spec, runtime_env_dir_name=f"runtime_resources_node{i}",
                                                  **_free_ports()) for i, spec in enumerate(specs)], dash
            except Exception:
                if cluster is not None:
                    cluster.shutdown()
                else:  # the head never came up: what it started is this process's, since the attempt began
                    _kill_new_children(before)
                raise

        cluster, workers, dash = start_ray_once_more_if_late(start, undo=lambda: None)  # cleaned up by start()
        try:
            cluster.wait_for_nodes()
            _wait_for_job_api(f"http://127.0.0.1:{dash}")
            yield RayCluster(cluster, cluster.address, f"http://127.0.0.1:{dash}", workers)
        finally:
            cluster.shutdown()


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


def job_submit_command(dashboard: str, entrypoint: list[str], runtime_env: Path, working_dir: Path = ROOT) -> list[str]:
    """``ray job submit --working-dir <repo> --runtime-env <file> -- <entrypoint>``, as the cluster docs submit."""
    return [str(BIN / "ray"), "job", "submit", "--address", dashboard, "--working-dir", str(working_dir),
            "--runtime-env", str(runtime_env), "--", *entrypoint]


def submit_job(dashboard: str, entrypoint: list[str], runtime_env: Path, cwd: Path, log: Path,
               timeout: float = 900.0, env: dict[str, str] | None = None, working_dir: Path = ROOT) -> tuple[str, str]:
    """``job_submit_command`` run from ``cwd`` (with ``env``, else this process's environment), waited on;
    returns (final status, the job's logs)."""
    cmd = job_submit_command(dashboard, entrypoint, runtime_env, working_dir)
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


def tracking_outage(server: MLflowServer | Gate, run_name: str, seconds: float, after_windows: int = 5,
                    back_by: Callable[[], bool] | None = None) -> Outage:
    """In the background: once the MLflow run tagged ``adlm.run_name = run_name`` has ``after_windows`` logged
    loss windows, stop ``server`` for ``seconds`` (or until ``back_by()`` is true, if sooner: a point of the run by
    which the server must be back, whatever the machine's pace), then start it again on the same port (a ``Gate``:
    at once; an ``MLflowServer``: on the same store, which takes seconds). ``end`` is when it answers again."""
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
        while time.time() < outage.start + seconds and not (back_by and back_by()):
            time.sleep(0.1)
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
                  "ActorLocationTracker", "_UsageCollectionActor", "JobSupervisor", "PlacementGroupCleaner")
"""Actors Ray keeps for the cluster itself (Ray Data's detached statistics, usage and autoscaling-coordination
actors, one each per cluster; the job API's supervisors, which end with their jobs; Ray Train's detached
placement-group cleaner, which reserves nothing and ends once it sees its controller gone, at times well after
the job): not work of the pipeline's. The groups they guard are checked on their own."""


def state_rows(dashboard: str, kind: str, token: str | None = None) -> list[dict]:
    """Every row of Ray's state API for ``kind`` (``actors``, ``tasks``, ``nodes``, ``placement_groups``) on the
    cluster whose dashboard is at ``dashboard`` (``token``: a token-authenticated cluster's)."""
    import requests

    headers = {"authorization": f"Bearer {token}"} if token else {}
    r = requests.get(f"{dashboard}/api/v0/{kind}", params={"limit": 10000, "detail": "1"}, headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"]["result"]["result"]


def leftovers(dashboard: str, token: str | None = None, timeout: float = 60.0) -> tuple[list[dict], list[dict]]:
    """The placement groups not removed and the live actors of the pipeline's work on the cluster whose state API
    is at ``dashboard`` (``token``: a token-authenticated cluster's), once both are empty or after ``timeout``
    seconds (a finished driver's groups and actors go within seconds: its job's end removes them)."""
    deadline = time.time() + timeout
    while True:
        groups = [g for g in state_rows(dashboard, "placement_groups", token) if g.get("state") != "REMOVED"]
        actors = [a for a in state_rows(dashboard, "actors", token) if a.get("state") != "DEAD"
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


# ----------------------------------------------------------------------------------------------------
# An autoscaling cluster: Ray's own autoscaler (its monitor, v1) with Ray's fake multi-node provider, which
# launches and terminates nodes as Ray processes on this machine where a cloud provider would start instances.

FAKE_HEAD_ID = "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"
"""The node id Ray's fake multi-node provider gives its head (``FAKE_HEAD_NODE_ID``), which the v2 autoscaler needs
the head to start with."""
FAKE_HEAD_TYPE = "ray.head.default"
"""The node type Ray's fake multi-node provider gives its head, whatever the config calls it: cluster.yaml's
``head`` goes under this name (its resources unchanged)."""
SCALED_WORKERS = {"cpu_worker": {"CPU": 1}, "gpu_worker": {"CPU": 1, "GPU": 1}}
"""cluster.yaml's worker types scaled to this machine: cluster.yaml's 32-CPU ``cpu_worker`` is a 1-CPU node here,
its 96-CPU 8-GPU ``gpu_worker`` a 1-CPU node with one fake GPU (Ray schedules on the resource, no device is behind
it). How many of each: ``scaled_max_workers``."""
SCALED_MAX_WORKERS = 4
"""The scaled cluster's ``max_workers``: two ``cpu_worker`` nodes at a time, and two more while killed ones are still
on the provider's list (a cloud drops a preempted instance from it at once; the fake provider keeps it until the
autoscaler finds it silent)."""
NODE_OBJECT_STORE = 100 * 1024**2
"""Each node's object store, scaled down with the rest (cluster.yaml's head: 8 GB)."""
MARKER = "ADLM_AUTOSCALING_CLUSTER"
"""Set, to the cluster's temp dir, in the environment of every process of an autoscaling cluster (the head's, the
nodes its monitor launches, their workers and job drivers inherit it): how its processes are found and stopped,
and no other Ray on the machine is touched."""


def scaled_max_workers(spec: dict, recipe: dict) -> int:
    """A worker type's ``max_workers`` scaled: one GPU node (all this machine holds); a CPU type capped by the
    cluster's ``max_workers`` alone (cluster.yaml's ``cpu_worker``) may take all ``SCALED_MAX_WORKERS``, one capped
    below it one less, so that it fills up while the cluster still has room, as on the real cluster."""
    if "GPU" in spec["resources"]:
        return 1
    return SCALED_MAX_WORKERS if spec["max_workers"] >= recipe["max_workers"] else SCALED_MAX_WORKERS - 1


def autoscaling_config(gcs_address: str, without: tuple[str, ...] = (), idle_timeout_s: float = 5.0,
                       recipe: dict | None = None, v2: bool = False) -> dict:
    """The autoscaler's config for Ray's fake multi-node provider: cluster.yaml's node types (or ``recipe``'s, a
    cluster.yaml-shaped config: a control; names and custom resources read from it; CPU, GPU, object store and
    counts scaled: ``SCALED_WORKERS``, ``scaled_max_workers``; Ray node labels as they are, which the provider gives
    the nodes it launches), all workers from zero, idle nodes retired after
    ``idle_timeout_s``; ``without``: worker types left out (a control); ``v2``: for Ray's v2 autoscaler, which needs
    the head's id. Written in full (the provider's defaults
    file, example.yaml, is not in Ray's wheel)."""
    import yaml

    recipe = recipe or yaml.safe_load((ROOT / "cluster.yaml").read_text())
    types = recipe["available_node_types"]
    head = types[recipe["head_node_type"]]
    node_types = {FAKE_HEAD_TYPE: {"resources": dict(head["resources"]), "labels": dict(head.get("labels") or {}),
                                   "node_config": {}, "max_workers": 0}}
    for name, scaled in SCALED_WORKERS.items():
        spec = types[name]  # a KeyError here: cluster.yaml renamed a node type this test stands for
        assert ("GPU" in spec["resources"]) == ("GPU" in scaled), (name, spec["resources"])
        if name in without:
            continue
        custom = {k: v for k, v in spec["resources"].items() if k not in ("CPU", "GPU")}
        node_types[name] = {"resources": {**custom, **scaled, "object_store_memory": NODE_OBJECT_STORE},
                            "labels": dict(spec.get("labels") or {}),
                            "node_config": {}, "min_workers": spec.get("min_workers", 0),
                            "max_workers": scaled_max_workers(spec, recipe)}
    return {
        "cluster_name": "adlm-autoscaling-test", "max_workers": SCALED_MAX_WORKERS,
        "upscaling_speed": recipe.get("upscaling_speed", 1.0), "idle_timeout_minutes": idle_timeout_s / 60,
        "docker": {}, "auth": {}, "available_node_types": node_types, "head_node_type": FAKE_HEAD_TYPE,
        # Ray's fake multi-node provider, each node with a runtime-env folder of its own (tests/autoscaler_provider).
        # launch_multiple: a launch of n nodes starts n (by default the provider starts one whatever n is, and the
        # autoscaler, seeing fewer than it asked for, launches more than the demand needs).
        "provider": {"type": "external", "module": "adlm_fake_provider.OwnDiskFakeProvider",
                     "gcs_address": gcs_address, "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "launch_multiple": True,
                     **({"head_node_id": FAKE_HEAD_ID} if v2 else {})},
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [],
        "rsync_filter": [], "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": []}


def node_type(node: dict) -> str:
    """The node type of a state-API node row, from what it offers (``SCALED_WORKERS`` tell them apart)."""
    res = node.get("resources_total") or {}
    if node.get("is_head_node"):
        return "head"
    return "gpu_worker" if res.get("GPU") else "cpu_worker" if res.get("CPU") else "unknown"


@dataclass
class AutoscalingCluster:
    """A running autoscaling cluster (``autoscaling_cluster``): its addresses, token and temp dir, and what a test
    asks of it (nodes and actors through the state API, its processes, a node killed, ``ray status``)."""

    address: str
    """GCS address."""
    dashboard: str
    """Job and state API (loopback)."""
    temp_dir: Path
    token: str
    client_env: dict[str, str]
    """The environment of a client of this cluster (``ray status``): token mode and the token file."""

    def _get(self, kind: str) -> list[dict]:
        return state_rows(self.dashboard, kind, self.token)

    def nodes(self) -> list[dict]:
        """Every node the cluster has had, alive or dead (state, type by ``node_type``, start and end times)."""
        return self._get("nodes")

    def workers(self) -> list[dict]:
        """The worker nodes alive now."""
        return [n for n in self.nodes() if n.get("state") == "ALIVE" and not n.get("is_head_node")]

    def actors(self) -> list[dict]:
        return self._get("actors")

    def head_id(self) -> str:
        return next(n["node_id"] for n in self.nodes() if n.get("is_head_node"))

    session_id: int = 0
    """The session id of the ``ray start`` that started the head (every process it started keeps it)."""

    def processes(self) -> list:
        """This cluster's live processes (``_cluster_processes``)."""
        return _cluster_processes(str(self.temp_dir), self.session_id)

    def kill_node(self, node_id: str) -> int:
        """Kill a worker node as a preempted cloud instance goes: its raylet and everything it started, at once
        (SIGKILL), nothing told. Returns how many processes were killed. The provider still lists the node until
        the autoscaler finds it unresponsive and terminates it (``AUTOSCALER_HEARTBEAT_TIMEOUT_S``), as a cloud
        provider lists an instance until it is gone."""
        import psutil

        roots = [p for p in self.processes() if _environ(p).get("RAY_OVERRIDE_NODE_ID_FOR_TESTING") == node_id]
        victims = {p.pid: p for p in roots}
        for p in roots:
            with contextlib.suppress(psutil.Error):
                victims.update({c.pid: c for c in p.children(recursive=True)})
        for p in victims.values():
            with contextlib.suppress(psutil.Error):
                p.kill()
        return len(victims)

    def status(self) -> str:
        """``ray status`` and the tail of the autoscaler's log: what a failed wait shows."""
        try:
            out = subprocess.run([str(BIN / "ray"), "status", "--address", self.address], env=self.client_env,
                                 capture_output=True, text=True, timeout=60)
            text = out.stdout + out.stderr
        except subprocess.TimeoutExpired:
            text = "(ray status did not answer in 60 s)"
        logs = sorted(self.temp_dir.glob("session_*/logs/monitor.log"))
        tail = logs[-1].read_text(errors="replace")[-3000:] if logs else "(no monitor.log)"
        return f"ray status:\n{text[-3000:]}\nmonitor.log (tail):\n{tail}"

    def wait_for(self, what: str, check: Callable[[], object], timeout: float, poll: float = 1.0) -> object:
        """Polls ``check`` until it returns something truthy (returned) or ``timeout`` seconds pass (an
        AssertionError naming ``what``, with ``status()``)."""
        import requests

        deadline = time.time() + timeout
        while True:
            try:
                got = check()
            except requests.RequestException:  # the state API slow to answer on a busy machine: ask again
                got = None
            except AssertionError as e:  # the check found that waiting is of no use
                raise AssertionError(f"{what}: no longer possible: {e}\n{self.status()}") from None
            if got:
                return got
            if time.time() > deadline:
                raise AssertionError(f"{what}: not within {timeout:.0f} s\n{self.status()}")
            time.sleep(poll)


def _environ(p: object) -> dict[str, str]:
    """The process's environment, read from /proc: psutil's ``environ()`` stops at the first empty entry, and Ray's
    processes that retitle themselves (``ray::DashboardAgent``) leave empty entries before the rest (it read {} for
    them, and two of a stopped cluster's agents were left running)."""
    try:
        raw = Path(f"/proc/{p.pid}/environ").read_bytes()
    except OSError:  # gone, or not ours to read
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _cluster_processes(marker: str, session_id: int) -> list:
    """The live processes of the cluster ``marker`` names: those whose environment carries it, those of the session
    its ``ray start`` began (``session_id``), and everything they started. Not the environment alone: a process that
    retitles itself (``ray::DashboardAgent``) may overwrite the start of its environment as /proc shows it."""
    import psutil

    found = {}
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if p.status() != psutil.STATUS_ZOMBIE and (
                    _environ(p).get(MARKER) == marker or (session_id and os.getsid(p.pid) == session_id)):
                found[p.pid] = p
    for p in list(found.values()):
        with contextlib.suppress(psutil.Error):
            found.update({c.pid: c for c in p.children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE})
    return list(found.values())


def _stop_cluster(marker: str, session_id: int, timeout: float = 60.0) -> list[str]:
    """SIGKILL every process of the cluster (``_cluster_processes``; the autoscaler's monitor first, so that it
    launches nothing more), again until none is left or ``timeout`` passes; returns what is left (``name pid``)."""
    import psutil

    deadline = time.time() + timeout
    while True:
        procs = _cluster_processes(marker, session_id)
        if not procs or time.time() > deadline:
            return [f"{p.name()} {p.pid}" for p in procs if p.is_running()]
        procs.sort(key=lambda p: "monitor" not in " ".join(_cmdline(p)))
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        time.sleep(0.5)


def _cmdline(p: object) -> list[str]:
    import psutil

    try:
        return p.cmdline()
    except psutil.Error:
        return []


@contextlib.contextmanager
def autoscaling_cluster(env: dict[str, str], token: str, log: Path, without: tuple[str, ...] = (),
                        idle_timeout_s: float = 5.0, recipe: dict | None = None,
                        v2: bool = False) -> Iterator[AutoscalingCluster]:
    """A 0-CPU head (cluster.yaml's, with ``adlm_driver``) whose autoscaler launches cluster.yaml's worker types
    (``autoscaling_config``) as Ray's fake multi-node provider does: Ray node processes on this machine. Started with
    ``ray start --head --autoscaling-config`` in ``env`` (token authentication on: ``RAY_AUTH_MODE=token`` and
    ``RAY_AUTH_TOKEN_PATH``; the S3 settings), in a temp dir and on ports of its own; never
    ``AutoscalingCluster.start()`` or ``ray stop``, which stop every Ray on the machine. The nodes the autoscaler
    launches are processes of its monitor: they inherit ``env``. ``v2``: Ray's v2 autoscaler (what ``ray up`` starts
    since Ray 2.50, label-aware) instead of the v1 monitor. On exit every process of this cluster is killed
    (``MARKER``), and none may be left."""
    import json
    import shutil
    import tempfile

    import yaml
    from ray.util import get_node_ip_address

    from pipelines.core.runtime import LOCAL_SYSTEM_CONFIG

    # Short: Ray's Unix socket paths live under it (at most 107 characters).
    temp = Path(tempfile.mkdtemp(prefix="adlm-as-", dir="/tmp"))
    port, dash = free_port(), free_port()
    gcs = f"{get_node_ip_address()}:{port}"
    settings = autoscaling_config(gcs, without, idle_timeout_s, recipe, v2)
    config = temp / "autoscaling.yaml"
    config.write_text(yaml.safe_dump(settings))
    head = settings["available_node_types"][FAKE_HEAD_TYPE]["resources"]
    head_labels = settings["available_node_types"][FAKE_HEAD_TYPE]["labels"]
    ports = _free_ports()
    pythonpath = os.pathsep.join(p for p in (str(ROOT / "tests" / "autoscaler_provider"), env.get("PYTHONPATH")) if p)
    # RAY_ADDRESS: a process of the cluster that looks for "its" Ray (Ray Train's placement-group cleaner, through
    # the state API) finds this one, as on a machine of its own, not "multiple active Ray instances".
    head_env = {**env, MARKER: str(temp), "RAY_FAKE_CLUSTER": "1", "PYTHONPATH": pythonpath, "RAY_ADDRESS": gcs,
                # The autoscaler's loop every second (Ray's fake-cluster tests' setting; default 5 s), and a node
                # that stops reporting given up after 10 s (default 30), after the GCS's health checks, every
                # second here (default 3), find it dead: scaled down with the rest.
                "AUTOSCALER_UPDATE_INTERVAL_S": "1", "AUTOSCALER_HEARTBEAT_TIMEOUT_S": "10",
                "RAY_health_check_period_ms": "1000",
                # v2: Ray's v2 autoscaler (what `ray up` starts), which knows the head by its instance id.
                **({"RAY_enable_autoscaler_v2": "1", "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_ID,
                    "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_ID} if v2 else {})}
    cmd = [str(BIN / "ray"), "start", "--head", f"--port={port}", "--num-cpus=0",
           f"--resources={json.dumps({k: v for k, v in head.items() if k not in ('CPU', 'GPU')})}",
           *([f"--labels={','.join(f'{k}={v}' for k, v in head_labels.items())}"] if head_labels else []),
           f"--temp-dir={temp}", "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           f"--dashboard-agent-listen-port={ports['dashboard_agent_listen_port']}",
           f"--dashboard-agent-grpc-port={ports['metrics_agent_port']}",
           f"--metrics-export-port={ports['metrics_export_port']}",
           f"--runtime-env-agent-port={ports['runtime_env_agent_port']}", f"--ray-client-server-port={free_port()}",
           f"--object-store-memory={NODE_OBJECT_STORE}", f"--autoscaling-config={config}",
           f"--system-config={json.dumps(LOCAL_SYSTEM_CONFIG, separators=(',', ':'))}", "--disable-usage-stats"]
    cluster = AutoscalingCluster(gcs, f"http://127.0.0.1:{dash}", temp, token,
                                 {k: v for k, v in env.items() if k != MARKER})
    left: list[str] = []
    sessions: list[int] = []
    try:
        def start_head() -> None:
            with log.open("w") as fh:
                # A session of its own: every process it starts (and they start) can be found by it.
                proc = subprocess.Popen(cmd, env=head_env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
                sessions.append(proc.pid)
                cluster.session_id = proc.pid
                if proc.wait(timeout=240) != 0:
                    out = log.read_text(errors="replace")
                    late = f" ({RAY_LATE})" if RAY_LATE in out else ""  # anywhere in the log, not only its tail
                    raise RuntimeError(f"ray start failed{late}:\n{out[-3000:]}")

        start_ray_once_more_if_late(start_head, undo=lambda: sessions and _stop_cluster(str(temp), sessions[-1]))
        cluster.wait_for("the head's job API", lambda: _jobs_api_up(cluster), timeout=120)
        yield cluster
    finally:
        left = [x for sid in sessions or [0] for x in _stop_cluster(str(temp), sid)]
        for f in temp.glob("session_*/logs/monitor.*"):  # the autoscaler's log, kept beside ``log`` for a post-mortem
            with contextlib.suppress(OSError):
                shutil.copy(f, log.parent / f"autoscaler-{f.name}")
        shutil.rmtree(temp, ignore_errors=True)
    assert not left, f"processes of the autoscaling cluster left after stopping it: {left}"


def _jobs_api_up(cluster: AutoscalingCluster) -> bool:
    import requests

    try:
        return requests.get(f"{cluster.dashboard}/api/jobs/", headers={"authorization": f"Bearer {cluster.token}"},
                            timeout=5).status_code == 200
    except requests.RequestException:
        return False
