"""The visualizer: DOT structure, SVG via Graphviz, the HTML report, the summary, render()."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crosscut.errors import CrosscutError
from crosscut.ir.plan import Plan
from crosscut.viz import (
    VizError,
    plan_to_dot,
    plan_to_html,
    render,
    render_dot,
    summary_text,
    timeline_svg,
)
from crosscut.viz.dot import PALETTE, coarsen, human_bytes, human_time, view_groups
from tests.plan_factory import make_plan, make_simulation, rename_node

BYTES = re.compile(r"\d+(\.\d+)? (B|KiB|MiB|GiB|TiB)")


@pytest.fixture(scope="module")
def plan() -> Plan:
    return make_plan(120, 4)


@pytest.fixture(scope="module")
def big() -> Plan:
    return make_plan(1650, 8)


def _boxes(dot: str) -> dict[str, int]:
    """DOT box id -> stage, read back from the cluster blocks."""
    out: dict[str, int] = {}
    stage = -1
    for line in dot.splitlines():
        if m := re.match(r"\s*subgraph cluster_stage_(\d+) \{", line):
            stage = int(m.group(1))
        elif line.startswith("  }"):
            stage = -1
        elif (m := re.match(r"\s+([ng]\d+) \[", line)) and stage >= 0:
            out[m.group(1)] = stage
    return out


def _edges(dot: str) -> list[tuple[str, str, str]]:
    return [
        (m.group(1), m.group(2), m.group(3) or "")
        for m in re.finditer(r"^\s+([ng]\d+) -> ([ng]\d+)(?: \[(.*)\])?;$", dot, re.M)
    ]


def _stage_clusters(svg: str) -> list[str]:
    """Stage clusters of Graphviz's SVG or of crosscut's own layout (viz/layout.py)."""
    return re.findall(
        r'<g (?:id="clust\d+" class="cluster"|class="cluster stage" id="stage_\d+")>'
        r"\s*<title>(cluster_stage_\d+)</title>",
        svg,
    )


# ---- factory -------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "d"), [(30, 2), (120, 4), (1650, 8)])
def test_factory_plans_are_schema_valid_and_forward(n: int, d: int) -> None:
    p = make_plan(n, d)
    assert Plan.from_dict(p.to_dict()) == p
    assert len(p.nodes) >= n - 30 and len(p.cluster.devices) == d
    assert all(p.assignment[u] <= p.assignment[v] for u, v, _ in p.edges)
    assert p.transfers and {t.tensor for t in p.transfers} <= {u for u, _, _ in p.edges}
    assert any(len(s.devices) > 1 for s in p.stages) == (d >= 3)


def test_human_units() -> None:
    assert human_bytes(0) == "0 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 << 30) == "3 GiB"
    assert human_time(0.0123) == "12.3 ms" and human_time(2e-5) == "20 µs"


# ---- DOT -----------------------------------------------------------------------------
def test_dot_has_one_cluster_per_stage_with_label(plan: Plan) -> None:
    dot = plan_to_dot(plan, coarse=False)
    assert len(re.findall(r"subgraph cluster_stage_\d+ \{", dot)) == plan.num_stages
    for s in plan.stages:
        assert f'label="stage {s.index} · {"+".join(s.devices)}' in dot
    group = next(s for s in plan.stages if len(s.devices) > 1)
    assert f"({group.split} split ×{len(group.devices)})" in dot
    assert set(_boxes(dot)) == {f"n{i}" for i in range(len(plan.nodes))}


def test_dot_every_cross_stage_edge_carries_bytes(plan: Plan) -> None:
    dot = plan_to_dot(plan, coarse=False)
    stage_of = _boxes(dot)
    crossing = [e for e in _edges(dot) if stage_of[e[0]] != stage_of[e[1]]]
    want = {(u, v) for u, v, _ in plan.edges if plan.assignment[u] != plan.assignment[v]}
    assert len(crossing) == len(want) > 0
    for _, _, attrs in crossing:
        assert BYTES.search(attrs), attrs
    devices = {s.index: s.devices for s in plan.stages}
    for a, b, attrs in crossing:
        assert ("dashed" in attrs) == (devices[stage_of[a]] != devices[stage_of[b]])
    inner = [e for e in _edges(dot) if stage_of[e[0]] == stage_of[e[1]]]
    assert inner and not any("label=" in attrs for _, _, attrs in inner)


def test_dot_colour_per_device_and_legend(plan: Plan) -> None:
    dot = plan_to_dot(plan, coarse=False)
    legend = dot[dot.index("subgraph cluster_legend") : dot.index("subgraph cluster_stage_0")]
    for i, d in enumerate(plan.cluster.devices):
        assert f"{d.name} · {d.kind}" in legend and PALETTE[i] in legend
    fills = {m.group(1) for m in re.finditer(r'fillcolor="([#0-9a-f:]+)", tooltip', dot)}
    assert len(fills) == plan.num_stages  # one fill per stage's device (group)
    assert any(":" in f for f in fills)  # the device group's nodes blend its colours
    assert "gradientangle=0" in dot


def test_dot_survives_hostile_names(plan: Plan) -> None:
    p = rename_node(plan, plan.nodes[5].name, 'a"b\\n}c')
    dot = plan_to_dot(p, coarse=False)
    assert 'a\\"b\\\\n}c' in dot


# ---- coarse view ----------------------------------------------------------------------
def test_coarse_view_of_1600_nodes_stays_small_and_exact(big: Plan) -> None:
    assert len(big.nodes) >= 1600
    groups = view_groups(big)
    assert groups is not None and len(groups) <= 400
    members = [m for g in groups for m in g.members]
    assert sorted(members) == sorted(n.name for n in big.nodes)
    assert all(big.assignment[m] == g.stage for g in groups for m in g.members)
    dot = plan_to_dot(big)
    boxes = _boxes(dot)
    assert len(boxes) == len(groups) <= 400
    group_of = {m: g.id for g in groups for m in g.members}
    want = {(group_of[u], group_of[v]) for u, v, _ in big.edges if group_of[u] != group_of[v]}
    assert {(a, b) for a, b, _ in _edges(dot)} == want


def test_coarsen_caps_boxes_even_without_module_paths(plan: Plan) -> None:
    data = plan.to_dict()
    for n in data["nodes"]:
        n["module_path"] = ""
    flat = Plan.from_dict(data)
    assert len(coarsen(flat, 400)) == flat.num_stages  # one "(top)" run per stage
    deep = coarsen(plan, 400, target=5)
    assert plan.num_stages <= len(deep) <= 5 + plan.num_stages


def test_coarse_svg_renders_quickly(big: Plan, graphviz: None) -> None:
    t0 = time.perf_counter()
    svg = render_dot(plan_to_dot(big), "svg").decode()
    assert time.perf_counter() - t0 < 20
    assert sorted(_stage_clusters(svg)) == sorted(
        f"cluster_stage_{i}" for i in range(big.num_stages)
    )


# ---- SVG / render ---------------------------------------------------------------------
def test_svg_has_one_cluster_group_per_stage(plan: Plan, graphviz: None) -> None:
    svg = render_dot(plan_to_dot(plan, coarse=False)).decode()
    assert len(_stage_clusters(svg)) == plan.num_stages
    assert svg.count('class="cluster"') == plan.num_stages + 1  # + the legend


@pytest.mark.parametrize("suffix", [".html", ".svg", ".dot", ".png"])
def test_render_dispatches_on_suffix(
    plan: Plan, tmp_path: Path, suffix: str, request: pytest.FixtureRequest
) -> None:
    if suffix in (".svg", ".png", ".html"):
        request.getfixturevalue("graphviz")
    out = render(plan, tmp_path / f"sub/plan{suffix}", simulation=make_simulation(plan))
    data = out.read_bytes()
    head = {
        ".html": b"<!DOCTYPE html>",
        ".svg": b"<?xml",
        ".dot": b"digraph",
        ".png": b"\x89PNG\r\n\x1a\n",
    }[suffix]
    assert data.startswith(head) and len(data) > 1000
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temp file left
    assert oct(out.stat().st_mode & 0o777) == "0o644"


def test_render_rejects_unknown_suffix(plan: Plan, tmp_path: Path) -> None:
    with pytest.raises(VizError, match=r"\.html, \.svg, \.dot, \.png") as info:
        render(plan, tmp_path / "plan.pdf")
    assert isinstance(info.value, CrosscutError) and not list(tmp_path.iterdir())


def test_missing_dot_gives_install_hint(
    plan: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no `dot`
    with pytest.raises(VizError, match="apt-get install graphviz") as info:
        render_dot("digraph { a -> b }")
    assert "brew install graphviz" in str(info.value)
    with pytest.raises(VizError, match="Graphviz"):
        render(plan, tmp_path / "plan.png")
    assert render(plan, tmp_path / "plan.dot").read_text().startswith("digraph")
    svg = render(plan, tmp_path / "plan.svg").read_text()  # crosscut's own layout instead
    assert svg.startswith("<?xml") and len(_stage_clusters(svg)) == plan.num_stages
    page = plan_to_html(plan, simulation=make_simulation(plan))
    assert len(_stage_clusters(page)) == plan.num_stages and 'class="timeline"' in page
    assert "install graphviz" not in page.lower()  # the report needs no Graphviz at all


# ---- HTML ----------------------------------------------------------------------------
def test_html_is_self_contained_with_timeline_and_bars(plan: Plan, graphviz: None) -> None:
    sim = make_simulation(plan)
    page = plan_to_html(plan, simulation=sim)
    refs = re.findall(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page, re.I)
    assert refs == [], refs
    urls = set(re.findall(r"https?://[^\s\"'<>]+", page))
    assert urls <= {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}, urls
    assert "<link" not in page and "<script src" not in page and "@import" not in page
    assert len(_stage_clusters(page)) == plan.num_stages
    timeline = page[page.index('<svg class="timeline"') :]
    timeline = timeline[: timeline.index("</svg>")]
    n_fb = sum(e.kind in "FB" for e in sim.events)
    assert timeline.count('class="ev ev-F"') + timeline.count('class="ev ev-B"') == n_fb
    assert timeline.count('class="ev ev-T"') == sum(e.kind == "T" for e in sim.events) > 0
    assert "time (ms)" in timeline
    assert page.count('class="bar') == plan.num_stages + 2 * len(plan.cluster.devices)
    for word in ("FEASIBLE", "dp_chain", "×1.07", "hint from dp_chain accepted", "resnet_like"):
        assert word in page


@pytest.mark.parametrize("coarse", [False, True])
def test_html_escapes_plan_text(plan: Plan, coarse: bool) -> None:
    evil = "<script>alert('x')</script>"
    victim = plan.transfers[0].tensor
    p = rename_node(plan, victim, evil)
    p.model.name = "<b>model</b>"
    p.solver.notes.append("<img src=x onerror=alert(1)>")
    page = plan_to_html(p, simulation=make_simulation(p), coarse=coarse)
    assert "<script>alert(" not in page and "<b>model" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(" in page and "&lt;b&gt;model" in page
    assert page.count("<script>") == 1  # only the report's own script


def test_html_coarse_view_lists_groups(big: Plan) -> None:
    page = plan_to_html(big)
    groups = view_groups(big)
    assert groups is not None
    assert page.count("<details class='grp'") == len(groups)
    assert f"{len(groups)} module groups for {len(big.nodes)} nodes" in page
    assert "no simulation was given" in page


def test_timeline_mirrors_group_stage_on_every_member(plan: Plan) -> None:
    sim = make_simulation(plan)
    lead_only = type(sim)(
        [e for e in sim.events if e.device == plan.stages[e.stage].devices[0]],
        sim.step_time_s,
        sim.bubble_fraction,
        sim.device_busy_s,
        sim.device_peak_bytes,
    )
    svg = timeline_svg(plan, lead_only)
    fb = sum(e.kind in "FB" for e in sim.events)  # mirrored back to the full count
    assert svg.count('class="ev ev-F"') + svg.count('class="ev ev-B"') == fb
    for d in plan.used_devices():
        assert f">{d}</text>" in svg


# ---- summary -------------------------------------------------------------------------
def test_summary_mentions_every_stage_and_the_solver(plan: Plan) -> None:
    text = summary_text(plan)
    for s in plan.stages:
        row = next(line for line in text.splitlines() if re.match(rf"\s*{s.index} \S", line))
        assert s.devices[0] in row and f"{s.compute_s * 1e3:.3g} ms" in row
    assert "FEASIBLE" in text and "gap 4.00%" in text and "bottleneck" in text
    assert f"{len(plan.transfers)}, " in text and "per micro-batch" in text
    for name in plan.solver.baselines:
        assert f"baseline {name}" in text
    assert "\x1b[" not in text  # plain text for logs
    # fits an 80-column terminal, one line per stage, and explains its words
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    assert "proven lower limit" in text and "one micro-batch through every stage" in text


# ---- boundaries ----------------------------------------------------------------------
def test_viz_never_imports_torch_or_solvers(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from tests.plan_factory import make_plan\n"
        "from crosscut.viz import render, summary_text\n"
        "p = make_plan(60, 3)\n"
        f"render(p, {str(tmp_path / 'p.html')!r}); render(p, {str(tmp_path / 'p.dot')!r})\n"
        "summary_text(p)\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ortools'}\n"
        "             | {m for m in sys.modules if m.startswith(('crosscut.runtime',\n"
        "                'crosscut.partitioner.solvers', 'crosscut.frontend'))})\n"
        "ours = sorted(m for m in sys.modules if m.startswith('crosscut'))\n"
        "print('forbidden:', bad, 'crosscut modules loaded:', ours)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'class="timeline"' in (tmp_path / "p.html").read_text()  # simulated by render
