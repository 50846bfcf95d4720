"""Cross-shaped (2-D) plans vs pipeline-only vs data-parallel-only, analytic costs.

For each model (training, one micro-batch of ``--batch``, SGD) on 4 and 8
devices of a preset cluster, prints the bottleneck (seconds per step in steady
state: the busiest device's stage times — one stage per device, except where
two consecutive stages share one device group, marked ``=`` in the layout) of:

* ``pipe``: the plain pipeline solver (one device per stage, CP-SAT);
* ``dp``: one stage batch-split over every device (data parallelism, ring
  all-reduce of all gradients);
* ``cross``: stages on device groups, split by batch or channel, chosen
  together with the boundaries (``partition(..., cross_shaped=True)``); the
  last stage may share the group of the stage before it (e.g. vgg16 on 8:
  convolutions by batch on all 8, then the classifier by channel on the same 8);

each divided by the lower bound (total compute / devices, or the largest
node's smallest share), and the chosen layout. All three are priced by the
same cost model (``partitioner/evaluate.py`` + ``partitioner/group_costs.py``).
Then Mariana's case on 4xK20c (4.8 GB cards): AlexNet at a batch whose
training state does not fit one card, and a widened AlexNet (twice the filters,
conv1 stride 2), with the predicted per-device peak memory.

    python benchmarks/cross_shaped.py                       # ~1-2 min on 2 cores
    python benchmarks/cross_shaped.py --preset 8xH100-nvlink --models vgg16
    python benchmarks/cross_shaped.py --every-width         # widths 1..N, not only 2^k and N
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import torch
import torchvision
from torch import nn

from crosscut.api import get_costs, trace
from crosscut.cost_models.analytic import channel_scales
from crosscut.cost_models.cluster import Cluster
from crosscut.ir.plan import Plan, PlanOptions
from crosscut.partitioner.build import plan_groups, plan_to_problem
from crosscut.partitioner.evaluate import evaluate, lower_bound
from crosscut.partitioner.partition import partition_graph
from crosscut.partitioner.solvers.cross import data_parallel

MODELS = ["alexnet", "vgg16", "resnet50", "googlenet", "inception_v3"]


def build(name: str) -> tuple[nn.Module, int]:
    kw: dict[str, Any] = {}
    if name in ("googlenet", "inception_v3"):
        kw = {"aux_logits": False, "init_weights": False}
    model: nn.Module = torchvision.models.get_model(name, weights=None, **kw)
    return model, 299 if name == "inception_v3" else 224


def wide_alexnet() -> nn.Module:
    """AlexNet with twice the filters everywhere and a stride-2 first conv."""
    model = torchvision.models.alexnet()
    f = model.features
    f[0] = nn.Conv2d(3, 128, kernel_size=11, stride=2, padding=2)
    f[3] = nn.Conv2d(128, 384, kernel_size=5, padding=2)
    f[6] = nn.Conv2d(384, 768, kernel_size=3, padding=1)
    f[8] = nn.Conv2d(768, 512, kernel_size=3, padding=1)
    f[10] = nn.Conv2d(512, 512, kernel_size=3, padding=1)
    c = model.classifier
    c[1] = nn.Linear(512 * 6 * 6, 8192)
    c[4] = nn.Linear(8192, 8192)
    c[6] = nn.Linear(8192, 1000)
    return model


def group_widths(num: int, every: bool) -> list[int]:
    """The group widths searched: ``compile``'s default (1, 2, 4, ... and ``num``) or all."""
    if every:
        return list(range(1, num + 1))
    return sorted({w for w in (1, 2, 4, 8, 16) if w <= num} | {num})


def solve(
    model: nn.Module,
    size: int,
    batch: int,
    preset: str,
    cross: bool,
    time_limit: float,
    every_width: bool = False,
) -> Plan:
    cluster = Cluster.from_any(preset)
    graph = trace(model, torch.randn(batch, 3, size, size), mode="train")
    graph.model_name = type(model).__name__
    costs = get_costs(graph, cluster)
    num = len(cluster.devices)
    widths = group_widths(num, every_width) if cross else [1]
    if cross:  # every share priced at its own size, as crosscut.partition prices it
        costs = costs.with_channel_scales(channel_scales(graph, cluster, widths))
        smaller = {}
        for w in widths:
            share = -(-batch // w)
            if share < batch:
                g = trace(model, torch.randn(share, 3, size, size, device="meta"), mode="train")
                smaller[share] = get_costs(g, cluster)
        costs = costs.with_share_scales(smaller, batch)
    options = PlanOptions(
        time_limit_s=time_limit, widths=widths, splits=["batch", "channel"] if cross else []
    )
    return partition_graph(graph, costs, cluster, options)


def layout(plan: Plan) -> str:
    parts = []
    for s in plan.stages:
        kind = s.split[0] if s.split != "none" else ""
        shared = s.index > 0 and s.devices == plan.stages[s.index - 1].devices
        mark = "=" if shared else ""
        parts.append(f"{mark}{len(s.devices)}{kind}:{len(plan.stage_nodes(s.index))}")
    return " | ".join(parts)


def dp_bottleneck(plan: Plan) -> float:
    pb, _, _ = plan_to_problem(plan)
    pb = dataclasses.replace(pb, widths=(1, pb.num_devices), splits=("batch",))
    found = data_parallel(pb)
    if found is None:
        return float("inf")
    return evaluate(pb, found[0], [g.leader for g in found[1]], found[1]).bottleneck


def peak(plan: Plan) -> int:
    pb, stage_of, stage_device = plan_to_problem(plan)
    return max(evaluate(pb, stage_of, stage_device, plan_groups(plan)).device_memory)


def table(
    models: list[str], presets: list[str], batch: int, time_limit: float, every_width: bool
) -> None:
    head = f"{'model':<13}{'cluster':<15}{'pipe/LB':>8}{'dp/LB':>8}{'cross/LB':>9}"
    head += f"{'pipe s':>9}{'dp s':>9}{'cross s':>9}{'solve s':>9}"
    print(head + "  layout (width+split:nodes per stage; = shares the group before)")
    for preset in presets:
        for name in models:
            model, size = build(name)
            pipe = solve(model, size, batch, preset, False, time_limit)
            t0 = time.perf_counter()
            cross = solve(model, size, batch, preset, True, time_limit, every_width)
            wall = time.perf_counter() - t0
            pb, _, _ = plan_to_problem(cross)
            lb = lower_bound(pb)
            dp = dp_bottleneck(cross)
            best_other = min(pipe.predicted.bottleneck_s, dp)
            flag = "" if cross.predicted.bottleneck_s <= best_other * (1 + 1e-9) else "  WORSE"
            print(
                f"{name:<13}{preset:<15}{pipe.predicted.bottleneck_s / lb:>8.3f}{dp / lb:>8.3f}"
                f"{cross.predicted.bottleneck_s / lb:>9.3f}{pipe.predicted.bottleneck_s:>9.4f}"
                f"{dp:>9.4f}{cross.predicted.bottleneck_s:>9.4f}"
                f"{wall:>9.2f}  {layout(cross)}{flag}"
            )


def mariana(time_limit: float) -> None:
    print("\nMariana's case, 4xK20c (4.8 GB usable per card), training, SGD:")
    cap = Cluster.from_any("4xK20c").devices[0].mem_cap
    for label, model, batch in (
        ("alexnet b=2048", torchvision.models.alexnet(), 2048),
        ("wide alexnet b=384", wide_alexnet(), 384),
    ):
        graph = trace(model, torch.randn(batch, 3, 224, 224), mode="train")
        cluster = Cluster.from_any("4xK20c")
        costs = get_costs(graph, cluster)
        options = PlanOptions(
            time_limit_s=time_limit, widths=[1, 2, 4], splits=["batch", "channel"]
        )
        state = sum(
            costs.resident_bytes(n.name) + costs.activation_bytes(n.name)
            for n in graph.nodes
            if not n.is_io
        )
        plan = partition_graph(graph, costs, cluster, options)
        print(
            f"  {label:<20} one-card training state {state / 1e9:6.2f} GB "
            f"(cap {cap / 1e9:.1f} GB); "
            f"plan peak {peak(plan) / 1e9:5.2f} GB/device, bottleneck "
            f"{plan.predicted.bottleneck_s:.3f} s, layout {layout(plan)}"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=MODELS)
    ap.add_argument("--preset", nargs="*", default=["4xV100", "8xV100"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--no-mariana", action="store_true")
    ap.add_argument(
        "--every-width",
        action="store_true",
        help="search every group width 1..N (default: 1, 2, 4, ... and N, as compile does)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    table(args.models, args.preset, args.batch, args.time_limit, args.every_width)
    if not args.no_mariana:
        mariana(args.time_limit)


if __name__ == "__main__":
    main()
