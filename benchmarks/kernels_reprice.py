"""Re-price a ``gpu_kernels.py`` measurement with the current analytic model (no GPU).

Per configuration: each op class's kernel time measured against the analytic
price's roofline part (launch overhead left out), the step against the price,
and the host's issue time against the launches it made.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import calibration as calib
from gpu_kernels import CLASSES, _build, node_class

from crosscut.cost_models.analytic import MathFlags, node_times
from crosscut.cost_models.cluster import Cluster
from crosscut.frontend.tracer import trace

__all__ = ["priced_classes", "report"]


def priced_classes(row: dict[str, Any], kind: str, size: int = 224) -> dict[str, Any]:
    """The analytic seconds per op class of ``row``'s step, kernels only (no launches)."""
    model = _build(row["model"])
    x = torch.empty(row["batch"], 3, size, size, device="meta")
    if row["layout"] == "nhwc":
        model = model.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    prec = row["precision"].split("-")[0]
    graph = trace(model, x, mode="train", precision=prec)
    spec = Cluster.from_spec(f"1x{kind}").devices[0]
    bare = dataclasses.replace(spec, launch_overhead_s=0.0)
    flags = MathFlags.of(row["precision"] != "fp32-notf32")
    out: dict[str, float] = defaultdict(float)
    nodes = 0
    for n in graph.nodes:
        f, b = node_times(graph, n, bare, flags)
        out[node_class(n.kind)] += f + b
        nodes += not n.is_io and n.op != "get_attr"
    return {"classes": dict(out), "nodes": nodes, "step": calib.single_step_s(graph, kind)}


def report(data: dict[str, Any]) -> int:
    """Print, per configuration, measured / priced per class and the step's parts."""
    kind = data["env"].get("kind", "H100")
    print(f"kernels of {data['env'].get('name', kind)} (ms, measured / analytic roofline)")
    for row in data["rows"]:
        p = priced_classes(row, kind)
        cells = []
        for c in CLASSES:
            m = row["classes"].get(c, {}).get("kernels_s", 0.0)
            a = p["classes"].get(c, 0.0)
            if m > 2e-4 or a > 2e-4:
                cells.append(f"{c[:5]} {m * 1e3:5.1f}/{a * 1e3:5.1f}")
        print(
            f"{row['model']:19} {row['precision']:5} {row['layout']:4} {row['batch']:4} "
            f"step {row['step_s'] * 1e3:6.1f} priced {p['step'] * 1e3:6.1f} "
            f"kernels {row['kernels_s'] * 1e3:6.1f} host {row['host_s'] * 1e3:5.1f} "
            f"launches {row['launches']:5.0f} nodes {p['nodes']:4d} "
            f"host/launch {row['host_s'] / max(row['launches'], 1) * 1e6:4.1f}us | "
            + " ".join(cells)
        )
    return 0
