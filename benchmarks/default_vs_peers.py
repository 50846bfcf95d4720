"""crosscut with default options vs DistributedDataParallel and torch.distributed.pipelining.

Why (issue 23): what a user gets from ``crosscut.compile(model, "torchrun", x)``
with no options on 2 gloo ranks × 1 thread must be at least as fast as what
the same user gets from the two peers they would otherwise pick:

* **crosscut default**: each rank calls ``crosscut.distributed.init()`` and
  ``crosscut.compile(model, "torchrun", x)`` — no option but ``cost="profiled"``
  for the profiled run — then trains; rank 0 reports what the planner chose
  (replicas R, stages S, micro-batches M, schedule, predicted step).
* **DDP**: ``DistributedDataParallel`` on the same 2 ranks, each on half of the
  global batch cut into ``max(1, R·M/2)`` micro-batches (crosscut's micro-batch
  size where it can be), gradients accumulated under ``no_sync()`` for all but
  the last (plain DDP for one micro-batch).
* **pipelining**: ``benchmarks/pipelining_peer.py`` (``pipeline()`` +
  ``Schedule1F1B``, ``--peer-microbatches``) at its best tried split: the
  ``--peer-tries`` module boundaries nearest the middle of the forward are each
  timed once before the rounds, the fastest is kept.

Every run is a fresh pair of processes (``OMP_NUM_THREADS=1``, a timeout,
both killed on a hang) timing ``--steps`` SGD steps after ``--warmup``, a
barrier before and after each; the runs go round by round (analytic,
profiled, DDP, pipelining; then again) so the shared VM's drifts hit all of
them alike. A row's verdict: crosscut's median ≤ the faster peer's median +
the spread between rounds (the larger max − min of the two series).

Run (a few minutes per model and round at this size, 2-core machine)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/default_vs_peers.py \\
        --models resnet50,googlenet,densenet121,unet --batch 64 --size 128 --rounds 2
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
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipelining_peer as peer
from distributed import build, data

from crosscut.cpu_malloc import keep_freed_memory

__all__ = ["crosscut_worker", "ddp_microbatches", "ddp_worker", "main", "verdict"]

NAN = float("nan")


def _timed_steps(ns: argparse.Namespace, step: Any) -> list[float]:
    """Seconds of each timed ``step()`` (SGD step included), a barrier before and after."""
    import torch.distributed as dist

    times = []
    for i in range(ns.warmup + ns.steps):
        dist.barrier()
        t = time.perf_counter()
        step()
        dist.barrier()
        if i >= ns.warmup:
            times.append(time.perf_counter() - t)
    return times


def crosscut_worker(ns: argparse.Namespace) -> int:
    """One rank of crosscut as a user runs it: init, compile with defaults, train."""
    import torch.distributed as dist

    import crosscut
    import crosscut.distributed

    torch.set_num_threads(1)
    # crosscut's default wait (300 s) unless --init-timeout: on a loaded VM rank 0's profiling
    # can outlast it while the other ranks wait for the plan (docs/BENCHMARKS.md, issue 23)
    ctx = crosscut.distributed.init(**({"timeout_s": ns.init_timeout} if ns.init_timeout else {}))
    model = build(ns.model)
    x, y = data(ns.batch, ns.size, ns.model)
    t0 = time.perf_counter()
    if ns.cost == "analytic":  # the default: not even cost= is passed
        pipe = crosscut.compile(model, "torchrun", x)
    else:
        pipe = crosscut.compile(model, "torchrun", x, cost=ns.cost)
    compile_s = time.perf_counter() - t0
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad()
        pipe.train_step(x, y, F.cross_entropy)
        opt.step()

    times = _timed_steps(ns, step)
    if ctx.rank == 0:
        chose = _chose(pipe)
        report = {"step_s": statistics.mean(times), "times": times, "compile_s": compile_s}
        Path(ns.report).write_text(json.dumps({**report, "chose": chose}))
    dist.destroy_process_group()
    return 0


def _chose(pipe: Any) -> dict[str, Any]:
    """What the planner chose, read from the returned pipeline's plan.

    ``running_replicas`` is what the runtime started (``pipe.replicas``), the
    plan's own count where the pipeline does not say.
    """
    plan = pipe.plan
    replicas = int(plan.replication.replicas)
    return {
        "replicas": replicas,
        "running_replicas": int(getattr(pipe, "replicas", replicas)),
        "stages": int(plan.num_stages),
        "microbatches": int(plan.options.microbatches),
        "schedule": str(plan.options.schedule),
        "predicted_step_s": float(plan.predicted.step_time_s),
        "cost_source": str(plan.options.cost_source),
    }


def ddp_worker(ns: argparse.Namespace) -> int:
    """One DDP rank: half the global batch in ``ns.ddp_m`` micro-batches, ``no_sync`` on all
    but the last (one all-reduce per step, as crosscut's replicas do)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DDP(build(ns.model))
    x, y = data(ns.batch, ns.size, ns.model)
    xs, ys = x.chunk(world)[rank].chunk(ns.ddp_m), y.chunk(world)[rank].chunk(ns.ddp_m)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad()
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            with ddp.no_sync() if i < len(xs) - 1 else nullcontext():
                loss = F.cross_entropy(ddp(xm), ym) / len(xs)
                loss.backward()  # type: ignore[no-untyped-call]
        opt.step()

    times = _timed_steps(ns, step)
    if rank == 0:
        Path(ns.report).write_text(json.dumps({"step_s": statistics.mean(times), "times": times}))
    dist.destroy_process_group()
    return 0


def ddp_microbatches(chose: dict[str, Any], world: int = 2) -> int:
    """DDP's micro-batches per rank for crosscut's micro-batch size: R·M / world, at least 1.

    crosscut's micro-batch is ``batch / (R·M)``; a DDP rank holds ``batch /
    world``, so it needs ``R·M / world`` of them. Where crosscut's micro-batch
    is larger than a DDP rank's half (R·M < world), DDP runs its half whole.
    """
    return max(1, int(chose["replicas"]) * int(chose["microbatches"]) // world)


def _launch(args: list[str], ns: argparse.Namespace, tmp: Path, tag: str) -> dict[str, Any]:
    """Two ranks of this file with ``args``; rank 0's report, or ``{"error": ...}``.

    Output goes to files (a full pipe would block a rank inside a collective);
    on a failure or past ``--timeout`` both ranks are killed.
    """
    from crosscut.cli.launch import free_port

    report, port = tmp / f"{tag}.json", free_port()
    report.unlink(missing_ok=True)
    procs, logs = [], []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")  # fmt: skip
        cmd = [sys.executable, __file__, *args, "--report", str(report), "--batch",
               str(ns.batch), "--size", str(ns.size), "--steps", str(ns.steps),
               "--warmup", str(ns.warmup)]  # fmt: skip
        log = tmp / f"{tag}.rank{r}.log"
        with log.open("w") as f:
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
        logs.append(log)
    deadline = time.monotonic() + ns.timeout
    while None in [p.poll() for p in procs]:  # a list: every rank polled, none skipped
        failed = any(p.returncode not in (None, 0) for p in procs)
        if failed or time.monotonic() > deadline:
            time.sleep(2 if failed else 0)  # let a failing rank's peer print its side
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.2)
    if all(p.returncode == 0 for p in procs) and report.exists():
        got: dict[str, Any] = json.loads(report.read_text())
        return got
    if any(p.returncode == -9 for p in procs) and time.monotonic() > deadline:
        return {"error": f"timed out after {ns.timeout:g} s"}
    errors = []
    for r, (p, log) in enumerate(zip(procs, logs)):
        if p.returncode not in (0, -9):
            lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
            errors.append(f"rank {r}: " + (lines[-1][:200] if lines else f"exit {p.returncode}"))
    errors.sort(key=lambda e: "Connection closed" in e)  # the cause, not its peer's echo
    return {"error": errors[0] if errors else "no report"}


def _best_split(name: str, ns: argparse.Namespace, tmp: Path) -> str:
    """The pipelining peer's fastest of ``--peer-tries`` splits near the forward's middle."""
    x, _ = data(ns.batch, ns.size, name)
    cands = peer.candidates(build(name), x[: ns.batch // ns.peer_microbatches])
    near = sorted(cands, key=lambda c: abs(c[2] - 0.5))[: ns.peer_tries]
    trial = argparse.Namespace(**{**vars(ns), "steps": 1, "warmup": 1})
    tried = {}
    for split, _, share in near:
        got = _peer(name, split, trial, tmp)
        tried[split] = got.get("step_s", float("inf"))
        took, err = got.get("step_s", NAN), got.get("error", "")
        print(f"  {name}: pipelining trial split at {split} ({share:.0%} of the forward "
              f"before it): {took:.2f} s {err}", flush=True)  # fmt: skip
    best = min(tried, key=lambda k: tried[k])
    print(f"  {name}: pipelining's best of {len(tried)} tried splits: {best}", flush=True)
    return best


def _peer(name: str, split: str, ns: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """pipelining_peer's launcher at ``--peer-microbatches``."""
    pns = argparse.Namespace(**{**vars(ns), "microbatches": ns.peer_microbatches})
    return peer.peer_step_time(__file__, name, split, pns, tmp)


def _chose_text(chose: dict[str, Any] | None) -> str:
    """``R=2,S=1,M=4,1f1b,pred=2.10s``: one token, so the table splits on whitespace."""
    if not chose:
        return "failed"
    reps = f"R={chose['replicas']}"
    if chose["running_replicas"] != chose["replicas"]:
        reps += f"(ran:{chose['running_replicas']})"
    return (f"{reps},S={chose['stages']},M={chose['microbatches']},{chose['schedule']},"
            f"pred={chose['predicted_step_s']:.2f}s")  # fmt: skip


def _ran(values: list[float]) -> list[float]:
    """The rounds that ran (a failed run is NaN in its series, and shown as nan)."""
    return [v for v in values if v == v]


def verdict(ours: list[float], theirs: list[float]) -> tuple[float, float, bool]:
    """(median ratio, spread, at least as fast): ours ≤ theirs + the larger range over rounds.

    Over the rounds that ran: a failed round drops out rather than failing the row.
    """
    ours, theirs = _ran(ours), _ran(theirs)
    if not ours or not theirs:
        return NAN, NAN, False
    spread = max(max(ours) - min(ours), max(theirs) - min(theirs))
    mine, best = statistics.median(ours), statistics.median(theirs)
    return mine / best, spread, mine <= best + spread


def _per_round(ours: list[float], *peers: list[float]) -> list[float]:
    """Each round's crosscut ÷ the faster peer of that round (NaN where a run failed)."""
    out = []
    for i, mine in enumerate(ours):
        theirs = _ran([p[i] for p in peers if i < len(p)])
        out.append(mine / min(theirs) if theirs else NAN)
    return out


def _series(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values) if values else "-"


def run_model(name: str, ns: argparse.Namespace, tmp: Path) -> list[list[str]]:
    """Interleaved rounds for one model; its table rows (one per crosscut cost source)."""
    split = _best_split(name, ns, tmp) if ns.peer_tries > 0 else ""
    xc: dict[str, list[float]] = {c: [] for c in ns.costs}
    chose: dict[str, dict[str, Any] | None] = {c: None for c in ns.costs}
    ddp: dict[int, list[float]] = {}
    pipe: list[float] = []
    for r in range(ns.rounds):
        load = os.getloadavg()[0]
        for cost in ns.costs:
            args = ["--role", "crosscut", "--model", name, "--cost", cost]
            args += ["--init-timeout", str(ns.init_timeout)]
            got = _launch(args, ns, tmp, f"{name}-xc-{cost}")
            xc[cost].append(got.get("step_s", NAN))
            chose[cost] = got.get("chose") or chose[cost]
            took, err = got.get("step_s", NAN), got.get("error", "")
            print(f"  {name} round {r + 1}: crosscut {cost}: {took:.2f} s/step (compile "
                  f"{got.get('compile_s', NAN):.1f} s) chose {_chose_text(got.get('chose'))} "
                  f"{err}", flush=True)  # fmt: skip
        ms = sorted({ddp_microbatches(c) for c in chose.values() if c} or {1})
        for m in ms:
            got = _launch(["--role", "ddp", "--model", name, "--ddp-m", str(m)], ns, tmp,
                          f"{name}-ddp-{m}")  # fmt: skip
            ddp.setdefault(m, []).append(got.get("step_s", NAN))
            print(
                f"  {name} round {r + 1}: DDP, {m} micro-batch(es) per rank: "
                f"{got.get('step_s', NAN):.2f} s/step {got.get('error', '')}",
                flush=True,
            )
        if split:
            got = _peer(name, split, ns, tmp)
            pipe.append(got.get("step_s", NAN))
            print(f"  {name} round {r + 1}: pipelining split at {split}, "
                  f"M={ns.peer_microbatches}: {pipe[-1]:.2f} s/step {got.get('error', '')}",
                  flush=True)  # fmt: skip
        print(f"  {name} round {r + 1}/{ns.rounds} done (load average at its start "
              f"{load:.1f})", flush=True)  # fmt: skip
    rows = []
    for cost in ns.costs:
        picked = chose[cost]
        m = ddp_microbatches(picked) if picked else 1
        peers = [s for s in (ddp.get(m, []), pipe) if _ran(s)]
        faster = min(peers, key=lambda s: statistics.median(_ran(s))) if peers else []
        ratio, spread, ok = verdict(xc[cost], faster)
        per_round = _per_round(xc[cost], ddp.get(m, []), pipe)
        rows.append([name, cost, _chose_text(chose[cost]), _series(xc[cost]), str(m),
                     _series(ddp.get(m, [])), _series(pipe), _series(per_round), f"{ratio:.2f}",
                     f"{spread:.2f}", "yes" if ok else "no"])  # fmt: skip
    return rows


COLUMNS = ["model", "costs", "crosscut-chose", "crosscut-s", "DDP-M", "DDP-s", "pipelining-s",
           "ratio-per-round", "crosscut/faster-peer", "spread", "at-least-as-fast"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,googlenet,densenet121,unet")
    ap.add_argument("--batch", type=int, default=64, help="global batch")
    ap.add_argument("--size", type=int, default=128, help="input side (3×size×size)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved measurement rounds")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per run")
    ap.add_argument("--costs", default="analytic,profiled", help="crosscut's cost sources")
    ap.add_argument("--peer-microbatches", type=int, default=8)
    ap.add_argument("--peer-tries", type=int, default=4, help="pipelining splits tried; 0: none")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per 2-rank run")
    ap.add_argument("--init-timeout", type=float, default=0,
                    help="crosscut.distributed.init(timeout_s=...); 0: its default")  # fmt: skip
    # worker-side arguments (the driver starts this file again as each rank)
    ap.add_argument("--role", default="", choices=["", "crosscut", "ddp"])
    ap.add_argument("--model", default="")
    ap.add_argument("--cost", default="analytic")
    ap.add_argument("--ddp-m", type=int, default=1)
    ap.add_argument("--report", default="")
    ap.add_argument("--peer-worker", default="")
    ap.add_argument("--split", default="")
    ap.add_argument("--microbatches", type=int, default=1)
    ns = ap.parse_args(argv)
    if ns.role == "crosscut":
        return crosscut_worker(ns)
    if ns.role == "ddp":
        return ddp_worker(ns)
    if ns.peer_worker:
        return peer.worker(ns, build, data)
    ns.costs = ns.costs.split(",")
    torch.set_num_threads(1)
    print(f"2 gloo ranks x 1 thread; global batch {ns.batch} at 3x{ns.size}x{ns.size}; "
          f"{ns.rounds} rounds of {ns.warmup} warm-up + {ns.steps} timed steps; torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs", flush=True)  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ns.models.split(","):
            rows += run_model(name, ns, Path(tmp))
    print(
        "\ns/step per round (a/b = round 1/round 2); ratio-per-round: crosscut ÷ the faster "
        "peer in that round; crosscut/faster-peer: of medians; DDP at crosscut's "
        f"micro-batch size; pipelining at its best tried split, M={ns.peer_microbatches}"
    )
    table = [COLUMNS, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    for r in table:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    return 0


if __name__ == "__main__":
    # every process this script starts, the baselines too (DDP, eager, the peer):
    # they run with the allocator crosscut's CPU ranks use, so the comparison is fair
    keep_freed_memory()
    raise SystemExit(main())
