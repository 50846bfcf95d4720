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


def bench_prefetch(batch: int, size: int, iters: int, rounds: int = 5) -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    gm = fx.symbolic_trace(model)
    c = CompiledModule(model, gm, chunks(gm, 1), ["cpu"], "gpipe", 1)
    ready = list(SlowBatches(iters, 0.0, batch, size))  # pre-made: "a loader without the sleep"
    opt = torch.optim.SGD(c.parameters(), lr=0.01)

    skip = 4

    def run(batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Seconds per step in steady state: the clock starts at batch ``skip``.

        Why skip: a fresh DataLoader forks its worker, and for the next few steps
        both processes take copy-on-write page faults on the parent's memory — a
        start-up cost a real epoch of thousands of steps amortises.
        """
        t0 = 0.0
        for i, (xb, yb) in enumerate(batches):
            if i == skip:
                t0 = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(c(xb), yb)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
        return (time.perf_counter() - t0) / (iters - skip)

    run(ready[: skip + 2])  # warm-up
    t_step = statistics.median(run(ready) for _ in range(2))

    def loader(workers: int) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        # Mariana's read stage: batches come from DataLoader worker processes, which
        # sleep "disk + decode" as long as a step without holding this process's GIL
        data = SlowBatches(iters, t_step, batch, size)
        return torch.utils.data.DataLoader(data, batch_size=None, num_workers=workers)

    # the same loop fed three ways, interleaved round by round so that the VM's
    # drifts hit all three alike; medians reported
    alone, plain, pref = [], [], []
    for _ in range(rounds):
        alone.append(run(ready))
        plain.append(run(loader(0)))  # read in this process: nothing overlaps
        pref.append(run(Prefetcher(loader(1), c, depth=2)))  # worker + prefetcher
    a, p, f = (statistics.median(v) for v in (alone, plain, pref))
    print(f"\nprefetch (resnet18/10 classes, batch={batch}, loader sleeps {t_step * 1e3:.1f} ms)")
    print(f"  no loader (batches in memory) {a * 1e3:8.1f} ms")
    print(f"  loader in-process             {p * 1e3:8.1f} ms  x{p / a:5.3f}")
    print(f"  worker + Prefetcher           {f * 1e3:8.1f} ms  x{f / a:5.3f} (target <= 1.10)")
    print("  per round: " + ", ".join(f"x{x / y:.3f}" for x, y in zip(pref, alone)))


def bench_simulated(names: list[str], batch: int, size: int, micro: int, iters: int) -> None:
    """Local 2-stage pipeline (a worker thread per stage, one intra-op thread each) vs the
    simulator's step time for the same plan, with eager on one thread beside it.

    Why one thread per op: the two stage threads then each get a core, as two GPUs
    would each run their stage, so the simulator's parallel-devices model applies.
    """
    import crosscut
    from crosscut.partitioner.simulate import simulate

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    print(f"\nlocal pipeline vs simulator: batch={batch} {size}x{size}, M={micro}, 1f1b, "
          "2 stage threads x 1 op thread; eager: 1 thread, full batch")  # fmt: skip
    print(f"  {'model':<10} {'eager s':>8} {'pipe s':>8} {'speedup':>8} {'sim s':>8} "
          f"{'pipe/sim':>9} (target within 15 %)")  # fmt: skip
    for name in names:
        torch.manual_seed(0)
        kw = {"aux_logits": False, "init_weights": False} if name == "googlenet" else {}
        model = torchvision.models.get_model(name, weights=None, **kw)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(batch, 3, size, size, generator=gen)
        y = torch.randint(0, 1000, (batch,), generator=gen)
        plan = crosscut.partition(
            model, ["cpu", "cpu"], x, microbatches=micro, schedule="1f1b",
            cost="profiled", require_all_devices=True,
        )  # fmt: skip
        sim = simulate(plan).step_time_s
        c = crosscut.compile(model, ["cpu", "cpu"], x, plan=plan, microbatches=micro,
                             schedule="1f1b")  # fmt: skip
        med = race({"eager": step_fn(model, x, y), "pipe": pipelined_step_fn(c, x, y)}, iters, 1)
        c.close()
        e, p = med["eager"], med["pipe"]
        print(f"  {name:<10} {e:8.2f} {p:8.2f} {e / p:7.2f}x {sim:8.2f} {p / sim:9.2f}")
    torch.set_num_threads(before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["resnet18", "resnet50"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    ap.add_argument("--sim-models", nargs="*", default=[], help="local pipeline vs simulator")
    ap.add_argument("--sim-batch", type=int, default=64)
    ap.add_argument("--sim-size", type=int, default=128)
    ap.add_argument("--sim-micro", type=int, default=8)
    ap.add_argument("--sim-iters", type=int, default=3)
    ap.add_argument("--no-prefetch", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for name in args.models:
        bench_model(name, args.batch, args.size, args.iters, args.micro)
    if args.sim_models:
        bench_simulated(args.sim_models, args.sim_batch, args.sim_size, args.sim_micro,
                        args.sim_iters)  # fmt: skip
    if not args.no_prefetch:
        bench_prefetch(args.batch, args.size, args.iters)


if __name__ == "__main__":
    main()
