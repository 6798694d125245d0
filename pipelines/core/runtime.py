"""The process environment every stage shares: offline/quiet defaults and the one way to start Ray.

- ``quiet_environment``: no telemetry, no usage statistics; ``environ``: settings for the length of a block.
- ``init_ray``: connect to ``$RAY_ADDRESS`` (a cluster, ``ray job submit``) or start a local Ray. A cluster
  that refuses this driver (no token, a wrong one, token mode off on this side) fails in one line naming what
  to set (``RayAuthError``), before any work. The workers' output reaches this console through
  ``pipelines.core.logs.WorkerOutput`` (every line of it with ``-v``).
- ``cpu_work_selector`` / ``cpu_work_options`` / ``cpu_placement``: where the CPU stages' work may run (never on a
  node labelled a GPU node).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipelines.core.logs import route_worker_output

PROJECT_ROOT = Path(__file__).resolve().parents[2]

FORWARDED_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM",
                 "HF_HOME", "HF_DATASETS_CACHE", "ADLM_CACHE", "MLFLOW_DISABLE_TELEMETRY", "ADLM_VERBOSITY")
"""Settings a driver passes to a cluster's workers (which do not inherit its shell). Never a credential:
nodes take those from their own environment or instance role (a job's runtime env shows in the dashboard). Not
the work directory: the entry point resolves it once and every Ray task or trial receives it as an argument."""


DRIVER_RESOURCE = "adlm_driver"
"""A custom resource only never-preempted nodes offer (cluster.yaml: the on-demand head; the KubeRay head). Tune
trial drivers ask for a sliver of it, so they, and the Ray Train controller that attaches to its driver's node,
are never on a spot node that preemption takes."""
LOCAL_SYSTEM_CONFIG = {"idle_worker_killing_time_threshold_ms": 120_000}
"""A local Ray's settings. Ray kills a worker process idle for 1 s beyond one per CPU, and a Ray Train fit starts
about 15 (controller, worker, placement-group cleaner, Ray Data's coordinators and read tasks): each later fit or
stage then starts them again, at 1-2 CPU-seconds each. Kept for 2 minutes they are reused: a tiny 1-worker fit
after the first costs about 20 CPU-seconds here instead of 30 (16 s instead of 21)."""


NODE_KIND_LABEL = "adlm.io/node-kind"
"""The Ray node label that says what a node is for: ``gpu`` on GPU node types (cluster.yaml's ``gpu_worker``, the
KubeRay ``gpu-worker`` group), ``cpu`` on the head and the CPU types. Ray's own labels live under ``ray.io/``."""
GPU_NODE_KIND = "gpu"


def cpu_work_selector() -> dict[str, str]:
    """The label selector every piece of CPU-only work carries (Ray Data's tasks and actors, Tune's trial drivers,
    CPU Ray Train workers, evaluation tasks without a GPU): any node not labelled a GPU node. A node without the
    label (a laptop, a cluster started without this project's labels) satisfies it, so it never leaves work
    unplaceable; on a labelled cluster CPU work neither lands on a GPU node's idle CPUs nor, with a label-aware
    autoscaler (v2: ``ray up``'s default, KubeRay's ``autoscalerOptions.version: v2``), starts one. A fresh dict
    each call (Ray keeps what it is given)."""
    return {NODE_KIND_LABEL: f"!{GPU_NODE_KIND}"}


def cpu_work_options(gpus: float = 0.0) -> dict[str, dict[str, str]]:
    """Ray remote options for a task or actor that asks for ``gpus`` GPUs: the CPU-work selector when it asks for
    none, nothing otherwise (GPU work goes where the GPUs are)."""
    return {} if gpus else {"label_selector": cpu_work_selector()}


def cpu_placement(bundle: dict[str, float]) -> Any:
    """What a Tune trial reserves for its own process (``tune.with_resources``): ``bundle`` (zero amounts left
    out), one bundle that carries the CPU-work selector. A trial's driver is CPU work whatever its training
    workers use; those ask for their own resources (Ray Train's worker group)."""
    # lazy: keeps ray out of this module's import
    from ray.tune import PlacementGroupFactory

    return PlacementGroupFactory([{k: v for k, v in bundle.items() if v}], bundle_label_selector=[cpu_work_selector()])


def driver_resources(cpu: float) -> dict[str, float]:
    """What a long-lived driver (a Tune trial's driver function) asks for: a sliver of ``DRIVER_RESOURCE`` and no
    CPU where the cluster offers that resource, else ``cpu`` CPUs (a local Ray, a cluster without the label)."""
    # lazy: keeps ray out of this module's import
    import ray

    if ray.is_initialized() and ray.cluster_resources().get(DRIVER_RESOURCE):
        return {"CPU": 0, DRIVER_RESOURCE: 0.01}
    return {"CPU": cpu}


class RayAuthError(ValueError):
    """This driver cannot join the Ray cluster at ``$RAY_ADDRESS``: its token is missing or refused."""


TOKEN_HINT = ("export RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<the cluster's token> (or RAY_AUTH_TOKEN_PATH=<file>; "
              "on the cluster: the Secrets Manager secret adlm/ray-auth-token)")


def _connect(address: str, env: dict | None) -> None:
    """``ray.init`` on a running cluster, its refusals turned into one line. A token the GCS refuses (or a driver
    whose RAY_AUTH_MODE is not ``token``) reads as a connection failure to Ray: the line names both causes."""
    # lazy: keeps ray out of this module's import
    import ray
    from ray.exceptions import AuthenticationError

    mode = os.environ.get("RAY_AUTH_MODE", "disabled")
    try:
        ray.init(address=address, log_to_driver=True, configure_logging=False, runtime_env=env)
    except AuthenticationError as e:
        raise RayAuthError(f"the Ray cluster at {address} needs this driver's token "
                           f"({str(e.message).strip().splitlines()[0][:120]}): {TOKEN_HINT}") from None
    except ConnectionError as e:
        why = "" if mode == "token" else f" (RAY_AUTH_MODE is {mode!r} here: a token-authenticated cluster refuses it)"
        raise RayAuthError(f"could not join the Ray cluster at {address}: {str(e).strip().splitlines()[0][:120]}; "
                           f"the address is wrong, the cluster is down, or it refused this driver{why}: check "
                           f"RAY_ADDRESS and {TOKEN_HINT}") from None


def quiet_environment() -> None:
    """Environment defaults for every stage: no telemetry, no usage statistics. (Ray's authentication mode
    is left alone here: a driver that connects to a token-authenticated cluster must keep it; only a local
    Ray that ``init_ray`` starts turns it off.)"""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@contextlib.contextmanager
def environ(env: dict[str, str]) -> Iterator[None]:
    """``env`` in this process's environment while the block runs; the previous values (or their absence) back
    afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def forwarded_env() -> dict[str, str]:
    """The ``FORWARDED_ENV`` settings present in this process."""
    return {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}


def spans_nodes() -> bool:
    """Whether this process's Ray can run work on another machine: a cluster of several nodes, or one whose
    head has no CPUs (an autoscaling cluster whose workers are not up yet: every task will run elsewhere)."""
    # lazy: keeps ray out of this module's import
    import ray

    if not ray.is_initialized():
        return False
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return len(alive) > 1 or any(not (n.get("Resources") or {}).get("CPU") for n in alive)


def init_ray(address: str | None = None, *, num_cpus: int | None = None, dashboard: bool = True,
             env_vars: dict[str, str] | None = None) -> bool:
    """Connect to ``address`` or ``$RAY_ADDRESS`` when set, else start a local Ray; True if this call
    started or connected (False: Ray was already initialised).

    A local Ray gets its dashboard on a free loopback port (``dashboard=True``): Ray Tune over Ray Train
    V2 needs the state API the dashboard serves, or finished trials' placement groups are never released
    (the next trials' workers then wait for them); loopback only, never open to the network. Data preparation alone starts without
    it (``dashboard=False``: seconds faster). ``env_vars``: extra environment for a local Ray's workers
    (without it they inherit this process's and the raylet's prestarted workers serve at once).
    """
    # lazy: keeps ray out of this module's import
    import ray

    if ray.is_initialized():
        return False
    quiet_environment()
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        # A cluster's workers do not inherit this shell: a driver started from one passes the (non-secret)
        # settings that matter. Inside a submitted job the job's runtime env already carries them (and Ray
        # refuses a driver env var that repeats one of the job's).
        in_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ
        env = None if in_job else {"env_vars": forwarded_env()}
        _connect(address, env)
        route_worker_output()
        return True
    # A Ray of this process alone, on loopback: no auth token written under $HOME (unless asked for one).
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    runtime_env = {"env_vars": env_vars} if env_vars else None
    if not dashboard:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
                 configure_logging=False, runtime_env=runtime_env, _system_config=LOCAL_SYSTEM_CONFIG)
        route_worker_output()
        return True
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # address="local": always a fresh local Ray, never a stale `ray start` head that
    # /tmp/ray/ray_current_cluster may still name.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port,
             log_to_driver=True, configure_logging=False, runtime_env=runtime_env, _system_config=LOCAL_SYSTEM_CONFIG)
    route_worker_output()
    return True
