"""The largest batch that fits: crosscut with and without recomputation vs the usual splits.

For each model and cluster (training, SGD, 1F1B with 8 micro-batches, analytic
costs, inputs 3x224x224 traced on meta tensors so nothing of the batch is
allocated) it doubles the batch from 32 until a method has no plan that fits
the memory caps, and prints the largest batch each method fits:

* ``recompute`` — ``crosscut.partition(..., recompute="auto")``;
* ``no-recompute`` — the same with ``recompute="never"``;
* ``param-balanced`` — contiguous stages with equal parameter bytes, the split
  torch.distributed.pipelining / DeepSpeed users get by default, priced by the
  same memory model (no recomputation);
* ``data-parallel`` — the whole model on every device, batch / devices each, no
  micro-batches: parameters, gradients and one device's share of activations.

Each cell is the largest power of two that fits (">N" when every tried batch
fits). Memory is the planner's prediction; ``benchmarks/cost_model.py`` checks
the memory model against PyTorch's tracker on CPU.

    python benchmarks/recompute_capacity.py                     # ~5 min on 2 cores
    python benchmarks/recompute_capacity.py --models vgg16 --clusters 4xK20c
"""

from __future__ import annotations

import argparse
import time

import torch

from crosscut.api import get_costs, micro_inputs, trace
from crosscut.cost_models import Cluster
from crosscut.errors import InfeasiblePlanError
from crosscut.models import load_model
from crosscut.partitioner.build import plan_nodes, problem_from_parts
from crosscut.partitioner.partition import partition_graph, plan_cluster
from crosscut.partitioner.plan import PlanOptions
from crosscut.partitioner.solvers.baselines import param_balanced

METHODS = ("recompute", "no-recompute", "param-balanced", "data-parallel")
MICRO = 8


def fits(name: str, cluster_spec: str, batch: int, time_limit: float) -> dict[str, bool]:
    """Whether each method has a plan within the caps at this global batch."""
    model = load_model(f"torchvision:{name}")
    x = torch.empty(batch, 3, 224, 224, device="meta")
    cluster = Cluster.from_any(cluster_spec)
    graph = trace(model, micro_inputs(x, MICRO), mode="train")
    costs = get_costs(graph, cluster)
    opts = PlanOptions(microbatches=MICRO, time_limit_s=time_limit)
    out: dict[str, bool] = {}
    for method, how in (("recompute", "auto"), ("no-recompute", "never")):
        try:
            partition_graph(graph, costs, cluster, opts, recompute=how)
            out[method] = True
        except InfeasiblePlanError:
            out[method] = False
    pc = plan_cluster(cluster)
    nodes = plan_nodes(graph, costs, [d.kind for d in pc.devices])
    problem = problem_from_parts(nodes, pc, opts, training=True, ties=graph.ties)
    out["param-balanced"] = param_balanced(problem) is not None
    # data parallel: one device holds everything; activations of batch/devices samples
    share = MICRO / len(cluster.devices)  # micro-batches' worth of samples per device
    need = sum(problem.resident) + share * sum(problem.activation)
    out["data-parallel"] = need <= min(problem.mem_cap) and batch % len(cluster.devices) == 0
    return out


def largest(name: str, cluster: str, top: int, time_limit: float) -> dict[str, str]:
    best = dict.fromkeys(METHODS, "<32")
    alive = set(METHODS)
    batch = 32
    while alive and batch <= top:
        ok = fits(name, cluster, batch, time_limit)
        for m in list(alive):
            if ok[m]:
                best[m] = str(batch)
            else:
                alive.discard(m)
        batch *= 2
    for m in alive:
        best[m] = f">{top}"
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models", nargs="+", default=["vgg16", "resnet50", "resnet152", "densenet121"]
    )
    ap.add_argument("--clusters", nargs="+", default=["4xK20c", "8xV100"])
    ap.add_argument("--top", type=int, default=8192, help="largest batch tried")
    ap.add_argument("--time-limit", type=float, default=5.0, help="solver seconds per plan")
    args = ap.parse_args(argv)
    print(f"largest global batch that fits (1F1B, {MICRO} micro-batches, SGD, 224x224)")
    head = f"{'model':<12} {'cluster':<8} " + " ".join(f"{m:>14}" for m in METHODS)
    print(head + "  seconds")
    for cluster in args.clusters:
        for name in args.models:
            t0 = time.perf_counter()
            best = largest(name, cluster, args.top, args.time_limit)
            row = " ".join(f"{best[m]:>14}" for m in METHODS)
            print(f"{name:<12} {cluster:<8} {row}  {time.perf_counter() - t0:7.1f}", flush=True)


if __name__ == "__main__":
    main()
