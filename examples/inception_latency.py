"""Split inception_v3 inference for latency: parallel branches on different devices.

With the ``latency`` objective the solver minimises the time of one batch
through the graph, so independent Inception branches may run at the same time
on different devices — or stay together when the transfers cost more than they
save, which the plan says in its notes.

    python examples/inception_latency.py --devices 2xV100
"""

from __future__ import annotations

import argparse

import torch
import torchvision

import crosscut
from crosscut.cost_models.cluster import Cluster


def main(argv: list[str] | None = None) -> tuple[float, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="2xV100")
    p.add_argument("--size", type=int, default=299)
    args = p.parse_args(argv)
    model = torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=False)
    x = torch.randn(1, 3, args.size, args.size)
    cluster = Cluster.from_any(args.devices)
    single = Cluster.from_specs(cluster.devices[:1], cluster.topology)
    one = crosscut.partition(model, single, x, mode="infer", objective="latency", time_limit=5)
    many = crosscut.partition(model, cluster, x, mode="infer", objective="latency", time_limit=10)
    n = len(cluster.devices)
    print(f"one device: {one.predicted.makespan_s * 1e3:.3f} ms")
    print(
        f"{n} devices: {many.predicted.makespan_s * 1e3:.3f} ms over {many.num_stages} stages"
        f" ({many.solver.status}, gap {many.solver.gap:.2%})"
    )
    for note in many.solver.notes:
        print("note:", note)
    return one.predicted.makespan_s, many.predicted.makespan_s


if __name__ == "__main__":
    main()
