"""The stage engine's cost per schedule action, measured where compute is nearly free.

A pipeline step runs ``F``, ``B`` (and ``W``) actions; besides its nodes' kernels each
action costs the engine host work: choosing it, waiting for and unpacking its inputs,
autograd's setup, handing its outputs on. A model whose ops are tiny (an 8-layer,
16-wide MLP) shows that work alone. This trains it on two CPU devices, in the local
runtime (one thread per device) and on two gloo ranks (``--ranks``), under 1F1B and
ZB-H1 with 1, 4 and 16 micro-batches, and prints each measured step beside the
simulator's, then the per-action cost that fits the gap (least squares over the
rows: the gap ÷ the actions on the busiest device). Since the simulator prices the
engine's cost per action (``calibration.action_overhead_s``) that residual is
what the price still misses.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/action_overhead.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/action_overhead.py --ranks
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import crosscut
from crosscut.cpu_malloc import keep_freed_memory
from crosscut.ir.plan import Plan

__all__ = ["main", "mlp"]

SCHEDULES = ("1f1b", "zb-h1")
MICROBATCHES = (1, 4, 16)


def mlp() -> nn.Module:
    """Eight 16-wide layers: each action's kernels take microseconds."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(16, 10))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 16, generator=g), torch.randint(0, 10, (64,), generator=g)


def _steps(step: object, warmup: int, steps: int) -> float:
    assert callable(step)
    for _ in range(warmup):
        step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t) / steps


def local_step(plan: Plan, steps: int) -> float:
    """Seconds per training step of ``plan`` in the local runtime."""
    x, y = _data()
    c = crosscut.compile(mlp(), ["cpu", "cpu"], x, plan=plan)
    opt = torch.optim.SGD(c.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad()
        c.train_step(x, y, nn.functional.cross_entropy)
        opt.step()

    return _steps(step, 5, steps)


def _worker(plan_path: str, report: str, steps: int) -> None:
    import torch.distributed as dist

    import crosscut.distributed as cd

    torch.set_num_threads(1)
    ctx = cd.init(timeout_s=120)
    x, y = _data()
    pipe = cd.compile_distributed(mlp(), x, plan_path, timeout_s=120)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad()
        pipe.train_step(x, y, nn.functional.cross_entropy)
        opt.step()

    for _ in range(5):
        step()
    dist.barrier()
    took = _steps(step, 0, steps)
    dist.barrier()
    if ctx.rank == 0:
        Path(report).write_text(json.dumps({"step_s": took}))
    dist.destroy_process_group()


def ranks_step(plan: Plan, steps: int) -> float:
    """Seconds per training step of ``plan`` on two gloo ranks (one thread each)."""
    from crosscut.cli.launch import free_port

    with tempfile.TemporaryDirectory() as tmp:
        path, report = Path(tmp) / "plan.json", Path(tmp) / "report.json"
        plan.save(str(path))
        port = free_port()
        procs = []
        for r in range(2):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1")  # fmt: skip
            cmd = [sys.executable, __file__, "--worker", str(path), str(report), str(steps)]
            procs.append(subprocess.Popen(cmd, env=env))
        for p in procs:
            if p.wait(timeout=300) != 0:
                raise SystemExit(f"a rank failed with exit status {p.returncode}")
        return float(json.loads(report.read_text())["step_s"])


def busiest_actions(plan: Plan) -> int:
    """Actions on the device that runs the most of them (F, B and, split, W)."""
    per_device = plan.options.microbatches * (3 if plan.options.schedule.startswith("zb") else 2)
    return per_device * (plan.num_stages // len({d for s in plan.stages for d in s.devices}))


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", action="store_true", help="two gloo ranks, not threads")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.worker:
        _worker(ns.worker[0], ns.worker[1], int(ns.worker[2]))
        return {}
    torch.set_num_threads(1)
    x, _ = _data()
    where = "2 gloo ranks" if ns.ranks else "local runtime, 2 threads"
    # each runtime's links: gloo on loopback between ranks, a memory copy between threads
    devices: str | list[str] = "2xcpu-gloo" if ns.ranks else ["cpu", "cpu"]
    print(f"8x16 MLP, batch 64, 2 CPU devices ({where}); simulated with the current model")
    print(f"{'schedule':8} {'M':>3} {'measured':>9} {'simulated':>9} {'ratio':>6} {'actions':>7}")
    gaps: list[tuple[float, int]] = []
    ratios: dict[str, float] = {}
    for schedule in SCHEDULES:
        for m in MICROBATCHES:
            plan = crosscut.partition(mlp(), devices, x, microbatches=m, replicas=1,
                                      require_all_devices=True, schedule=schedule)  # fmt: skip
            took = ranks_step(plan, ns.steps) if ns.ranks else local_step(plan, ns.steps)
            sim = plan.predicted.step_time_s
            n = busiest_actions(plan)
            gaps.append((took - sim, n))
            ratios[f"{schedule} M={m}"] = took / sim
            print(f"{schedule:8} {m:3d} {took * 1e3:7.2f}ms {sim * 1e3:7.2f}ms "
                  f"{took / sim:6.2f} {n:7d}", flush=True)  # fmt: skip
    per_action = sum(g * n for g, n in gaps) / sum(n * n for _, n in gaps)
    print(f"unpriced per action (least squares over the rows): {per_action * 1e3:.3f} ms")
    ratios["per_action_s"] = per_action
    return ratios


if __name__ == "__main__":
    keep_freed_memory()  # every process this script starts (crosscut/cpu_malloc.py)
    main()
