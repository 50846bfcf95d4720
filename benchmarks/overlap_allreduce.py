"""The replicas' gradient all-reduce during the last backward vs after it (issue 16).

4 gloo ranks on this machine: 2 replicas × 2 stages of resnet50 at 128×128
(global batch 32, 4 micro-batches per replica, 1F1B). One pipeline times its
training step with the replicas' all-reduce run by DDP's reducer during each
stage's last backward (runtime/dist/overlap.py) and with the after-backward one
(the same pipeline, its reducer switched off), in
interleaved rounds so both see the same machine; a step's time is the slowest
rank's. Gradients are compared too: the two ways must give the same numbers up
to the all-reduce's summation order.

    OMP_NUM_THREADS=1 python benchmarks/overlap_allreduce.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torchvision
from torch import nn


def worker(ns: argparse.Namespace) -> int:
    import crosscut.distributed as cd

    torch.set_num_threads(1)
    cd.init(timeout_s=600)
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None, num_classes=10)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ns.batch, 3, ns.size, ns.size, generator=g)
    y = torch.randint(0, 10, (ns.batch,), generator=g)
    pipe = cd.compile_distributed(
        model, x, replicas=2, microbatches=ns.microbatches, schedule="1f1b", timeout_s=600
    )
    reducer = pipe._reducer
    assert reducer is not None, "DDP's reducer is not in use"
    times: dict[str, list[float]] = {"overlapped": [], "after backward": []}
    grads: dict[str, list[torch.Tensor]] = {}
    for r in range(ns.rounds + 1):  # round 0 warms up
        for mode in ("overlapped", "after backward"):
            pipe._reducer = reducer if mode == "overlapped" else None
            for _ in range(ns.steps):
                pipe.zero_grad()
                dist.barrier()
                t0 = time.perf_counter()
                pipe.train_step(x, y, nn.functional.cross_entropy)
                took = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                if r > 0:
                    times[mode].append(float(took))
            grads[mode] = [p.grad.clone() for p in pipe.parameters() if p.grad is not None]
    if dist.get_rank() == 0:
        for mode, ts in times.items():
            print(f"{mode:>15}: median {statistics.median(ts):.3f} s, "
                  f"min {min(ts):.3f} s over {len(ts)} steps")  # fmt: skip
        a, b = statistics.median(times["overlapped"]), statistics.median(times["after backward"])
        print(f"after / overlapped = {b / a:.3f}")
    diff = max((u - v).abs().max().item() for u, v in zip(*grads.values(), strict=True))
    print(f"rank {dist.get_rank()}: largest gradient difference {diff:.3g}")
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2, help="steps per mode per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", action="store_true")
    ns = ap.parse_args(argv)
    if ns.worker:
        return worker(ns)
    args = [a for a in (argv if argv is not None else sys.argv[1:])]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "4", str(Path(__file__).resolve()), "--worker", *args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, env=env, check=False, timeout=3600).returncode


if __name__ == "__main__":
    sys.exit(main())
