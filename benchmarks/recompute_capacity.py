"""The largest batch that fits: crosscut with and without recomputation vs the usual splits.

For each model and cluster (training, SGD, 1F1B with 8 micro-batches, analytic
costs, inputs 3x224x224 traced on meta tensors so nothing of the batch is
allocated) it finds, for each method on its own, the largest power-of-two
global batch from 32 to ``--top`` with a plan inside every device's memory cap,
by bisection on the exponent (feasibility only grows worse with the batch):

* ``recompute`` — ``crosscut.partition(..., recompute="auto")``;
* ``no-recompute`` — the same with ``recompute="never"``;
* ``param-balanced`` — contiguous stages with equal parameter bytes, the split
  torch.distributed.pipelining / DeepSpeed users get by default, priced by the
  same memory model (no recomputation);
* ``data-parallel`` — the whole model on every device, batch / devices each, no
  micro-batches: parameters, gradients and one device's share of activations.

A cell is the largest batch that fits, ``<32`` when none does, ``>=top`` when
the largest tried does. A ``?`` marks a cell where some solve ended at its time
limit without a plan and without proving there is none: it counts as "does not
fit", so the true largest batch may be larger.

Two more columns, at the ``recompute`` column's batch: ``R stages`` (the
stages "auto" recomputes, of the plan's stages: per stage, only where a stage
does not fit without it) and ``vs always`` (the predicted step time of that
plan over the same model planned with ``recompute="always"``, every stage
recomputing: below 1 is what choosing per stage saves).

Memory is the planner's prediction; ``benchmarks/cost_model.py`` checks the
memory model against PyTorch's tracker on CPU.

    python benchmarks/recompute_capacity.py                     # ~2 min on 2 cores
    python benchmarks/recompute_capacity.py --models vgg16 --clusters 4xK20c
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from crosscut.api import get_costs, micro_inputs, trace
from crosscut.cli.model_refs import load_model
from crosscut.cost_models.cluster import Cluster
from crosscut.errors import InfeasiblePlanError, PartitionError
from crosscut.ir.plan import Plan, PlanOptions
from crosscut.partitioner.build import plan_nodes, problem_from_parts
from crosscut.partitioner.partition import partition_graph, plan_cluster
from crosscut.partitioner.solvers.baselines import param_balanced

METHODS = ("recompute", "no-recompute", "param-balanced", "data-parallel")
MICRO = 8
TIMED_OUT: set[tuple[str, str, str]] = set()  # (model, cluster, method) with a time-out


@functools.lru_cache(maxsize=4)
def _setup(name: str, cluster_spec: str, batch: int) -> tuple[Any, Any, Cluster]:
    """The traced graph (one micro-batch, meta tensors) and its analytic costs."""
    model = load_model(f"torchvision:{name}")
    x = torch.empty(batch, 3, 224, 224, device="meta")
    cluster = Cluster.from_any(cluster_spec)
    graph = trace(model, micro_inputs(x, MICRO), mode="train")
    return graph, get_costs(graph, cluster), cluster


def plan_for(name: str, cluster_spec: str, batch: int, how: str, time_limit: float) -> Plan:
    graph, costs, cluster = _setup(name, cluster_spec, batch)
    opts = PlanOptions(microbatches=MICRO, time_limit_s=time_limit)
    return partition_graph(graph, costs, cluster, opts, recompute=how)


def fits(method: str, name: str, cluster_spec: str, batch: int, time_limit: float) -> bool:
    """Whether ``method`` has a plan within the caps at this global batch."""
    if method in ("recompute", "no-recompute"):
        how = "auto" if method == "recompute" else "never"
        try:
            plan_for(name, cluster_spec, batch, how, time_limit)
            return True
        except InfeasiblePlanError:
            return False
        except PartitionError:  # the time limit ran out before a plan or a proof
            TIMED_OUT.add((name, cluster_spec, method))
            return False
    graph, costs, cluster = _setup(name, cluster_spec, batch)
    pc = plan_cluster(cluster)
    nodes = plan_nodes(graph, costs, [d.kind for d in pc.devices])
    opts = PlanOptions(microbatches=MICRO)
    problem = problem_from_parts(nodes, pc, opts, training=True, ties=graph.ties)
    if method == "param-balanced":
        return param_balanced(problem) is not None
    # data parallel: one device holds everything; activations of batch/devices samples
    share = MICRO / len(cluster.devices)  # micro-batches' worth of samples per device
    need = sum(problem.resident) + share * sum(problem.activation)
    return need <= min(problem.mem_cap) and batch % len(cluster.devices) == 0


def _fits_at(method: str, name: str, cluster: str, time_limit: float, batch: int) -> bool:
    return fits(method, name, cluster, batch, time_limit)


def largest(ok: Callable[[int], bool], lo_exp: int, hi_exp: int) -> tuple[int, int]:
    """(largest exponent e in [lo_exp, hi_exp] with ok(2**e), or lo_exp - 1; probes)."""
    probes = 1
    if not ok(2**lo_exp):
        return lo_exp - 1, probes
    probes += 1
    if ok(2**hi_exp):
        return hi_exp, probes
    good, bad = lo_exp, hi_exp  # ok(2**good), not ok(2**bad)
    while bad - good > 1:
        mid = (good + bad) // 2
        probes += 1
        if ok(2**mid):
            good = mid
        else:
            bad = mid
    return good, probes


def row(name: str, cluster: str, top: int, time_limit: float) -> dict[str, str]:
    lo, hi = 5, int(math.log2(top))
    out: dict[str, str] = {}
    probes = 0
    best_rec = 0
    for method in METHODS:
        probe = functools.partial(_fits_at, method, name, cluster, time_limit)
        e, n = largest(probe, lo, hi)
        probes += n
        cell = "<32" if e < lo else (f">={top}" if e == hi else str(2**e))
        out[method] = cell + ("?" if (name, cluster, method) in TIMED_OUT else "")
        if method == "recompute" and e >= lo:
            best_rec = 2**e
    out["probes"] = str(probes)
    out["R stages"] = out["vs always"] = "-"
    if best_rec:
        auto = plan_for(name, cluster, best_rec, "auto", time_limit)
        flags = [s.recompute for s in auto.stages]
        out["R stages"] = f"{sum(flags)}/{len(flags)}"
        try:
            always = plan_for(name, cluster, best_rec, "always", time_limit)
            ratio = auto.predicted.step_time_s / always.predicted.step_time_s
            out["vs always"] = f"{ratio:.3f}"
        except PartitionError:
            out["vs always"] = "timeout"
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument(
        "--models", nargs="+", default=["vgg16", "resnet50", "resnet152", "densenet121"]
    )
    ap.add_argument("--clusters", nargs="+", default=["4xK20c", "8xV100"])
    ap.add_argument("--top", type=int, default=8192, help="largest batch tried (a power of 2)")
    ap.add_argument("--time-limit", type=float, default=5.0, help="solver seconds per plan")
    args = ap.parse_args(argv)
    print(f"largest global batch that fits (1F1B, {MICRO} micro-batches, SGD, 224x224)")
    cols = [*METHODS, "R stages", "vs always"]
    head = f"{'model':<12} {'cluster':<8} " + " ".join(f"{m:>14}" for m in cols)
    print(head + "  probes  seconds")
    for cluster in args.clusters:
        for name in args.models:
            t0 = time.perf_counter()
            cells = row(name, cluster, args.top, args.time_limit)
            line = " ".join(f"{cells[m]:>14}" for m in cols)
            took = time.perf_counter() - t0
            print(f"{name:<12} {cluster:<8} {line}  {cells['probes']:>6}  {took:7.1f}", flush=True)
            _setup.cache_clear()


if __name__ == "__main__":
    main()
