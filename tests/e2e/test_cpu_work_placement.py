"""CPU work never lands on a GPU node, even one whose CPUs are idle: the CPU-work label selector
(``pipelines.core.runtime.cpu_work_selector``) on a cluster whose GPU node carries ``adlm.io/node-kind=gpu``.

One Ray cluster on this machine (tests/support/cluster.py): a 0-CPU head; a CPU node (1 CPU, labelled ``cpu``); a
"GPU" node (2 CPUs and a GPU Ray schedules on, with no device behind it) labelled ``gpu``; and its twin without the
label, which stands for a GPU node nobody declared. The pre-flight check of a Ray that will not grow counts only
the nodes CPU work may use. The real stages run from this process as their commands run them: Ray Data preparation (its tokenizer actors), a CPU training run (its Ray Train workers and Ray Data reads) and
the evaluation's tasks. Nothing of theirs runs on the labelled node, while its unlabelled twin, otherwise the same,
takes their work (so the work would have landed on a GPU node's idle CPUs); and the evaluation's tasks submitted
without the selector (the control) do land on the labelled node.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, away_from_session_ray
from tests.support.cluster import RAY_OWN_ACTORS, ray_cluster, state_rows

pytestmark = pytest.mark.slow


def _where(job: int, seconds: float = 1.0) -> str:
    """An evaluation job stand-in: ``seconds`` of work, then the node it ran on."""
    import ray

    time.sleep(seconds)
    return ray.get_runtime_context().get_node_id()


def test_cpu_stages_never_run_on_a_gpu_labelled_node_with_idle_cpus(tiny_data: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    import pipelines.core.runtime as runtime
    import pipelines.evaluation.executors as executors
    from pipelines.core.placement import Unplaceable, check_run, fixed_nodes, run_demand, unplaceable
    from pipelines.data.embedded import embedded_slices
    from pipelines.data.prepare import PrepareConfig, prepare
    from pipelines.evaluation.executors import RayExecutor
    from pipelines.training.config import load_config
    from pipelines.training.trainer import train
    from tests.support.data import TINY_MODEL, data_overrides

    label = runtime.NODE_KIND_LABEL
    nodes = ({"num_cpus": 1, "labels": {label: "cpu"}},
             {"num_cpus": 2, "num_gpus": 1, "labels": {label: runtime.GPU_NODE_KIND}},
             {"num_cpus": 2, "num_gpus": 1})
    texts = embedded_slices(tmp_path / "text", {"train": 60_000})
    with away_from_session_ray(), ray_cluster(nodes=0, extra_nodes=nodes) as rc:
        cpu, gpu, twin = (n.node_id for n in rc.workers)
        try:
            ray.init(address=rc.address)
            # The pre-flight check of a Ray that will not grow counts only the nodes CPU work may use: a CPU run of two
            # 2-CPU workers fits the labelled node and the twin, but not the twin and the CPU node.
            wide = load_config(ROOT / "configs" / "demo.yaml", ["scaling.num_workers=2", "scaling.cpus_per_worker=2"])
            assert not unplaceable(run_demand(wide), fixed_nodes())
            with pytest.raises(Unplaceable, match="will not grow and cannot place"):
                check_run(wide)
            # Data preparation: three tokenizer actors of a CPU each, as many as the nodes the selector allows hold.
            prepare(PrepareConfig(source=[f"train={texts['train']}"], tokenizer="gpt2", length=32, unit_mb=0.01,
                                  actors=3, min_actors=3, actor_cpus=1.0, out=str(tmp_path / "prepared"),
                                  ray_address=rc.address))
            # A CPU training run of one 2-CPU worker: more than the CPU node holds.
            cfg = load_config(ROOT / "configs" / "demo.yaml", [
                *data_overrides(tiny_data), *TINY_MODEL, "run.max_steps=4", "run.val_every=4", "run.ckpt_every=4",
                "run.log_every=1", "run.val_batches=1", "batch.global_batch=8", "batch.micro_batch=4",
                "scaling.num_workers=1", "scaling.cpus_per_worker=2", "data.read_cpus=0.25", "run.name=placed",
                "mlflow.experiment=placed"])
            result = train(cfg, workdir=tmp_path / "work", tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                           register=False)
            assert result.step == 4
            # The evaluation's tasks: six at once, a CPU each, no GPU.
            ran = RayExecutor(cpus=1, gpus=0).run(_where, [{"job": i} for i in range(6)], desc="placed")

            actors = [a for a in state_rows(rc.dashboard, "actors")
                      if not str(a.get("class_name", "")).endswith(RAY_OWN_ACTORS)]
            tasks = [t for t in state_rows(rc.dashboard, "tasks") if t.get("type") == "NORMAL_TASK"]
            work = {"tokenizer actor": [a["node_id"] for a in actors if "MapWorker" in a["class_name"]],
                    "Ray Train worker": [a["node_id"] for a in actors if a["class_name"] == "RayTrainWorker"],
                    "Ray Data read": [t["node_id"] for t in tasks if "Read" in str(t.get("name"))],
                    "evaluation task": ran}
            for what, where in work.items():
                assert where and gpu not in where, (what, where, {"cpu": cpu, "gpu": gpu, "twin": twin})
            # Nothing that holds a CPU ran there (Ray Data's and Ray Train's bookkeeping tasks ask for none: they may
            # go anywhere and make no node start).
            held = [(r.get("class_name") or r.get("name")) for r in [*actors, *tasks]
                    if r.get("node_id") == gpu and (r.get("required_resources") or {}).get("CPU")]
            assert not held, held
            # The unlabelled twin took work of every kind that needed more than the CPU node holds.
            for what in ("tokenizer actor", "Ray Train worker", "evaluation task"):
                assert twin in work[what], (what, work[what])

            # The control: the same tasks without the selector, as many as the three nodes have CPUs, all at once:
            # some land on the labelled node's idle CPUs.
            monkeypatch.setattr(executors, "cpu_work_options", lambda gpus=0.0: {})  # where the executor reads it
            ran = RayExecutor(cpus=1, gpus=0).run(_where, [{"job": i, "seconds": 3.0} for i in range(5)],
                                                  desc="unplaced")
            assert gpu in ran, ran
        finally:
            ray.shutdown()


DRIVER = '''
import json, sys, time

import ray

import pipelines.evaluation.executors as executors
from pipelines.evaluation.executors import RayExecutor


def where(seconds):
    time.sleep(seconds)
    return ray.get_runtime_context().get_node_id()


ray.init()
if sys.argv[1] == "control":  # the selector left off
    executors.cpu_work_options = lambda gpus=0.0: {}
# GPU work that leaves its node's CPU idle; then, while it runs, two CPU tasks of the evaluation's executor.
held = ray.remote(where).options(num_cpus=0, num_gpus=1).remote(float(sys.argv[2]))
while not [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")]:
    time.sleep(0.5)
time.sleep(2)
cpu = RayExecutor(cpus=1, gpus=0).run(where, [{"seconds": 3.0}, {"seconds": 3.0}], desc=sys.argv[1])
print("NODES " + json.dumps({"gpu": ray.get(held), "cpu": cpu}))
'''


def test_the_v2_autoscaler_starts_cpu_nodes_for_cpu_work_while_a_gpu_node_idles(tmp_path: Path) -> None:
    """Ray's v2 autoscaler (what ``ray up`` starts) on cluster.yaml's node types and labels (Ray's fake multi-node
    provider, tests/support/cluster.py): with a ``gpu_worker`` up for GPU work and one of its CPUs idle, the
    evaluation's CPU tasks make it launch ``cpu_worker`` nodes and run there, none on the GPU node. The control: once
    the CPU nodes are retired, the same tasks without the selector run on the GPU node's idle CPU."""
    import subprocess
    import sys

    from tests.e2e.test_cluster import TOKEN, _env
    from tests.support.cluster import autoscaling_cluster, node_settings, node_type

    token = tmp_path / "auth_token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    env = {**_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token)), **node_settings()}
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    with autoscaling_cluster(env, TOKEN, tmp_path / "ray-start.log", v2=True) as ac:
        def run(case: str, seconds: float) -> dict:
            r = subprocess.run([sys.executable, str(driver), case, str(seconds)], cwd=ROOT, capture_output=True,
                               text=True, timeout=300,
                               env={**ac.client_env, "RAY_ADDRESS": ac.address, "PYTHONPATH": str(ROOT)})
            line = [x for x in r.stdout.splitlines() if x.startswith("NODES ")]
            assert r.returncode == 0 and line, f"{r.stderr[-3000:]}\n{ac.status()}"
            kinds = {n["node_id"]: node_type(n) for n in ac.nodes()}
            got = json.loads(line[0].removeprefix("NODES "))
            return {"gpu": kinds[got["gpu"]], "cpu": [kinds[n] for n in got["cpu"]]}

        placed = run("selector", 20.0)
        assert placed == {"gpu": "gpu_worker", "cpu": ["cpu_worker", "cpu_worker"]}, f"{placed}\n{ac.status()}"
        ac.wait_for("the idle cpu_worker nodes retired", lambda: not [
            n for n in ac.workers() if node_type(n) == "cpu_worker"], timeout=90)
        control = run("control", 10.0)
        assert "gpu_worker" in control["cpu"], f"{control}\n{ac.status()}"
