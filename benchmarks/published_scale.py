"""Predicted vs published: the training time of large published ResNet-50 runs, from their setup.

Each run is given as what its paper states — GPUs per node and nodes, the
network, images per GPU, precision, epochs — and priced the way crosscut
prices data parallelism (the planner's own functions): one GPU's training
step at its per-GPU batch (analytic costs at achieved rates, ``efficiency.py``),
replicated over every GPU, with the gradient all-reduce in DDP buckets
overlapped with the backward (``partitioner/replicas.py``, ``simulate.py``),
the optimizer update and the per-iteration overhead. Predicted time = epochs ×
1,281,167 / global batch × step. Data loading, evaluation and checkpointing are
not modelled (each paper reports them as hidden or excluded). Target: each run
within ±25 %.

Sources (docs/BENCHMARKS.md has the details and what is approximate):

* Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour"
  (arXiv:1706.02677, 2017): 256 P100 in 32 Big Basin servers (NVLink), 50 Gbit
  Ethernet, 32 images/GPU, fp32, 90 epochs, ~1 hour;
* Akiba et al., "Extremely Large Minibatch SGD: Training ResNet-50 on ImageNet in
  15 Minutes" (arXiv:1711.04325, 2017): 1,024 P100 (PCIe) in 128 nodes of
  PFN's MN-1, InfiniBand FDR, 32 images/GPU, fp32 compute with fp16 gradients on
  the wire, 90 epochs, 15 min;
* Jia et al., "Highly Scalable Deep Learning Training System with
  Mixed-Precision: Training ImageNet in Four Minutes" (arXiv:1807.11205, 2018):
  2,048 P40 in 256 nodes, 100 Gbit InfiniBand, 32 images/GPU (64K batch), fp16
  with fp16 gradients, 90 epochs, 6.6 min;
* Mikami et al., "Massively Distributed SGD: ImageNet/ResNet-50 Training in a
  Flash" (arXiv:1811.05233, 2018): 2,176 V100 on ABCI (544 nodes of 4, two
  InfiniBand EDR per node), ~32 images/GPU (68K batch), mixed precision with
  fp16 gradients, 90 epochs, 224 s.

    python benchmarks/published_scale.py
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torchvision

import crosscut
from crosscut.cost_models import Cluster
from crosscut.partitioner.annotate import annotate
from crosscut.partitioner.plan import Plan

__all__ = ["RUNS", "PublishedRun", "main", "predict_run"]

IMAGENET_TRAIN = 1_281_167
TOLERANCE = 0.25


@dataclass(frozen=True)
class PublishedRun:
    """One published large-scale ResNet-50 training run."""

    name: str
    cluster: str  # crosscut spec: "NODESxGPUSxKIND[-TOPOLOGY]+[NICSx]NETWORK"
    per_gpu_batch: int
    precision: str  # "fp32" | "fp16" (autocast)
    grad_bytes: float  # bytes per gradient element on the wire
    epochs: int
    published_s: float
    note: str = ""


RUNS: list[PublishedRun] = [
    PublishedRun("Goyal et al. 2017", "32x8xP100+eth50", 32, "fp32", 4.0, 90, 3600.0),
    PublishedRun("Akiba et al. 2017", "128x8xP100-pcie+ib56", 32, "fp32", 2.0, 90, 15 * 60.0),
    PublishedRun("Jia et al. 2018", "256x8xP40+ib100", 32, "fp16", 2.0, 90, 6.6 * 60.0),
    PublishedRun("Mikami et al. 2018", "544x4xV100+2xib100", 32, "fp16", 2.0, 90, 224.0),
]


def _slowest_link(cluster: Cluster) -> list[float]:
    n = len(cluster.devices)
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    return [
        min(cluster.bandwidth[i][j] for i, j in pairs),
        max(cluster.latency[i][j] for i, j in pairs),
    ]


def data_parallel_plan(run: PublishedRun, model: torch.nn.Module | None = None) -> Plan:
    """One GPU's plan at the per-GPU batch, priced as a replica of every GPU of the run."""
    cluster = Cluster.from_spec(run.cluster)
    model = model or torchvision.models.resnet50(weights=None)
    x = torch.empty(run.per_gpu_batch, 3, 224, 224, device="meta")
    plan = crosscut.partition(
        model,
        f"1x{cluster.devices[0].kind}",
        x,
        precision=run.precision,
        optimizer="momentum",
    )
    plan.cluster.nodes, plan.cluster.nics = cluster.nodes, cluster.nics
    plan.cluster.network = list(cluster.network)
    plan.cluster.network_name = cluster.network_name
    plan.cluster.node_link = _slowest_link(cluster)
    plan.replication.replicas = cluster.total_devices
    plan.replication.grad_bytes = run.grad_bytes
    return annotate(plan)


def predict_run(run: PublishedRun) -> tuple[float, Plan]:
    """(predicted seconds of the whole run, the priced plan)."""
    plan = data_parallel_plan(run)
    global_batch = run.per_gpu_batch * plan.replication.replicas
    steps = run.epochs * IMAGENET_TRAIN / global_batch
    return steps * plan.predicted.step_time_s, plan


def main() -> None:
    print(
        f"{'run':<20}{'cluster':<24}{'prec':<6}{'step ms':>8}{'exposed':>9}"
        f"{'pred s':>9}{'publ s':>9}{'ratio':>7}"
    )
    for run in RUNS:
        got, plan = predict_run(run)
        rep = plan.replication
        flag = "" if abs(got / run.published_s - 1) <= TOLERANCE else "  OUT"
        print(
            f"{run.name:<20}{run.cluster:<24}{run.precision:<6}"
            f"{plan.predicted.step_time_s * 1e3:>8.1f}{rep.exposed_s * 1e3:>7.1f}ms"
            f"{got:>9.0f}{run.published_s:>9.0f}{got / run.published_s:>7.2f}"
            f"  ({rep.reduction}, wire {rep.allreduce_s * 1e3:.1f} ms){flag}"
        )


if __name__ == "__main__":
    main()
