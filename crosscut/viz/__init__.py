"""Pictures of a Plan: DOT/SVG/PNG of the partitioned DAG, an HTML report, a terminal summary.

The visualizer reads only a Plan (and optionally a simulation of it); it never
imports torch, the solvers or the runtime, so ``crosscut show plan.json`` works
on a laptop that only has the plan file. :func:`render` picks the format from
the output suffix and writes atomically, so a viewer never sees half a file.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from crosscut.errors import CrosscutError
from crosscut.fileio import check_writable, write_atomic
from crosscut.ir.plan import Plan
from crosscut.viz.dot import INSTALL_HINT, VizError, plan_to_dot, render_dot, view_groups
from crosscut.viz.html import plan_to_html
from crosscut.viz.layout import layout_svg
from crosscut.viz.summary import print_summary, summary_text
from crosscut.viz.timeline import EventLike, SimulationLike, timeline_svg

__all__ = [
    "FORMATS",
    "INSTALL_HINT",
    "EventLike",
    "SimulationLike",
    "VizError",
    "default_simulation",
    "layout_svg",
    "plan_to_dot",
    "plan_to_html",
    "print_summary",
    "render",
    "render_dot",
    "summary_text",
    "timeline_svg",
]

FORMATS = (".html", ".svg", ".dot", ".png")


def default_simulation(plan: Plan) -> SimulationLike | None:
    """Simulate ``plan``'s schedule for the timeline, or None if that is impossible.

    A report without a timeline is still worth writing, so a plan the simulator
    rejects (a CrosscutError) or a checkout without the simulator yields None.
    """
    try:
        from crosscut.partitioner.simulate import simulate
    except ImportError:
        return None
    try:
        return simulate(plan)
    except CrosscutError:
        return None


def render(
    plan: Plan,
    out_path: str | os.PathLike[str],
    *,
    simulation: SimulationLike | None = None,
    coarse: bool | None = None,
    max_nodes: int = 400,
) -> Path:
    """Write ``plan`` to ``out_path`` as .html, .svg, .dot or .png (chosen by suffix).

    HTML simulates the plan when no ``simulation`` is given and draws the graph
    with crosscut's own layout (:mod:`crosscut.viz.layout`). SVG is Graphviz's
    drawing when ``dot`` is on PATH and that same layout when it is not; PNG
    needs Graphviz. DOT and HTML need nothing but the plan.
    """
    out = Path(out_path)
    suffix = out.suffix.lower()
    if suffix not in FORMATS:
        raise VizError(
            "a plan picture's file suffix names its format",
            value=out.name,
            remedy=f"use one of {', '.join(FORMATS)}",
        )
    check_writable(out, "the picture")  # before the work, not after it
    data: bytes
    if suffix == ".html":
        sim = simulation if simulation is not None else default_simulation(plan)
        data = plan_to_html(plan, simulation=sim, coarse=coarse, max_nodes=max_nodes).encode()
    else:
        dot_src = plan_to_dot(plan, coarse=coarse, max_nodes=max_nodes)
        if suffix == ".svg" and shutil.which("dot") is None:  # Graphviz only makes it prettier
            groups = view_groups(plan, coarse=coarse, max_nodes=max_nodes)
            data = ('<?xml version="1.0" encoding="UTF-8"?>\n' + layout_svg(plan, groups)).encode()
        else:
            data = dot_src.encode() if suffix == ".dot" else render_dot(dot_src, suffix[1:])
    return write_atomic(out, data, "the picture")
