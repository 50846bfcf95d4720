"""The training script of the README's `crosscut run`: one process per plan device.

    crosscut partition torchvision:resnet18 --devices 2xV100 --batch 32 \\
        --microbatches 4 --input-shape 3x64x64 -o plan.json
    crosscut run --plan plan.json examples/train_distributed.py --steps 8

`crosscut run` starts one process per plan device (torchrun) and passes the
plan in ``CROSSCUT_PLAN``; every rank builds the same seeded model and data,
``crosscut.compile`` gives each rank its own stage, and ``train_step`` runs
the pipelined forward and backward (the loss comes back on the last stage,
``None`` elsewhere). The data is one fixed random batch, so the printed loss
must go down as the model memorises it: a quick check that the ranks train
together. On CPU (gloo) the ranks are plain processes; on GPUs use
``--devices`` naming your cards.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import torchvision

import crosscut
import crosscut.distributed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--clip", type=float, default=5.0, help="max gradient norm (0: off)")
    args = ap.parse_args()

    ctx = crosscut.distributed.init()  # reads torchrun's environment
    torch.manual_seed(0)  # every rank builds the same model and data
    model = torchvision.models.resnet18(weights=None)
    x, y = torch.randn(32, 3, 64, 64), torch.randint(0, 1000, (32,))

    pipe = crosscut.compile(model, None, x)  # the plan comes from CROSSCUT_PLAN
    opt = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    first = last = None
    for step in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = pipe.train_step(x, y, F.cross_entropy)  # None off the loss-computing rank
        if args.clip > 0:  # the whole model's norm, on every rank (not torch's: one stage's)
            crosscut.clip_grad_norm_(pipe, args.clip)
        opt.step()
        if loss is not None:
            last = float(loss)
            first = last if first is None else first
            ms = (time.perf_counter() - t0) * 1e3
            print(f"rank {ctx.rank}: step {step + 1}/{args.steps} loss {last:.4f} ({ms:.0f} ms)")
    if first is not None and last is not None:
        verdict = "went down" if last < first else "DID NOT go down"
        print(f"rank {ctx.rank}: loss {first:.4f} -> {last:.4f}: {verdict}", flush=True)
    pipe.close()


if __name__ == "__main__":
    main()
