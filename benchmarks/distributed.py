"""Distributed pipeline vs eager on one machine: 2 ranks × 1 thread vs 1 process × 1 thread.

Why: a 2-stage pipeline on two cores should approach 2× the throughput of
one core running eager training (bounded by the bubble, M / (M + S - 1), and
by the cost of moving activations over loopback gloo). The benchmark also
prints the simulator's prediction for the same plan next to the measurement,
so the cost model's error is visible.

Run (about 10 minutes for both models on a 2-core machine, 3 rounds)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/distributed.py \\
        --models resnet50,googlenet --batch 64 --size 128 --microbatches 8

Input is 3×128×128 by default (224×224 runs too, ~3× slower). Each rank is
started with OMP_NUM_THREADS=1 and ``torch.set_num_threads(1)``. ``unet``
(benchmarks/unet.py) is a model name here too. crosscut with default options
(the planner's own choice of replicas, stages and micro-batches) against
DistributedDataParallel and this pipelining peer: ``benchmarks/default_vs_peers.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipelining_peer as peer
import unet

from crosscut.cpu_malloc import keep_freed_memory

__all__ = ["eager_step_time", "main", "pipeline_step_time"]


def build(name: str) -> nn.Module:
    """A torchvision model by name, or ``"unet"`` (benchmarks/unet.py); seeded, so ranks agree."""
    torch.manual_seed(0)
    if name == "unet":
        return unet.UNet()
    kw: dict[str, Any] = {"num_classes": 1000}
    if name in ("googlenet", "inception_v3"):
        kw.update(aux_logits=False, init_weights=False)
    model: nn.Module = torchvision.models.get_model(name, weights=None, **kw)
    return model


def data(batch: int, size: int, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """One global batch: images and targets (class ids; per-pixel ones for ``"unet"``)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, size, size, generator=g)
    if name == "unet":
        return x, unet.targets(batch, size, g)
    return x, torch.randint(0, 1000, (batch,))


def eager_step_time(
    name: str, batch: int, size: int, steps: int, warmup: int, chunks: int = 1
) -> float:
    """Seconds per SGD step of eager training on one thread (batch cut in ``chunks``)."""
    torch.set_num_threads(1)
    model = build(name)
    x, y = data(batch, size, name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        opt.zero_grad()
        for xm, ym in zip(x.chunk(chunks), y.chunk(chunks)):
            loss = nn.functional.cross_entropy(model(xm), ym) / chunks
            loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return sum(times) / len(times)


def _worker(ns: argparse.Namespace) -> int:
    """One rank: compile the plan, time train steps (a barrier before each), rank 0 reports."""
    import torch.distributed as dist

    import crosscut.distributed as cd

    torch.set_num_threads(1)
    ctx = cd.init(timeout_s=300)
    x, y = data(ns.batch, ns.size, ns.worker)
    pipe = cd.compile_distributed(build(ns.worker), x, ns.plan, timeout_s=300)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    times = []
    for i in range(ns.warmup + ns.steps):
        dist.barrier()
        t = time.perf_counter()
        opt.zero_grad()
        pipe.train_step(x, y, nn.functional.cross_entropy)
        opt.step()
        dist.barrier()
        if i >= ns.warmup:
            times.append(time.perf_counter() - t)
    if ctx.rank == 0:
        Path(ns.report).write_text(json.dumps({"step_s": sum(times) / len(times)}))
    dist.destroy_process_group()
    return 0


def pipeline_step_time(name: str, plan_path: Path, ns: argparse.Namespace, ranks: int = 2) -> float:
    """Launch ``ranks`` ranks (1 thread each) of this file as workers; return their mean
    step time."""
    from crosscut.cli.launch import free_port

    report = plan_path.with_suffix(".report.json")
    port = free_port()
    procs = []
    for r in range(ranks):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(ranks),
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        cmd = [sys.executable, __file__, "--worker", name, "--plan", str(plan_path),
               "--report", str(report), "--batch", str(ns.batch), "--size", str(ns.size),
               "--steps", str(ns.steps), "--warmup", str(ns.warmup)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env))
    for p in procs:
        if p.wait(timeout=ns.timeout) != 0:
            raise SystemExit(f"a worker failed with exit status {p.returncode}")
    return float(json.loads(report.read_text())["step_s"])


def capacity(name: str, ns: argparse.Namespace, alone: float) -> float:
    """How many cores' worth of throughput ``ns.ranks`` concurrent 1-thread processes
    really get.

    2.0 for 2 ranks on two free physical cores; near 1.0 where the two vCPUs
    share one core or memory bandwidth. The pipeline's speedup cannot exceed it.
    """
    cmd = [sys.executable, __file__, "--eager-only", name, "--batch", str(ns.batch),
           "--size", str(ns.size), "--steps", "1", "--warmup", "1",
           "--microbatches", str(ns.microbatches)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    n = ns.ranks
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    each = [float(p.communicate(timeout=ns.timeout)[0].split()[-1]) for p in procs]
    return n * alone / max(each)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,googlenet")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved measurement rounds")
    ap.add_argument("--cost", default="analytic", choices=["analytic", "profiled"])
    ap.add_argument("--ranks", type=int, default=2, help="gloo ranks, one stage each")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--worker", default="")
    ap.add_argument("--eager-only", default="")
    ap.add_argument("--plan", default="")
    ap.add_argument("--report", default="")
    ap.add_argument("--peer", action="store_true", help="also time torch.distributed.pipelining")
    ap.add_argument("--peer-tries", type=int, default=5, help="split points tried for its best")
    ap.add_argument(
        "--peer-schedule",
        type=peer.schedule_names,
        action="extend",
        help="the peer's torch schedules, comma-separated or repeated: "
        f"{', '.join(peer.SCHEDULES)} (default 1f1b)",
    )
    ap.add_argument("--peer-worker", default="")
    ap.add_argument("--split", default="")
    ns = ap.parse_args(argv)
    ns.peer_schedule = list(dict.fromkeys(ns.peer_schedule or ["1f1b"]))
    if ns.worker:
        return _worker(ns)
    if ns.peer_worker:
        return peer.worker(ns, build, data)
    if ns.eager_only:
        m = ns.microbatches
        print(eager_step_time(ns.eager_only, ns.batch, ns.size, ns.steps, ns.warmup, m))
        return 0
    from crosscut.api import partition
    from crosscut.partitioner.simulate import simulate

    torch.set_num_threads(1)
    rows = []
    peer_rows: list[tuple[str, str, str, str, float, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ns.models.split(","):
            x, _ = data(ns.batch, ns.size)
            plan = partition(
                build(name),
                f"{ns.ranks}xcpu-gloo",  # the ranks' links: gloo on loopback
                x,
                microbatches=ns.microbatches,
                schedule=ns.schedule,
                cost=ns.cost,
                require_all_devices=True,
            )
            path = plan.save(Path(tmp) / f"{name}.json")
            sim = simulate(plan)
            kind = plan.cluster.devices[0].kind
            one_device = sum(n.time_s[kind] for n in plan.nodes) * ns.microbatches
            # the three measurements interleaved round by round, so that the VM's
            # drifts hit all of them alike; medians reported, each round's speed-up too
            eagers, micros, pipes = [], [], []
            splits = _peer_splits(name, ns, Path(tmp)) if ns.peer else {}
            peer_times: dict[tuple[str, str], list[float]] = {k: [] for k in splits}
            for r in range(ns.rounds):
                eagers.append(eager_step_time(name, ns.batch, ns.size, ns.steps, ns.warmup))
                micros.append(
                    eager_step_time(name, ns.batch, ns.size, ns.steps, ns.warmup, ns.microbatches)
                )
                pipes.append(pipeline_step_time(name, path, ns, ns.ranks))
                for (sched, label), split in splits.items():
                    if not split:  # no split of this kind (refused while choosing): nothing to time
                        peer_times[sched, label].append(float("nan"))
                        continue
                    got = peer.peer_step_time(__file__, name, split, ns, Path(tmp), sched)
                    peer_times[sched, label].append(got.get("step_s", float("nan")))
                    print(f"  {name} round {r + 1}: pipelining {sched} {label} split at {split}: "
                          f"{got.get('step_s', float('nan')):.2f} s {got.get('error', '')}",
                          flush=True)  # fmt: skip
                print(
                    f"  {name} round {r + 1}/{ns.rounds}: eager {eagers[-1]:.2f} s, "
                    f"eager/M {micros[-1]:.2f} s, pipeline {pipes[-1]:.2f} s "
                    f"({eagers[-1] / pipes[-1]:.2f}x)",
                    flush=True,
                )
            eager, micro, piped = (statistics.median(v) for v in (eagers, micros, pipes))
            cap = capacity(name, ns, micro)
            rows.append((name, eager, micro, piped, cap, one_device, sim.step_time_s))
            for (sched, label), split in splits.items():
                ran = [v for v in peer_times[sched, label] if v == v]  # NaN: a failed round
                t = statistics.median(ran) if ran else float("nan")
                peer_rows.append((name, label, sched, split or "-", t, piped, eager))
    print(
        f"\n{ns.batch}x3x{ns.size}x{ns.size}, {ns.microbatches} micro-batches, "
        f"{ns.schedule}, costs {ns.cost}; {ns.ranks} ranks x 1 thread vs 1 process x 1 thread"
    )
    print(
        "eager = full batch; eager/M = the same micro-batches in sequence; capacity = "
        "cores' worth of throughput that many concurrent 1-thread processes get on this machine"
    )
    print(
        f"{'model':<10} {'eager s':>8} {'eager/M':>8} {'pipe s':>8} {'speedup':>8} "
        f"{'vs /M':>6} {'capacity':>8} | {'sim 1dev':>8} {'sim pipe':>8} {'sim spd':>8} "
        f"| {'pipe/sim':>8}"
    )
    for name, eager, micro, piped, cap, one, sim_step in rows:
        print(
            f"{name:<10} {eager:8.2f} {micro:8.2f} {piped:8.2f} {eager / piped:7.2f}x "
            f"{micro / piped:5.2f}x {cap:7.2f}x | {one:8.2f} {sim_step:8.2f} "
            f"{one / sim_step:7.2f}x | {piped / sim_step:8.2f}"
        )
    if peer_rows:
        used = ", ".join(peer.SCHEDULES[k].torch_name for k in ns.peer_schedule)
        print(f"\ntorch.distributed.pipelining (pipeline() + {used}), same job, medians "
              f"(crosscut ran {ns.schedule}; nan: refused or failed, see the rounds):")  # fmt: skip
        at = max(14, *(len(row[3]) for row in peer_rows))  # 3 cuts for 2 pieces per rank
        print(f"{'model':<10} {'split':<22} {'schedule':<16} {'at':<{at}} {'peer s':>8} "
              f"{'crosscut s':>10} {'peer/crosscut':>13} {'eager/peer':>10}")  # fmt: skip
        for name, label, sched, split, t, piped, eager in peer_rows:
            print(f"{name:<10} {label:<22} {sched:<16} {split:<{at}} {t:8.2f} {piped:10.2f} "
                  f"{t / piped:12.2f}x {eager / t:9.2f}x")  # fmt: skip
    return 0


def _peer_splits(name: str, ns: argparse.Namespace, tmp: Path) -> dict[tuple[str, str], str]:
    """Per peer schedule, its parameter-balanced cuts and its best of ``--peer-tries`` tried ones.

    Keys are (schedule, label); values the cuts, comma-separated ("" where no
    cut list could be made, e.g. a model with fewer candidates than pieces).
    A tried cut list torch refuses counts as infinitely slow; its error is
    printed, and the run goes on.
    """
    x, _ = data(ns.batch, ns.size)
    cands = peer.candidates(build(name), x[: ns.batch // ns.microbatches])
    trial = argparse.Namespace(**{**vars(ns), "steps": 1, "warmup": 1})
    out: dict[tuple[str, str], str] = {}
    for sched in ns.peer_schedule:
        pieces = peer.SCHEDULES[sched].pieces(ns.ranks)
        try:
            balanced = ",".join(peer.balanced_splits(cands, pieces))
        except ValueError as e:
            print(f"  {name}: pipelining {sched}: no parameter-balanced split: {e}", flush=True)
            balanced = ""
        tried: dict[str, float] = {}
        for cuts in peer.tried_splits(cands, pieces, ns.peer_tries):
            split = ",".join(cuts)
            shares = "/".join(f"{c[2]:.0%}" for c in cands if c[0] in cuts)
            got = peer.peer_step_time(__file__, name, split, trial, tmp, sched)
            tried[split] = got.get("step_s", float("inf"))
            took = got.get("step_s", float("nan"))
            print(f"  {name}: pipelining trial split at {split} under {sched} ({shares} of the "
                  f"forward before): {took:.2f} s {got.get('error', '')}", flush=True)  # fmt: skip
        ran = [k for k in tried if tried[k] < float("inf")]
        best = min(ran, key=lambda k: tried[k]) if ran else ""
        print(f"  {name}: pipelining {sched}: parameter-balanced split at {balanced or '-'}; "
              f"best of {len(tried)} tried: {best or '- (none ran)'}", flush=True)  # fmt: skip
        out[sched, "parameter-balanced"] = balanced
        out[sched, f"best of {len(tried)} tried"] = best
    return out


if __name__ == "__main__":
    # every process this script starts, the baselines too (DDP, eager, the peer):
    # they run with the allocator crosscut's CPU ranks use, so the comparison is fair
    keep_freed_memory()
    raise SystemExit(main())
