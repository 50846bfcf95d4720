"""How good is the cost model? Profiled per-node times and predicted memory vs the real thing.

For each model at the given batch on the CPU, in one run:

* time: sum over nodes of profiled forward+backward seconds (``profile_costs``)
  vs the median wall time of whole-model forward+backward steps; the analytic
  CPU preset (``analytic_costs`` on ``Cluster.from_spec("1xcpu")``) is checked the
  same way (``analytic s`` / ``an err %``);
* memory: the memory model's training peak (``peak_memory``, one plain step,
  gradients appearing during backward) vs the peak that
  ``torch.distributed._tools.mem_tracker.MemTracker`` records for a real step
  (params, buffers, grads, optimizer state, activations, temporaries).

Targets: profiled time within 10 %, memory within 15 %.
Run: ``.venv/bin/python benchmarks/cost_model.py`` (``--models resnet50 --batch 4``
for a quick check).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torchvision

from crosscut.cost_models.analytic import analytic_costs
from crosscut.cost_models.cluster import Cluster
from crosscut.cost_models.memory import peak_memory
from crosscut.cost_models.profiled import profile_costs
from crosscut.cpu_malloc import keep_freed_memory
from crosscut.frontend.tracer import trace

__all__ = ["main", "measure_peak", "measure_step"]


def _loss(out: Any) -> torch.Tensor:
    """Sum of every tensor the model returns (GoogLeNet returns aux logits in train mode)."""
    if isinstance(out, torch.Tensor):
        return out.sum()
    return sum((_loss(o) for o in out), torch.zeros(()))


def measure_step(model: torch.nn.Module, x: torch.Tensor, steps: int) -> float:
    """Median seconds of forward+backward (no optimizer), after two warm-up steps."""
    times: list[float] = []
    for i in range(steps + 2):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        _loss(model(x)).backward()  # type: ignore[no-untyped-call]
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_peak(model: torch.nn.Module, x: torch.Tensor, optimizer: str) -> int:
    """Peak bytes of the second training step (optimizer state exists by then)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    opt: torch.optim.Optimizer
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(
            model.parameters(), lr=1e-3, momentum=0.9 if optimizer == "momentum" else 0
        )
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            batch = x.clone()
            _loss(model(batch)).backward()  # type: ignore[no-untyped-call]
            opt.step()
            del batch
            if step == 0:
                tracker.reset_mod_stats()
    snap = tracker.get_tracker_snapshot("peak")
    return int(sum(int(v["Total"]) for v in snap.values()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,googlenet,vgg16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3, help="timed whole-model steps")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per node when profiling")
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "momentum", "adam"])
    ap.add_argument("--no-cache", action="store_true")
    args = ap.parse_args(argv)
    keep_freed_memory()  # the allocator profiles and crosscut's CPU runs use (cpu_malloc.py)
    torch.manual_seed(0)
    rows: list[tuple[str, float, float, float, float, float, float, float, float]] = []
    for name in args.models.split(","):
        kwargs: dict[str, Any] = {"weights": None}
        if name == "googlenet":
            kwargs["init_weights"] = False
        model = getattr(torchvision.models, name)(**kwargs).train()
        x = torch.randn(args.batch, 3, 224, 224)
        graph = trace(model, x, mode="train")
        table = profile_costs(
            graph,
            "cpu",
            repeats=args.repeats,
            warmup=1,
            cache_dir=None if args.no_cache else ".crosscut-cache",
        )
        predicted_t = table.total("cpu", "train")
        analytic_t = analytic_costs(graph, Cluster.from_spec("1xcpu")).total("cpu", "train")
        measured_t = measure_step(model, x, args.steps)
        predicted_m = peak_memory(graph, optimizer=args.optimizer, grads_resident=False)
        predicted_m += x.numel() * x.element_size()  # the batch clone the step allocates
        measured_m = measure_peak(model, x, args.optimizer)
        rows.append(
            (
                name,
                predicted_t,
                measured_t,
                100 * (predicted_t - measured_t) / measured_t,
                predicted_m / 2**20,
                measured_m / 2**20,
                100 * (predicted_m - measured_m) / measured_m,
                analytic_t,
                100 * (analytic_t - measured_t) / measured_t,
            )
        )
        print(f"done {name}", flush=True)
    print(f"\nbatch {args.batch}, optimizer {args.optimizer}, {torch.get_num_threads()} threads")
    head = ("model", "sum node s", "step s", "err %", "pred MiB", "meas MiB", "err %",
            "analytic s", "an err %")  # fmt: skip
    print(f"{head[0]:<10} " + " ".join(f"{h:>10}" for h in head[1:]))
    for r in rows:
        nums = (
            f"{r[1]:.3f}",
            f"{r[2]:.3f}",
            f"{r[3]:+.1f}",
            f"{r[4]:.0f}",
            f"{r[5]:.0f}",
            f"{r[6]:+.1f}",
            f"{r[7]:.3f}",
            f"{r[8]:+.1f}",
        )
        print(f"{r[0]:<10} " + " ".join(f"{v:>10}" for v in nums))


if __name__ == "__main__":
    main()
