"""A Ray cluster (``tests.support.cluster.ray_cluster``) run by a process of its own, for a cluster with token
authentication: Ray reads its authentication mode and token once per process, so a test process that has used a
local Ray without authentication cannot also start, or be a client of, a cluster that has it. This process starts
the cluster with this environment's ``RAY_AUTH_MODE`` and ``RAY_AUTH_TOKEN_PATH``, prints one JSON line (GCS
address, job API, the head's session folder) and shuts the cluster down when its standard input closes.

    python -m tests.cluster_process '{"nodes": 2, "head_resources": {"adlm_driver": 100}}'
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    # tests.conftest sets RAY_AUTH_MODE=disabled and drops the work directory and the tracking URI: put this
    # environment's back, which the nodes take (as cluster.yaml's nodes take them from their containers).
    kept = {k: os.environ[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "ADLM_WORKDIR", "MLFLOW_TRACKING_URI")
            if k in os.environ}
    from tests.support.cluster import ray_cluster

    os.environ.update(kept)
    with ray_cluster(**json.loads(sys.argv[1])) as rc:
        print(json.dumps({"address": rc.address, "dashboard": rc.dashboard,
                          "session_dir": rc.cluster.head_node.get_session_dir_path()}), flush=True)
        sys.stdin.read()  # until the test closes it (or ends)


if __name__ == "__main__":
    main()
