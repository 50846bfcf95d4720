"""The planner's strategy vs every strategy fixed by hand, over the torchvision zoo.

The rule this checks (issue 23): the plan crosscut chooses is never predicted
slower than any alternative it lists (data parallelism on every device among
them), nor than the best plan of a grid of (replicas R, micro-batches M)
fixed by hand. Each model is traced on meta tensors (nothing is computed),
once per micro-batch size; the hand grid reuses the same traces.

    python benchmarks/strategy_zoo.py                    # 10 models × 5 clusters
    python benchmarks/strategy_zoo.py --models resnet18 --clusters 8xV100
    python benchmarks/strategy_zoo.py --servers          # the one-server acceptance table

Prints one row per (model, cluster): the chosen strategy, its step, the data
parallel baseline's step, the best hand-fixed step and the planning time.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass

import torch
import torchvision

from crosscut.cost_models.cluster import Cluster
from crosscut.errors import CrosscutError
from crosscut.options import PlanRequest
from crosscut.strategy import plan_strategy
from crosscut.traced import TraceCache

__all__ = ["CLUSTERS", "MODELS", "SERVERS", "ZooRow", "check", "main", "servers"]

MODELS = (
    "resnet18",
    "resnet50",
    "vgg11",
    "densenet121",
    "mobilenet_v2",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "squeezenet1_0",
    "shufflenet_v2_x0_5",
    "googlenet",
    "regnet_x_400mf",
    "mnasnet0_5",
)
CLUSTERS = ("2xV100", "4xK20c", "8xV100", "2x8xV100", "8xH100")
GRID_M = (1, 2, 4, 8)
# model, cluster, global batch, precision, one device's batch: servers users train on
SERVERS = (
    ("resnet50", "8xV100", 256, "fp32", 32),
    ("resnet50", "8xH100", 3200, "fp16", 400),
    ("resnet50", "4xA100-80GB", 512, "fp32", 128),
    ("densenet121", "8xV100", 256, "fp32", 32),
    ("vgg16", "8xV100", 256, "fp32", 32),
)


@dataclass
class ZooRow:
    model: str
    cluster: str
    chosen: str
    step_s: float
    data_parallel_s: float  # 0: data parallelism has no plan (the reason is in the plan)
    best_fixed_s: float  # the best hand-fixed (R, M); 0: none fits
    best_fixed: str
    slower_than_listed: list[str]  # alternatives the plan lists as faster (must be empty)
    plan_s: float

    @property
    def ok(self) -> bool:
        tol = 1 + 1e-9
        return not self.slower_than_listed and (
            self.best_fixed_s == 0 or self.step_s <= self.best_fixed_s * tol
        )


def build(name: str) -> torch.nn.Module:
    kw = {"aux_logits": False, "init_weights": False} if name == "googlenet" else {}
    model: torch.nn.Module = torchvision.models.get_model(name, weights=None, **kw)
    return model


def check(name: str, spec: str, *, batch: int = 64, size: int = 64, limit: float = 20.0) -> ZooRow:
    """Plan ``name`` on ``spec`` with default options, then every (R, M) of the grid by hand."""
    x = torch.empty(batch, 3, size, size, device="meta")
    request = PlanRequest(time_limit=limit)
    cache = TraceCache(build(name), (x,), request, name)
    cluster = Cluster.from_any(spec)
    t0 = time.perf_counter()
    plan = plan_strategy(cache, cluster, request)
    plan_s = time.perf_counter() - t0
    step = plan.predicted.step_time_s
    rows = plan.strategy.alternatives
    faster = [a.text() for a in rows if 0 < a.step_time_s < step * (1 - 1e-9)]
    dp = plan.strategy.data_parallel()
    best, best_label = 0.0, "-"
    for r in sorted({a.replicas for a in rows}):
        for m in GRID_M:
            if batch % (r * m):
                continue
            fixed = dataclasses.replace(request, replicas=r, microbatches=m, time_limit=limit / 2)
            try:
                p = plan_strategy(cache, cluster, fixed)
            except CrosscutError:  # no fit, or the model refuses that micro-batch
                continue
            s = p.predicted.step_time_s
            if best == 0 or s < best:
                best, best_label = s, f"R={r} M={m} ({p.num_stages} stages)"
    return ZooRow(
        model=name,
        cluster=spec,
        chosen=f"R={plan.replication.replicas} × {plan.num_stages} stages, "
        f"M={plan.options.microbatches}",
        step_s=step,
        data_parallel_s=0.0 if dp is None else dp.step_time_s,
        best_fixed_s=best,
        best_fixed=best_label,
        slower_than_listed=faster,
        plan_s=plan_s,
    )


def servers() -> int:
    """Default options on one server at 224x224: chosen vs data parallel vs one device."""
    import crosscut

    print(
        f"{'model':<12} {'cluster':<12} {'batch':>5} {'prec':<5} {'chosen':<42} "
        f"{'img/s':>7} {'DP img/s':>8} {'x one':>6} {'plan s':>6}"
    )
    for name, spec, batch, precision, one in SERVERS:
        model = build(name)
        x = torch.empty(batch, 3, 224, 224, device="meta")
        t0 = time.perf_counter()
        plan = crosscut.partition(model, spec, x, precision=precision)
        wall = time.perf_counter() - t0
        kind = spec.split("x", 1)[1]
        xs = torch.empty(one, 3, 224, 224, device="meta")
        single = crosscut.partition(model, f"1x{kind}", xs, precision=precision)
        dp = plan.strategy.data_parallel()
        dp_rate = batch / dp.step_time_s if dp is not None and dp.step_time_s > 0 else 0.0
        from crosscut.viz.summary import strategy_line

        print(
            f"{name:<12} {spec:<12} {batch:>5} {precision:<5} {strategy_line(plan)[:42]:<42} "
            f"{plan.predicted.throughput:7.0f} {dp_rate:8.0f} "
            f"{plan.predicted.throughput / single.predicted.throughput:6.2f} {wall:6.1f}",
            flush=True,
        )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", action="store_true", help="the one-server table only")
    ap.add_argument("--models", default=",".join(MODELS[:10]))
    ap.add_argument("--clusters", default=",".join(CLUSTERS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=20.0)
    a = ap.parse_args()
    if a.servers:
        return servers()
    print(
        f"{'model':<20} {'cluster':<9} {'chosen':<26} {'step ms':>9} {'DP ms':>9} "
        f"{'hand best ms':>12} {'plan s':>6} ok"
    )
    bad = 0
    for name in a.models.split(","):
        for spec in a.clusters.split(","):
            row = check(name, spec, batch=a.batch, size=a.size, limit=a.time_limit)
            dp = f"{row.data_parallel_s * 1e3:9.3f}" if row.data_parallel_s else f"{'no fit':>9}"
            print(
                f"{row.model:<20} {row.cluster:<9} {row.chosen:<26} {row.step_s * 1e3:9.3f} "
                f"{dp} {row.best_fixed_s * 1e3:12.3f} {row.plan_s:6.1f} "
                f"{'yes' if row.ok else 'NO: ' + row.best_fixed}",
                flush=True,
            )
            bad += not row.ok
    print(f"{bad} of the rows break the rule")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
