"""Mariana's AlexNet on four K20c cards, and a run of the plan on four CPU devices.

Tencent's Mariana split AlexNet across four 4.8 GB K20c GPUs, two per PCIe
switch. This partitions torchvision's AlexNet for that cluster (``4xK20c``,
training, batch 128) and prints where each layer goes and what it costs, then
replays that very plan — the same assignment, at the batch it was made for —
on four ``cpu`` devices (one per K20c of the plan) to check it trains exactly
like eager.

    python examples/mariana_alexnet.py
    python examples/mariana_alexnet.py --batch 16   # quick
"""

from __future__ import annotations

import argparse
import copy

import torch
import torchvision

import crosscut
from crosscut.verify import verify_plan
from crosscut.viz import summary_text


def main(argv: list[str] | None = None) -> bool:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--microbatches", type=int, default=4)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = torchvision.models.alexnet(weights=None)
    x = torch.randn(args.batch, 3, 224, 224)
    plan = crosscut.partition(
        model,
        "4xK20c",
        x,
        microbatches=args.microbatches,
        model_name="torchvision:alexnet",
        time_limit=10,
        require_all_devices=True,  # Mariana used all four cards
    )
    print(summary_text(plan))
    # Replay the plan itself on one CPU device per planned K20c (the plan is checked
    # against this model and batch by its fingerprint; nothing is re-partitioned).
    print(f"replaying the plan on {len(plan.cluster.devices)} cpu devices at batch {args.batch}")
    report = verify_plan(copy.deepcopy(model), x, plan)
    print(report.text())
    return report.ok


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
