"""A plan's partitioned graph laid out in Python and drawn as inline SVG: no Graphviz.

Why our own layout: the HTML report must show the split on a machine with
nothing but Python, and a CNN drawn by Graphviz is one very tall column
(ResNet-50: 10,000 pt) that no screen can show whole. This layout is built for
the question the report answers, "where are the cuts":

* each stage is a horizontal **band**, top to bottom in stage order, outlined
  in its device's colour and titled with its devices, time, memory and first
  and last layer;
* inside a band, boxes sit in **columns by depth** (longest path from the
  model's inputs), so parallel branches (an Inception block's four paths, a
  ResNet shortcut) stack in one column, and columns **wrap** into lines when a
  stage is longer than the page is wide;
* edges inside a stage are thin grey curves; a tensor sent to another stage
  is **one arrow per (tensor, receiving stage)**, to its first reader there,
  labelled with its bytes per micro-batch: red and dashed when it crosses
  devices (a transfer), dark grey when the two stages share their devices.

Large graphs are drawn with the coarse view's module groups
(:func:`crosscut.viz.dot.view_groups`); each group box links to its entry in
the report's group list. Everything is plain SVG elements with ``<title>``
tooltips, so the picture needs no script to read.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from crosscut.ir.plan import Plan, PlanStage
from crosscut.viz.dot import (
    TRANSFER_COLOR,
    NodeGroup,
    box_edges,
    device_colors,
    human_bytes,
    human_time,
    lighten,
    stage_label,
)

__all__ = ["GraphLayout", "layout_graph", "layout_svg", "stage_layers"]

_e = html.escape

BOX_W, BOX_H = 124, 30  # px: room for ~18 characters of 10 px text on two lines
GAP_X, GAP_Y = 34, 12  # between columns / stacked boxes
LINE_GAP = 22  # between wrapped lines of one band
BAND_PAD, BAND_TITLE = 12, 22  # inner padding, title strip
BAND_GAP = 46  # between bands: room for the transfer labels
WIDTH = 1400  # least natural width in px; the report scales the picture to its box
ASPECT = 1.8  # width / height of the report's graph box on a laptop screen (80vh of 16:10)
SHARED_STAGE_EDGE = "#333333"  # cross-stage edge between stages on the same devices
INNER_EDGE = "#9aa3ab"


@dataclass
class Box:
    """One drawn box: a node, or a module group of the coarse view."""

    id: str
    stage: int
    label: str
    tip: str
    members: list[str]
    x: float = 0.0
    y: float = 0.0


@dataclass
class Arrow:
    """One drawn edge; ``cross`` edges leave their stage and carry ``nbytes``."""

    src: str
    dst: str
    cross: bool
    transfer: bool = False
    nbytes: int = 0
    seconds: float = 0.0


@dataclass
class GraphLayout:
    """Boxes with positions, arrows, and each stage band's rectangle (x, y, w, h)."""

    boxes: dict[str, Box]
    arrows: list[Arrow]
    bands: dict[int, tuple[float, float, float, float]]
    width: float
    height: float


def stage_layers(plan: Plan, stage: int) -> tuple[str, str]:
    """The first and last layer a stage runs, by module path (node name when module-less)."""
    info = {n.name: n for n in plan.nodes}
    names = [n for n in plan.stage_nodes(stage) if info[n].op != "placeholder"]
    names = names or plan.stage_nodes(stage)
    if not names:
        return "-", "-"
    label = [info[n].module_path or n for n in (names[0], names[-1])]
    return label[0], label[1]


def _boxes(plan: Plan, groups: list[NodeGroup] | None) -> list[Box]:
    info = {n.name: n for n in plan.nodes}
    if groups is None:
        placed = plan.placement()
        return [
            Box(
                f"n{i}",
                placed[n.name],
                n.name,
                f"{n.name} · {n.kind} ({n.target}) · output {human_bytes(n.out_bytes)}",
                [n.name],
            )
            for i, n in enumerate(plan.nodes)
        ]
    kinds = {d.name: d.kind for d in plan.cluster.devices}
    out = []
    for g in groups:
        kind = kinds[plan.stages[g.stage].devices[0]]
        secs = sum(info[m].time_s.get(kind, 0.0) for m in g.members)
        tip = f"{g.key} · {len(g.members)} ops · {human_time(secs)}: " + ", ".join(g.members[:12])
        out.append(
            Box(g.id, g.stage, g.key, tip + (" …" if len(g.members) > 12 else ""), g.members)
        )
    return out


def _arrows(plan: Plan, box_of: dict[str, Box]) -> list[Arrow]:
    """Inner edges once per box pair; cross-stage edges once per (source box, receiving stage)."""
    stage_of = {b.id: b.stage for b in box_of.values()}
    pairs = box_edges(plan, box_of)
    arrows = [Arrow(a, b, cross=False) for a, b in pairs if stage_of[a] == stage_of[b]]
    seconds = {(t.tensor, t.dst_stage): t.time_s for t in plan.transfers}
    for (src, reader), tensors in pairs.items():
        sender, stage = stage_of[src], stage_of[reader]
        if sender == stage:
            continue
        arrows.append(
            Arrow(
                src,
                reader,
                cross=True,
                transfer=plan.stages[sender].devices != plan.stages[stage].devices,
                nbytes=sum(tensors.values()),
                seconds=sum(seconds.get((t, stage), 0.0) for t in tensors),
            )
        )
    return arrows


def _depths(plan: Plan, box_of: dict[str, Box]) -> dict[str, int]:
    """Longest path from the inputs, per box (boxes take their first member's depth)."""
    preds: dict[str, list[str]] = {}
    for src, dst, _ in plan.edges:
        preds.setdefault(dst, []).append(src)
    depth: dict[str, int] = {}
    for n in plan.nodes:  # topological order
        depth[n.name] = 1 + max((depth.get(p, 0) for p in preds.get(n.name, [])), default=-1)
    out: dict[str, int] = {}
    for name, box in box_of.items():
        out.setdefault(box.id, depth[name])
    return out


def layout_graph(plan: Plan, groups: list[NodeGroup] | None = None) -> GraphLayout:
    """Place every box: bands per stage, columns by depth, lines as wide as :func:`_fit_line`."""
    boxes = _boxes(plan, groups)
    box_of = {m: b for b in boxes for m in b.members}
    depth = _depths(plan, box_of)
    stacks: list[list[list[Box]]] = []  # per stage: its columns, each a stack of boxes
    for stage in plan.stages:
        columns: dict[int, list[Box]] = {}
        for b in boxes:
            if b.stage == stage.index:
                columns.setdefault(depth[b.id], []).append(b)
        stacks.append([columns[d] for d in sorted(columns)])
    per_line = _fit_line(stacks)
    width = 2 * BAND_PAD + per_line * (BOX_W + GAP_X) - GAP_X
    bands: dict[int, tuple[float, float, float, float]] = {}
    y = 0.0
    for stage, ordered in zip(plan.stages, stacks, strict=True):
        top = y
        y += BAND_TITLE + BAND_PAD
        for start in range(0, len(ordered), per_line):
            line = ordered[start : start + per_line]
            for i, column in enumerate(line):
                for j, b in enumerate(column):
                    b.x = BAND_PAD + i * (BOX_W + GAP_X)
                    b.y = y + j * (BOX_H + GAP_Y)
            y += max(len(c) for c in line) * (BOX_H + GAP_Y) - GAP_Y + LINE_GAP
        y += BAND_PAD - (LINE_GAP if ordered else 0)
        bands[stage.index] = (0.0, top, float(width), y - top)
        y += BAND_GAP
    return GraphLayout(
        {b.id: b for b in boxes}, _arrows(plan, box_of), bands, float(width), max(y - BAND_GAP, 1)
    )


def _height(stacks: list[list[list[Box]]], per_line: int) -> float:
    """The picture's height when every line holds ``per_line`` columns."""
    y = 0.0
    for ordered in stacks:
        y += BAND_TITLE + 2 * BAND_PAD + BAND_GAP - LINE_GAP
        for start in range(0, len(ordered), per_line):
            tallest = max(len(c) for c in ordered[start : start + per_line])
            y += tallest * (BOX_H + GAP_Y) - GAP_Y + LINE_GAP
    return y


def _fit_line(stacks: list[list[list[Box]]]) -> int:
    """Columns per line: at least :data:`WIDTH`'s worth, widened until the picture is
    about as wide as a screen's graph box is (ASPECT), so "fit" fills the box instead
    of showing a thin tall strip."""
    longest = max((len(s) for s in stacks), default=1)
    per_line = max(1, int((WIDTH - 2 * BAND_PAD + GAP_X) // (BOX_W + GAP_X)))
    while per_line < longest:
        width = 2 * BAND_PAD + per_line * (BOX_W + GAP_X) - GAP_X
        if width >= ASPECT * _height(stacks, per_line):
            break
        per_line += 1
    return per_line


def _two_lines(text: str, limit: int = 19) -> tuple[str, str]:
    """A label cut into two short lines (dotted paths break at dots), the rest elided."""
    if len(text) <= limit:
        return text, ""
    cut = text.rfind(".", 0, limit + 1)
    cut = cut + 1 if cut > 0 else limit
    rest = text[cut:]
    return text[:cut], rest if len(rest) <= limit else "…" + rest[-(limit - 1) :]


def _path(a: Box, b: Box) -> str:
    """A curve from a's right side to b's left side, or top-down when b is not to the right."""
    if b.x > a.x:
        x0, y0, x1, y1 = a.x + BOX_W, a.y + BOX_H / 2, b.x, b.y + BOX_H / 2
        mid = (x0 + x1) / 2
        return f"M{x0:.1f},{y0:.1f} C{mid:.1f},{y0:.1f} {mid:.1f},{y1:.1f} {x1:.1f},{y1:.1f}"
    x0, y0, x1, y1 = a.x + BOX_W / 2, a.y + BOX_H, b.x + BOX_W / 2, b.y
    if y1 <= y0:  # same line, to the left (rare): leave from the bottom, enter from the top
        y1 = b.y
    mid = (y0 + y1) / 2
    return f"M{x0:.1f},{y0:.1f} C{x0:.1f},{mid:.1f} {x1:.1f},{mid:.1f} {x1:.1f},{y1:.1f}"


def layout_svg(plan: Plan, groups: list[NodeGroup] | None = None) -> str:
    """The partitioned graph as one ``<svg>`` element (px units, viewBox = natural size)."""
    lay = layout_graph(plan, groups)
    colors = device_colors(plan)
    w, h = lay.width, lay.height
    parts = [
        f'<svg class="graph" xmlns="http://www.w3.org/2000/svg" width="{w:.0f}" '
        f'height="{h:.0f}" viewBox="0 0 {w:.0f} {h:.0f}" font-family="sans-serif" '
        'font-size="10" role="img" aria-label="partitioned graph">',
        "<defs>",
        *(
            f'<marker id="arrow-{name}" viewBox="0 0 10 10" refX="9" refY="5" '
            f'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
            f'<path d="M0,0 L10,5 L0,10 z" fill="{color}"/></marker>'
            for name, color in (
                ("inner", INNER_EDGE),
                ("shared", SHARED_STAGE_EDGE),
                ("transfer", TRANSFER_COLOR),
            )
        ),
        "</defs>",
    ]
    parts += (_band_svg(plan, stage, lay, colors) for stage in plan.stages)
    boxes = lay.boxes
    for arrow in (a for a in lay.arrows if not a.cross):
        a, b = boxes[arrow.src], boxes[arrow.dst]
        parts.append(
            f'<path class="edge" d="{_path(a, b)}" fill="none" stroke="{INNER_EDGE}" '
            'stroke-width="1" marker-end="url(#arrow-inner)"/>'
        )
    for stage in plan.stages:
        parts += _stage_boxes_svg(stage, lay, colors, linked=groups is not None)
    parts += (_cross_arrow_svg(arrow, lay) for arrow in lay.arrows if arrow.cross)
    parts.append("</svg>")
    return "".join(parts)


def _band_svg(plan: Plan, stage: PlanStage, lay: GraphLayout, colors: dict[str, str]) -> str:
    """A stage's band: its rectangle in its device's colour, titled with its layers."""
    x, y, bw, bh = lay.bands[stage.index]
    edge = colors.get(stage.devices[0], "#888888")
    first, last = stage_layers(plan, stage.index)
    title = f"{stage_label(plan, stage)} · layers {first} → {last}"
    return (
        f'<g class="cluster stage" id="stage_{stage.index}"><title>cluster_stage_'
        f"{stage.index}</title>"
        f'<rect x="{x + 1:.1f}" y="{y + 1:.1f}" width="{bw - 2:.1f}" height="{bh - 2:.1f}" '
        f'rx="8" fill="#fafafa" stroke="{edge}" stroke-width="2.5"/>'
        f'<text x="{x + BAND_PAD:.1f}" y="{y + 16:.1f}" font-size="12" font-weight="600" '
        f'fill="#1d232a">{_e(title)}</text></g>'
    )


def _stage_boxes_svg(
    stage: PlanStage, lay: GraphLayout, colors: dict[str, str], *, linked: bool
) -> list[str]:
    """A stage's boxes, filled with its devices' colours (``linked``: to the group list)."""
    parts = []
    fills = [lighten(colors.get(d, "#bab0ac")) for d in stage.devices]
    fill = fills[0]
    if len(fills) > 1:  # a device group: the box shows every member's colour
        parts.append(
            f'<defs><linearGradient id="group-{stage.index}">'
            + "".join(
                f'<stop offset="{i / (len(fills) - 1):.3f}" stop-color="{c}"/>'
                for i, c in enumerate(fills)
            )
            + "</linearGradient></defs>"
        )
        fill = f"url(#group-{stage.index})"
    for b in (b for b in lay.boxes.values() if b.stage == stage.index):
        one, two = _two_lines(b.label)
        text = (
            f'<text x="{b.x + 6:.1f}" y="{b.y + (13 if two else 19):.1f}" fill="#111">'
            f"{_e(one)}</text>"
        )
        if two:
            text += f'<text x="{b.x + 6:.1f}" y="{b.y + 25:.1f}" fill="#111">{_e(two)}</text>'
        node = (
            f'<g class="node" id="{_e(b.id)}"><title>{_e(b.tip)}</title>'
            f'<rect x="{b.x:.1f}" y="{b.y:.1f}" width="{BOX_W}" height="{BOX_H}" rx="4" '
            f'fill="{fill}" stroke="#55606b" stroke-width="0.6"/>{text}</g>'
        )
        if linked:
            node = f'<a href="#grp-{_e(b.id)}">{node}</a>'
        parts.append(node)
    return parts


def _cross_arrow_svg(arrow: Arrow, lay: GraphLayout) -> str:
    """A value sent to another stage: red and dashed across devices, labelled with its bytes."""
    a, b = lay.boxes[arrow.src], lay.boxes[arrow.dst]
    kind = "transfer" if arrow.transfer else "shared"
    color = TRANSFER_COLOR if arrow.transfer else SHARED_STAGE_EDGE
    dash = ' stroke-dasharray="6 3"' if arrow.transfer else ""
    label = human_bytes(arrow.nbytes) + (f" · {human_time(arrow.seconds)}" if arrow.seconds else "")
    tip = f"{a.label} (stage {a.stage}) → {b.label} (stage {b.stage}): {label} per micro-batch"
    x0, y0 = a.x + BOX_W / 2, a.y + BOX_H
    x1, y1 = b.x + BOX_W / 2, b.y
    if y1 <= y0:  # a later stage drawn above is impossible, but stay safe
        y0, y1 = a.y, b.y + BOX_H
    mid = (y0 + y1) / 2
    return (
        f'<g class="{kind}"><title>{_e(tip)}</title><path d="M{x0:.1f},{y0:.1f} '
        f'C{x0:.1f},{mid:.1f} {x1:.1f},{mid:.1f} {x1:.1f},{y1:.1f}" fill="none" '
        f'stroke="{color}" stroke-width="2"{dash} marker-end="url(#arrow-{kind})"/>'
        f'<text x="{(x0 + x1) / 2 + 4:.1f}" y="{mid - 3:.1f}" fill="{color}" '
        f'font-size="10">{_e(label)}</text></g>'
    )
