"""The tracking server a cluster runs, on this one machine: a throwaway PostgreSQL cluster (``initdb`` in a
temporary folder, ``pg_ctl`` on 127.0.0.1 and a free port), an S3 server on loopback (moto) for the artifacts, and
``mlflow/server.sh`` against both with basic authentication on: nothing between client, server and database is
mocked. Each part can be stopped and started again (a database outage, a server killed and restarted).

``initdb`` refuses to run as root (as CI and these machines run): as root the cluster's folder belongs to the
``postgres`` user and every server-side command runs as that user (``runuser``); a normal user runs them directly.
Debian puts the binaries in ``/usr/lib/postgresql/<major>/bin``, which is not on ``PATH``: ``pg_bin`` looks there.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import free_port
from tests.support.cluster import http_ok, stop_group

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def pg_bin() -> Path | None:
    """The folder of PostgreSQL's server binaries (``initdb``, ``pg_ctl``): ``PATH``, else the newest of Debian's
    ``/usr/lib/postgresql/<major>/bin``; None when PostgreSQL is not installed."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    majors = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name)
                    if p.parent.parent.name.isdigit() else 0)
    return majors[-1].parent if majors else None


def missing() -> str | None:
    """Why the PostgreSQL tests cannot run here (one line), or None when they can."""
    if pg_bin() is None:
        return "PostgreSQL is not installed (no initdb on PATH or under /usr/lib/postgresql): apt-get install postgresql"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a 'postgres' user to run initdb as (Debian's postgresql package makes one)"
    from sqlalchemy.engine import make_url

    try:
        make_url("postgresql://").get_dialect().import_dbapi()  # the driver a postgresql:// store URI loads
    except ImportError as e:
        return f"no PostgreSQL driver ({e.name}) in this environment: pip install -e '.[server]'"
    return None


class Postgres:
    """A PostgreSQL cluster of its own in a fresh temporary folder, on 127.0.0.1:``port``; its Unix socket is in the
    folder (only its owner, and root, reach it: the superuser connects there without a password, every other client
    over TCP with a password, scram-sha-256)."""

    def __init__(self, bin_dir: Path | None = None) -> None:
        self.bin = bin_dir or pg_bin()
        if self.bin is None:
            raise RuntimeError(missing())
        # Not under pytest's temporary root: that folder is its user's alone, and the server runs as postgres.
        self.dir = Path(tempfile.mkdtemp(prefix="adlm-pg-"))
        self.data, self.log = self.dir / "data", self.dir / "postgres.log"
        self.port = free_port()
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth-local=trust",
                   "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C"], timeout=120)

    def _run(self, cmd: list[str], timeout: float, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([*self.as_user, *cmd], capture_output=True, text=True, timeout=timeout, cwd=self.dir)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:2])} failed ({r.returncode}): {(r.stderr or r.stdout)[-2000:]}"
                               + (f"\n{self.log.read_text(errors='replace')[-2000:]}" if self.log.exists() else ""))
        return r

    def start(self, timeout: float = 60.0) -> Postgres:
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c max_connections=200"
        self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "-t",
                   str(int(timeout)), "start"], timeout=timeout + 30)
        return self

    def stop(self, mode: str = "fast", timeout: float = 30.0) -> None:
        """``pg_ctl stop``: ``fast`` ends every session at once (what an operator's restart does); ``immediate`` if
        that does not finish in ``timeout``."""
        if not (self.data / "postmaster.pid").exists():
            return
        pg_ctl = [str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-t", str(int(timeout)), "stop"]
        if self._run([*pg_ctl, "-m", mode], timeout=timeout + 30, check=False).returncode != 0:
            self._run([*pg_ctl, "-m", "immediate"], timeout=timeout + 30, check=False)

    def running(self) -> bool:
        r = subprocess.run([str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                           capture_output=True, timeout=30)
        return r.returncode == 0

    def psql(self, sql: str, db: str = "postgres", file: Path | None = None,
             user: tuple[str, str] | None = None) -> str:
        """Run ``sql`` (or a file) as the superuser over the socket, or as ``user`` (name, password) over TCP; its
        unaligned output."""
        where = ["-h", "127.0.0.1", "-U", user[0]] if user else ["-h", str(self.dir), "-U", "postgres"]
        cmd = [shutil.which("psql") or str(self.bin / "psql"), *where, "-p", str(self.port), "-d", db, "-v",
               "ON_ERROR_STOP=1", "-X", "-q", "-A", "-t"]
        cmd += ["-f", str(file)] if file is not None else ["-c", sql]
        env = {**os.environ, "PGPASSWORD": user[1]} if user else None
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"psql: {r.stderr[-2000:]}")
        return r.stdout.strip()

    def create_database(self, name: str, owner: str, password: str) -> str:
        """A database owned by a login role with ``password`` (made if missing); its URI over TCP."""
        if not self.psql(f"SELECT 1 FROM pg_roles WHERE rolname = '{owner}'"):
            self.psql(f"CREATE ROLE {owner} LOGIN PASSWORD '{password}'")
        self.psql(f"CREATE DATABASE {name} OWNER {owner}")
        return self.uri(name, owner, password)

    def uri(self, db: str, user: str, password: str) -> str:
        return f"postgresql://{user}:{password}@127.0.0.1:{self.port}/{db}"

    def close(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def postgres() -> Iterator[Postgres]:
    """A started ``Postgres``, stopped and removed afterwards whatever happened."""
    pg = None
    try:
        pg = Postgres()
        try:
            pg.start()
        except RuntimeError:  # its free port taken meanwhile by another process: once more on another
            pg.stop()
            pg.port = free_port()
            pg.start()
        yield pg
    finally:
        if pg is not None:
            pg.close()


@dataclass
class S3Bucket:
    """moto's S3 server on a free loopback port with one bucket; ``env``: what a client (here: only the tracking
    server, which serves the artifacts) needs to reach it. Nothing is put into this process's environment."""

    endpoint: str
    bucket: str
    env: dict[str, str]
    server: object = field(repr=False, default=None)

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                            aws_secret_access_key="testing")

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]


@contextlib.contextmanager
def s3_bucket(bucket: str = "mlflow") -> Iterator[S3Bucket]:
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer

    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    srv.start()
    try:
        host, port = srv.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        env = {"AWS_ENDPOINT_URL": endpoint, "MLFLOW_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}
        s3 = S3Bucket(endpoint, bucket, env, srv)
        s3.client().create_bucket(Bucket=bucket)
        yield s3
    finally:
        srv.stop()


class RecipeServer:
    """``bash mlflow/server.sh`` (the recipe users run) on a free loopback port with ``env``; it can be killed
    (SIGKILL: a crash) and started again on the same port, store and secrets."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir, self.port = workdir, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "server.log"
        self.env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # the venv's mlflow
                    "ADLM_WORKDIR": str(workdir), "MLFLOW_HOST": "127.0.0.1", "MLFLOW_PORT": str(self.port), **env}
        self.proc: subprocess.Popen | None = None

    def run(self, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
        """``mlflow/server.sh ARGS`` to its end (a subcommand: ``upgrade``)."""
        return subprocess.run(["bash", str(ROOT / "mlflow" / "server.sh"), *args], env=self.env, cwd=self.workdir,
                              capture_output=True, text=True, timeout=timeout)

    def start(self, timeout: float = 120.0) -> RecipeServer:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(["bash", str(ROOT / "mlflow" / "server.sh")], env=self.env, cwd=self.workdir,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not http_ok(f"{self.url}/health"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                state = f"exited with {self.proc.returncode}" if self.proc.poll() is not None else \
                    f"not healthy after {timeout:.0f} s"
                self.stop()
                raise RuntimeError(f"mlflow/server.sh {state}; its log:\n{self.log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.5)
        return self

    def kill(self) -> None:
        """SIGKILL the server's whole process group: a crash, nothing flushed or closed."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)
        self.proc = None


@dataclass
class TrackingStack:
    """PostgreSQL + S3 + the recipe's server, and the credentials of a non-admin user made through MLflow's auth
    API (what a cluster's nodes hold in ``~/.mlflow/credentials``)."""

    pg: Postgres
    s3: S3Bucket
    server: RecipeServer
    store_uri: str
    user: str
    password: str
    admin_password: str

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def client_env(self) -> dict[str, str]:
        """What a client process needs: the server's URI and the user's credentials."""
        return {"MLFLOW_TRACKING_URI": self.url, "MLFLOW_TRACKING_USERNAME": self.user,
                "MLFLOW_TRACKING_PASSWORD": self.password}


@contextlib.contextmanager
def tracking_stack(workdir: Path) -> Iterator[TrackingStack]:
    """Everything started in order, and stopped in reverse order whatever happens (the fixture's teardown)."""
    import requests

    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(postgres())
        db_password = secrets.token_hex(12)
        store = pg.create_database("mlflow", "mlflow", db_password)
        auth_db = pg.create_database("mlflow_auth", "mlflow", db_password)
        s3 = stack.enter_context(s3_bucket())
        admin_password = secrets.token_hex(12)  # MLflow asks for 12 characters or more
        (workdir / "admin_password").write_text(admin_password)
        server = RecipeServer(workdir, {
            **s3.env, "MLFLOW_BACKEND_STORE_URI": store, "MLFLOW_ARTIFACTS_DESTINATION": f"s3://{s3.bucket}/artifacts",
            "MLFLOW_AUTH": "basic", "MLFLOW_AUTH_ADMIN_PASSWORD_FILE": str(workdir / "admin_password"),
            "MLFLOW_AUTH_DB_URI": auth_db})
        stack.callback(server.stop)
        server.start()
        user, password = "pipeline", secrets.token_hex(12)
        r = requests.post(f"{server.url}/api/2.0/mlflow/users/create", json={"username": user, "password": password},
                          auth=("admin", admin_password), timeout=30)
        r.raise_for_status()
        yield TrackingStack(pg, s3, server, store, user, password, admin_password)
