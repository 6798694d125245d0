"""Ray's private names the pipeline uses, and why no public API serves each (Ray is pinned: pyproject.toml)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipelines.compat import PrivateName

_HERE = "pipelines/compat/ray.py"
TUNE_SESSION = PrivateName("ray.tune.trainable.trainable_fn_utils", "_in_tune_session", "Ray has no public test "
                           "for 'this process runs a Tune trial' (tune.get_context() answers outside one too)", _HERE)
STATE = PrivateName("ray._private.state", "state", "the public placement_group_table() leaves out a group's "
                    "creator actor, which tells a group a dead actor left", _HERE)
BIN_PACK = PrivateName("ray.autoscaler._private.resource_demand_scheduler", "get_bin_pack_residual", "the "
                       "autoscaler's own bin packing, which no public API exposes", _HERE)
KV_GET = PrivateName("ray.experimental.internal_kv", "_internal_kv_get", "the monitor's autoscaling report (what "
                     "`ray status` reads) has no public reader but the CLI", _HERE)
KV_READY = PrivateName("ray.experimental.internal_kv", "_internal_kv_initialized", KV_GET.why, _HERE)
WORKER = PrivateName("ray._private.worker", None, "the driver's printer of its workers' output (and of Ray's own "
                     "messages) can only be replaced there; Ray has no public hook", _HERE)
PRIVATE = [TUNE_SESSION, STATE, BIN_PACK, KV_GET, KV_READY, WORKER]


def in_tune_trial() -> bool:
    """Whether this process runs a Ray Tune trial's function."""
    return bool(TUNE_SESSION.load()())


@dataclass(frozen=True)
class PlacementGroupRecord:
    """What the GCS keeps of one placement group."""

    id: bytes
    removed: bool
    detached: bool
    creator_job_hex: str
    creator_actor: bytes
    """Empty or nil: the driver created it."""


def placement_groups() -> list[PlacementGroupRecord]:
    """Every placement group the GCS knows, with its creator (connected Ray only)."""
    # lazy: keeps ray out of this module's import
    from ray.core.generated import gcs_pb2

    accessor = STATE.load()._connect_and_get_accessor()
    table = gcs_pb2.PlacementGroupTableData
    records = []
    for raw in accessor.get_placement_group_table():
        pg = table.FromString(raw)
        records.append(PlacementGroupRecord(pg.placement_group_id, pg.state == table.REMOVED, pg.is_detached,
                                            pg.creator_job_id.hex(), pg.creator_actor_id))
    return records


def actor_state(actor_id_hex: str) -> str | None:
    """An actor's state in the GCS (``ALIVE``, ``DEAD``, ...), None if it knows no such actor."""
    entry = STATE.load().actor_table(actor_id_hex)
    return entry.get("State") if entry else None


def bin_pack_residual(nodes: list[dict[str, float]], demands: list[dict[str, float]]) -> list[dict[str, float]]:
    """The demands the autoscaler's bin packing leaves unplaced on ``nodes``."""
    residual, _ = BIN_PACK.load()(nodes, demands)
    return residual


def internal_kv_get(key: str) -> bytes | None:
    """A value of the GCS's key-value store (None where this process has no Ray)."""
    return KV_GET.load()(key) if KV_READY.load()() else None


def worker_module() -> Any:
    """``ray._private.worker``: the driver's ``global_worker``, its output dispatcher and printers."""
    return WORKER.load()


def driver_is_script() -> bool:
    """Whether this process is a driver (a script), not a Ray worker."""
    w = worker_module()
    return w.global_worker.mode == w.SCRIPT_MODE


def print_worker_logs(data: dict[str, Any], stream: Any) -> None:
    """Ray's own printing of a batch of worker lines (its progress bars keep their rendering)."""
    worker_module().print_worker_logs(data, stream)
