"""Shared test setup: offline environment, every cache in the session's temp folder, one local Ray."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[1]

_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "RAY_AUTH_MODE": "disabled",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",
    # Two xdist workers on two cores: a second BLAS/OpenMP thread in each only spins against the other worker.
    "OMP_NUM_THREADS": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "RAY_USAGE_STATS_ENABLED": "0",
    "TOKENIZERS_PARALLELISM": "false",
    # No Ray API call starts a local Ray by itself: a thread a finished test left behind (Ray Data's prefetcher)
    # would otherwise start one in this process while a test starts a cluster of its own, and the pytest worker
    # dies with it ("the connection to the plasma store is failed. Terminate the process": seen once).
    "RAY_ENABLE_AUTO_CONNECT": "0",
    # A session Ray's log monitor lists its logs folder every 0.1 s until it holds 1,000 files, then every 0.5 s:
    # with the few hundred worker logs a session gathers, that listing is most of its CPU (4.6% of a core with 300
    # files, 2.3% listing every 0.5 s; measured here). New workers' lines reach the driver at most 0.5 s later.
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    # Ray Train's preemption watcher, an actor a fit, polls Ray's drain state so that a run can checkpoint before a
    # spot node is reclaimed through the drain API. No test drains a node (the node-loss tests kill theirs), and
    # each watcher is a process of its own: about 1.5 CPU-seconds a fit, 11 of them a suite (benchmarks/suite_cpu.py).
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}
os.environ.update(_ENV)
# moto's in-process S3/EC2 servers run on werkzeug, which sets its own logger to INFO on its first request: every
# request would then be an INFO line in the stderr of whatever command a test checks next.
logging.getLogger("werkzeug").setLevel(logging.WARNING)
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("ADLM_WORKDIR", None)


# The longest modules, longest first (per-module totals of `--durations=0` on this machine). `make test` runs
# `pytest -n 2 --dist loadfile --no-loadscope-reorder`: xdist hands out whole modules in this order, each worker
# starting with two. The cluster module (about 470-520 s of mostly waiting on its clusters, 7 tests) goes first: with
# xdist's default order (the modules of most tests first) it was handed out after about 85% of the tests and ran
# its last 8 minutes with the other worker out of work (two in-place runs: 815 s and 1,007 s).
LONGEST_FIRST = ("test_cluster.py", "test_journey.py", "test_train.py", "test_tune.py", "test_recipes.py",
                 "test_tracking_outage.py", "test_mlflow_postgres.py", "test_prepare_cluster.py",
                 "test_fast_sampling_bench.py", "test_prepare_data.py", "test_metrics.py",
                 "test_model_core.py", "test_train_step.py", "test_study.py", "test_mlflow_server.py",
                 "test_cluster_parts.py", "test_serving.py", "test_lm_eval.py", "test_promotion.py", "test_evaluate.py",
                 "test_placement.py",
                 "test_encoder.py", "test_distill_pipeline.py", "test_gpu_check.py", "test_serve_load.py",
                 "test_import_pipeline.py", "test_hf_export.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def load_script(path: Path, name: str, register: bool = False):
    """The script at ``path`` (a benchmark, a deploy tool: not in a package) as a fresh module named ``name``;
    ``register``: also put in ``sys.modules`` under that name (a dataclass looks its module up there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def _isolated_caches(tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.mktemp("caches")
    os.environ["HF_HOME"] = str(base / "hf")
    os.environ["HF_DATASETS_CACHE"] = str(base / "hf" / "datasets")
    os.environ["MPLCONFIGDIR"] = str(base / "mpl")
    # The node cache (the converted evaluation LM: 23 CPU-seconds to convert) is the whole run's, shared by the
    # xdist workers as every process of a machine shares it (its entries are written whole, by an atomic rename:
    # storage.shared_cache_entry); each worker converted its own before. Still empty at the start of every run.
    run_base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run_base = run_base.parent  # pytest-N/popen-gwK -> pytest-N, the run's
    os.environ["ADLM_CACHE"] = str(run_base / "node-cache")


@pytest.fixture(autouse=True)
def _no_leaked_tracking_uri() -> None:
    """Each test starts with MLflow's process-wide tracking URI unset (its environment decides), whatever ran before
    it in this worker. Seen once with the modules in another order: a test_serving test read another test's store
    ("Registered Model with name=adlm not found"). The leak's source is not pinned down; a suspect is a block of
    ``pipelines.tracking.mlflow_model.using_tracking_uri`` in a thread that outlived its test, restoring another's URI."""
    import sys

    if "mlflow" in sys.modules:
        from pipelines.compat.mlflow import forget_global_tracking_uri

        forget_global_tracking_uri()


def start_session_ray() -> None:
    """The session's local Ray: 2 CPUs, started the way every stage starts it (its workers inherit this
    process's environment), without the dashboard. A dashboard's dozen processes cost about 0.1 CPU-second a
    second while idle (0.2 with it, 0.1 without, measured here), over the whole session of each xdist worker; no
    test on this Ray needs its state API (Ray Train under Tune does: the cluster tests' heads have one)."""
    import ray

    from pipelines.core.runtime import init_ray

    # Its raylet once missed Ray's start-up window under the suite's load, on the way back from a module's own cluster.
    start_ray_once_more_if_late(lambda: init_ray(num_cpus=2, dashboard=False), undo=ray.shutdown)


RAY_LATE = "timed out during startup"
"""What Ray says of a raylet that missed its 30 s start-up window (in the exception, or ``ray start``'s output)."""


def start_ray_once_more_if_late(start: Callable[[], T], undo: Callable[[], object]) -> T:
    """``start()``, and once more from scratch (after ``undo()``) if it failed because a raylet missed Ray's 30 s
    start-up window (RAY_LATE in the error), as one can on 2 busy cores; any other failure is raised at once.
    The one retry policy of every Ray the tests start: the session's, a module's cluster, a ``ray start`` head."""
    for attempt in (1, 2):
        try:
            return start()
        except Exception as e:
            undo()
            if attempt == 2 or RAY_LATE not in str(e):
                raise
    raise AssertionError("unreachable")


# Whether this process's ``ray_session`` fixture has started. A session fixture is set up once, so the Ray it
# promises must be back after any module that took it away, even when the fixture was first asked for inside that
# module (its tests' ``tiny_data`` does): CI once ran the cluster module first on an xdist worker, whose Ray was then
# down for test_tune's sweep ("Ray has not been started yet").
_SESSION_RAY = {"started": False}


@contextlib.contextmanager
def away_from_session_ray() -> Iterator[None]:
    """For tests with a Ray cluster of their own: the session's local Ray is stopped while they run and brought
    back afterwards (if it was up, or the ``ray_session`` fixture started it meanwhile)."""
    import ray

    was = ray.is_initialized()
    ray.shutdown()
    try:
        yield
    finally:
        ray.shutdown()
        if was or _SESSION_RAY["started"]:
            start_session_ray()


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray runtime for the whole test session (``start_session_ray``)."""
    import ray

    start_session_ray()
    _SESSION_RAY["started"] = True
    yield ray
    _SESSION_RAY["started"] = False
    ray.shutdown()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of tiny-model tests: two cores shared with Ray's processes and other
    test processes, oversubscribed threads slow tiny models ~10x."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture()
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh work directory with its own sqlite MLflow store."""
    d = tmp_path / "work"
    d.mkdir()
    monkeypatch.setenv("ADLM_WORKDIR", str(d))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{d / 'mlflow.db'}")
    return d


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory, ray_session) -> Path:
    """Tiny real shards (embedded-corpus text, a 512-entry BPE, rows of 32) shared by the train/tune tests."""
    from tests.support.data import make_tiny_data

    return make_tiny_data(tmp_path_factory.mktemp("tiny-data"))


@pytest.fixture(scope="session")
def pg_tracking(tmp_path_factory: pytest.TempPathFactory):
    """The tracking server a cluster runs, for the whole session: a throwaway PostgreSQL, S3 on loopback (moto) and
    ``mlflow/server.sh`` with basic authentication on them (tests/support/postgres.py), stopped whatever happens.
    Skipped with the reason on a machine without PostgreSQL; CI installs it and sets ``ADLM_REQUIRE_POSTGRES``, which
    makes a missing one a failure instead."""
    from tests.support.postgres import missing, tracking_stack

    why = missing()
    if why:
        if os.environ.get("ADLM_REQUIRE_POSTGRES"):
            pytest.fail(f"ADLM_REQUIRE_POSTGRES is set but {why}")
        pytest.skip(why)
    with tracking_stack(tmp_path_factory.mktemp("pg-tracking")) as stack:
        yield stack
