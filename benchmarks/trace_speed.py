"""Front-end speed: trace + shape propagation + analytic costs of ResNet-50 at batch 32.

Target: under 3 s wall time, so ``crosscut partition`` answers interactively.
Run: ``.venv/bin/python benchmarks/trace_speed.py [--model resnet50 --batch 32 --runs 3]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torchvision

from crosscut.cost_models.analytic import analytic_costs
from crosscut.cost_models.cluster import Cluster
from crosscut.frontend.tracer import trace

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cluster", default="4xK20c")
    args = ap.parse_args(argv)
    model = getattr(torchvision.models, args.model)(weights=None)
    x = torch.randn(args.batch, 3, 224, 224)
    cluster = Cluster.from_spec(args.cluster)
    rows: list[tuple[float, float, float]] = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        graph = trace(model, x, mode="train")
        t1 = time.perf_counter()
        table = analytic_costs(graph, cluster)
        t2 = time.perf_counter()
        rows.append((t1 - t0, t2 - t1, t2 - t0))
    med = [statistics.median(r[i] for r in rows) for i in range(3)]
    print(f"{args.model} batch {args.batch}: {len(graph)} nodes, cluster {args.cluster}")
    print(f"trace+shapes {med[0]:.3f} s   analytic costs {med[1]:.3f} s   total {med[2]:.3f} s")
    print(f"target < 3 s: {'PASS' if med[2] < 3.0 else 'FAIL'}  (median of {args.runs} runs)")
    print(f"predicted fwd+bwd on {cluster.kinds[0]}: {table.total(cluster.kinds[0]):.4f} s")


if __name__ == "__main__":
    main()
