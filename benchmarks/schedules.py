"""Schedules that close the bubble: 1F1B against the zero-bubble schedules, priced and measured.

Two parts, side by side in one run:

* **simulated** (no hardware): one model's stages solved once on a preset
  cluster, then priced under every schedule (``partitioner/schedule_choice``),
  and re-cut into two stages per device for interleaved 1F1B (``1f1b-v2``):
  step, bubble, the busiest device's memory, and the ratio to 1F1B; and what
  ``schedule="auto"`` (the default) picks. Issue 25's target: resnet50,
  4 stages, M = 4 on ``4xV100`` — a zero-bubble step at least 15 % shorter
  than 1F1B's within the same memory cap.
* **measured** (``--measure``): the same partition on ``--ranks`` gloo ranks (2) of this
  machine (one thread each, ``benchmarks/distributed.py``'s workers), each
  schedule's plan run in interleaved rounds (median per schedule), against the
  simulator's step for the same plan (profiled costs: ``--cost profiled``).

    python benchmarks/schedules.py
    OMP_NUM_THREADS=1 python benchmarks/schedules.py --measure --model resnet18 \\
        --batch 16 --size 64 --microbatches 2 --cost profiled
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import distributed as dist_bench

from crosscut.api import partition
from crosscut.ir.plan import Plan
from crosscut.ir.schedule import INTERLEAVED_SCHEDULES
from crosscut.partitioner.annotate import annotate
from crosscut.partitioner.interleave import interleave
from crosscut.partitioner.schedule_choice import PREFERENCE

__all__ = ["main", "priced"]


def variants(plan: Plan) -> dict[str, Plan]:
    """``plan``'s stages under every schedule of :data:`PREFERENCE`, and the interleaved
    re-cuts of them (:data:`INTERLEAVED_SCHEDULES`: two to four stages per device, and
    interleaved zero bubble), each priced."""
    out = {}
    for name in PREFERENCE:
        other = Plan.from_dict(plan.to_dict())
        other.options.schedule = name
        out[name] = annotate(other)
    for name in INTERLEAVED_SCHEDULES:
        recut = interleave(plan, name)
        if recut is not None:
            out[name] = recut
    return out


def priced(plan: Plan) -> dict[str, tuple[float, float, int]]:
    """Schedule -> (step s, bubble, busiest device's bytes) of :func:`variants`."""
    return {
        name: (
            p.predicted.step_time_s,
            p.predicted.bubble_fraction,
            max(p.predicted.device_peak_bytes.values()),
        )
        for name, p in variants(plan).items()
    }


def _table(plan: Plan, rows: dict[str, tuple[float, float, int]], cap: int) -> None:
    base = rows["1f1b"][0]
    print(f"{'schedule':10} {'step':>10} {'bubble':>7} {'peak':>9} {'vs 1f1b':>8}  fits the cap")
    for name, (step, bubble, peak) in rows.items():
        print(
            f"{name:10} {step * 1e3:8.2f}ms {bubble:7.1%} {peak / 2**30:7.2f}GiB "
            f"{step / base:8.3f}  {'yes' if peak <= cap else 'no'}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--cluster", default="4xV100")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--measure", action="store_true", help="gloo ranks of this machine")
    ap.add_argument("--ranks", type=int, default=2, help="with --measure: ranks (= stages)")
    ap.add_argument("--cost", default="analytic", choices=["analytic", "profiled"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument(
        "--schedules", default="",
        help="with --measure: the schedules to run, comma-separated (default: every one priced)",
    )  # fmt: skip
    ns = ap.parse_args(argv)
    model = dist_bench.build(ns.model)
    x, _ = dist_bench.data(ns.batch, ns.size, ns.model)
    # measured on gloo ranks: priced with their links (loopback TCP), not a thread's copy
    devices = f"{ns.ranks}xcpu-gloo" if ns.measure else ns.cluster
    # the pipeline solved once under 1F1B, then priced under every schedule; and what
    # "auto" (the default) chooses for the same request
    base = partition(model, devices, x, microbatches=ns.microbatches, replicas=1,
                     require_all_devices=True, cost=ns.cost, schedule="1f1b")  # fmt: skip
    auto = partition(model, devices, x, microbatches=ns.microbatches, replicas=1,
                     require_all_devices=True, cost=ns.cost)  # fmt: skip
    plans = variants(base)
    rows = priced(base)
    cap = min(d.mem_cap for d in auto.cluster.devices)
    where = f"{ns.ranks} CPU ranks" if ns.measure else ns.cluster
    print(f"{ns.model}, batch {ns.batch} at {ns.size}px, {base.num_stages} stages, "
          f"M={ns.microbatches}, {where}, {ns.cost} costs (simulated):")  # fmt: skip
    _table(base, rows, cap)
    note = next((n for n in auto.solver.notes if n.startswith("schedule ")), "")
    print(f"auto chose {auto.options.schedule} ({auto.num_stages} stages): {note}")
    if not ns.measure:
        best_zb = min(rows[n][0] for n in ("zb-h1", "zb-h2") if rows[n][2] <= cap)
        print(f"best zero-bubble step / 1f1b step = {best_zb / rows['1f1b'][0]:.3f}")
        inter = [rows[n][0] for n in INTERLEAVED_SCHEDULES if n in rows and rows[n][2] <= cap]
        if inter:
            print(f"best interleaved step / 1f1b step = {min(inter) / rows['1f1b'][0]:.3f}")
        return 0
    torch.set_num_threads(1)
    run = [n.strip() for n in ns.schedules.split(",") if n.strip()] or list(rows)
    unknown = sorted(set(run) - set(rows))
    if unknown or "1f1b" not in run:
        raise SystemExit(
            f"--schedules {ns.schedules!r}: unknown {unknown} or no 1f1b (the baseline); "
            f"choose among {', '.join(rows)}"
        )
    times: dict[str, list[float]] = {n: [] for n in run}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name in run:
            paths[name] = Path(tmp) / f"{name}.json"
            plans[name].save(str(paths[name]))
        for r in range(ns.rounds):  # interleaved: a load change hits every schedule alike
            for name in run:
                t = dist_bench.pipeline_step_time(ns.model, paths[name], ns, ns.ranks)
                times[name].append(t)
                print(f"  round {r + 1}: {name} {t:.3f} s/step", flush=True)
    base = statistics.median(times["1f1b"])
    print(f"measured medians ({ns.ranks} ranks x 1 thread):")
    for name, ts in times.items():
        med = statistics.median(ts)
        sim = rows[name][0]
        print(f"  {name:8} {med:.3f} s/step  vs 1f1b {med / base:.3f}  "
              f"simulated {sim:.3f} s (measured/simulated {med / sim:.3f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
