"""Synthetic partition problems: CNN-shaped DAGs without torch, for tests and benchmarks.

Real graphs need torch and a model zoo; the solvers only need the shape of
the DAG and realistic magnitudes, so these generators mimic coarsened CNNs:
ResNet-like chains with residual skips, DenseNet-like blocks where every node
reads all previous ones, Inception-like parallel branches. Compute times are
lognormal, activations shrink with depth and parameters grow with depth, as in
real image networks. ``python benchmarks/synthetic.py``
prints the solver timing table.
"""

from __future__ import annotations

import itertools
import random
import sys
import time

from crosscut.ir.problem import PartitionProblem
from crosscut.ir.schedule import DEFAULT_SCHEDULE

__all__ = [
    "densenet_like",
    "inception_like",
    "make_problem",
    "num_nodes",
    "random_dag",
    "resnet_like",
]

GB = 1 << 30


def make_problem(
    edges: list[tuple[int, int]],
    n: int,
    num_devices: int,
    *,
    rng: random.Random,
    bandwidth: float = 12e9,
    latency: float = 20e-6,
    mem_cap: int = 32 * GB,
    microbatches: int = 8,
    training: bool = True,
    objective: str = "throughput",
    schedule: str = DEFAULT_SCHEDULE,
) -> PartitionProblem:
    """Attach CNN-like costs to a DAG whose nodes are numbered in topological order."""
    depth = [i / max(1, n - 1) for i in range(n)]
    base = [rng.lognormvariate(0.0, 0.7) * 2e-3 for _ in range(n)]  # ~2 ms per node
    out_b = [int(40e6 * 0.05 ** depth[i] * rng.uniform(0.7, 1.3)) for i in range(n)]
    params = [int(2e5 * 400 ** depth[i] * rng.uniform(0.2, 1.8)) for i in range(n)]
    d = num_devices
    return PartitionProblem(
        names=[f"n{i}" for i in range(n)],
        compute=[[b] * d for b in base],
        resident=[4 * p for p in params],  # weights, grads, two Adam moments
        activation=out_b,
        out_bytes=out_b,
        edges=sorted(set(edges)),
        devices=[f"cuda:{i}" for i in range(d)],
        mem_cap=[mem_cap] * d,
        bandwidth=[[bandwidth] * d for _ in range(d)],
        latency=[[latency] * d for _ in range(d)],
        microbatches=microbatches,
        schedule=schedule,
        objective=objective,
        training=training,
    )


def resnet_like(blocks: int) -> list[tuple[int, int]]:
    """stem -> blocks of (conv, conv, add) with the block input skipping to the add."""
    edges: list[tuple[int, int]] = []
    prev = 0
    i = 1
    for _ in range(blocks):
        a, b, add = i, i + 1, i + 2
        edges += [(prev, a), (a, b), (b, add), (prev, add)]
        prev, i = add, i + 3
    edges.append((prev, i))  # head
    return edges


def densenet_like(
    layers: tuple[int, ...] = (6, 12, 24, 16), per_layer: int = 4
) -> list[tuple[int, int]]:
    """Dense blocks: each layer's concat reads the block input and every earlier layer."""
    edges: list[tuple[int, int]] = []
    prev = 0
    i = 1
    for bi, count in enumerate(layers):
        outs = [prev]
        for _ in range(count):
            cat = i
            edges += [(o, cat) for o in outs]
            chain = list(range(cat, cat + per_layer + 1))
            edges += list(itertools.pairwise(chain))
            outs.append(chain[-1])
            i = chain[-1] + 1
        cat = i
        edges += [(o, cat) for o in outs]
        i += 1
        if bi + 1 < len(layers):
            edges.append((cat, i))  # transition
            prev, i = i, i + 1
        else:
            prev = cat
    edges.append((prev, i))
    return edges


def inception_like(modules: int) -> list[tuple[int, int]]:
    """Modules of four parallel branches (1, 2, 3, 1 nodes) joined by a concat."""
    edges: list[tuple[int, int]] = []
    prev = 0
    i = 1
    for _ in range(modules):
        ends = []
        for length in (1, 2, 3, 1):
            chain = [prev, *range(i, i + length)]
            edges += list(itertools.pairwise(chain))
            ends.append(chain[-1])
            i += length
        edges += [(e, i) for e in ends]
        prev, i = i, i + 1
    edges.append((prev, i))
    return edges


def random_dag(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """A connected random DAG: each node reads one or two earlier nodes."""
    edges = set()
    for v in range(1, n):
        for _ in range(rng.choice((1, 1, 2))):
            edges.add((rng.randrange(max(0, v - 4), v), v))
    return sorted(edges)


def num_nodes(edges: list[tuple[int, int]]) -> int:
    return 1 + max(max(e) for e in edges)


def _bench(argv: list[str]) -> None:
    from crosscut.partitioner.solvers import SolveSettings, solve

    limit = float(argv[0]) if argv else 10.0
    workers = int(argv[1]) if len(argv) > 1 else 1
    cases = {
        "resnet-60": resnet_like(20),
        "resnet-150": resnet_like(50),
        "inception-100": inception_like(12),
        "densenet-300": densenet_like(),
    }
    print(
        f"{'graph':15} {'n':>4} {'E':>5} {'D':>2} {'status':>9} {'time_s':>7} {'gap':>8} "
        f"{'obj_ms':>8} {'dp_ms':>8} {'S':>2}"
    )
    for name, edges in cases.items():
        n = num_nodes(edges)
        for d in (2, 4, 8):
            prob = make_problem(edges, n, d, rng=random.Random(1))
            t0 = time.perf_counter()
            res = solve(prob, SolveSettings(time_limit=limit, seed=0, workers=workers))
            wall = time.perf_counter() - t0
            print(
                f"{name:15} {n:4d} {len(prob.edges):5d} {d:2d} {res.status:>9} {wall:7.2f} "
                f"{res.gap:8.2e} {res.objective * 1e3:8.3f} "
                f"{res.baselines.get('chain_dp', float('inf')) * 1e3:8.3f} {res.num_stages:2d}",
                flush=True,
            )


if __name__ == "__main__":
    _bench(sys.argv[1:])
