"""Where the pipeline's Ray work can go: a deadline on waits that cannot end, the release of reservations a dead
actor left, and a pre-flight placement with the autoscaler's own bin packing.

- ``placement_deadline`` (below): work Ray cannot place fails in one line instead of waiting for ever.
- ``release_orphaned_groups``: a job's placement groups whose creating actor died (Ray keeps them to the job's end).
- ``run_demand`` / ``sweep_demand`` / ``unplaceable`` / ``fit_concurrency``: what a run or a sweep asks for at
  once, placed on a cluster's nodes (or cluster.yaml's node types) with ``get_bin_pack_residual``;
  ``fixed_nodes``: the nodes of a Ray that will not grow (this process's own, or a running cluster without an
  autoscaler), on which ``check_run``, ``check_task`` (an evaluation's tasks) and the sweep's ``fit_concurrency``
  refuse what cannot be placed.

Ray waits without end for a task, actor or placement group that no node can take now, and says so only in
``ray status`` ("Pending Demands"). On an autoscaling cluster the wait ends when a node is launched; on a fixed
cluster (a laptop head, KubeRay without autoscaling, nodes whose CPUs placement groups hold in part) it never
does (a sweep waits for a 1-CPU task until killed).

``placement_deadline`` watches the cluster's pending demands from the driver (the GCS's view, what ``ray status``
prints). When the same demands have been pending, with nothing else on the cluster changing (no node added or
lost, no resource taken or freed), for ``ADLM_PLACEMENT_TIMEOUT_S`` seconds (default 900), nothing is going to
change: it names the demand and the fix in one line and interrupts the driver, whose entry point turns that into
``error: ...`` (exit 1). A wait for a running job's resources to free (a trial queued behind another) is not
stuck: the running work takes and frees resources meanwhile (Ray Data's read tasks come and go).
"""

from __future__ import annotations

import _thread
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from pipelines.compat import ray as compat_ray
from pipelines.core.logs import get_logger
from pipelines.core.runtime import GPU_NODE_KIND, NODE_KIND_LABEL
from pipelines.core.settings import env_number

log = get_logger(__name__)

TIMEOUT_ENV = "ADLM_PLACEMENT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 900.0
POLL_S = 5.0


class PlacementError(RuntimeError):
    """Work that Ray could not place within the deadline (the message is the one line to print)."""

    exit_code = 1  # the work failed after it started (pipelines.core.cli)


class Unplaceable(PlacementError):
    """Pre-flight: a run or a sweep that a fixed cluster's nodes cannot place, refused before any work starts."""

    exit_code = 2  # bad input, found before any work (pipelines.core.cli)


def _demands(status: Any) -> list[tuple[tuple[tuple[str, float], ...], int]]:
    """The pending demands of a ``ClusterStatus``: (bundle, count), tasks and actors, placement groups and
    constraints alike, sorted."""
    out = []
    rd = status.resource_demands
    for group in [*rd.ray_task_actor_demand, *rd.placement_group_demand, *rd.cluster_constraint_demand]:
        for by_count in group.bundles_by_count:
            out.append((tuple(sorted((k, float(v)) for k, v in by_count.bundle.items())), int(by_count.count)))
    return sorted(out)


def _usage(status: Any) -> tuple:
    """Every live node and what of its schedulable resources is in use (memory and Ray's per-group and per-node
    bookkeeping resources left out): a change here is work starting or ending, or a node coming or going."""
    rows = []
    for n in [*status.active_nodes, *getattr(status, "idle_nodes", [])]:
        for u in n.resource_usage.usage:
            name = u.resource_name
            if name.startswith("node:") or "_group_" in name or name in ("memory", "object_store_memory"):
                continue
            rows.append((n.node_id, name, round(float(u.used), 4)))
    pending = (len(status.pending_launches), len(status.pending_nodes))
    return tuple(sorted(rows)), pending


def _free(status: Any) -> str:
    """Each node's free CPU and GPU (and custom resources), for the error line."""
    parts = []
    for n in [*status.active_nodes, *getattr(status, "idle_nodes", [])]:
        free = {}
        for u in n.resource_usage.usage:
            name = u.resource_name
            if name.startswith("node:") or "_group_" in name or name in ("memory", "object_store_memory"):
                continue
            free[name] = round(float(u.total) - float(u.used), 3)
        parts.append("{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(free.items())) + "}")
    return "; ".join(parts) or "none"


def describe(demands: list, status: Any, seconds: float) -> str:
    """The one line: what waits, for how long, what the nodes have free, what to do."""
    what = ", ".join(f"{dict(b)} x{c}" for b, c in demands)
    return (f"Ray could not place {what} for {seconds:.0f} s with nothing on the cluster changing (the nodes have "
            f"free: {_free(status)}): no node can take it, and without an autoscaler none will; give the cluster a "
            "node that fits, or ask less (data.read_cpus, scaling.cpus_per_worker, the sweep's max_concurrent or "
            f"resources.trial_cpu, the evaluation's cpus_per_task), or wait longer with {TIMEOUT_ENV}")


REINTERRUPT_S = 30.0
"""Seconds before a second interrupt of a driver that has not handled the first (long enough for Tune's
graceful stop, which a second interrupt would force)."""


class PlacementWatch:
    """Polls the GCS every ``poll`` seconds; sets ``message`` (the one line) and calls ``on_stuck(self)`` once
    when the same demands have been pending with an unchanged cluster for ``timeout`` seconds."""

    def __init__(self, timeout: float, on_stuck: Callable[[PlacementWatch], None], poll: float = POLL_S) -> None:
        self.timeout, self.on_stuck, self.poll = timeout, on_stuck, poll
        self.message: str | None = None
        self.handled = threading.Event()
        """Set once the driver has turned the interrupt into its error (the last resort then stands down)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="adlm-placement-watch", daemon=True)

    def start(self) -> PlacementWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.poll)

    def _status(self) -> Any | None:
        ray = sys.modules.get("ray")  # a command that never imported Ray has none to watch (and imports none here)
        if ray is None:
            return None
        try:
            # Ray may still be half imported by the main thread (lm-eval imports it late): no reading this time.
            if not ray.is_initialized():
                return None
            # lazy: imports no Ray where the command has none (checked above)
            from ray.autoscaler.v2.sdk import get_cluster_status

            return get_cluster_status(ray.get_runtime_context().gcs_address, timeout=10)
        except Exception:  # noqa: BLE001 - Ray half imported, the GCS busy or going away: no reading this time
            return None

    def _run(self) -> None:
        since, last = None, None
        while not self._stop.wait(self.poll):
            st = self._status()
            if st is None:
                since, last = None, None
                continue
            demands = _demands(st)
            state = (demands, _usage(st))
            if not demands or state != last:
                since, last = (time.monotonic() if demands else None), state
                continue
            if since is not None and time.monotonic() - since >= self.timeout:
                self.message = describe(demands, st, time.monotonic() - since)
                self.on_stuck(self)
                return


def _interrupt_main() -> None:
    """SIGINT to the main thread: a real signal, which also wakes a blocking call (a sleep, a socket read) that
    ``_thread.interrupt_main``'s flag alone would leave waiting; that flag where Python does not handle SIGINT."""
    if callable(signal.getsignal(signal.SIGINT)):
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    else:
        _thread.interrupt_main()


def _interrupt_driver(watch: PlacementWatch) -> None:
    """Say it, then interrupt the driver's main thread (Tune stops its experiment on that, saved; a ``ray.get``
    returns with KeyboardInterrupt); once more half a minute later if the driver has not yet turned it into its
    error (an interrupt can land in code that swallows it); a minute after the first (stuck in code that never
    sees the interrupt), end the process with the line."""
    log.error(watch.message)
    _interrupt_main()

    def last_resort() -> None:
        if watch.handled.wait(REINTERRUPT_S):
            return
        _interrupt_main()
        if not watch.handled.wait(60 - REINTERRUPT_S):
            print(f"error: {watch.message}", file=sys.stderr, flush=True)
            os._exit(1)

    threading.Thread(target=last_resort, daemon=True).start()


_active: list[PlacementWatch] = []


def timeout_s() -> float:
    """``ADLM_PLACEMENT_TIMEOUT_S`` (seconds; 0 turns the deadline off), else 900; a ``SettingError`` (one line,
    exit 2) for anything else."""
    return float(env_number(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


@contextlib.contextmanager
def placement_deadline() -> Iterator[PlacementWatch | None]:
    """Around an entry point's work (its main thread): the watch runs while Ray is up; a stuck wait interrupts
    the work, and the KeyboardInterrupt that results leaves this block as a ``PlacementError`` (one line)."""
    t = timeout_s()
    if t <= 0:
        yield None
        return
    watch = PlacementWatch(t, _interrupt_driver).start()
    _active.append(watch)
    try:
        yield watch
        check()
    except KeyboardInterrupt:
        if watch.message:
            watch.handled.set()
            raise PlacementError(watch.message) from None
        raise
    finally:
        _active.remove(watch)
        watch.stop()


def check() -> None:
    """Raise the ``PlacementError`` of a watch that fired (work that swallowed the interrupt, e.g. a Tune
    experiment that stopped on it and returned)."""
    for w in _active:
        if w.message:
            w.handled.set()
            raise PlacementError(w.message)


def release_orphaned_groups() -> list[str]:
    """Remove this job's placement groups whose creating actor is dead; returns their ids.

    Ray removes a group an actor created only once both that actor and its job are dead, so one that a killed
    actor leaves holds its resources until the job ends (a whole ``run_all`` job: the evaluation then runs with
    half a node's CPU reserved for no one). Ray Train's controller, killed with its Tune trial (ASHA's stop, a lost
    node) while it restarts its worker group, can leave such a group unknown to its own cleaner; and one
    registered in the moment after its creator died is never marked so, and outlives the job (seen: a smoke job's
    trial group still reserved after the job ended). Nothing can use a group whose creator is gone (its workers die
    with it): removing it is safe while other work runs."""
    # lazy: keeps ray out of this module's import
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    if not ray.is_initialized():
        return []
    job = ray.get_runtime_context().get_job_id()
    released = []
    for pg in compat_ray.placement_groups():
        if (pg.removed or pg.detached or pg.creator_job_hex != job
                or not pg.creator_actor or ray.ActorID(pg.creator_actor).is_nil()):
            continue  # removed, detached, another job's, or the driver's own
        state = compat_ray.actor_state(pg.creator_actor.hex())
        if state is not None and state != "DEAD":
            continue
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(pg.id)))
        released.append(pg.id.hex())
    if released:
        log.warning(f"released {len(released)} placement group(s) left reserved by dead actors of this job "
                    f"({', '.join(r[:12] for r in released)}): Ray keeps them until the job ends")
    return released


# ----------------------------------------------------------------------------------------------------------
# Pre-flight: what a recipe or a sweep asks for, placed with the autoscaler's own bin packing


def brief(nodes: list[dict[str, float]]) -> list[dict[str, float]]:
    """Nodes as a message shows them: their CPUs, GPUs and custom resources, without memory and object store."""
    return [{k: v for k, v in n.items() if k not in ("memory", "object_store_memory")} for n in nodes]


def run_demand(cfg: Any) -> list[dict[str, float]]:
    """What one training run asks Ray for at once (a ``TrainConfig``): its worker group's bundles
    (``scaling.num_workers`` x ``cpus_per_worker`` CPUs, a GPU each with ``use_gpu``; Ray Train's PACK group, which
    the autoscaler flattens into single bundles) and one Ray Data read task of ``data.read_cpus``. Local mode
    (``num_workers`` 0) trains in its driver: the read task only. The Ray Train controller asks for nothing."""
    s = cfg.scaling
    bundle = {"CPU": float(s.cpus_per_worker), **({"GPU": 1.0} if s.use_gpu else {})}
    return [dict(bundle) for _ in range(s.num_workers)] + [{"CPU": float(cfg.data.read_cpus)}]


def sweep_demand(cfg: Any, trial: dict[str, float], concurrent: int) -> list[dict[str, float]]:
    """``concurrent`` trials at once: each its driver's ``trial`` resources plus its run's demand."""
    return [b for _ in range(concurrent) for b in [dict(trial), *run_demand(cfg)]]


def node_types(cluster: dict[str, Any]) -> list[dict[str, float]]:
    """Every node a cluster.yaml-shaped config can have at once: the head, and each worker type ``max_workers``
    times, with the resources it declares."""
    nodes = []
    for name, t in cluster["available_node_types"].items():
        count = 1 if name == cluster["head_node_type"] else int(t.get("max_workers", 0))
        nodes += [{k: float(v) for k, v in t.get("resources", {}).items()} for _ in range(count)]
    return nodes


def unplaceable(demands: list[dict[str, float]], nodes: list[dict[str, float]]) -> list[dict[str, float]]:
    """The demands that fit on none of ``nodes`` together (Ray's autoscaler's bin packing:
    ``resource_demand_scheduler.get_bin_pack_residual``, what it leaves unfulfilled); zero amounts left out."""
    clean = [{k: v for k, v in d.items() if v} for d in demands]
    return compat_ray.bin_pack_residual(nodes, [d for d in clean if d])


def fit_concurrency(cfg: Any, trial: dict[str, float], wanted: int, nodes: list[dict[str, float]]) -> int:
    """How many of ``wanted`` concurrent trials ``nodes`` (a fixed cluster's, all of it) can run at once, each with
    its driver's ``trial`` resources and its run's demand; raises ``PlacementError`` (one line) when not even one
    trial fits."""
    for k in range(wanted, 0, -1):
        if not unplaceable(sweep_demand(cfg, trial, k), nodes):
            return k
    left = unplaceable(sweep_demand(cfg, trial, 1), nodes)
    raise Unplaceable(f"one trial asks for {dict(trial)} and {run_demand(cfg)} together, but this Ray's nodes "
                      f"({brief(nodes)}) cannot place {left}: ask less (scaling.cpus_per_worker, scaling.num_workers, "
                      "data.read_cpus, resources.trial_cpu) or run on a bigger machine or cluster")


def check_run(cfg: Any) -> None:
    """Pre-flight of one training run: on a Ray that will not grow (``fixed_nodes``), a run whose worker group
    and read task its nodes cannot place together is refused in one line (``Unplaceable``) before any work, where
    Ray would wait for good. Nothing is checked where nodes may still be added."""
    nodes = fixed_nodes(cpu_work=not cfg.scaling.use_gpu)  # a CPU run: none of its work on a GPU node
    if nodes is None:
        return
    demand = run_demand(cfg)
    left = unplaceable(demand, nodes)
    if left:
        raise Unplaceable(f"run {cfg.run.name!r} asks for {demand} at once, but this Ray's nodes ({brief(nodes)}) "
                          f"will not grow and cannot place {left}: ask less (scaling.num_workers, "
                          "scaling.cpus_per_worker, scaling.use_gpu, data.read_cpus) or run on a bigger machine or an "
                          "autoscaling cluster")


def check_task(bundle: dict[str, float], what: str, fix: str) -> None:
    """Pre-flight of work done as Ray tasks of one size (``bundle``: an evaluation job's ``{"CPU": ..., "GPU": ...}``):
    on a Ray that will not grow, a task that no node can take is refused in one line (``Unplaceable``), where Ray
    would wait for good. ``what`` names the work, ``fix`` the settings that ask less."""
    nodes = fixed_nodes(cpu_work=not bundle.get("GPU"))
    if nodes is None:
        return
    if unplaceable([bundle], nodes):
        raise Unplaceable(f"{what} asks for {brief([bundle])[0]} a task, but no node of this Ray ({brief(nodes)}) "
                          f"has that much, and it will not grow: ask less ({fix}) or run on a bigger machine or an "
                          "autoscaling cluster")


AUTOSCALING_STATUS_KEY = "__autoscaling_status"
"""Where Ray's v1 monitor (run on every head that ``ray start --head`` or ``ray.init`` starts, unless an autoscaler of
its own replaces it: KubeRay's sidecar, the v2 autoscaler) writes its report every few seconds (``ray status`` reads
it)."""


def without_autoscaler(report: bytes | str | None) -> bool:
    """Whether a monitor's report (``AUTOSCALING_STATUS_KEY``) is that of Ray's read-only provider: a cluster
    started by hand (``ray start`` on each node, KubeRay without autoscaling, a laptop head), whose nodes nothing
    will add. That provider types every node ``node_<its id>``; an autoscaler (cluster.yaml's, KubeRay's) types
    them by its node types. False when there is no report to read (a head just started, or an autoscaler that
    writes none, such as the v2 one): a cluster that may grow."""
    try:
        summary = (json.loads(report).get("autoscaler_report") or {}) if report else {}
        mapping = summary.get("node_type_mapping") or {}
        return bool(mapping) and all(t == f"node_{n}" for n, t in mapping.items())
    except (ValueError, AttributeError, TypeError):  # unreadable: it says nothing, so the cluster may grow
        return False


def autoscaling_report() -> bytes | None:
    """The connected cluster's monitor report (what ``ray status`` reads), None if there is none."""
    return compat_ray.internal_kv_get(AUTOSCALING_STATUS_KEY)


def own_ray() -> bool:
    """Whether this process started the Ray it is connected to: a driver (no Ray task or actor runs it) without
    ``$RAY_ADDRESS``, for which ``init_ray`` starts a local Ray."""
    # lazy: keeps ray out of this module's import
    import ray

    # The worker mode, not get_task_id(): asked in a driver, that logs a warning of Ray's on the console.
    return not os.environ.get("RAY_ADDRESS") and ray.get_runtime_context().worker.mode != ray.WORKER_MODE


def fixed_nodes(cpu_work: bool = False) -> list[dict[str, float]] | None:
    """The nodes of a Ray that will not grow, as their total resources: the one this process started itself (a
    driver without ``$RAY_ADDRESS``: ``init_ray`` then starts a local Ray), or a running cluster with no autoscaler
    (``without_autoscaler``); None where nodes may still be added (an autoscaling cluster: its demands wait for a
    launch, which ``placement_deadline`` bounds). A Ray task or actor (a Tune trial) started no Ray, whatever its
    environment says: only the monitor's report tells. ``cpu_work``: only the nodes CPU-only work may use (not
    those labelled GPU nodes: ``pipelines.core.runtime.cpu_work_selector``)."""
    # lazy: keeps ray out of this module's import
    import ray

    if not ray.is_initialized() or not (own_ray() or without_autoscaler(autoscaling_report())):
        return None
    return [{k: float(v) for k, v in (n.get("Resources") or {}).items() if not k.startswith("node:")}
            for n in ray.nodes() if n.get("Alive")
            and not (cpu_work and (n.get("Labels") or {}).get(NODE_KIND_LABEL) == GPU_NODE_KIND)]
