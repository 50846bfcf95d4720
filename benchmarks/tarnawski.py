"""Read the published device-placement workloads of Tarnawski et al. as partition problems.

Source: Tarnawski, Phanishayee, Devanur, Mahajan, Nina Paravecino, "Efficient
Algorithms for Device Placement of DNN Graph Operators", NeurIPS 2020; the
graphs are in https://github.com/msr-fiddle/dnn-partitioning
(``throughput-inputs/{LayerGraphs,OperatorGraphs}/*.json``, MIT licence; not
vendored here: clone that repository and point ``--graphs`` at it).

Each file gives ``maxFPGAs`` identical accelerators and ``maxCPUs`` CPU cores
(the paper's k and l), per node its accelerator and CPU latency (ms), whether
it runs on an accelerator at all, its memory size, and per edge the time to
move the producer's output. The conversion to crosscut's model
(:class:`~crosscut.ir.problem.PartitionProblem`):

* a training graph's forward and backward nodes of one ``colorClass`` must be
  colocated (the paper's rule); they become one node whose time is their sum,
  with ``training=True`` (crosscut charges each cut edge twice: activation
  forward, gradient back). Inference graphs keep their nodes.
* edges are the forward-direction edges between merged nodes (backward edges
  mirror them); an edge's cost (ms) becomes ``out_bytes`` at 1 byte per ns, on
  uniform links, so a transfer costs what the paper says.
* devices: ``maxFPGAs`` accelerators with ``maxSizePerFPGA`` of memory, then
  ``maxCPUs`` CPU cores with unlimited memory; a node an accelerator cannot
  run costs 10^6 s there.

The cost models differ in one way: the paper's CPU pays no communication and
crosscut's every stage does, so objectives are comparable between crosscut's
solvers, not with the paper's tables.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from crosscut.ir.problem import PartitionProblem

__all__ = ["load"]

_UNSUPPORTED_S = 1e6
_BYTES_PER_S = 1e9  # 1 byte per ns: out_bytes = cost in ns


def _topo(n: int, edges: set[tuple[int, int]]) -> list[int]:
    succ: dict[int, list[int]] = defaultdict(list)
    indeg = [0] * n
    for u, v in edges:
        succ[u].append(v)
        indeg[v] += 1
    ready = sorted(v for v in range(n) if indeg[v] == 0)
    order: list[int] = []
    while ready:
        u = ready.pop(0)
        order.append(u)
        for v in sorted(succ[u]):
            indeg[v] -= 1
            if indeg[v] == 0:
                ready.append(v)
    if len(order) != n:
        raise ValueError("the merged graph has a cycle")
    return order


def load(path: str | Path, devices: int | None = None) -> PartitionProblem:
    """The workload at ``path`` as a problem (``devices``: accelerators; the file's by default)."""
    data = json.loads(Path(path).read_text())
    nodes = data["nodes"]
    training = any(n.get("isBackwardNode", 0) for n in nodes)
    key: dict[int, tuple[str, int]] = {}
    for n in nodes:
        color = n.get("colorClass") if training else None
        key[n["id"]] = ("id", n["id"]) if color is None else ("color", color)
    groups = sorted(set(key.values()))
    gid = {g: i for i, g in enumerate(groups)}
    m = len(groups)
    acc, cpu, size = [0.0] * m, [0.0] * m, [0.0] * m
    ok = [True] * m
    backward = {n["id"] for n in nodes if n.get("isBackwardNode", 0)}
    for n in nodes:
        g = gid[key[n["id"]]]
        acc[g] += n["fpgaLatency"] / 1e3
        cpu[g] += n["cpuLatency"] / 1e3
        size[g] += n["size"]
        ok[g] = ok[g] and bool(n["supportedOnFpga"])
    cost = [0.0] * m
    edges: set[tuple[int, int]] = set()
    for e in data["edges"]:
        if e["sourceId"] in backward:
            continue  # a gradient edge: mirrors a forward one
        u, v = gid[key[e["sourceId"]]], gid[key[e["destId"]]]
        if u != v:
            edges.add((u, v))
            cost[u] = max(cost[u], e["cost"] / 1e3)
    order = _topo(m, edges)
    pos = {g: i for i, g in enumerate(order)}
    k = devices if devices is not None else int(data["maxFPGAs"])
    cpus = int(data["maxCPUs"])
    d = k + cpus
    cap = int(data["maxSizePerFPGA"])
    return PartitionProblem(
        names=[f"{groups[g][0]}{groups[g][1]}" for g in order],
        compute=[[acc[g] if ok[g] else _UNSUPPORTED_S] * k + [cpu[g]] * cpus for g in order],
        resident=[int(size[g]) for g in order],
        activation=[0] * m,
        out_bytes=[round(cost[g] * _BYTES_PER_S) for g in order],
        edges=sorted((pos[u], pos[v]) for u, v in edges),
        devices=[f"acc{i}" for i in range(k)] + [f"cpu{i}" for i in range(cpus)],
        mem_cap=[cap] * k + [1 << 62] * cpus,
        bandwidth=[[_BYTES_PER_S] * d for _ in range(d)],
        latency=[[0.0] * d for _ in range(d)],
        microbatches=1,
        training=training,
    )
