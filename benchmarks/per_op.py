"""Analytic per-op prices against per-node times measured on a GPU, and what their errors
cost a pipeline.

A whole-model throughput can be right while single ops are priced 3x off in both
directions; the planner, though, cuts the model where the *per-op* prices say the
stages balance. This re-prices the per-node profiles that ``benchmarks/gpu_check.py``
recorded on a GPU (``docs/benchmarks/h100-gpu-check-profiles.json``, one H100) with
the current analytic model, no GPU needed, and prints per configuration:

* ``ana/meas``: the analytic step over the summed measured nodes;
* ``L1``: sum over nodes of |price - measured| over the measured sum, after scaling
  the prices to the measured total (so it counts per-op error, not the total's);
* ``imbalance S=k``: cut the nodes, in graph order, into ``k`` contiguous stages of
  equal analytic price, as a planner trusting the prices would; the slowest stage's
  measured time over the mean stage's. 1.00 is a balanced pipeline; 1.30 means the
  step is 30 % longer than the prices promised, from per-op error alone;
* with ``-v``: each op kind's measured and priced milliseconds.

``--oracle KINDS`` prices the named op kinds (or node names, e.g. ``conv1``) at their
measured times instead: how much of the imbalance fixing those prices would remove.

    .venv/bin/python benchmarks/per_op.py -v
    .venv/bin/python benchmarks/per_op.py --oracle batch_norm,max_pool2d,conv1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import calibration as calib

from crosscut.cost_models.analytic import analytic_costs
from crosscut.cost_models.cluster import Cluster
from crosscut.frontend.tracer import trace

__all__ = ["Row", "imbalance", "main", "reprice"]

PROFILES = Path(__file__).resolve().parent.parent / "docs/benchmarks/h100-gpu-check-profiles.json"
STAGES = (2, 4, 8)


@dataclass
class Row:
    """One recorded configuration, re-priced."""

    config: str
    ratio: float  # analytic total / measured total
    l1: float
    imbalance: dict[int, float]
    stage_ratios: list[float]  # per stage at S=8: measured / scaled price
    kinds: dict[str, tuple[float, float]] = field(default_factory=dict)  # kind -> (meas, price)


def imbalance(
    order: list[str], price: dict[str, float], meas: dict[str, float], k: int
) -> list[float]:
    """Measured seconds of ``k`` contiguous stages cut at equal cumulative ``price``."""
    total = sum(price[n] for n in order) or 1.0
    stages = [0.0] * k
    acc = 0.0
    for n in order:
        stages[min(k - 1, int(acc / total * k))] += meas[n]
        acc += price[n]
    return stages


def reprice(entry: dict[str, object], oracle: set[str], size: int = 224) -> Row:
    """Trace ``entry``'s model as it was profiled and price it analytically."""
    model = calib.build_model(str(entry["model"]))
    x = torch.empty(int(str(entry["batch"])), 3, size, size, device="meta")
    if entry["layout"] == "nhwc":
        model = model.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    graph = trace(model, x, mode="train", precision=str(entry["precision"]))
    kind = str(entry.get("kind", "H100"))
    table = analytic_costs(graph, Cluster.from_spec(f"1x{kind}"), optimizer="momentum")
    nodes = entry["nodes"]
    assert isinstance(nodes, dict)
    order = [n.name for n in graph.nodes]
    meas = {n: float(nodes[n]["profiled"]) for n in order}
    price = {n: table.node_time(n, kind, True) for n in order}
    for n in order:
        if nodes[n]["kind"] in oracle or n in oracle:
            price[n] = meas[n]
    scale = sum(meas.values()) / sum(price.values())
    l1 = sum(abs(price[n] * scale - meas[n]) for n in order) / sum(meas.values())
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for n in order:
        kinds[nodes[n]["kind"]][0] += meas[n]
        kinds[nodes[n]["kind"]][1] += price[n]
    imb = {}
    for k in STAGES:
        st = imbalance(order, price, meas, k)
        imb[k] = max(st) / (sum(st) / k)
    eight = imbalance(order, price, meas, 8)
    mean8 = sum(eight) / 8
    return Row(
        config=f"{entry['model']} {entry['precision']} {entry['layout']} {entry['batch']}",
        ratio=1.0 / scale,
        l1=l1,
        imbalance=imb,
        stage_ratios=[s / mean8 for s in eight],
        kinds={k: (v[0], v[1]) for k, v in kinds.items()},
    )


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", type=Path, default=PROFILES)
    ap.add_argument("--oracle", default="", help="op kinds or node names priced as measured")
    ap.add_argument("--models", default="", help="only these models (comma-separated)")
    ap.add_argument("-v", action="store_true", help="per op kind")
    ns = ap.parse_args(argv)
    data = json.loads(ns.profiles.read_text())
    device = data.get("env", {}).get("kind", "H100")
    oracle = {k for k in ns.oracle.split(",") if k}
    wanted = {m for m in ns.models.split(",") if m}
    exact = f"; priced as measured: {','.join(sorted(oracle))}" if oracle else ""
    name = data.get("env", {}).get("name", device)
    print(f"per-node profiles of {name}; analytic prices of the current model{exact}")
    cuts = " ".join(f"{'S=' + str(k):>6}" for k in STAGES)
    print(f"{'configuration':32} {'ana/meas':>8} {'L1':>6} {cuts}   S=8 stages, measured / mean")
    rows = []
    for entry in data["profile"]:
        if "nodes" not in entry or (wanted and entry["model"] not in wanted):
            continue
        row = reprice(dict(entry, kind=device), oracle)
        rows.append(row)
        print(f"{row.config:32} {row.ratio:8.2f} {row.l1:6.3f} "
              + " ".join(f"{row.imbalance[k]:6.3f}" for k in STAGES) + "   "
              + " ".join(f"{r:.2f}" for r in row.stage_ratios))  # fmt: skip
        if ns.v:
            for kind, (m, p) in sorted(row.kinds.items(), key=lambda kv: -kv[1][0])[:8]:
                print(f"    {kind:22} measured {m * 1e3:7.2f} ms  priced {p * 1e3:7.2f} ms  "
                      f"{p / m if m else float('nan'):5.2f}")  # fmt: skip
    if rows:
        means = [f"S={k} {statistics.mean(r.imbalance[k] for r in rows):.3f}" for k in STAGES]
        print(
            f"mean L1 {statistics.mean(r.l1 for r in rows):.3f}; mean imbalance {', '.join(means)}"
        )
    return rows


if __name__ == "__main__":
    main()
