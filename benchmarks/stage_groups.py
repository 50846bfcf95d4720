"""Stages replicated to their own degrees against data parallelism and plain pipelines.

Why (issue 23): on one node, with ``cross_shaped=True`` the planner may give a
stage a batch-split group of devices (data parallelism inside that stage), so
a model's many-FLOP, few-parameter layers take many devices and its
parameter-heavy layers few, whose gradients then cross few links. This
prints, per (model, cluster), the plan with batch-split groups allowed, the
default plan (no groups) and data parallelism on every device, with the
planning time of the grouped search. Analytic costs, models traced on meta
tensors (nothing is computed).

Groups are searched by default now that each share is priced at its own batch
(the model traced at ``ceil(micro-batch / w)`` samples: crosscut's own K20c
prices AlexNet at 1.74x the per-sample time at 4 samples as at 32); the
"default" column is the default plan (batch-split groups searched) and "no
groups" forbids them (``cross_shaped=False``): the same search with and
without groups.

    python benchmarks/stage_groups.py
    python benchmarks/stage_groups.py --models alexnet --clusters 8xK20c
"""

from __future__ import annotations

import argparse
import time

import torch
import torchvision

import crosscut
from crosscut.viz.summary import strategy_line

__all__ = ["main"]

MODELS = ("alexnet", "vgg16", "resnet50", "googlenet", "densenet121")
CLUSTERS = ("8xK20c", "4xK20c", "8xV100")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--clusters", default=",".join(CLUSTERS))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--time-limit", type=float, default=10.0)
    args = ap.parse_args()
    print(
        f"{'model':12} {'cluster':8} {'default ms':>10} {'no groups':>9} {'DP ms':>8} "
        f"{'DP/dflt':>7} {'plan s':>6}  default strategy"
    )
    for name in args.models.split(","):
        model = torchvision.models.get_model(name, weights=None)
        x = torch.empty(args.batch, 3, 224, 224, device="meta")
        for spec in args.clusters.split(","):
            t0 = time.perf_counter()
            plan = crosscut.partition(model, spec, x, time_limit=args.time_limit)
            wall = time.perf_counter() - t0
            plain = crosscut.partition(
                model, spec, x, time_limit=args.time_limit, cross_shaped=False
            )
            dp = plan.strategy.data_parallel()
            dp_s = dp.step_time_s if dp is not None and dp.step_time_s > 0 else float("nan")
            ours = plan.predicted.step_time_s
            print(
                f"{name:12} {spec:8} {ours * 1e3:10.1f} {plain.predicted.step_time_s * 1e3:9.1f} "
                f"{dp_s * 1e3:8.1f} {dp_s / ours:7.2f} {wall:6.1f}  {strategy_line(plan)}",
                flush=True,
            )


if __name__ == "__main__":
    main()
