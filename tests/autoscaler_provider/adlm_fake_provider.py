"""Ray's fake multi-node provider (``FakeMultiNodeProvider``, what ``ray.cluster_utils.AutoscalingCluster`` drives)
with one change for nodes that share one machine: each node it launches keeps its runtime environments in a folder
of its own, as each cloud instance has its own disk.

Why: Ray's runtime-env agent unpacks a job's working directory afresh, deleting what is there, the first time the
job's work lands on its node. Nodes sharing the session's one folder (what the provider gives them) delete the folder
the job's driver and the other nodes' workers run in whenever a node is launched mid-job (seen here: a sweep's
training workers failing in ``os.getcwd()`` after the autoscaler added a node).

The autoscaler's monitor loads it as ``provider: {type: external, module: adlm_fake_provider.OwnDiskFakeProvider}``;
``tests/support/cluster.py`` puts this folder (this module alone, not the project) on the monitor's PYTHONPATH.
"""

from __future__ import annotations

# private: Ray's fake multi-node provider exists only as a private module
import ray._private.parameter as parameter

# private: Ray's fake multi-node provider exists only as a private module
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider


class OwnDiskFakeProvider(FakeMultiNodeProvider):
    def _create_node_with_resources_and_labels(self, node_config: dict, tags: dict, count: int, resources: dict,
                                               labels: dict) -> None:
        base = parameter.RayParams
        folder = f"runtime_resources_node{self._next_node_id + 1}"  # the id the base class gives this node

        class OwnFolder(base):
            def __init__(self, *args: object, **kwargs: object) -> None:
                kwargs.setdefault("runtime_env_dir_name", folder)
                super().__init__(*args, **kwargs)

        # The base class builds the node's RayParams through this module attribute; its lock (re-entrant) is held
        # across the launch, and nothing else in the monitor builds RayParams.
        with self.lock:
            parameter.RayParams = OwnFolder
            try:
                super()._create_node_with_resources_and_labels(node_config, tags, count, resources, labels)
            finally:
                parameter.RayParams = base
