"""Work Ray can place where the pipeline runs, and a wait it cannot satisfy failing in one line.

On the session's local Ray (2 CPUs): the training split is read with nothing but read tasks of the CPUs asked
for, even when a placement group holds all but a sliver of every CPU (Ray Data's read_parquet first samples the
files in tasks of a whole CPU, which then never start); a demand that no node can take is named, with the fix,
by the deadline watch, and the driver's wait ends in a ``PlacementError`` instead of going on for ever.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from pipelines.core import placement
from pipelines.data.ray_source import READ_TASK_BYTES, read_concurrency, read_pieces


def test_read_pieces_cover_every_row_once_in_manifest_order() -> None:
    shards = [("a", 10), ("b", 3), ("c", 0), ("d", 7)]
    assert read_pieces(shards, 2) == [("a", 0, 10), ("b", 0, 3), ("d", 0, 7)]  # one a shard, the empty one left out
    pieces = read_pieces(shards, 8)  # fewer shards than blocks: each cut in equal parts, at least 8 in all
    assert len(pieces) >= 8
    rows = [(u, r) for u, a, b in pieces for r in range(a, b)]
    assert rows == [(u, r) for u, n in shards for r in range(n)]


def test_a_small_split_is_read_one_task_at_a_time_and_a_large_one_by_as_many_as_it_has_pieces() -> None:
    """A read task's worker costs more to start than a small split costs to read: the tiny data's 8 pieces are read
    one after the other (one worker), a 10 GB split by all its 100 pieces at once, anything between by its size."""
    assert read_concurrency(3 * 2**20, 8) == 1
    assert read_concurrency(0, 8) == 1
    assert read_concurrency(READ_TASK_BYTES + 1, 8) == 2
    assert read_concurrency(10 * 2**30, 100) == 100


def test_the_split_is_read_where_only_a_sliver_of_cpu_is_free(ray_session, tiny_data: Path) -> None:
    """A placement group holds 1.9 of the 2 CPUs (as trials' drivers and workers hold a cluster's nodes): the split
    still reads, in its manifest's order, through read tasks of 0.05 CPU."""
    import ray
    import ray.data
    from ray.util.placement_group import placement_group, remove_placement_group

    from pipelines.data.manifest import read_manifest
    from pipelines.data.ray_source import split_dataset
    from pipelines.data.reader import read_rows

    m = read_manifest(tiny_data / "train")
    ctx = ray.data.DataContext.get_current()
    saved = ctx.execution_options.preserve_order
    ctx.execution_options.preserve_order = True  # as training reads it (pipelines.training.trainer)
    pg = placement_group([{"CPU": 1.9}])
    ray.get(pg.ready(), timeout=60)
    try:
        ds = split_dataset(m, ["input_ids"], blocks=4, num_cpus=0.05)
        ids = np.concatenate([np.stack(b["input_ids"]) for b in ds.iter_batches(batch_size=None,
                                                                                 batch_format="numpy")])
    finally:
        remove_placement_group(pg)
        ctx.execution_options.preserve_order = saved
    want, _ = read_rows(str(tiny_data / "train"))
    assert ids.shape == want.shape and (ids == want).all()


_NOWHERE = """
import json, sys, time
import ray
from pipelines.core import placement
placement.POLL_S = 0.5
placement.REINTERRUPT_S = 2.0
ray.init(address=sys.argv[1], log_to_driver=False)

@ray.remote(num_cpus=0, resources={"adlm_nowhere": 1})
def nowhere() -> int:
    return 1

def wait(swallow: bool) -> dict:
    ref = nowhere.remote()
    t0 = time.monotonic()
    try:
        with placement.placement_deadline():
            if swallow:  # code that eats the first interrupt, as some libraries do
                try:
                    time.sleep(60)
                except KeyboardInterrupt:
                    pass
            ray.get(ref, timeout=120)
        return {"error": None}
    except placement.PlacementError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    finally:
        ray.cancel(ref, force=True)

print(json.dumps([wait(False), wait(True)]))
"""


def test_a_demand_no_node_can_take_is_named_and_the_wait_fails_in_one_line(ray_session, monkeypatch) -> None:
    """A task asking for a resource no node has: the watch names the demand and the fix within its deadline, and
    the driver's ``ray.get`` on it ends as a PlacementError (the entry points print it as ``error: ...``). In a
    driver process of its own (as a command is): the watch interrupts the driver's main thread, which in a pytest
    worker is not the thread running the test. An interrupt that code swallows is followed by a second one."""
    import json
    import os
    import subprocess
    import sys

    import ray

    env = {**os.environ, placement.TIMEOUT_ENV: "3"}
    out = subprocess.run([sys.executable, "-c", _NOWHERE, ray.get_runtime_context().gcs_address], env=env,
                         capture_output=True, text=True, timeout=180, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    direct, swallowed = json.loads(out.stdout.strip().splitlines()[-1])
    for res in (direct, swallowed):
        line = res["error"]
        assert line and "\n" not in line and "{'adlm_nowhere': 1.0} x1" in line and placement.TIMEOUT_ENV in line, line
        assert res["seconds"] < 60  # the deadline, not the get's own timeout


def test_work_that_runs_resets_the_clock() -> None:
    """The watch fires only on a cluster where nothing changes: a demand pending while resources are taken and
    freed (a queued trial behind a running one) is a wait, not a hang."""

    class Status:
        def __init__(self, used: float) -> None:
            from types import SimpleNamespace as NS

            bundle = NS(bundle={"CPU": 1.0}, count=2)
            self.resource_demands = NS(ray_task_actor_demand=[NS(bundles_by_count=[bundle])],
                                       placement_group_demand=[], cluster_constraint_demand=[])
            usage = [NS(resource_name="CPU", total=1.0, used=used), NS(resource_name="memory", total=9.0, used=0.0)]
            self.active_nodes = [NS(node_id="n1", resource_usage=NS(usage=usage))]
            self.pending_launches, self.pending_nodes = [], []

    fired: list[str] = []
    watch = placement.PlacementWatch(1.0, lambda w: fired.append(w.message), poll=0.05)
    busy = iter([Status(0.25 * (i % 3)) for i in range(60)])  # usage changes at every poll: work runs
    watch._status = lambda: next(busy, None)
    watch.start()
    time.sleep(2.5)
    watch.stop()
    assert not fired
    still = Status(0.01)
    watch = placement.PlacementWatch(1.0, lambda w: fired.append(w.message), poll=0.05)
    watch._status = lambda: still
    watch.start()
    time.sleep(2.5)
    watch.stop()
    assert len(fired) == 1 and "{'CPU': 1.0} x2" in fired[0] and "{CPU: 0.99}" in fired[0], fired


def test_a_group_whose_creating_actor_died_is_released_and_no_other(ray_session) -> None:
    """Ray keeps a placement group an actor created until its job ends, even after the actor is killed (what a Tune
    trial's Ray Train controller, stopped by ASHA, left reserved; the control below): ``release_orphaned_groups``
    removes that one, and neither the driver's own group nor a live actor's."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    @ray.remote(num_cpus=0)
    class Creator:
        def make(self) -> str:
            pg = placement_group([{"CPU": 0.01}])
            ray.get(pg.ready(), timeout=60)
            return pg.id.hex()

    dead, alive = Creator.remote(), Creator.remote()
    orphan, kept = ray.get(dead.make.remote(), timeout=120), ray.get(alive.make.remote(), timeout=120)
    own = placement_group([{"CPU": 0.01}])
    ray.get(own.ready(), timeout=60)
    ray.kill(dead)
    time.sleep(2)
    try:
        assert ray.util.placement_group_table()[orphan]["state"] == "CREATED"  # Ray keeps it: the leak
        released = placement.release_orphaned_groups()
        assert released == [orphan], released
        table = ray.util.placement_group_table()
        assert table[orphan]["state"] == "REMOVED"
        assert table[kept]["state"] == table[own.id.hex()]["state"] == "CREATED"
    finally:
        remove_placement_group(own)
        ray.kill(alive)
        time.sleep(1)
        placement.release_orphaned_groups()


def test_the_smoke_sweep_fits_where_it_ran_and_not_on_a_one_cpu_head() -> None:
    """The pre-flight's packing (Ray's autoscaler's) on fixed clusters: the smoke sweep's two trials
    (a 0.5-CPU worker and a 0.25-CPU read task each) fit two 1-CPU nodes with their drivers on them (0.01 CPU
    each, no adlm_driver on the head) or on the head's adlm_driver; on a head of one CPU with adlm_driver and no
    other node, two trials' workers fill the CPU and their reads are left over: refused (it waited for good)."""
    from pipelines.core.placement import sweep_demand, unplaceable
    from pipelines.orchestration.profiles import profile
    from pipelines.training.config import load_config
    from pipelines.tuning.space import load_space

    root = Path(__file__).resolve().parents[2]
    space = load_space(root / "tune_spaces" / "smoke.yaml")
    cfg = load_config(root / "configs" / "demo.yaml", [*profile("smoke").sweep_overrides,
                                                       *(f"{k}={v}" for k, v in space.overrides.items())])
    two_nodes = [{"CPU": 0.0}, {"CPU": 1.0}, {"CPU": 1.0}]
    assert not unplaceable(sweep_demand(cfg, {"CPU": space.trial_cpu}, space.max_concurrent), two_nodes)
    assert not unplaceable(sweep_demand(cfg, {"adlm_driver": 0.01}, space.max_concurrent),
                           [{"CPU": 0.0, "adlm_driver": 100.0}, {"CPU": 1.0}, {"CPU": 1.0}])
    left = unplaceable(sweep_demand(cfg, {"adlm_driver": 0.01}, space.max_concurrent),
                       [{"CPU": 1.0, "adlm_driver": 100.0}])
    assert left and all(set(d) == {"CPU"} for d in left), left
    assert not unplaceable(sweep_demand(cfg, {"adlm_driver": 0.01}, 1), [{"CPU": 1.0, "adlm_driver": 100.0}])
    # A Ray of this process alone: the sweep runs as many trials at once as it places, and refuses in one line a
    # trial that fits nowhere, before Tune starts.
    one_cpu = [{"CPU": 1.0, "adlm_driver": 100.0}]
    assert placement.fit_concurrency(cfg, {"adlm_driver": 0.01}, space.max_concurrent, one_cpu) == 1
    assert placement.fit_concurrency(cfg, {"CPU": 0.01}, 2, [{"CPU": 2.0}]) == 2
    with pytest.raises(placement.PlacementError) as e:
        placement.fit_concurrency(cfg, {"CPU": 0.5}, 2, [{"CPU": 0.5}])
    assert "\n" not in str(e.value) and "cannot place" in str(e.value)


def test_a_ray_that_will_not_grow_is_told_from_one_that_may(ray_session, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fixed_nodes``: the Ray this process started gives its nodes; the same Ray joined as a running cluster
    (``$RAY_ADDRESS``) gives them too, read from its monitor's report, which is Ray's read-only provider's (a
    cluster started by hand), and so does a Ray task (a Tune trial: it started no Ray, whatever its environment
    lacks); a report that types nodes by an autoscaler's node types, or none, may grow. (The autoscaler test in
    tests/e2e/test_cluster.py runs a sweep against a real autoscaler's 0-CPU head: taken for fixed, it would be
    refused.)"""
    import json

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    own = placement.fixed_nodes()
    assert own and sum(n.get("CPU", 0) for n in own) == 2, own
    deadline = time.monotonic() + 60  # the monitor writes its first report a few seconds after the head starts
    while not placement.without_autoscaler(report := placement.autoscaling_report()):
        assert time.monotonic() < deadline, report
        time.sleep(0.5)
    monkeypatch.setenv("RAY_ADDRESS", ray_session.get_runtime_context().gcs_address)
    assert placement.fixed_nodes() == own and not placement.own_ray()
    # A Tune trial (any Ray task or actor) started no Ray, without $RAY_ADDRESS too: the report decides there.
    monkeypatch.delenv("RAY_ADDRESS")
    assert placement.own_ray()
    assert ray_session.get(ray_session.remote(lambda: (placement.own_ray(), placement.fixed_nodes())).remote()) == (
        False, own)
    status = json.loads(report)
    status["autoscaler_report"]["node_type_mapping"] = {n: "cpu_worker" for n in
                                                        status["autoscaler_report"]["node_type_mapping"]}
    assert not placement.without_autoscaler(json.dumps(status))
    assert not any(placement.without_autoscaler(r) for r in (None, b"", b"{", b'{"load_metrics_report": {}}'))


@pytest.mark.parametrize("command", ["train", "tune"])
def test_what_a_fixed_ray_cannot_place_is_refused_in_one_line_before_any_work(
        command: str, ray_session, tiny_data: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A run of three 1-CPU workers on this 2-CPU Ray, and a sweep whose one trial asks as much: exit 2, one line
    naming what to lower, before the MLflow run (no store written) or any Ray work."""
    import importlib

    from tests.support.data import TINY_MODEL, data_overrides, set_args

    root = Path(__file__).resolve().parents[2]
    work = tmp_path / "work"
    sets = [*data_overrides(tiny_data), *TINY_MODEL, "run.name=too-big", "scaling.num_workers=3",
            "scaling.cpus_per_worker=1", "batch.global_batch=24"]
    args = ["--config", str(root / "configs" / "demo.yaml"), "--workdir", str(work), *set_args(sets)]
    if command == "tune":
        args = ["--space", str(root / "tune_spaces" / "smoke.yaml"), *args]
    rc = importlib.import_module(f"pipelines.{command}").main(args)
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == 2 and err, err
    line = err[-1]
    assert line.startswith("error: ") and "cannot place" in line and "scaling.num_workers" in line, line
    assert not (work / "mlflow.db").exists() and not (work / "ray_results").exists()
