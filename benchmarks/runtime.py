"""Runtime overheads, measured side by side in one run (CPU friendly).

1. One-stage CompiledModule vs eager: train step time (forward, backward,
   SGD step); target overhead <= 5 %.
2. 2- and 4-stage pipelines (``["cpu"] * k``, 1F1B, M micro-batches) vs eager:
   throughput recorded (on one CPU socket the stages share cores, so this
   measures executor overhead and threading, not a device speed-up).
3. Prefetcher: a loader that sleeps as long as a step; step time with the
   prefetcher vs the step alone (target within 10 %), and without it.

Timings alternate between variants each iteration so machine noise hits
both alike; medians are reported.

    .venv/bin/python benchmarks/runtime.py --models resnet18 resnet50 --batch 8 --size 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterable, Iterator

import torch
import torchvision
from torch import fx, nn

from crosscut.runtime import CompiledModule, Prefetcher

__all__ = ["main"]

SKIP = ("placeholder", "output", "get_attr")


def chunks(gm: fx.GraphModule, k: int) -> dict[str, int]:
    comp = [n.name for n in gm.graph.nodes if n.op not in SKIP]
    return {name: i * k // len(comp) for i, name in enumerate(comp)}


def step_fn(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(module.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()

    return step


def pipelined_step_fn(c: CompiledModule, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(c.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad()
        c.train_step(x, y, nn.functional.cross_entropy)
        opt.step()

    return step


def race(fns: dict[str, Callable[[], None]], iters: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(warmup + iters):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_model(name: str, batch: int, size: int, iters: int, micro: int) -> None:
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None)
    gm = fx.symbolic_trace(model)
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 1000, (batch,))
    fns = {"eager": step_fn(model, x, y)}
    c1 = CompiledModule(model, gm, chunks(gm, 1), ["cpu"], "gpipe", 1)
    fns["compiled k=1"] = step_fn(c1, x, y)
    for k in (2, 4):
        ck = CompiledModule(model, gm, chunks(gm, k), ["cpu"] * k, "1f1b", micro)
        fns[f"k={k} fwd+bwd M={micro}"] = step_fn(ck, x, y)
        fns[f"k={k} train_step 1f1b M={micro}"] = pipelined_step_fn(ck, x, y)
    med = race(fns, iters)
    base = med["eager"]
    print(f"\n{name} batch={batch} {size}x{size} threads={torch.get_num_threads()}")
    for key, t in med.items():
        print(
            f"  {key:<28} {t * 1e3:8.1f} ms/step  {batch / t:7.1f} img/s  x{t / base:5.3f} vs eager"
        )
    print(
        f"  -> one-stage overhead: {100 * (med['compiled k=1'] / base - 1):+.1f} % (target <= 5 %)"
    )


class SlowBatches(torch.utils.data.IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """``count`` batches, each taking ``delay`` seconds to "read"."""

    def __init__(self, count: int, delay: float, batch: int, size: int) -> None:
        self.count, self.delay, self.batch, self.size = count, delay, batch, size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(0)
        for _ in range(self.count):
            time.sleep(self.delay)
            x = torch.randn(self.batch, 3, self.size, self.size, generator=gen)
            yield x, torch.randint(0, 10, (self.batch,), generator=gen)


def bench_prefetch(batch: int, size: int, iters: int) -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    gm = fx.symbolic_trace(model)
    c = CompiledModule(model, gm, chunks(gm, 1), ["cpu"], "gpipe", 1)
    y = torch.randint(0, 10, (batch,))
    step = step_fn(c, torch.randn(batch, 3, size, size), y)
    for _ in range(2):
        step()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    t_step = (time.perf_counter() - t0) / iters

    def loader(workers: int) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        # Mariana's read stage: batches come from DataLoader worker processes, which
        # sleep "disk + decode" as long as a step without holding this process's GIL
        data = SlowBatches(iters, t_step, batch, size)
        return torch.utils.data.DataLoader(data, batch_size=None, num_workers=workers)

    def run(batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Seconds per step in steady state: the clock starts once batch 0 is in hand."""
        opt = torch.optim.SGD(c.parameters(), lr=0.01)
        t0 = 0.0
        for i, (xb, yb) in enumerate(batches):
            if i == 0:
                t0 = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(c(xb), yb)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
        return (time.perf_counter() - t0) / (iters - 1)

    t_plain = run(loader(0))  # read in this process: nothing overlaps
    t_pref = run(Prefetcher(loader(1), c, depth=2))  # read in a worker, staged by the prefetcher
    print(f"\nprefetch (resnet18/10 classes, batch={batch}, loader sleeps {t_step * 1e3:.1f} ms)")
    print(f"  step alone           {t_step * 1e3:8.1f} ms")
    print(f"  loader in-process    {t_plain * 1e3:8.1f} ms  x{t_plain / t_step:5.3f}")
    print(
        f"  worker + Prefetcher  {t_pref * 1e3:8.1f} ms  x{t_pref / t_step:5.3f} (target <= 1.10)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["resnet18", "resnet50"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for name in args.models:
        bench_model(name, args.batch, args.size, args.iters, args.micro)
    bench_prefetch(args.batch, args.size, args.iters)


if __name__ == "__main__":
    main()
