"""One rank of the torchrun detection check: what cluster does this rank see?

Launched by ``tests/test_detect.py`` as 2 torchrun node groups on 127.0.0.1;
each rank writes the cluster ``Cluster.from_any("torchrun")`` detected, and
torchrun's variables it came from, to ``OUT/rank<RANK>.json``. Detection reads
the environment only: no process group, nothing to wait on.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from crosscut.cost_models.cluster import Cluster


def main() -> None:
    out = Path(sys.argv[1])
    cluster = Cluster.from_any("torchrun")
    env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE")}
    record = {
        "rank": int(os.environ["RANK"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "env": env,
        "name": cluster.name,
        "nodes": cluster.nodes,
        "per_node": len(cluster.devices),
        "total": cluster.total_devices,
        "kinds": cluster.kinds,
        "network": cluster.network_name,
        "same_node_0_1": cluster.same_node(0, 1),
        "same_node_0_per_node": cluster.same_node(0, len(cluster.devices)),
    }
    (out / f"rank{record['rank']}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
