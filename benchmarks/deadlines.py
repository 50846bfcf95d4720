"""Does ``partition`` return by its time limit? Wall time of whole calls, tracing included.

The cases that used to overrun (issue 16): resnet50 (training, batch 32,
3x224x224, analytic costs) on ``64xV100`` with ``cross_shaped=True`` (the group
DP had no deadline: 298-486 s for a 30 s limit) and pipeline-only; and a
synthetic 2,564-node graph on 7 devices of four speeds (the fallback baseline
was quadratic and ran after the budget: 14.3 s for 10 s).

    OMP_NUM_THREADS=1 python benchmarks/deadlines.py                # ~2 min
    OMP_NUM_THREADS=1 python benchmarks/deadlines.py --limit 10 --cases synthetic
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

CASES = ("resnet50-cross", "resnet50-pipeline", "synthetic")


def _resnet50(cross: bool, limit: float) -> tuple[float, str]:
    import torch
    import torchvision

    from crosscut.api import partition

    with torch.device("meta"):
        model = torchvision.models.resnet50()
    x = torch.empty(32, 3, 224, 224, device="meta")
    t0 = time.perf_counter()
    plan = partition(model, "64xV100", x, cross_shaped=cross, time_limit=limit)
    wall = time.perf_counter() - t0
    s = plan.solver
    return (
        wall,
        f"{s.status} objective {s.objective * 1e3:.3f} ms bound {s.best_bound * 1e3:.3f} ms",
    )


def _synthetic(limit: float) -> tuple[float, str]:
    from synthetic import make_problem, num_nodes, resnet_like

    from crosscut.partitioner.solvers import SolveSettings, solve

    edges = resnet_like(854)
    pb = make_problem(edges, num_nodes(edges), 7, rng=random.Random(1), mem_cap=128 << 30)
    speed = (1.0, 1.0, 1.5, 1.5, 2.0, 3.0, 3.0)
    pb = dataclasses.replace(pb, compute=[[row[0] * s for s in speed] for row in pb.compute])
    t0 = time.perf_counter()
    res = solve(pb, SolveSettings(time_limit=limit))
    wall = time.perf_counter() - t0
    return wall, (
        f"{res.status} objective {res.objective * 1e3:.3f} ms bound {res.best_bound * 1e3:.3f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=float, default=30.0, help="time_limit in seconds")
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    args = ap.parse_args()
    print(f"{'case':<20} {'limit_s':>7} {'wall_s':>7} {'ratio':>6}  result")
    for case in args.cases:
        if case == "synthetic":
            wall, what = _synthetic(args.limit)
        else:
            wall, what = _resnet50(case == "resnet50-cross", args.limit)
        print(f"{case:<20} {args.limit:7.1f} {wall:7.1f} {wall / args.limit:6.2f}  {what}")


if __name__ == "__main__":
    main()
