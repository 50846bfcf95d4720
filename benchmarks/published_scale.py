"""Predicted vs published: the training time of large published ResNet-50 runs, from their setup.

Each run is given as what its paper states — GPUs per node and nodes, the
network, images per GPU, precision, epochs — and priced the way crosscut
prices data parallelism (the planner's own functions): one GPU's training
step at its per-GPU batch (analytic costs at achieved rates, ``efficiency.py``),
replicated over every GPU, with the gradient all-reduce in DDP buckets
overlapped with the backward (``partitioner/replicas.py``, ``simulate.py``),
the optimizer update and the per-iteration overhead. Predicted time = epochs ×
1,281,167 / global batch × step. Target: each run within ±25 %.

Where a paper says how it reduced gradients, the run is priced that way and
not as the planner would choose: Akiba et al.'s ring, after the backward
(ChainerMN overlapped nothing in 2017, and reduced one fused buffer). The
hierarchical reductions of the others (Gloo's halving/doubling between Big
Basin servers, Jia et al.'s hierarchical all-reduce, Mikami et al.'s 2D-torus)
are priced as the cheapest of crosscut's ring, tree and 2d. The table says
where each run's step goes, and sets the published per-GPU rate against the
papers' own scaling efficiencies: the rate one GPU of each paper's framework
reached alone (published rate ÷ efficiency) against the rate crosscut prices
one GPU at, and the scaling efficiency crosscut predicts (the step of the
GPUs the paper's efficiency was measured against over the step at the GPU
count it was published for) against the published one: a ratio of one
framework's own steps, so it checks the communication model apart from how
fast each framework computed. One validation pass
of 50,000 images per epoch is priced as a column of its own and not added: no
paper says whether its time includes it (it is at most ~1 % of each run).

Sources (docs/BENCHMARKS.md has the details and what is approximate):

* Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour"
  (arXiv:1706.02677, 2017): 256 P100 in 32 Big Basin servers (NVLink), 50 Gbit
  Ethernet, 32 images/GPU, fp32, 90 epochs, ~1 hour; gradients reduced inside a
  server, then between servers by Gloo, during backprop; ~90 % scaling
  efficiency from 8 to 256 GPUs;
* Akiba et al., "Extremely Large Minibatch SGD: Training ResNet-50 on ImageNet in
  15 Minutes" (arXiv:1711.04325, 2017): 1,024 P100 (PCIe: 4.7 TFLOPS fp64 each
  in PFN's post) in 128 nodes of PFN's MN-1, two InfiniBand FDR links per node
  and a ring all-reduce (PFN's MN-1 blog post, 2017), 32 images/GPU, fp32
  compute with fp16 gradients on the wire, 90 epochs, 15 min; ChainerMN
  overlapped no all-reduce before v1.2 (its double buffering, Chainer blog,
  May 2018); 80 % scaling efficiency;
* Jia et al., "Highly Scalable Deep Learning Training System with
  Mixed-Precision: Training ImageNet in Four Minutes" (arXiv:1807.11205, 2018):
  2,048 P40 in 256 nodes, 100 Gbit Ethernet, hierarchical all-reduce,
  32 images/GPU (64K batch), fp16 with fp16 gradients, 90 epochs, 6.6 min;
  87.9 % scaling efficiency;
* Mikami et al., "ImageNet/ResNet-50 Training in 224 Seconds" (arXiv:1811.05233v1,
  2018; v2 is "Massively Distributed SGD ... in a Flash"): 2,176 V100 on ABCI (544 nodes of 4, two
  InfiniBand EDR per node), 2D-torus all-reduce, 34K then 68K batch (16 then
  32 images/GPU: we price 32), mixed precision with fp16 gradients, 90
  epochs, 224 s; 91.62 % scaling efficiency on 1,088 GPUs.

The scaling efficiencies are as NVIDIA's news post on Mikami et al. tabulates
them from the papers.

Held out besides (``HELD_OUT``, ``ONE_SERVER``): NVIDIA's TensorFlow2 EfficientNet
runs on 2-8 nodes, OneFlow's DLPerf PyTorch ResNet-50 on 2 and 4 nodes, and
Lambda's ResNet-50 rows for one server of 2-8 GPUs (their sources are at each list).

    python benchmarks/published_scale.py
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torchvision

import crosscut
from crosscut.cost_models.calibration import step_overhead_s
from crosscut.cost_models.cluster import Cluster
from crosscut.ir.plan import Plan
from crosscut.partitioner.annotate import annotate
from crosscut.partitioner.replicas import reduction, stage_gradient_bytes
from crosscut.partitioner.simulate import simulate

__all__ = [
    "HELD_OUT",
    "ONE_SERVER",
    "RUNS",
    "Breakdown",
    "PublishedRun",
    "breakdown",
    "main",
    "predict_run",
]

IMAGENET_TRAIN = 1_281_167
IMAGENET_VAL = 50_000
TOLERANCE = 0.25


@dataclass(frozen=True)
class PublishedRun:
    """One published large-scale ResNet-50 training run, as its paper describes it."""

    name: str
    cluster: str  # crosscut spec: "NODESxGPUSxKIND[-TOPOLOGY]+[NICSx]NETWORK"
    per_gpu_batch: int
    precision: str  # "fp32" | "fp16" (autocast)
    grad_bytes: float  # bytes per gradient element on the wire
    epochs: int
    published_s: float
    algorithm: str | None = None  # the all-reduce the run used ("ring" | "tree" | "2d")
    overlap: bool = True  # whether its all-reduce overlapped the backward
    scaling: float = 0.0  # the paper's scaling efficiency (0: not published) ...
    scaling_gpus: int = 0  # ... at this many GPUs (0: the run's) ...
    scaling_base: int = 1  # ... against this many (1: one GPU; Goyal et al.: one server)
    model: str = "resnet50"  # a torchvision constructor
    image: int = 224  # input height and width
    optimizer: str = "momentum"  # the update each step includes
    source: str = "paper"  # "paper" (the four large ResNet-50 runs) | "dle-tf2" | "dlperf"
    # | "lambda"
    # the convolutions' layout: "nhwc" (channels-last, as the vendors' 16-bit runs) or
    # PyTorch's default "nchw" (16-bit convolutions pay cuDNN's transposes)
    layout: str = "nhwc"


RUNS: list[PublishedRun] = [
    PublishedRun(
        "Goyal et al. 2017",
        "32x8xP100+eth50",
        32,
        "fp32",
        4.0,
        90,
        3600.0,
        None,
        True,
        0.90,
        256,
        8,
    ),
    PublishedRun(
        "Akiba et al. 2017",
        "128x8xP100-pcie+2xib56",
        32,
        "fp32",
        2.0,
        90,
        15 * 60.0,
        "ring",
        False,
        0.80,
    ),
    PublishedRun(
        "Jia et al. 2018", "256x8xP40+eth100", 32, "fp16", 2.0, 90, 6.6 * 60.0, None, True, 0.879
    ),
    PublishedRun(
        "Mikami et al. 2018",
        "544x4xV100+2xib100",
        32,
        "fp16",
        2.0,
        90,
        224.0,
        None,
        True,
        0.9162,
        1088,
    ),
]


# Held out: NVIDIA DeepLearningExamples, TensorFlow2 EfficientNet v1 README
# (tensorflow:21.09-tf2-py3 NGC container, Horovod, XLA, RMSprop, 500 epochs,
# AutoAugment, SyncBN), "Training accuracy" (time to train) and "Training
# performance" (images/s, weak scaling vs one GPU) tables, on DGX A100 80 GB
# (8 HDR InfiniBand NICs per node) and DGX-1 32 GB V100 (4 EDR). Per-GPU
# batch from the README's train_benchmark_8x*.sh scripts. Nothing in
# efficiency.py was fitted to these, nor to any TensorFlow figure.
def _tf2(
    name: str,
    cluster: str,
    model: str,
    image: int,
    batch: int,
    hours: float,
    weak: float,
    precision: str = "fp32",
) -> PublishedRun:
    gpus = Cluster.from_spec(cluster).total_devices
    return PublishedRun(
        name,
        cluster,
        batch,
        precision,
        4.0,
        500,
        hours * 3600.0,
        None,
        True,
        weak / gpus,
        model=model,
        image=image,
        optimizer="rmsprop",
        source="dle-tf2",
    )


_A100_2, _A100_4, _A100_8 = (f"{n}x8xA100-80GB+8xib200" for n in (2, 4, 8))
_V100_4, _V100_8 = (f"{n}x8xV100-32GB+4xib100" for n in (4, 8))
HELD_OUT: list[PublishedRun] = [
    _tf2("EffNet-B0 16xA100", _A100_2, "efficientnet_b0", 224, 512, 10.0, 14.74),
    _tf2("EffNet-B4 32xA100", _A100_4, "efficientnet_b4", 380, 80, 38.0, 28.98),
    _tf2("EffNet-B4 64xA100", _A100_8, "efficientnet_b4", 380, 80, 19.0, 57.41),
    _tf2("EffNet-B0 32xV100", _V100_4, "efficientnet_b0", 224, 256, 11.5, 20.36),
    _tf2("EffNet-B4 32xV100", _V100_4, "efficientnet_b4", 380, 32, 97.0, 23.48),
    _tf2("EffNet-B4 64xV100", _V100_8, "efficientnet_b4", 380, 32, 50.0, 45.16),
    # mixed precision (AMP; Horovod reduces the fp32 gradients of fp32 weights)
    _tf2("EffNet-B0 16xA100 AMP", _A100_2, "efficientnet_b0", 224, 1024, 4.5, 11.77, "fp16"),
    _tf2("EffNet-B4 32xA100 AMP", _A100_4, "efficientnet_b4", 380, 160, 14.0, 27.46, "fp16"),
    _tf2("EffNet-B4 64xA100 AMP", _A100_8, "efficientnet_b4", 380, 160, 7.0, 54.16, "fp16"),
    _tf2("EffNet-B0 32xV100 AMP", _V100_4, "efficientnet_b0", 224, 512, 10.0, 21.23, "fp16"),
    _tf2("EffNet-B4 32xV100 AMP", _V100_4, "efficientnet_b4", 380, 64, 41.0, 20.50, "fp16"),
    _tf2("EffNet-B4 64xV100 AMP", _V100_8, "efficientnet_b4", 380, 64, 20.5, 40.96, "fp16"),
]


# Held out: OneFlow's DLPerf reproduction of NVIDIA DeepLearningExamples' PyTorch
# ResNet-50 v1.5 (NGC pytorch:20.03, DALI on CPU, DDP over NCCL 2.5.6) on 1, 2
# and 4 nodes of 8 V100-SXM2-16GB, one 100 Gbit/s InfiniBand adapter per node
# (the README's `ibstat`), median of 5 runs of iterations 20-120; published
# as images/s, priced here as one epoch at that rate.
def _at_rate(
    name: str, cluster: str, batch: int, precision: str, rate: float, scaling: float, source: str
) -> PublishedRun:
    """A run published as images/s, priced as one epoch at that rate (NCHW, PyTorch)."""
    return PublishedRun(
        name,
        cluster,
        batch,
        precision,
        4.0,
        1,
        IMAGENET_TRAIN / rate,
        None,
        True,
        scaling,
        source=source,
        layout="nchw",  # the scripts pass no --memory-format: PyTorch's default
    )


def _dlperf(nodes: int, precision: str, batch: int, rate: float, speedup: float) -> PublishedRun:
    name = f"DLPerf RN50 {nodes * 8}xV100{' AMP' if precision == 'fp16' else ''}"
    cluster = f"{nodes}x8xV100+ib100"
    return _at_rate(name, cluster, batch, precision, rate, speedup / (nodes * 8), "dlperf")


HELD_OUT += [
    _dlperf(2, "fp32", 128, 5716.79, 15.56),
    _dlperf(4, "fp32", 128, 10917.09, 29.72),
    _dlperf(2, "fp16", 256, 11991.94, 14.94),
    _dlperf(4, "fp16", 256, 22551.16, 28.09),
]


# Held out: Lambda's multi-GPU rows of the same tables as its one-GPU ones
# (github.com/lambdal/deeplearning-benchmark, pytorch/pytorch-train-throughput-fp32.csv
# and -fp16.csv; calibration.py's "lambda" source): NVIDIA DeepLearningExamples'
# ResNet-50 v1.5 in NGC pytorch 22.09 or later, synthetic data, DDP on one server, each
# GPU at its one-GPU row's batch, PyTorch's NCHW layout; published as images/s, priced
# as one epoch at that rate. The all-reduce crosses NVLink/NVSwitch on the SXM servers
# and PCIe on the workstation cards; AMP reduces the fp32 gradients of fp32 weights.
def _lambda(
    name: str, cluster: str, batch: int, precision: str, rate: float, one: float
) -> PublishedRun:
    gpus = Cluster.from_spec(cluster).total_devices  # scaling against the table's one-GPU row
    return _at_rate(name, cluster, batch, precision, rate, rate / (gpus * one), "lambda")


ONE_SERVER: list[PublishedRun] = [
    _lambda("8xA100 fp32", "1x8xA100-80GB", 640, "fp32", 7397.0, 1066.0),
    _lambda("8xA100 AMP", "1x8xA100-80GB", 1280, "fp16", 11439.0, 1582.0),
    _lambda("8xH100 fp32", "1x8xH100", 640, "fp32", 14985.0, 1893.0),
    _lambda("8xH100 AMP", "1x8xH100", 1280, "fp16", 22088.0, 2781.5),
    _lambda("8xV100 fp32", "1x8xV100", 128, "fp32", 2817.0, 369.0),
    _lambda("8xV100 AMP", "1x8xV100", 256, "fp16", 6174.0, 833.0),
    _lambda("4xA100 fp32", "1x4xA100-80GB", 640, "fp32", 4042.0, 1066.0),
    _lambda("2xRTX4090 fp32", "1x2xRTX4090", 224, "fp32", 1363.0, 721.0),
    _lambda("8xRTX6000Ada fp32", "1x8xRTX6000Ada", 496, "fp32", 5126.0, 647.0),
]


def _slowest_link(cluster: Cluster) -> list[float]:
    n = len(cluster.devices)
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    return [
        min(cluster.bandwidth[i][j] for i, j in pairs),
        max(cluster.latency[i][j] for i, j in pairs),
    ]


def one_gpu_plan(run: PublishedRun, model: torch.nn.Module | None = None) -> Plan:
    """One GPU's training plan at the run's per-GPU batch and precision."""
    kind = Cluster.from_spec(run.cluster).devices[0].kind
    x = torch.empty(run.per_gpu_batch, 3, run.image, run.image, device="meta")
    net = model or getattr(torchvision.models, run.model)(weights=None)
    if run.layout == "nhwc":
        net, x = net.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    return crosscut.partition(
        net,
        f"1x{kind}",
        x,
        precision=run.precision,
        optimizer=run.optimizer,
    )


def replicated(plan: Plan, run: PublishedRun, gpus: int = 0) -> Plan:
    """``plan`` priced as a replica on every GPU of the run (or of ``gpus`` of its GPUs)."""
    spec = run.cluster
    if gpus:  # the same nodes, fewer of them
        node = spec.split("x", 1)[1]
        spec = f"{max(1, gpus // len(Cluster.from_spec('1x' + node).devices))}x{node}"
    cluster = Cluster.from_spec(spec)
    out = copy.deepcopy(plan)
    out.cluster.nodes, out.cluster.nics = cluster.nodes, cluster.nics
    out.cluster.network = list(cluster.network)
    out.cluster.network_name = cluster.network_name
    out.cluster.node_link = _slowest_link(cluster)
    out.replication.replicas = gpus or cluster.total_devices
    out.replication.grad_bytes = run.grad_bytes
    return annotate(out)


def data_parallel_plan(run: PublishedRun, model: torch.nn.Module | None = None) -> Plan:
    """One GPU's plan at the per-GPU batch, priced as a replica of every GPU of the run."""
    return replicated(one_gpu_plan(run, model), run)


@dataclass(frozen=True)
class Breakdown:
    """Where one run's predicted step goes (seconds), and the rates it implies."""

    forward: float
    backward: float
    update: float
    overhead: float
    exposed: float  # the all-reduce the step waits for
    wire: float  # the all-reduce alone on the wire
    algorithm: str
    eval_s: float  # one validation pass per epoch over the whole run (not added)
    step: float
    total: float  # predicted seconds of the run
    gpu_rate: float  # images/s one GPU is priced at, alone (no all-reduce)
    published_rate: float  # images/s per GPU the published time implies
    framework_rate: float  # published_rate / the paper's scaling efficiency (0: unknown)
    scaling: float = 0.0  # the scaling efficiency crosscut predicts where the paper measured it


def _exposed(plan: Plan, run: PublishedRun, bwd: float) -> tuple[float, float, str]:
    """(exposed, on the wire, algorithm) of ``plan``'s all-reduce as ``run`` did it."""
    names = [run.algorithm] if run.algorithm else None
    replicas = plan.replication.replicas
    if replicas <= 1:
        return 0.0, 0.0, "none"
    if run.overlap:
        red = reduction(plan, replicas, algorithms=names)
        return max(0.0, red.positions[0].finish(0.0, bwd, bwd) - bwd), red.seconds, red.algorithm
    # one call on one fused buffer after the backward (ChainerMN's pack_params)
    grads = [int(b * run.grad_bytes / 4.0) for b in stage_gradient_bytes(plan)]
    red = reduction(plan, replicas, grads, algorithms=names)
    return red.seconds, red.seconds, red.algorithm


def breakdown(run: PublishedRun, plan: Plan | None = None) -> Breakdown:
    """Price ``run`` as it ran: its all-reduce algorithm, overlapped or not."""
    one = plan or one_gpu_plan(run)
    full = replicated(one, run)
    kind = full.cluster.devices[0].kind
    bwd = sum(n.bwd_s.get(kind, 0.0) for n in full.nodes)
    fwd = sum(n.time_s.get(kind, 0.0) for n in full.nodes) - bwd
    update = simulate(full).update_s
    overhead = step_overhead_s(full.cluster.devices[0].device)
    alone = fwd + bwd + update + overhead
    exposed, wire, algorithm = _exposed(full, run, bwd)
    replicas = full.replication.replicas
    steps = run.epochs * IMAGENET_TRAIN / (run.per_gpu_batch * replicas)
    per_gpu_val = math.ceil(IMAGENET_VAL / replicas / run.per_gpu_batch)
    published_rate = run.epochs * IMAGENET_TRAIN / run.published_s / replicas
    scaling = 0.0
    if run.scaling:
        at = replicated(one, run, run.scaling_gpus) if run.scaling_gpus else full
        base = replicated(one, run, run.scaling_base) if run.scaling_base > 1 else one
        scaling = (alone + _exposed(base, run, bwd)[0]) / (alone + _exposed(at, run, bwd)[0])
    return Breakdown(
        forward=fwd,
        backward=bwd,
        update=update,
        overhead=overhead,
        exposed=exposed,
        wire=wire,
        algorithm=algorithm,
        eval_s=run.epochs * per_gpu_val * fwd,
        step=alone + exposed,
        total=steps * (alone + exposed),
        gpu_rate=run.per_gpu_batch / alone,
        published_rate=published_rate,
        framework_rate=published_rate / run.scaling if run.scaling else 0.0,
        scaling=scaling,
    )


def predict_run(run: PublishedRun) -> tuple[float, Plan]:
    """(predicted seconds of the whole run, the priced plan)."""
    one = one_gpu_plan(run)
    return breakdown(run, one).total, replicated(one, run)


def main() -> None:
    rates = []
    for title, runs in (
        ("The four large ResNet-50 runs (papers)", RUNS),
        (
            "Held out: TF2 EfficientNet (NVIDIA DLE 21.09); PyTorch ResNet-50 (DLPerf, NGC 20.03)",
            HELD_OUT,
        ),
        ("Held out: one server of 2-8 GPUs (Lambda, NGC PyTorch, DDP)", ONE_SERVER),
    ):
        print(title)
        print(
            f"{'run':<24}{'cluster':<24}{'fwd':>6}{'bwd':>6}{'upd+oh':>7}{'exposed':>8}"
            f"{'step ms':>8}{'pred s':>8}{'publ s':>8}{'ratio':>7}{'eval s':>7}"
        )
        for run in runs:
            b = breakdown(run)
            flag = "" if abs(b.total / run.published_s - 1) <= TOLERANCE else "  OUT"
            print(
                f"{run.name:<24}{run.cluster:<24}{b.forward * 1e3:>6.1f}{b.backward * 1e3:>6.1f}"
                f"{(b.update + b.overhead) * 1e3:>7.1f}{b.exposed * 1e3:>8.1f}{b.step * 1e3:>8.1f}"
                f"{b.total:>8.0f}{run.published_s:>8.0f}{b.total / run.published_s:>7.2f}"
                f"{b.eval_s:>7.1f}  ({b.algorithm}{'' if run.overlap else ', after backward'}, "
                f"wire {b.wire * 1e3:.1f} ms){flag}",
                flush=True,
            )
            rates.append((run, b))
        print()
    print(
        f"{'run':<24}{'img/s/GPU priced':>17}{'published':>10}{'framework alone':>16}"
        f"{'priced/fw':>10}{'scaling: publ':>14}{'pred':>6}{'  (GPUs vs base)'}"
    )
    for run, b in rates:
        gpus = run.scaling_gpus or Cluster.from_spec(run.cluster).total_devices
        print(
            f"{run.name:<24}{b.gpu_rate:>17.0f}{b.published_rate:>10.0f}{b.framework_rate:>16.0f}"
            f"{b.gpu_rate / b.framework_rate:>10.2f}{run.scaling:>14.3f}{b.scaling:>6.3f}"
            f"  ({gpus} vs {run.scaling_base})"
        )


if __name__ == "__main__":
    main()
