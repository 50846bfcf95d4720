"""A batch-split stage's shares, concurrent vs one after another, in one run (CPU).

One stage holding the whole model, split by batch over ``["cpu"] * width``
logical devices, one micro-batch (so the local executor runs the stage
inline). Three variants, timed alternately each iteration so machine noise
hits all alike, medians reported:

* ``eager``       — the fx-traced model on the whole batch, one thread;
* ``sequential``  — ``BatchSplitStage.parallel = False``: the shares one after
  another on the stage's thread (the behaviour before share threads);
* ``parallel``    — the shares concurrently, one thread per group device.

``torch.set_num_threads(1)`` keeps each share on one core, so the speed-up
measures the share threads alone (bounded by ``width`` and the free cores).
Both the forward alone (``no_grad``) and a training step (forward, backward,
SGD) are timed; the backward runs on the caller's thread in every variant.

    .venv/bin/python benchmarks/cross_shaped_runtime.py --model resnet18 --batch 32 --size 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torchvision
from torch import fx, nn

from crosscut.runtime import CompiledModule
from crosscut.runtime.batch_split import BatchSplitStage

__all__ = ["main"]


def race(fns: dict[str, Callable[[], None]], iters: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each function, the functions interleaved."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(warmup + iters):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def step_fn(
    module: nn.Module, x: torch.Tensor, y: torch.Tensor, before: Callable[[], None]
) -> Callable[[], None]:
    opt = torch.optim.SGD(module.parameters(), lr=0.01)

    def step() -> None:
        before()
        opt.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()

    return step


def forward_fn(
    module: nn.Module, x: torch.Tensor, before: Callable[[], None]
) -> Callable[[], None]:
    def fwd() -> None:
        before()
        with torch.no_grad():
            module(x)

    return fwd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--bn-mode", default="micro", choices=["micro", "step"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)(num_classes=10).train()
    gm = fx.symbolic_trace(model)
    eager = fx.symbolic_trace(model)
    stage_of = {n.name: 0 for n in gm.graph.nodes if n.op not in ("placeholder", "output")}
    c = CompiledModule(
        model, gm, stage_of, ["cpu"], groups=[(["cpu"] * args.width, "batch")], bn_mode=args.bn_mode
    )
    stage = next(m for m in c.modules() if isinstance(m, BatchSplitStage))
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 10, (args.batch,))

    def mode(parallel: bool) -> Callable[[], None]:
        def set_mode() -> None:
            stage.parallel = parallel

        return set_mode

    def nothing() -> None:
        return None

    print(
        f"{args.model}, batch {args.batch}, {args.size}x{args.size}, {args.width}-way batch "
        f"split, bn_mode {args.bn_mode}, torch threads 1, {args.iters} iterations (medians, "
        "interleaved)"
    )
    for what, make in (
        ("forward (no_grad)", lambda m, b: forward_fn(m, x, b)),
        ("train step", lambda m, b: step_fn(m, x, y, b)),
    ):
        t = race(
            {
                "eager": make(eager, nothing),
                "sequential": make(c, mode(False)),
                "parallel": make(c, mode(True)),
            },
            args.iters,
        )
        ms = {k: v * 1e3 for k, v in t.items()}
        print(
            f"{what:18s} eager {ms['eager']:7.1f} ms  sequential {ms['sequential']:7.1f} ms  "
            f"parallel {ms['parallel']:7.1f} ms  | sequential/parallel "
            f"{t['sequential'] / t['parallel']:.2f}x  "
            f"eager/parallel {t['eager'] / t['parallel']:.2f}x"
        )
    c.close()


if __name__ == "__main__":
    main()
