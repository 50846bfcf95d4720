"""The pipeline timeline of a simulated plan as inline SVG.

One row per device, one box per forward (light) or backward (dark) action in
the device's colour (the colour means "this device" in every picture of the
report), labelled with its micro-batch ("F3", "B3"), so the bubbles of the
schedule show as the grey gaps between boxes. A device running several
stages (an interleaved schedule) draws each one's boxes apart: class
``vstage-j`` for its ``j``-th stage, the later ones lighter and outlined.
The transfer part of an action (the simulator's ``"T"`` events) runs as a
thin red lane under its device.
The drawing takes any object shaped like
``crosscut.partitioner.simulate.Simulation`` (see :class:`SimulationLike`), so
tests and other simulators can draw without importing the partitioner.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Protocol

from crosscut.ir.plan import Plan
from crosscut.viz.dot import TRANSFER_COLOR, device_colors, lighten

__all__ = ["EventLike", "SimulationLike", "action_color", "nice_step", "timeline_svg"]


class EventLike(Protocol):
    """One action on one device: ``kind`` is "F", "B" or "T" (transfer)."""

    @property
    def device(self) -> str: ...
    @property
    def stage(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def microbatch(self) -> int: ...
    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...


class SimulationLike(Protocol):
    """What the visualizer reads from a simulation of a plan's schedule."""

    @property
    def events(self) -> Sequence[EventLike]: ...
    @property
    def step_time_s(self) -> float: ...
    @property
    def bubble_fraction(self) -> float: ...
    @property
    def device_busy_s(self) -> Mapping[str, float]: ...
    @property
    def device_peak_bytes(self) -> Mapping[str, int]: ...


_WHAT = {
    "F": "forward",
    "B": "backward",
    "W": "weight-gradient backward",
    "T": "transfer",
    "R": "gradient all-reduce",
}


def _darken(color: str, amount: float) -> str:
    """``color`` (#rrggbb) mixed with black by ``amount``."""
    r, g, b = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c * (1.0 - amount)):02x}" for c in (r, g, b))


def action_color(device_color: str, kind: str) -> str:
    """A forward in the device's colour lightened, a backward in the colour itself, the
    weight-gradient part of a split backward (``W``) darkened."""
    if kind == "F":
        return lighten(device_color, 0.45)
    return _darken(device_color, 0.45) if kind == "W" else device_color


def _text_on(fill: str) -> str:
    """Black text on light fills, white on dark ones (relative luminance of an #rrggbb)."""
    r, g, b = (int(fill[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return "#111" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.45 else "#fff"


def nice_step(span: float, ticks: int = 8) -> float:
    """A 1-2-5 tick step giving about ``ticks`` ticks over ``span``."""
    if span <= 0:
        return 1.0
    raw = span / ticks
    mag = 10.0 ** math.floor(math.log10(raw))
    return next(float(m * mag) for m in (1, 2, 5, 10) if m * mag >= raw)


def _rows(plan: Plan, sim: SimulationLike) -> dict[str, list[EventLike]]:
    """Device -> events, in cluster order; a device group shares its stage's boxes."""
    rows: dict[str, list[EventLike]] = {d: [] for d in plan.used_devices()}
    for e in sim.events:
        rows.setdefault(e.device, []).append(e)
    for st in plan.stages:  # the simulator may report a cross-shaped stage on its first device
        if len(st.devices) > 1:
            lead = [e for e in rows.get(st.devices[0], []) if e.stage == st.index]
            for d in st.devices[1:]:
                if not any(e.stage == st.index for e in rows[d]):
                    rows[d].extend(lead)
    order = [d.name for d in plan.cluster.devices]
    return {d: rows[d] for d in sorted(rows, key=lambda d: order.index(d) if d in order else 99)}


def _box(
    e: EventLike, at: tuple[float, float, float, float], fill: str, v: int, tip: str
) -> list[str]:
    """One F/B/W action's box at ``at`` (x, row top, width, height), labelled when wide
    enough; ``v``: its stage's place on a device running several (-1: the only one)."""
    x0, y, w, h = at
    # a later virtual stage of the device: its own class, lighter, outlined dark
    edge = 'stroke="#fff" stroke-width="0.5"'
    if v > 0:
        fill, edge = lighten(fill, 0.35), 'stroke="#333" stroke-width="1"'
    vclass = f" vstage-{v}" if v >= 0 else ""
    out = [
        f'<rect class="ev ev-{html.escape(e.kind)}{vclass}" x="{x0:.1f}" y="{y + 2}" '
        f'width="{w:.1f}" height="{h}" fill="{fill}" {edge}><title>{tip}</title></rect>'
    ]
    label = f"{html.escape(e.kind)}{e.microbatch}"
    if w > 7 * len(label) + 4:
        out.append(
            f'<text x="{x0 + w / 2:.1f}" y="{y + (h + 4) / 2 + 4:.1f}" text-anchor="middle" '
            f'fill="{_text_on(fill)}" pointer-events="none">{label}</text>'
        )
    return out


def timeline_svg(plan: Plan, sim: SimulationLike, *, width: int = 1200) -> str:
    """An SVG Gantt chart of ``sim``: rows = devices, x = time in ms."""
    rows = _rows(plan, sim)
    colors = device_colors(plan)
    # a device running several stages (an interleaved schedule): each one's boxes apart
    hosted: dict[str, list[int]] = {}
    for st in plan.stages:
        hosted.setdefault(st.devices[0], []).append(st.index)
    span = max([sim.step_time_s, *(e.end for e in sim.events)], default=0.0) or 1e-9
    left, right, top, row_h, lane = 130, 20, 28, 30, 7
    plot = width - left - right
    height = top + len(rows) * (row_h + lane + 6) + 40

    def x(t: float) -> float:
        return left + t / span * plot

    parts = [
        f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" '
        'font-size="11" role="img" aria-label="pipeline timeline">'
    ]
    step = nice_step(span * 1e3) / 1e3
    t = 0.0
    axis_y = top + len(rows) * (row_h + lane + 6)
    while t <= span * 1.0001:
        parts.append(
            f'<line x1="{x(t):.1f}" y1="{top - 6}" x2="{x(t):.1f}" y2="{axis_y}" '
            'stroke="#ddd" stroke-width="1"/>'
            f'<text x="{x(t):.1f}" y="{axis_y + 14}" text-anchor="middle" fill="#444">'
            f"{t * 1e3:.4g}</text>"
        )
        t += step
    parts.append(
        f'<text x="{left + plot / 2:.0f}" y="{axis_y + 30}" text-anchor="middle" '
        'fill="#222">time (ms)</text>'
    )
    for i, (dev, events) in enumerate(rows.items()):
        y = top + i * (row_h + lane + 6)
        parts.append(
            f'<text x="{left - 8}" y="{y + row_h / 2 + 4:.1f}" text-anchor="end" '
            f'fill="#222">{html.escape(dev)}</text>'
            f'<rect class="row" x="{left}" y="{y}" width="{plot}" height="{row_h}" '
            'fill="#eeeeee"/>'
        )
        for e in events:
            x0, x1 = x(e.start), x(e.end)
            w = max(x1 - x0, 0.5)
            tip = html.escape(
                f"{dev} stage {e.stage} {_WHAT.get(e.kind, e.kind)} of micro-batch {e.microbatch}: "
                f"{e.start * 1e3:.3f}–{e.end * 1e3:.3f} ms"
            )
            if e.kind == "T":
                parts.append(
                    f'<rect class="ev ev-T" x="{x0:.1f}" y="{y + row_h + 1}" width="{w:.1f}" '
                    f'height="{lane - 2}" fill="{TRANSFER_COLOR}"><title>{tip}</title></rect>'
                )
                continue
            if e.kind == "R":  # the replicas' all-reduce: communication, not a stage's compute
                parts.append(
                    f'<rect class="ev ev-R" x="{x0:.1f}" y="{y + 2}" width="{w:.1f}" '
                    f'height="{row_h - 4}" fill="#9aa3ab"><title>{tip}</title></rect>'
                )
                continue
            mine = hosted.get(dev, [])
            v = mine.index(e.stage) if len(mine) > 1 and e.stage in mine else -1
            fill = action_color(colors.get(dev, "#bab0ac"), e.kind)
            parts += _box(e, (x0, y, w, row_h - 4), fill, v, tip)
    parts.append("</svg>")
    return "".join(parts)
