"""crosscut's own graph layout (viz/layout.py) and the report built on it, without Graphviz.

What a reader of the report must be able to trust: every node is drawn once,
inside its own stage's band, without overlapping another; a tensor sent to a
stage is one arrow however many ops read it there; red means a transfer and
nothing else; every number of the solver record has a unit. These tests read
the SVG/HTML text back, so they run on a machine with neither Graphviz nor a
browser (test_viz_browser.py checks the same page in Chromium).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from crosscut.ir.plan import Plan
from crosscut.viz import plan_to_dot, plan_to_html, render
from crosscut.viz.dot import (
    ATTENTION_COLOR,
    PALETTE,
    TRANSFER_COLOR,
    device_colors,
    view_groups,
)
from crosscut.viz.layout import BOX_H, BOX_W, layout_graph, layout_svg, stage_layers
from crosscut.viz.timeline import action_color
from tests.plan_factory import make_plan, make_simulation

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def plan() -> Plan:
    return make_plan(120, 4)


def _cross_pairs(plan: Plan) -> set[tuple[str, int]]:
    """(tensor, receiving stage) for every edge that leaves its stage."""
    placed = plan.placement()
    return {(a, placed[b]) for a, b, _ in plan.edges if placed[a] != placed[b]}


@pytest.mark.parametrize(("n", "d"), [(30, 2), (120, 4), (400, 6)])
def test_every_node_is_drawn_once_inside_its_band_without_overlap(n: int, d: int) -> None:
    plan = make_plan(n, d)
    lay = layout_graph(plan)
    drawn = [m for b in lay.boxes.values() for m in b.members]
    assert sorted(drawn) == sorted(x.name for x in plan.nodes)
    placed = plan.placement()
    for box in lay.boxes.values():
        assert box.stage == placed[box.members[0]]
        x, y, w, h = lay.bands[box.stage]
        assert x <= box.x and box.x + BOX_W <= x + w and y <= box.y and box.y + BOX_H <= y + h
        assert box.x + BOX_W <= lay.width and box.y + BOX_H <= lay.height
    spots = [(round(b.x), round(b.y)) for b in lay.boxes.values()]
    assert len(set(spots)) == len(spots)  # equal spots = two boxes on top of each other
    tops = [lay.bands[s.index][1] for s in plan.stages]
    assert tops == sorted(tops)  # stages top to bottom, in order


def test_parallel_branches_share_a_column() -> None:
    """A node and its shortcut sibling (same depth) stack in one column: no long chain."""
    plan = make_plan(120, 4)
    lay = layout_graph(plan)
    columns = {(round(b.x), b.stage) for b in lay.boxes.values()}
    assert len(columns) < len(lay.boxes)


def test_one_arrow_per_tensor_and_receiving_stage(plan: Plan) -> None:
    svg = layout_svg(plan)
    arrows = svg.count('<g class="transfer">') + svg.count('<g class="shared">')
    assert arrows == len(_cross_pairs(plan)) > 0
    dot = plan_to_dot(plan, coarse=False)
    cross = [line for line in dot.splitlines() if "->" in line and "label=" in line]
    assert len(cross) == len(_cross_pairs(plan))


def test_an_extra_reader_in_the_same_stage_adds_no_arrow(plan: Plan) -> None:
    """Reading a sent tensor once more inside the receiving stage is still one arrow."""
    placed = plan.placement()
    src, dst, size = next((a, b, s) for a, b, s in plan.edges if placed[a] != placed[b])
    other = next(
        n.name
        for n in plan.nodes
        if placed[n.name] == placed[dst]
        and n.name != dst
        and (src, n.name) not in {(a, b) for a, b, _ in plan.edges}
        and plan.nodes.index(n) > next(i for i, x in enumerate(plan.nodes) if x.name == src)
    )
    more = Plan.from_dict({**plan.to_dict(), "edges": [*map(list, plan.edges), [src, other, size]]})
    assert _cross_pairs(more) == _cross_pairs(plan)
    svg = layout_svg(more)
    assert svg.count('<g class="transfer">') + svg.count('<g class="shared">') == len(
        _cross_pairs(plan)
    )


def test_transfers_are_red_and_no_device_is(plan: Plan) -> None:
    assert TRANSFER_COLOR not in PALETTE and ATTENTION_COLOR not in PALETTE
    for colour in PALETTE:  # no device colour is red-ish or orange-ish either
        r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
        assert not (r > 180 and g < 150 and b < 150), colour
    svg = layout_svg(plan)
    crossing = {(t.tensor, t.dst_stage) for t in plan.transfers if t.src_device != t.dst_device}
    assert svg.count(f'stroke="{TRANSFER_COLOR}"') == svg.count('<g class="transfer">')
    assert svg.count('<g class="transfer">') <= len(crossing)


def test_stage_layers_name_first_and_last_layer(plan: Plan) -> None:
    page = plan_to_html(plan, simulation=make_simulation(plan))
    info = {n.name: n for n in plan.nodes}
    for s in plan.stages:
        first, last = stage_layers(plan, s.index)
        names = [n for n in plan.stage_nodes(s.index) if info[n].op != "placeholder"]
        assert last == (info[names[-1]].module_path or names[-1])
        assert f"<code>{first}</code> → <code>{last}</code>" in page


def test_solver_record_has_units_and_explains_the_bounds(plan: Plan) -> None:
    page = plan_to_html(plan, simulation=make_simulation(plan))
    record = page[page.index("id='solver'") :]
    for field in ("objective", "best bound", "lower bound"):
        row = re.search(rf"<th class='l'>{field}</th><td class='l'>([^<]*)</td>", record)
        assert row is not None, field
        assert re.fullmatch(r"[\d.]+ (µs|ms|s) per (micro-batch|step)", row.group(1)), row.group(1)
    for term in ("<dt>best bound</dt>", "<dt>lower bound</dt>", "<dt>optimality gap</dt>"):
        assert term in record


def test_a_tied_baseline_reads_tie_not_failure(plan: Plan) -> None:
    data = plan.to_dict()
    data["solver"]["baselines"] = {"same": data["solver"]["objective"]}
    data["solver"]["baselines"]["worse"] = data["solver"]["objective"] * 0.5
    tied = Plan.from_dict(data)
    page = plan_to_html(tied)
    assert re.search(r"×1\.00</td><td class='l'>tie</td>", page)
    assert re.search(r"×0\.50</td><td class='l'><span class='warn'>ours slower", page)


def test_timeline_draws_transfers_and_colours_boxes_by_device(plan: Plan) -> None:
    sim = make_simulation(plan)
    page = plan_to_html(plan, simulation=sim)
    timeline = page[page.index('<svg class="timeline"') :]
    timeline = timeline[: timeline.index("</svg>")]
    assert timeline.count(f'fill="{TRANSFER_COLOR}"') == sum(e.kind == "T" for e in sim.events)
    colours = device_colors(plan)
    fills = re.findall(r'class="ev ev-([FB])" [^>]*fill="([^"]+)"', timeline)
    want = {(k, action_color(colours[d], k)) for d in plan.used_devices() for k in "FB"}
    assert fills and set(fills) <= want


def test_report_renders_with_dot_hidden_from_path(tmp_path: Path) -> None:
    """A fresh machine: no Graphviz on PATH. The report still draws every stage."""
    plan = make_plan(120, 4)
    plan.save(tmp_path / "plan.json")
    script = (
        "import shutil, sys\n"
        "assert shutil.which('dot') is None, shutil.which('dot')\n"
        "from crosscut.ir.plan import Plan\n"
        "from crosscut.viz import render\n"
        "render(Plan.load(sys.argv[1]), sys.argv[2])\n"
    )
    env = {"PATH": str(tmp_path), "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "plan.json"), str(tmp_path / "r.html")],
        env=env,
        check=True,
        timeout=120,
    )
    page = (tmp_path / "r.html").read_text()
    stages = re.findall(r'<g class="cluster stage" id="stage_(\d+)">', page)
    assert sorted(map(int, stages)) == list(range(plan.num_stages))
    assert page.count('<g class="node"') == len(plan.nodes)
    assert "Graphviz" not in page


def test_coarse_layout_links_every_box_to_its_group() -> None:
    plan = make_plan(1650, 8)
    groups = view_groups(plan)
    assert groups is not None
    svg = layout_svg(plan, groups)
    assert svg.count('<g class="node"') == len(groups)
    assert set(re.findall(r'<a href="#grp-([^"]+)">', svg)) == {g.id for g in groups}


def test_svg_without_graphviz_is_our_layout(
    plan: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    out = render(plan, tmp_path / "plan.svg").read_text()
    assert out.startswith("<?xml") and '<svg class="graph"' in out
