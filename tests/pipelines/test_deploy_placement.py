"""No GPU node for CPU work: Ray's own autoscalers (v1's bin packing, v2's scheduler) run on cluster.yaml's node
types and the RayCluster's groups, with and without the CPU stages' label selector."""

from __future__ import annotations

import copy

from tests.pipelines.test_deploy import _cluster, _kuberay, _recipes


def _gpu_nodes_for_cpu_work(cluster: dict) -> list[tuple[int, dict[str, float]]]:
    """(cpu_worker nodes up, CPU bundle) for which Ray's v1 autoscaler (``get_nodes_for``, with its own scorer, as
    its monitor calls it for pending tasks and actors under the cluster's ``max_workers``) would launch a GPU node
    type: every recipe's CPU-only bundles, 100 of each pending, with each count of ``cpu_worker`` nodes up."""
    from functools import partial

    # private: the autoscaler's scheduler and KubeRay config reader have no public API
    from ray.autoscaler._private.node_provider_availability_tracker import NodeAvailabilitySummary

    # private: the autoscaler's scheduler and KubeRay config reader have no public API
    from ray.autoscaler._private.resource_demand_scheduler import _default_utilization_scorer, get_nodes_for

    from pipelines.core.placement import run_demand
    from pipelines.training.config import load_config

    types = {n: {"resources": {k: float(v) for k, v in t["resources"].items()}, "max_workers": t.get("max_workers", 0)}
             for n, t in cluster["available_node_types"].items()}
    head = cluster["head_node_type"]
    gpu = {n for n, t in types.items() if t["resources"].get("GPU")}
    scorer = partial(_default_utilization_scorer, node_availability_summary=NodeAvailabilitySummary({}))
    bundles = {tuple(sorted(b.items())) for r in _recipes() for b in run_demand(load_config(r)) if not b.get("GPU")}
    found = []
    for up in range(types["cpu_worker"]["max_workers"] + 1):
        existing = {head: 1, "cpu_worker": up}
        for bundle in sorted(bundles):
            added, _ = get_nodes_for(types, existing, head, cluster["max_workers"] + 1 - sum(existing.values()),
                                     [dict(bundle)] * 100, scorer)
            found += [(up, dict(bundle))] if gpu & {n for n, k in added.items() if k} else []
    return found


def test_cpu_only_work_never_makes_the_autoscaler_launch_a_gpu_node() -> None:
    """Ray's autoscaler ranks a GPU node type last for demand that asks for no GPU, but takes it when no CPU type
    can grow: cluster.yaml's ``cpu_worker`` may grow to the cluster's own ``max_workers``, so the CPU sweep, Ray
    Data and CPU training never get a p4d.24xlarge. The control: ``cpu_worker`` capped below the cluster (4 of 12,
    as it was), and the autoscaler launches GPU nodes for CPU work once the CPU type is (nearly) full."""
    cluster = _cluster()
    nodes = cluster["available_node_types"]
    assert nodes["cpu_worker"]["max_workers"] >= cluster["max_workers"] and not nodes["cpu_worker"]["resources"].get("GPU")
    assert not _gpu_nodes_for_cpu_work(cluster)
    control = copy.deepcopy(cluster)
    control["available_node_types"]["cpu_worker"]["max_workers"] = 4
    assert _gpu_nodes_for_cpu_work(control)


def _v2_launches(config: dict, selector: dict[str, str] | None, demand: int = 1000) -> dict[str, int]:
    """What Ray's v2 autoscaler (its ``ResourceDemandScheduler``, with the node types, labels and limits it reads from
    ``config``: a cluster.yaml-shaped config, or one Ray derived from a RayCluster) launches for ``demand`` pending
    1-CPU tasks carrying ``selector`` on an empty cluster: node type -> count. The selector goes into the request as
    the GCS reports it: a value ``!v`` is "not in (v)", any other "in (v)" (Ray's label-selector syntax)."""
    from ray.autoscaler.v2.instance_manager.config import AutoscalingConfig
    from ray.autoscaler.v2.scheduler import ResourceDemandScheduler, SchedulingRequest
    from ray.autoscaler.v2.utils import ResourceRequestUtil
    from ray.core.generated.common_pb2 import LabelSelectorOperator as Op

    auto = AutoscalingConfig(copy.deepcopy(config), skip_content_hash=True)
    sel = [[(k, Op.LABEL_OPERATOR_NOT_IN, [v[1:]]) if v.startswith("!") else (k, Op.LABEL_OPERATOR_IN, [v])
            for k, v in selector.items()]] if selector else None
    requests = ResourceRequestUtil.group_by_count(
        [ResourceRequestUtil.make({"CPU": 1.0}, label_selectors=sel) for _ in range(demand)])
    reply = ResourceDemandScheduler(None).schedule(SchedulingRequest(
        disable_launch_config_check=True, node_type_configs=auto.get_node_type_configs(),
        max_num_nodes=auto.get_max_num_nodes(), resource_requests=requests))
    return {launch.instance_type: launch.count for launch in reply.to_launch}


def _gpu_types(config: dict) -> set[str]:
    return {n for n, t in config["available_node_types"].items() if t.get("resources", {}).get("GPU")}


def test_node_types_say_what_they_are_for_and_cpu_work_selects_against_gpu_nodes() -> None:
    """Every GPU node type and group carries the label ``adlm.io/node-kind=gpu``, every other one ``cpu``, on both
    launchers (cluster.yaml; the RayCluster, labels as Ray's KubeRay autoscaler reads them); the CPU-work selector
    excludes exactly the GPU ones; KubeRay runs the label-aware v2 autoscaler."""
    # private: the autoscaler's scheduler and KubeRay config reader have no public API
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    from pipelines.core.runtime import GPU_NODE_KIND, NODE_KIND_LABEL, cpu_work_selector

    assert cpu_work_selector() == {NODE_KIND_LABEL: f"!{GPU_NODE_KIND}"}
    cluster, _ = _kuberay()
    assert cluster["spec"]["autoscalerOptions"]["version"] == "v2"
    derived = _derive_autoscaling_config_from_ray_cr({**cluster, "metadata": {**cluster["metadata"], "namespace": "n"}})
    for config in (_cluster(), derived):
        types = config["available_node_types"]
        assert _gpu_types(config)
        for name, t in types.items():
            kind = GPU_NODE_KIND if name in _gpu_types(config) else "cpu"
            assert t.get("labels") == {NODE_KIND_LABEL: kind}, (name, t.get("labels"))


def test_cpu_only_work_never_makes_the_v2_autoscaler_launch_a_gpu_node() -> None:
    """Ray's v2 autoscaler (``ray up``'s since Ray 2.50; the RayCluster's ``autoscalerOptions.version: v2``) scales by
    labels: CPU work carrying the CPU-work selector gets only CPU nodes, however much of it waits and however few CPU
    nodes the CPU type may have (KubeRay: the cluster-wide limit is the groups' sum, so ``cpu-worker`` fills up while
    the cluster still has room; the rest waits for a CPU pod). The controls: the same demand without the selector,
    and the autoscaler launches GPU nodes for it; on cluster.yaml, also with ``cpu_worker`` capped below the cluster
    (4 of 12)."""
    # private: the autoscaler's scheduler and KubeRay config reader have no public API
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    from pipelines.core.runtime import cpu_work_selector

    cluster, _ = _kuberay()
    kuberay = _derive_autoscaling_config_from_ray_cr({**cluster, "metadata": {**cluster["metadata"], "namespace": "n"}})
    capped = _cluster()
    capped["available_node_types"]["cpu_worker"]["max_workers"] = 4
    for config in (_cluster(), capped, kuberay):
        gpu, cpu_types = _gpu_types(config), set(config["available_node_types"]) - _gpu_types(config)
        launched = _v2_launches(config, cpu_work_selector())
        assert launched and set(launched) <= cpu_types, launched  # CPU nodes up to their type's limit, no GPU node
        assert gpu & set(_v2_launches(config, None)), _v2_launches(config, None)  # the control
