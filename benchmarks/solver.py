"""Solver quality and speed on every torchvision classification model.

For each model (batch 32, analytic costs, training, 1F1B with 4 micro-batches)
on 2, 4 and 8 devices of a preset cluster, prints one row: nodes before/after
coarsening, status, wall time, gap, bottleneck ÷ lower bound (max of total
compute / devices and the largest node), and the ratio of each baseline's
bottleneck to crosscut's. Ends with the summary the acceptance criteria ask
for: share of rows OPTIMAL or gap ≤ 1% within 10 s (column ``met``: a solve
stopped at the limit with gap ≤ 1 % counts, as the issue words it), median
wall time, and the geometric-mean advantage over the parameter-balanced split.

    python benchmarks/solver.py                      # all models, ~15-25 min on 2 cores
    python benchmarks/solver.py --models swin_v2_s swin_v2_b   # issue 3's last misses
    python benchmarks/solver.py --models resnet50 densenet121 --devices 8
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from crosscut.api import get_costs, micro_inputs, trace
from crosscut.cli.model_refs import (
    default_input_shape,
    load_model,
    torchvision_classification_models,
)
from crosscut.cost_models.cluster import Cluster
from crosscut.ir.plan import PlanOptions
from crosscut.partitioner.partition import partition_graph

HEAVY = {"vit_h_14", "vit_l_16", "vit_l_32", "regnet_y_128gf"}


def run_model(
    name: str, devices: list[int], preset: str, batch: int, micro: int, time_limit: float
) -> list[dict[str, object]]:
    model = load_model(f"torchvision:{name}")
    shape = default_input_shape(f"torchvision:{name}")
    x = torch.randn(batch, *shape)
    t0 = time.perf_counter()
    graph = trace(model, micro_inputs(x, micro), mode="train")
    trace_s = time.perf_counter() - t0
    rows = []
    for n in devices:
        cluster = Cluster.from_any(f"{n}x{preset}")
        costs = get_costs(graph, cluster)
        opts = PlanOptions(microbatches=micro, time_limit_s=time_limit)
        t1 = time.perf_counter()
        plan = partition_graph(graph, costs, cluster, opts)
        wall = time.perf_counter() - t1
        rec = plan.solver
        obj = rec.objective
        rows.append(
            {
                "model": name,
                "devices": n,
                "nodes": len(graph),
                "coarse": rec.coarse_nodes,
                "status": rec.status,
                "met": "yes"
                if meets_target(rec.status, rec.gap, rec.wall_time_s, time_limit)
                else "NO",
                "solve_s": rec.wall_time_s,
                "wall_s": wall,
                "trace_s": trace_s,
                "gap": rec.gap,
                "lb_ratio": obj / rec.lower_bound if rec.lower_bound else 1.0,
                "stages": plan.num_stages,
                **{f"x_{k}": v / obj for k, v in rec.baselines.items() if obj > 0},
            }
        )
    return rows


def meets_target(status: str, gap: float, solve_s: float, time_limit: float) -> bool:
    """Issue 3's target: "status OPTIMAL or gap <= 1 % within 10 s" (the time limit).

    A solve that stops at its time limit with its incumbent proven within 1 %
    meets it as much as one that finishes the proof; both must return within
    the limit (the solver keeps a reserve for re-pricing, so it does).
    """
    return (status == "OPTIMAL" or gap <= 0.01) and solve_s <= time_limit


# (column key, header, width, format) of the printed table
COLUMNS = [
    ("model", "model", 22, "s"),
    ("devices", "dev", 3, "d"),
    ("nodes", "nodes", 5, "d"),
    ("coarse", "coarse", 6, "d"),
    ("status", "status", 8, "s"),
    ("met", "met", 3, "s"),
    ("solve_s", "solve_s", 7, ".2f"),
    ("gap", "gap", 7, ".2%"),
    ("lb_ratio", "obj/LB", 6, ".3f"),
    ("stages", "S", 2, "d"),
    ("x_chain_dp", "chain_dp", 8, ".3f"),
    ("x_greedy", "greedy", 7, ".3f"),
    ("x_param_balanced", "param", 7, ".3f"),
    ("x_uniform_by_count", "uniform", 7, ".3f"),
]


def _fmt(row: object, *, header: bool = False) -> str:
    cells = []
    for key, title, width, fmt in COLUMNS:
        align = "<" if key == "model" else ">"
        if header:
            cells.append(f"{title:{align}{width}}")
            continue
        value = row.get(key, float("nan")) if isinstance(row, dict) else None
        cells.append(f"{value:{align}{width}{fmt}}")
    return " ".join(cells)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--devices", nargs="*", type=int, default=[2, 4, 8])
    parser.add_argument("--preset", default="V100")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--skip-heavy", action="store_true", help=f"skip {sorted(HEAVY)}")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = args.models or torchvision_classification_models()
    if args.skip_heavy:
        names = [n for n in names if n not in HEAVY]
    print(_fmt(COLUMNS, header=True))
    rows: list[dict[str, object]] = []
    for name in names:
        try:
            got = run_model(
                name, args.devices, args.preset, args.batch, args.microbatches, args.time_limit
            )
        except Exception as exc:  # report and continue: one broken model must not hide the rest
            print(f"{name:22} FAILED: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        for r in got:
            rows.append(r)
            print(_fmt(r), flush=True)
    if not rows:
        return 1
    solve = [float(r["solve_s"]) for r in rows]  # type: ignore[arg-type]
    good = [r for r in rows if r["met"] == "yes"]
    param = [float(r["x_param_balanced"]) for r in rows if "x_param_balanced" in r]  # type: ignore[arg-type]
    worse_than_chain = [r for r in rows if float(r.get("x_chain_dp", 1.0)) < 1.0 - 1e-9]  # type: ignore[arg-type]
    print()
    limit = f"{args.time_limit:g} s"
    print(f"rows: {len(rows)}; OPTIMAL or gap<=1% within {limit}: {len(good)}/{len(rows)}")
    optimal = [r for r in rows if r["status"] == "OPTIMAL" and r["met"] == "yes"]
    print(
        f"  of which OPTIMAL (proof finished): {len(optimal)}; stopped at the limit "
        f"with gap<=1%: {len(good) - len(optimal)}"
    )
    print(f"solve time: median {statistics.median(solve):.2f} s, max {max(solve):.2f} s")
    if param:
        gm = math.exp(sum(math.log(p) for p in param) / len(param))
        print(f"param-balanced / crosscut bottleneck, geometric mean: {gm:.2f}x")
    print(f"rows where the fixed-order chain split beat crosscut: {len(worse_than_chain)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
