"""Heterogeneous devices: how device orders are searched, side by side (issue 16).

Three strategies of ``solve_cpsat(orders=...)`` on the same problems, same
time limit: ``auto`` (the class model where transfers cost the same on every
link, enumeration of distinct orders otherwise), ``enumerate`` (one model per
distinct order, up to 24) and ``heuristic`` (the first two orders only, what
crosscut did for more than four devices before the class model). Each row
prints objective ÷ the best objective any strategy found, status and gap; a
strategy's OPTIMAL is a proof, so a ratio above 1 against it is a real loss.

Problems:

* ``synthetic``: CNN-like DAGs (``benchmarks/synthetic.py``) on 6 identical
  devices plus one 10x slower, and on 5 devices of 5 kinds (speeds 1, 1.3,
  1.7, 2.5, 4), training, uniform links. Needs nothing else.
* ``--graphs DIR``: the published workloads of Tarnawski et al. (NeurIPS 2020):
  6 accelerators and 1 CPU core (3 + 1 for the small BERTs), clone
  https://github.com/msr-fiddle/dnn-partitioning and give its folder;
  converted by ``benchmarks/tarnawski.py``.

    OMP_NUM_THREADS=1 python benchmarks/heterogeneous.py                    # ~2 min
    OMP_NUM_THREADS=1 python benchmarks/heterogeneous.py --graphs ../dnn-partitioning
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from pathlib import Path

from synthetic import (
    densenet_like,
    inception_like,
    make_problem,
    num_nodes,
    resnet_like,
)

from crosscut.ir.problem import PartitionProblem
from crosscut.partitioner.solvers.cpsat import solve_cpsat
from crosscut.partitioner.solvers.settings import SolveSettings

STRATEGIES = ("auto", "enumerate", "heuristic")


def _with_speeds(pb: PartitionProblem, speeds: list[float]) -> PartitionProblem:
    d = len(speeds)
    return dataclasses.replace(
        pb,
        compute=[[row[0] * s for s in speeds] for row in pb.compute],
        devices=[f"dev{i}" for i in range(d)],
        mem_cap=[pb.mem_cap[0]] * d,
        bandwidth=[[pb.bandwidth[0][0]] * d for _ in range(d)],
        latency=[[pb.latency[0][0]] * d for _ in range(d)],
    )


def synthetic() -> list[tuple[str, PartitionProblem]]:
    out = []
    graphs = {
        "resnet_like(16)": resnet_like(16),
        "densenet_like()": densenet_like(),
        "inception_like(9)": inception_like(9),
    }
    for name, edges in graphs.items():
        pb = make_problem(edges, num_nodes(edges), 1, rng=random.Random(0))
        out.append((f"{name} 6+1", _with_speeds(pb, [1.0] * 6 + [10.0])))
        out.append((f"{name} 5 kinds", _with_speeds(pb, [1.0, 1.3, 1.7, 2.5, 4.0])))
    return out


def published(folder: Path) -> list[tuple[str, PartitionProblem]]:
    from tarnawski import load  # the sibling script (this folder is sys.path[0])

    files = sorted((folder / "throughput-inputs").glob("*/*.json"))
    if not files:
        raise SystemExit(f"no throughput-inputs/*/*.json under {folder}")
    return [(f"{f.parent.name[:5]}/{f.stem}", load(f)) for f in files]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", type=Path, help="a clone of msr-fiddle/dnn-partitioning")
    ap.add_argument("--limit", type=float, default=10.0, help="time_limit per solve (s)")
    args = ap.parse_args()
    cases = published(args.graphs) if args.graphs else synthetic()
    print(f"time limit {args.limit} s per solve; ratio = objective / best of the three")
    head = f"{'problem':34} {'n':>5} {'d':>2}"
    for s in STRATEGIES:
        head += f" | {s:>9} {'status':>8} {'gap':>7} {'wall':>5}"
    print(head)
    worst = dict.fromkeys(STRATEGIES, 1.0)
    for name, pb in cases:
        runs = {}
        for s in STRATEGIES:
            t0 = time.perf_counter()
            res = solve_cpsat(pb, SolveSettings(time_limit=args.limit, orders=s))
            runs[s] = (res, time.perf_counter() - t0)
        best = min(r.objective for r, _ in runs.values())
        row = f"{name:34} {pb.n:5d} {pb.num_devices:2d}"
        for s in STRATEGIES:
            res, wall = runs[s]
            ratio = res.objective / best
            worst[s] = max(worst[s], ratio)
            row += f" | {ratio:9.4f} {res.status:>8} {res.gap:7.2%} {wall:5.1f}"
        print(row, flush=True)
    print("worst ratio: " + ", ".join(f"{s} {worst[s]:.4f}" for s in STRATEGIES))


if __name__ == "__main__":
    main()
