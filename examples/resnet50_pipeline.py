"""Train resnet50 as a pipeline on synthetic data.

Partitions resnet50 over N devices (``cpu`` devices by default, ``cuda:i``
when you have GPUs), prints the plan's summary, and runs a few SGD steps with
1F1B over micro-batches, reporting the loss and the step time next to the plan's
prediction. The steps train on one fixed synthetic batch, so the loss falls
as the model memorises it (lr 0.01 with momentum: a larger rate with batch
norm over 4-sample micro-batches makes it jump around instead).

Predicted vs measured: with the default analytic costs the prediction is
the device preset's peak speed times an efficiency, which a shared CPU does
not reach (expect the measured step to be 1-3x the prediction on a laptop);
``--cost profiled`` times every op on this machine first and predicts much
closer. Step 0 is slower still: it starts the device threads and warms the
allocator.

    python examples/resnet50_pipeline.py --devices cpu,cpu --batch 8 --size 64 --steps 2
    python examples/resnet50_pipeline.py --devices cuda:0,cuda:1,cuda:2,cuda:3 --batch 64
"""

from __future__ import annotations

import argparse
import time

import torch
import torchvision
from torch import nn

import crosscut
from crosscut.viz import summary_text


def main(argv: list[str] | None = None) -> list[float]:
    """Run the example; returns each step's loss."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="cpu,cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=96, help="input height and width")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model", default="resnet50")
    p.add_argument(
        "--cost", default="analytic", choices=["analytic", "profiled"], help="how ops are priced"
    )
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = torchvision.models.get_model(args.model, weights=None, num_classes=100)
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 100, (args.batch,))
    devices = args.devices.split(",")
    compiled = crosscut.compile(
        model,
        devices,
        x,
        microbatches=args.microbatches,
        require_all_devices=True,
        time_limit=5,
        cost=args.cost,
    )
    print(summary_text(compiled.plan))
    opt = torch.optim.SGD(compiled.parameters(), lr=0.01, momentum=0.9)
    losses: list[float] = []
    predicted = compiled.plan.predicted.step_time_s
    print(f"training on one fixed batch; predicted step {predicted:.3f} s ({args.cost} costs)")
    for step in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = compiled.train_step((x,), y, nn.functional.cross_entropy)
        opt.step()
        took = time.perf_counter() - t0
        losses.append(float(loss))
        print(
            f"step {step}: loss {float(loss):.4f}, {took:.3f} s = {took / predicted:.2f}x the "
            "prediction" + (" (includes start-up)" if step == 0 else "")
        )
    return losses


if __name__ == "__main__":
    main()
