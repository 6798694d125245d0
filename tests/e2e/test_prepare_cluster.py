"""Data preparation where it runs at scale: a stand-in for a hub dataset in Parquet files,
prepared into s3:// (moto) on a Ray cluster of a 0-CPU head and two worker nodes (tests/support/cluster.py).

One run of the hub path, with a node that hosts a tokenizer actor killed mid-prepare: the actor is restarted on
the other node, its units are done again, and the command completes without a rerun. The driver read no row (a
row-count probe in this process, which is the driver); each tokenizer actor read one unit's row groups of one file
at a time (each unit's record says how many rows it read); and the shards equal, byte for byte, those of the local
path over the same files with the same settings on the same cluster, undisturbed. (The hub path undisturbed gives
the local path's shards too: tests/pipelines/test_prepare_hub.py, on one node; so the node loss changed nothing.)
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from pipelines.data.embedded import bible_documents
from pipelines.data.sources import NAMED_SOURCES, READS
from tests.conftest import away_from_session_ray
from tests.support.cluster import ray_cluster, s3_server
from tests.support.hub import REPO, stand_in_source, write_stand_in

pytestmark = pytest.mark.slow

FILES = 4


@pytest.fixture()
def own_ray():
    """A cluster of its own: leave the session's local Ray for this test and bring it back afterwards."""
    with away_from_session_ray():
        yield


def _shards(s3, prefix: str) -> dict[str, bytes]:
    return {k.rsplit("/", 1)[1]: s3.read(k) for k in s3.keys(prefix) if k.rsplit("/", 1)[1].startswith("part-")}


def _kill_a_tokenizer_node(rc, s3, prefix: str, deadline: float, run_over: threading.Event) -> bool:
    """Kill the node of a live tokenizer actor as soon as the run has written its first unit (or half a second
    after the actor is up: units here take milliseconds); whether the run was still going (no manifest yet)
    when the node died. Gives up at ``deadline`` or once ``run_over`` is set (no actor will show up then)."""
    from ray.util.state import list_actors

    node = None
    while node is None and time.time() < deadline and not run_over.is_set():
        alive = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
                 if "MapWorker" in (a.class_name or "")]
        node = next((n for a in alive for n in rc.workers if n.node_id == a.node_id), None)
        time.sleep(0.05)
    assert node is not None, "no tokenizer actor showed up"
    wait = time.time() + 0.5
    while not [k for k in s3.keys(f"{prefix}/_units/") if k.endswith(".json")] and time.time() < wait:
        time.sleep(0.02)
    running = not s3.keys(f"{prefix}/manifest.json")
    rc.remove(node)
    return running


def test_a_hub_dataset_prepared_into_s3_on_a_cluster_survives_a_node_loss(tmp_path: Path, own_ray,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from pipelines.data.prepare import PrepareConfig, prepare

    docs = [c[:1200] for c in bible_documents()[:1000]]
    write_stand_in(tmp_path / "local", docs, files=FILES, row_group=5)
    per_file = -(-len(docs) // FILES)
    monkeypatch.setitem(NAMED_SOURCES, "standin", stand_in_source())
    with s3_server() as s3, ray_cluster(nodes=2) as rc:
        mirror = f"s3://{s3.bucket}/hub"
        write_stand_in(mirror, docs, files=FILES, row_group=5)
        try:
            # The hub path into the bucket; a tokenizer actor's node dies once the run has written its first unit.
            # The run is this (the driver's) thread's and the killer another's: every ray.put of the driver then
            # comes from one thread. Puts from two threads of a driver that was connected to an earlier cluster
            # collide in Ray 2.60 ("Tried to create an owned object that already exists": the process aborts),
            # as this test did after the autoscaler test in one process.
            READS.update(units=0, max_rows=0)
            killed: dict = {}
            run_over = threading.Event()

            def kill() -> None:
                try:
                    killed["mid_run"] = _kill_a_tokenizer_node(rc, s3, "out/train", time.time() + 300, run_over)
                except BaseException as e:  # noqa: BLE001 - reported by the assertion below
                    killed["error"] = e

            t = threading.Thread(target=kill)
            t.start()
            try:
                m = prepare(PrepareConfig.from_dict({"source": ["standin"], "hub_mirror": mirror,
                                                     "ray_address": rc.address, "out": f"s3://{s3.bucket}/out"}))["train"]
            finally:
                run_over.set()
                t.join(timeout=60)
            assert not t.is_alive() and "error" not in killed, killed.get("error")
            assert killed["mid_run"], "the run ended before the node died"
            assert len(rc.workers) == 1
            assert READS == {"units": 0, "max_rows": 0}  # the driver read footers, never rows
            records = [json.loads(s3.read(k)) for k in s3.keys("out/train/_units/") if k.endswith(".json")]
            assert len(records) == m.options["units"] >= 16
            # Each unit read its own row groups of one file: every row once, never more than a file's rows at a time
            # (a unit done again on the other node rewrote its record).
            assert max(r["stats"]["rows_read"] for r in records) < per_file
            assert sum(r["stats"]["rows_read"] for r in records) == len(docs)
            hub = _shards(s3, "out/train/")
            assert sorted(hub) == sorted(s.name for s in m.shards) and m.documents == len(docs)

            # The local path over the same files with the same settings, on the node left: the same shards, byte for
            # byte.
            local = prepare(PrepareConfig(source=[f"train={tmp_path / 'local' / REPO / 'plain_text'}"], tokenizer="gpt2",
                                 length=64, out=str(tmp_path / "local_out"), ray_address=rc.address))["train"]
            assert local.content_hash() == m.content_hash() and local.token_frequency == m.token_frequency
            assert {s.name: (tmp_path / "local_out" / "train" / s.name).read_bytes() for s in local.shards} == hub
        finally:
            ray.shutdown()  # the driver leaves the cluster before it is taken down
