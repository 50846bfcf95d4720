"""A self-contained HTML report of a plan: one file, no network, no build step.

Everything is inline (the DAG as Graphviz SVG, CSS, a few lines of JS), so the
report can be mailed, attached to CI, or opened from a laptop on a plane. The
page answers, top to bottom: what model on what cluster; how fast and how
sure (step time, bubble, solver status and gap); which device is busy or full
(compute and memory bars against the caps); when each device works (the
pipeline timeline); where the cuts are (the DAG, coarse for large graphs, with
a click-to-expand list of each module group's nodes); what crosses the wire
(transfers); and the solver's full record. Every string that came from the
plan is escaped.
"""

from __future__ import annotations

import html
import re

from crosscut.partitioner.plan import Plan
from crosscut.viz.dot import (
    TRANSFER_COLOR,
    NodeGroup,
    VizError,
    device_colors,
    human_bytes,
    human_time,
    plan_to_dot,
    render_dot,
    view_groups,
)
from crosscut.viz.summary import baseline_ratios, stage_cap
from crosscut.viz.timeline import SimulationLike, microbatch_color, timeline_svg

__all__ = ["plan_to_html", "strip_svg_prolog"]

_e = html.escape

_CSS = """
:root { --fg:#1d232a; --muted:#5b6670; --line:#d9dee3; --bg:#f6f7f9; --card:#fff; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;
       color:var(--fg); background:var(--bg); }
header { padding:18px 28px 10px; background:#1f2d3d; color:#fff; }
header h1 { margin:0 0 4px; font-size:22px; font-weight:600; }
header .sub { color:#c9d3dd; font-size:13px; }
main { padding:12px 28px 40px; max-width:1500px; }
section { background:var(--card); border:1px solid var(--line); border-radius:8px;
          padding:14px 18px; margin:14px 0; }
h2 { font-size:16px; margin:0 0 10px; }
.kpis { display:flex; flex-wrap:wrap; gap:10px; }
.kpi { background:var(--card); border:1px solid var(--line); border-radius:8px;
       padding:10px 14px; min-width:150px; }
.kpi .v { font-size:20px; font-weight:600; } .kpi .k { color:var(--muted); font-size:12px; }
table { border-collapse:collapse; font-size:13px; }
th, td { padding:4px 10px; border-bottom:1px solid var(--line); text-align:right;
         white-space:nowrap; }
th { color:var(--muted); font-weight:600; } td.l, th.l { text-align:left; }
tr.hot td { background:#fff4e5; }
.bar { position:relative; width:260px; height:16px; background:#e9ecef; border-radius:3px;
       overflow:hidden; display:inline-block; vertical-align:middle; }
.bar > span { position:absolute; left:0; top:0; bottom:0; }
.bar.over > span { background:#c0392b !important; }
.swatch { display:inline-block; width:12px; height:12px; border-radius:2px;
          vertical-align:middle; margin-right:6px; border:1px solid rgba(0,0,0,.2); }
.muted { color:var(--muted); } .warn { color:#a04000; } .bad { color:#c0392b; }
.scroll { overflow:auto; border:1px solid var(--line); border-radius:6px; background:#fff; }
#dag { max-height:80vh; cursor:grab; } #dag.drag { cursor:grabbing; }
#dag svg { display:block; }
.toolbar { margin:0 0 8px; display:flex; gap:6px; align-items:center; }
.toolbar button { font:inherit; padding:2px 10px; border:1px solid var(--line);
                  background:#fff; border-radius:4px; cursor:pointer; }
details.grp { margin:2px 0; } details.grp summary { cursor:pointer; }
details.grp[open] { background:#fffbe6; } details.grp ul { margin:4px 0 8px 18px; padding:0; }
code { font-size:12px; }
"""

_JS = """
(function () {
  var box = document.getElementById('dag');
  var svg = box && box.querySelector('svg');
  if (svg) {
    var vb = svg.viewBox && svg.viewBox.baseVal;
    var natural = vb && vb.width ? vb.width * 4 / 3 : svg.getBoundingClientRect().width;
    svg.removeAttribute('height');
    var scale = Math.min(1, (box.clientWidth - 4) / natural);
    var label = document.getElementById('zoom-level');
    var apply = function () {
      svg.setAttribute('width', Math.max(50, natural * scale));
      if (label) { label.textContent = Math.round(scale * 100) + '%'; }
    };
    apply();
    var zoom = function (f) { scale = Math.max(0.05, Math.min(8, scale * f)); apply(); };
    document.getElementById('zoom-in').onclick = function () { zoom(1.25); };
    document.getElementById('zoom-out').onclick = function () { zoom(0.8); };
    document.getElementById('zoom-fit').onclick = function () {
      scale = (box.clientWidth - 4) / natural; apply(); };
    document.getElementById('zoom-1').onclick = function () { scale = 1; apply(); };
    box.addEventListener('wheel', function (ev) {
      if (ev.ctrlKey) { ev.preventDefault(); zoom(ev.deltaY < 0 ? 1.1 : 0.9); }
    }, {passive: false});
    var drag = null;
    box.addEventListener('mousedown', function (ev) {
      if (ev.target.closest && ev.target.closest('a')) { return; }
      drag = [ev.clientX, ev.clientY, box.scrollLeft, box.scrollTop]; box.classList.add('drag');
    });
    window.addEventListener('mouseup', function () { drag = null; box.classList.remove('drag'); });
    window.addEventListener('mousemove', function (ev) {
      if (!drag) { return; }
      box.scrollLeft = drag[2] - (ev.clientX - drag[0]);
      box.scrollTop = drag[3] - (ev.clientY - drag[1]);
    });
  }
  var openHash = function () {
    var id = decodeURIComponent(location.hash.slice(1));
    var el = id && document.getElementById(id);
    if (el && el.tagName === 'DETAILS') { el.open = true; el.scrollIntoView({block: 'center'}); }
  };
  window.addEventListener('hashchange', openHash); openHash();
  var all = document.getElementById('groups-toggle');
  if (all) { all.onclick = function () {
    var ds = document.querySelectorAll('details.grp'), open = !ds[0].open;
    for (var i = 0; i < ds.length; i++) { ds[i].open = open; }
  }; }
})();
"""


def strip_svg_prolog(svg: str) -> str:
    """Drop the XML declaration, DOCTYPE and comments so the SVG can sit inside HTML."""
    start = svg.find("<svg")
    body = svg[start:] if start >= 0 else svg
    return re.sub(r"<!--.*?-->", "", body, flags=re.S).strip()


def _bar(frac: float, color: str, text: str) -> str:
    over = " over" if frac > 1 else ""
    width = max(0.0, min(frac, 1.0)) * 100
    return (
        f'<span class="bar{over}" title="{_e(text)}"><span style="width:{width:.1f}%;'
        f'background:{color}"></span></span> <span class="muted">{_e(text)}</span>'
    )


def _kpis(plan: Plan, sim: SimulationLike | None) -> str:
    p, r = plan.predicted, plan.solver
    step = sim.step_time_s if sim is not None else p.step_time_s
    bubble = sim.bubble_fraction if sim is not None else p.bubble_fraction
    status_cls = "" if r.status in ("OPTIMAL", "FEASIBLE", "REPLAYED", "MANUAL") else " warn"
    items = [
        ("step time" + (" (simulated)" if sim is not None else ""), human_time(step)),
        ("throughput", f"{p.throughput:.4g} samples/s"),
        ("bottleneck stage", human_time(p.bottleneck_s)),
        ("bubble", f"{bubble:.1%}"),
        ("stages / devices", f"{plan.num_stages} / {len(set(plan.used_devices()))}"),
        ("solver", f'<span class="{status_cls}">{_e(r.status or "-")}</span>'),
        ("gap", f"{r.gap:.2%}"),
    ]
    cells = "".join(
        f'<div class="kpi"><div class="v">{v if k == "solver" else _e(v)}</div>'
        f'<div class="k">{_e(k)}</div></div>'
        for k, v in items
    )
    return f'<div class="kpis">{cells}</div>'


def _stages(plan: Plan, colors: dict[str, str]) -> str:
    bottleneck = max(s.time_s for s in plan.stages)
    rows = []
    for s in plan.stages:
        cap = stage_cap(plan, s)
        frac = s.memory_bytes / cap if cap else 0.0
        devs = " ".join(
            f'<span class="swatch" style="background:{colors.get(d, "#999")}"></span>{_e(d)}'
            for d in s.devices
        )
        if len(s.devices) > 1:
            devs += f' <span class="muted">({_e(s.split)} split)</span>'
        hot = ' class="hot"' if s.time_s == bottleneck else ""
        rows.append(
            f"<tr{hot}><td>{s.index}</td><td class='l'>{devs}</td>"
            f"<td>{len(plan.stage_nodes(s.index))}</td><td>{s.compute_s * 1e3:.3f}</td>"
            f"<td>{s.comm_s * 1e3:.3f}</td><td>{s.time_s * 1e3:.3f}</td><td class='l'>"
            + _bar(frac, "#59a14f", f"{human_bytes(s.memory_bytes)} / {human_bytes(cap)}")
            + "</td></tr>"
        )
    head = (
        "<tr><th>stage</th><th class='l'>devices</th><th>nodes</th><th>compute ms</th>"
        "<th>comm ms</th><th>time ms</th><th class='l'>memory / cap</th></tr>"
    )
    return (
        "<section id='stages'><h2>Stages</h2><table>"
        + head
        + "".join(rows)
        + "</table><p class='muted'>highlighted: the bottleneck stage</p></section>"
    )


def _devices(plan: Plan, sim: SimulationLike | None, colors: dict[str, str]) -> str:
    step = sim.step_time_s if sim is not None else plan.predicted.step_time_s
    rows = []
    for d in plan.cluster.devices:
        stages = [s for s in plan.stages if d.name in s.devices]
        if not stages:
            rows.append(f"<tr><td class='l'>{_e(d.name)}</td><td class='l muted'>unused</td></tr>")
            continue
        if sim is not None and d.name in sim.device_busy_s:
            busy = sim.device_busy_s[d.name]
        elif sim is not None:  # a group member the simulator reported on its lead device
            busy = max((sim.device_busy_s.get(s.devices[0], 0.0) for s in stages), default=0.0)
        else:
            busy = sum(s.compute_s for s in stages) * plan.options.microbatches
        peak = (sim.device_peak_bytes.get(d.name) if sim is not None else None) or (
            plan.predicted.device_peak_bytes.get(d.name) or sum(s.memory_bytes for s in stages)
        )
        frac = peak / d.mem_cap
        sw = f'<span class="swatch" style="background:{colors[d.name]}"></span>'
        rows.append(
            f"<tr><td class='l'>{sw}{_e(d.name)} <span class='muted'>{_e(d.kind)}</span></td>"
            f"<td class='l'>{_bar(busy / step if step else 0, colors[d.name], f'busy {human_time(busy)} of {human_time(step)}')}</td>"  # noqa: E501
            f"<td class='l'>{_bar(frac, '#4e79a7' if frac <= 0.9 else '#e67e22', f'{human_bytes(peak)} / {human_bytes(d.mem_cap)} ({frac:.0%})')}</td></tr>"  # noqa: E501
        )
    return (
        "<section id='devices'><h2>Devices: compute and memory</h2><table>"
        "<tr><th class='l'>device</th><th class='l'>compute (busy / step)</th>"
        "<th class='l'>memory peak / cap</th></tr>" + "".join(rows) + "</table></section>"
    )


def _timeline(plan: Plan, sim: SimulationLike | None) -> str:
    if sim is None:
        return (
            "<section id='timeline'><h2>Pipeline timeline</h2><p class='muted'>no simulation "
            "was given; render the report with crosscut.viz.render to include one</p></section>"
        )
    mbs = sorted({e.microbatch for e in sim.events})[:12]
    key = " ".join(
        f'<span class="swatch" style="background:{microbatch_color(m, "F")}"></span>'
        f'<span class="swatch" style="background:{microbatch_color(m, "B")}"></span>mb {m}'
        for m in mbs
    )
    return (
        "<section id='timeline'><h2>Pipeline timeline</h2>"
        f"<p class='muted'>{_e(plan.options.schedule)} schedule, "
        f"{plan.options.microbatches} micro-batches · step {human_time(sim.step_time_s)} · "
        f"bubble {sim.bubble_fraction:.1%} (grey gaps) · light = forward, dark = backward, "
        f"<span style='color:{TRANSFER_COLOR}'>red lane = transfer</span></p>"
        f"<p>{key}</p><div class='scroll'>{timeline_svg(plan, sim)}</div></section>"
    )


def _dag(plan: Plan, groups: list[NodeGroup] | None, dot_src: str) -> str:
    try:
        svg = strip_svg_prolog(render_dot(dot_src, "svg").decode())
    except VizError as exc:
        svg = (
            f"<p class='warn'>{_e(str(exc))}</p><details><summary>DOT source</summary>"
            f"<pre>{_e(dot_src)}</pre></details>"
        )
    view = (
        f"coarse view: {len(groups)} module groups for {len(plan.nodes)} nodes; click a box "
        "or a list entry below for its nodes"
        if groups is not None
        else f"{len(plan.nodes)} nodes"
    )
    tools = (
        "<div class='toolbar'><button id='zoom-out'>−</button><button id='zoom-in'>+</button>"
        "<button id='zoom-fit'>fit</button><button id='zoom-1'>100%</button>"
        "<span id='zoom-level' class='muted'></span><span class='muted'>· drag to pan, "
        "ctrl+wheel to zoom</span></div>"
    )
    return (
        f"<section id='graph'><h2>Partitioned graph</h2><p class='muted'>{_e(view)}; "
        "a box per stage, colour per device, transfers bold dashed with bytes per "
        f"micro-batch</p>{tools}<div id='dag' class='scroll'>{svg}</div>"
        + (_group_list(plan, groups) if groups is not None else "")
        + "</section>"
    )


def _group_list(plan: Plan, groups: list[NodeGroup]) -> str:
    info = {n.name: n for n in plan.nodes}
    parts = [
        "<h2 style='margin-top:14px'>Module groups "
        "<button id='groups-toggle' class='muted'>expand / collapse all</button></h2>"
    ]
    for st in plan.stages:
        parts.append(f"<h3 style='font-size:14px;margin:10px 0 4px'>stage {st.index}</h3>")
        for g in (g for g in groups if g.stage == st.index):
            items = "".join(
                f"<li>{_e(m)} <code>{_e(info[m].kind)}</code> "
                f"<span class='muted'>{_e(info[m].target)}</span></li>"
                for m in g.members
            )
            parts.append(
                f"<details class='grp' id='grp-{_e(g.id)}'><summary>{_e(g.key)} "
                f"<span class='muted'>· {len(g.members)} nodes</span></summary>"
                f"<ul>{items}</ul></details>"
            )
    return "".join(parts)


def _transfers(plan: Plan, limit: int = 40) -> str:
    ts = sorted(plan.transfers, key=lambda t: -t.bytes)
    total = sum(t.bytes for t in ts)
    rows = "".join(
        f"<tr><td class='l'>{_e(t.tensor)}</td><td>{t.src_stage} → {t.dst_stage}</td>"
        f"<td class='l'>{_e(t.src_device)} → {_e(t.dst_device)}</td>"
        f"<td>{_e(human_bytes(t.bytes))}</td><td>{_e(human_time(t.time_s))}</td></tr>"
        for t in ts[:limit]
    )
    more = f"<p class='muted'>… and {len(ts) - limit} more</p>" if len(ts) > limit else ""
    return (
        f"<section id='transfers'><h2>Transfers: {len(ts)} tensors, {_e(human_bytes(total))} "
        "per micro-batch</h2><table><tr><th class='l'>tensor</th><th>stages</th>"
        "<th class='l'>devices</th><th>bytes</th><th>time</th></tr>"
        f"{rows}</table>{more}</section>"
    )


def _solver(plan: Plan) -> str:
    r = plan.solver
    fields = [
        ("solver", r.solver or "-"),
        ("status", r.status or "-"),
        ("objective", f"{r.objective:.6g}"),
        ("best bound", f"{r.best_bound:.6g}"),
        ("gap", f"{r.gap:.2%}"),
        ("lower bound", f"{r.lower_bound:.6g}"),
        ("wall time", f"{r.wall_time_s:.2f} s"),
        ("workers / seed", f"{r.workers} / {r.seed}"),
        ("coarse nodes", str(r.coarse_nodes)),
    ]
    rec = "".join(
        f"<tr><th class='l'>{_e(k)}</th><td class='l'>{_e(v)}</td></tr>" for k, v in fields
    )
    base = "".join(
        f"<tr><td class='l'>{_e(name)}</td><td>{value:.6g}</td><td>×{ratio:.2f}</td>"
        f"<td class='l {'' if ratio > 1 else 'bad'}'>{'beaten' if ratio > 1 else 'not beaten'}"
        "</td></tr>"
        for name, value, ratio in baseline_ratios(plan)
    )
    notes = "".join(f"<li>{_e(n)}</li>" for n in r.notes)
    return (
        "<section id='solver'><h2>Solver record</h2><div style='display:flex;gap:40px;"
        f"flex-wrap:wrap'><table>{rec}</table><div><table><tr><th class='l'>baseline</th>"
        "<th>objective</th><th>baseline / ours</th><th class='l'></th></tr>"
        f"{base}</table>"
        + (f"<h3 style='font-size:14px'>Notes</h3><ul>{notes}</ul>" if notes else "")
        + "</div></div></section>"
    )


def plan_to_html(
    plan: Plan,
    *,
    simulation: SimulationLike | None = None,
    coarse: bool | None = None,
    max_nodes: int = 400,
) -> str:
    """The whole report as one HTML string (inline SVG, CSS and JS; no network)."""
    m, c, o = plan.model, plan.cluster, plan.options
    colors = device_colors(plan)
    groups = view_groups(plan, coarse=coarse, max_nodes=max_nodes)
    dot_src = plan_to_dot(plan, coarse=coarse, max_nodes=max_nodes)
    shapes = ", ".join("×".join(str(x) for x in s) for s in m.input_shapes)
    sub = (
        f"{m.name} · batch {m.batch_size} · {m.mode} · {m.dtype} · input {shapes} · "
        f"{len(plan.nodes)} nodes, {len(plan.edges)} edges · cluster {c.name or '-'}: "
        + ", ".join(f"{d.name} ({d.kind}, {human_bytes(d.mem_cap)})" for d in c.devices)
        + f" · {o.objective}, {o.schedule}, {o.microbatches} micro-batches, "
        f"costs {o.cost_source} · crosscut {plan.crosscut_version or '?'} "
        f"{plan.created_at}"
    )
    body = "".join(
        [
            _kpis(plan, simulation),
            _stages(plan, colors),
            _devices(plan, simulation, colors),
            _timeline(plan, simulation),
            _dag(plan, groups, dot_src),
            _transfers(plan),
            _solver(plan),
        ]
    )
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>crosscut plan · {_e(m.name)}</title><style>{_CSS}</style></head><body>"
        f"<header><h1>crosscut plan · {_e(m.name)}</h1><div class='sub'>{_e(sub)}</div>"
        f"</header><main>{body}</main><script>{_JS}</script></body></html>\n"
    )
