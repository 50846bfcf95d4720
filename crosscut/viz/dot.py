"""Graphviz DOT drawing of a partitioned plan.

The drawing is the plan's DAG with one ``subgraph cluster_stage_k`` per stage,
nodes filled with their device's colour (striped across a device group for
cross-shaped stages) and every cross-stage edge labelled with the bytes it
carries, drawn bold and dashed when it crosses devices (a transfer). Graphs
with more nodes than ``max_nodes`` are drawn coarse: consecutive nodes of one
stage that share a ``module_path`` prefix collapse into one box, so a
1,600-node MaxViT stays a readable picture of a few hundred boxes. Only the
``dot`` binary is needed to turn the source into SVG/PNG; producing the DOT
text needs nothing but the plan.
"""

from __future__ import annotations

import itertools
import math
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from crosscut.errors import CrosscutError
from crosscut.ir.plan import Plan, PlanStage

__all__ = [
    "ATTENTION_COLOR",
    "INSTALL_HINT",
    "PALETTE",
    "TRANSFER_COLOR",
    "BoxLike",
    "NodeGroup",
    "VizError",
    "box_edges",
    "coarsen",
    "device_colors",
    "human_bytes",
    "human_time",
    "lighten",
    "plan_to_dot",
    "render_dot",
    "stage_label",
    "view_groups",
]

# One meaning per colour across every picture: these ten mean "a device" (a
# device keeps its colour across every picture of the same cluster); red means
# "a transfer" and orange "needs attention", so neither appears here. Tableau
# 10 with its red, orange and pink swapped for cyan, olive and navy.
PALETTE = (
    "#4e79a7",
    "#59a14f",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#9c755f",
    "#17becf",
    "#bcbd22",
    "#1f3a93",
    "#bab0ac",
)
TRANSFER_COLOR = "#d62728"
ATTENTION_COLOR = "#e67e22"  # over a cap, slower than a baseline
INSTALL_HINT = (
    "install Graphviz: `apt-get install graphviz` (Debian/Ubuntu), "
    "`brew install graphviz` (macOS), or write a .dot/.html file instead"
)


class VizError(CrosscutError):
    """Drawing a plan failed (Graphviz missing, timed out, or an unknown format)."""


@dataclass
class NodeGroup:
    """Consecutive nodes of one stage drawn as one box in the coarse view."""

    id: str
    stage: int
    key: str  # module_path prefix the members share ("(top)" for module-less nodes)
    members: list[str] = field(default_factory=list)


# ---- formatting ---------------------------------------------------------------------
def human_bytes(n: float) -> str:
    """Bytes in binary units with three significant digits ("1.50 MiB")."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"  # pragma: no cover - loop always returns


def human_time(seconds: float) -> str:
    """Seconds in the unit that keeps three significant digits readable."""
    s = float(seconds)
    if s == 0:
        return "0 ms"
    if abs(s) >= 1:
        return f"{s:.3g} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def device_colors(plan: Plan) -> dict[str, str]:
    """Device name -> palette colour, by position in the cluster (stable per cluster)."""
    return {d.name: PALETTE[i % len(PALETTE)] for i, d in enumerate(plan.cluster.devices)}


def lighten(color: str, amount: float = 0.55) -> str:
    r, g, b = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    mix = [round(c + (255 - c) * amount) for c in (r, g, b)]
    return "#" + "".join(f"{c:02x}" for c in mix)


def _q(text: str) -> str:
    """A DOT double-quoted string; backslashes doubled so a name never injects escapes."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def stage_label(plan: Plan, stage: PlanStage) -> str:
    """ "stage k · device(s) · time · mem", naming the split of a device group."""
    devs = "+".join(stage.devices)
    if len(stage.devices) > 1:
        devs += f" ({stage.split} split ×{len(stage.devices)})"
    return (
        f"stage {stage.index} · {devs} · {human_time(stage.time_s)} · "
        f"{human_bytes(stage.memory_bytes)}"
    )


# ---- coarsening ---------------------------------------------------------------------
def _prefix(path: str, depth: int) -> str:
    return ".".join(path.split(".")[:depth]) if path else ""


def _runs(plan: Plan, depth: int) -> list[NodeGroup]:
    """Consecutive same-prefix runs per stage; module-less nodes join the run before them."""
    module = {n.name: n.module_path for n in plan.nodes}
    groups: list[NodeGroup] = []
    for stage in plan.stages:
        last_key: str | None = None
        for name in plan.stage_nodes(stage.index):
            key = _prefix(module[name], depth) or last_key or "(top)"
            if groups and groups[-1].stage == stage.index and key == last_key:
                groups[-1].members.append(name)
            else:
                groups.append(NodeGroup(f"g{len(groups)}", stage.index, key, [name]))
            last_key = key
    return groups


def _cap(groups: list[NodeGroup], limit: int) -> list[NodeGroup]:
    """Merge neighbouring groups of a stage until at most ``limit`` boxes remain."""
    if len(groups) <= limit:
        return groups
    by_stage: dict[int, list[NodeGroup]] = {}
    for g in groups:
        by_stage.setdefault(g.stage, []).append(g)
    out: list[NodeGroup] = []
    for stage, gs in by_stage.items():
        budget = max(1, math.floor(limit * len(gs) / len(groups)))
        size = math.ceil(len(gs) / budget)
        for i in range(0, len(gs), size):
            chunk = gs[i : i + size]
            key = chunk[0].key if len(chunk) == 1 else f"{chunk[0].key} … {chunk[-1].key}"
            members = [m for g in chunk for m in g.members]
            out.append(NodeGroup(f"g{len(out)}", stage, key, members))
    return out


def coarsen(plan: Plan, max_nodes: int = 400, *, target: int | None = None) -> list[NodeGroup]:
    """Collapse each stage's nodes into module groups, at most ``target`` boxes.

    Picks the deepest ``module_path`` prefix whose groups fit, so the picture
    keeps as much structure as the budget allows; if even top-level modules do
    not fit, neighbouring groups inside a stage are merged. Groups never span
    stages, so stage clusters and transfers stay exact.
    """
    limit = max(target if target is not None else max_nodes, plan.num_stages)
    depth_max = max((len(n.module_path.split(".")) for n in plan.nodes if n.module_path), default=1)
    best: list[NodeGroup] | None = None
    for depth in range(1, depth_max + 1):
        groups = _runs(plan, depth)
        if len(groups) <= limit or best is None:
            best = groups
        if len(groups) > limit:
            break
    assert best is not None
    return _cap(best, limit)


# ---- DOT ----------------------------------------------------------------------------
def _node_fill(devices: list[str], colors: dict[str, str]) -> str:
    fills = [lighten(colors.get(d, PALETTE[-1])) for d in devices]
    if len(fills) == 1:
        return f"style={_q('rounded,filled')}, fillcolor={_q(fills[0])}"
    # a left-to-right blend of the group's colours: reads as "several devices" and,
    # unlike style=striped, draws no separator line through the label
    return f"style={_q('rounded,filled')}, gradientangle=0, fillcolor={_q(':'.join(fills))}"


def _legend(plan: Plan, colors: dict[str, str]) -> list[str]:
    """A narrow column of device swatches (a row would widen the whole chain-shaped picture)."""
    lines = [
        "  subgraph cluster_legend {",
        '    label="devices"; style="rounded,dashed"; color="#888888"; fontsize=11;',
    ]
    names = []
    for i, d in enumerate(plan.cluster.devices):
        text = f"{d.name} · {d.kind} · {human_bytes(d.mem_cap)}"
        lines.append(
            f"    legend_{i} [label={_q(text)}, style={_q('rounded,filled')}, "
            f"fillcolor={_q(lighten(colors[d.name]))}, color={_q(colors[d.name])}, penwidth=2];"
        )
        names.append(f"legend_{i}")
    lines.append(
        '    legend_tx [label="transfer:\\nbold dashed,\\nbytes per micro-batch", '
        f"shape=plaintext, fontcolor={_q(TRANSFER_COLOR)}];"
    )
    names.append("legend_tx")
    lines += [f"    {a} -> {b} [style=invis];" for a, b in itertools.pairwise(names)]
    lines.append("  }")
    return lines


def view_groups(
    plan: Plan, *, coarse: bool | None = None, max_nodes: int = 400
) -> list[NodeGroup] | None:
    """The boxes of the coarse view, or None when the plan is drawn node by node.

    ``coarse=None`` goes coarse only above ``max_nodes`` nodes; an explicit
    ``True`` on a small graph still collapses it to about a third of its nodes.
    """
    if coarse is None:
        coarse = len(plan.nodes) > max_nodes
    if not coarse:
        return None
    target = min(max_nodes, max(plan.num_stages, len(plan.nodes) // 3))
    return coarsen(plan, max_nodes, target=target)


def plan_to_dot(plan: Plan, *, coarse: bool | None = None, max_nodes: int = 400) -> str:
    """The partitioned DAG as DOT source (no Graphviz binary needed).

    ``coarse=None`` draws coarse only when the plan has more than ``max_nodes``
    nodes; ``True`` always collapses to modules; ``False`` draws every node.
    """
    colors = device_colors(plan)
    groups = view_groups(plan, coarse=coarse, max_nodes=max_nodes)
    coarse = groups is not None
    if groups is None:
        groups = [
            NodeGroup(f"n{i}", plan.placed_stage(n.name), n.name, [n.name])
            for i, n in enumerate(plan.nodes)
        ]
    box_of = {m: g for g in groups for m in g.members}
    node_info = {n.name: n for n in plan.nodes}
    out = [
        f"digraph {_q('plan ' + plan.model.name)} {{",
        '  graph [rankdir=TB, fontname="Helvetica", fontsize=12, newrank=true, '
        "nodesep=0.25, ranksep=0.35, labelloc=t, labeljust=l];",
        '  node [shape=box, fontname="Helvetica", fontsize=10, height=0.3, penwidth=1];',
        '  edge [fontname="Helvetica", fontsize=9, color="#666666", arrowsize=0.6];',
    ]
    out += _legend(plan, colors)
    for stage in plan.stages:
        color = colors.get(stage.devices[0], PALETTE[-1])
        out.append(f"  subgraph cluster_stage_{stage.index} {{")
        out.append(
            f"    label={_q(stage_label(plan, stage))}; style={_q('rounded,filled')}; "
            f'fillcolor="#fafafa"; color={_q(color)}; penwidth=2;'
        )
        fill = _node_fill(stage.devices, colors)
        kind = plan.cluster.devices[plan.cluster.index(stage.devices[0])].kind
        for g in (g for g in groups if g.stage == stage.index):
            if coarse:
                secs = sum(node_info[m].time_s.get(kind, 0.0) for m in g.members)
                label = f"{g.key}\n{len(g.members)} ops · {human_time(secs)}"
                tip = ", ".join(g.members[:12]) + (" …" if len(g.members) > 12 else "")
                extra = f", URL={_q('#grp-' + g.id)}, tooltip={_q(tip)}"
            else:
                n = node_info[g.members[0]]
                label = f"{n.name}\n{n.kind}"
                extra = f", tooltip={_q(f'{n.name} ({n.target}) {human_bytes(n.out_bytes)}')}"
            out.append(f"    {g.id} [label={_q(label)}, {fill}{extra}];")
        out.append("  }")
    out += _edges(plan, box_of)
    out.append("}")
    return "\n".join(out) + "\n"


class BoxLike(Protocol):
    """A drawn box (a node group here, a laid-out box in ``viz/layout.py``)."""

    @property
    def id(self) -> str: ...
    @property
    def stage(self) -> int: ...


def box_edges(plan: Plan, box_of: Mapping[str, BoxLike]) -> dict[tuple[str, str], dict[str, int]]:
    """The plan's edges between boxes (``box_of``: node -> its box), in first-seen order.

    One entry per pair of boxes in a stage, and one per (source box,
    receiving stage) across stages, to the first reader there (a tensor a
    stage reads in several places is sent once); each maps the tensors it
    carries to their bytes, a tensor counted once per entry.
    """
    agg: dict[tuple[str, str], dict[str, int]] = {}
    first_reader: dict[tuple[str, int], str] = {}
    for src, dst, nbytes in plan.edges:
        ga, gb = box_of.get(src), box_of.get(dst)
        if ga is None or gb is None or ga.id == gb.id:
            continue
        target = gb.id
        if ga.stage != gb.stage:  # plan.edges follow topological order
            target = first_reader.setdefault((ga.id, gb.stage), gb.id)
        agg.setdefault((ga.id, target), {})[src] = nbytes
    return agg


def _edges(plan: Plan, box_of: dict[str, NodeGroup]) -> list[str]:
    """Edges between boxes; cross-stage ones carry bytes, cross-device ones are transfers.

    A tensor that a stage reads in several places is sent once, so it is drawn
    once: one arrow per (source box, receiving stage), to the first reader.
    """
    tx_time = {(t.tensor, t.dst_stage): t.time_s for t in plan.transfers}
    stage_of = {g.id: g.stage for g in box_of.values()}
    lines = []
    for (a, b), tensors in box_edges(plan, box_of).items():
        sa, sb = stage_of[a], stage_of[b]
        if sa == sb:
            lines.append(f"  {a} -> {b};")
            continue
        total = sum(tensors.values())
        label = human_bytes(total)
        secs = sum(tx_time.get((t, sb), 0.0) for t in tensors)
        if secs:
            label += f"\n{human_time(secs)}"
        cross_device = plan.stages[sa].devices != plan.stages[sb].devices
        style = (
            f'style="bold,dashed", penwidth=2, color={_q(TRANSFER_COLOR)}, '
            f"fontcolor={_q(TRANSFER_COLOR)}"
            if cross_device
            else 'style=bold, color="#333333"'
        )
        lines.append(f"  {a} -> {b} [label={_q(label)}, {style}];")
    return lines


def render_dot(dot_src: str, fmt: str = "svg", *, timeout_s: float = 120.0) -> bytes:
    """Run Graphviz ``dot -T<fmt>`` on ``dot_src``; a clear VizError if it cannot."""
    if fmt not in ("svg", "png"):
        raise VizError("render_dot draws svg or png", value=fmt, remedy="pass fmt='svg' or 'png'")
    exe = shutil.which("dot")
    if exe is None:
        raise VizError(
            "drawing a plan as SVG/PNG needs the Graphviz `dot` binary on PATH",
            value="dot not found",
            remedy=INSTALL_HINT,
        )
    try:
        proc = subprocess.run(
            [exe, f"-T{fmt}"],
            input=dot_src.encode(),
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise VizError(
            f"Graphviz must finish within {timeout_s:g} s",
            value=f"{dot_src.count(chr(10))} DOT lines",
            remedy="draw the coarse view (coarse=True) or lower max_nodes",
        ) from exc
    if proc.returncode != 0:
        raise VizError(
            "Graphviz `dot` must accept the generated DOT",
            value=proc.stderr.decode(errors="replace").strip()[:500],
            remedy="report this as a crosscut bug with the .dot file attached",
        )
    return proc.stdout
