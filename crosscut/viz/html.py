"""A self-contained HTML report of a plan: one file, no network, no build step.

Everything is inline (the DAG as SVG laid out in Python by
:mod:`crosscut.viz.layout`, CSS, a few lines of JS), so the report can be
mailed, attached to CI, or opened from a laptop on a plane, and it needs
neither Graphviz nor a network. Colours keep one meaning each: the palette
colours are devices, red is a transfer, orange needs attention. The
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

from crosscut.ir.plan import Plan
from crosscut.viz.dot import (
    ATTENTION_COLOR,
    TRANSFER_COLOR,
    NodeGroup,
    device_colors,
    human_bytes,
    human_time,
    view_groups,
)
from crosscut.viz.layout import layout_svg, stage_layers
from crosscut.viz.rates import rates_html
from crosscut.viz.summary import alternative_rows, baseline_ratios, stage_cap, strategy_line
from crosscut.viz.timeline import SimulationLike, action_color, timeline_svg

__all__ = ["plan_to_html", "strip_svg_prolog"]

_e = html.escape
_MEMORY = "#6b7785"  # memory bars: neutral grey, orange (attention) above 90 % of the cap

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
.bar.over > span { background:%ATT% !important; }
.swatch { display:inline-block; width:12px; height:12px; border-radius:2px;
          vertical-align:middle; margin-right:6px; border:1px solid rgba(0,0,0,.2); }
.muted { color:var(--muted); } .warn { color:%ATT%; font-weight:600; }
.scroll { overflow:auto; border:1px solid var(--line); border-radius:6px; background:#fff; }
#dag { height:80vh; cursor:grab; } #dag.drag { cursor:grabbing; }
#dag svg { display:block; }
.toolbar { margin:0 0 8px; display:flex; gap:6px; align-items:center; }
.toolbar button { font:inherit; padding:2px 10px; border:1px solid var(--line);
                  background:#fff; border-radius:4px; cursor:pointer; }
details.grp { margin:2px 0; } details.grp summary { cursor:pointer; }
details.grp[open] { background:#fffbe6; } details.grp ul { margin:4px 0 8px 18px; padding:0; }
code { font-size:12px; }
dl.explain { margin:10px 0 0; font-size:13px; } dl.explain dt { font-weight:600; }
dl.explain dd { margin:0 0 6px 16px; color:var(--muted); }
""".replace("%ATT%", ATTENTION_COLOR)

_JS = """
(function () {
  var box = document.getElementById('dag');
  var svg = box && box.querySelector('svg');
  if (svg) {
    var vb = svg.viewBox.baseVal;
    var natural = [vb.width, vb.height];  // px: crosscut's layout draws in px
    var label = document.getElementById('zoom-level');
    var scale = 1;
    var apply = function () {
      svg.setAttribute('width', Math.max(20, natural[0] * scale));
      svg.setAttribute('height', Math.max(20, natural[1] * scale));
      if (label) { label.textContent = 'zoom ' + Math.round(scale * 100) + '%'; }
    };
    var fit = function () {  // the whole graph in the box: both width and height
      scale = Math.min((box.clientWidth - 4) / natural[0], (box.clientHeight - 4) / natural[1]);
      apply();
    };
    // open wide enough to read the node names; "fit" shows the whole graph
    scale = Math.min(1, (box.clientWidth - 4) / natural[0]);
    apply();
    var zoom = function (f) { scale = Math.max(0.02, Math.min(8, scale * f)); apply(); };
    document.getElementById('zoom-in').onclick = function () { zoom(1.25); };
    document.getElementById('zoom-out').onclick = function () { zoom(0.8); };
    document.getElementById('zoom-fit').onclick = fit;
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
        *(
            [
                (
                    "replicas (all-reduce)",
                    f"{plan.replication.replicas} ({plan.replication.reduction})",
                )
            ]
            if plan.replication.replicas > 1
            else []
        ),
        ("solver", f'<span class="{status_cls}">{_e(r.status or "-")}</span>'),
        ("optimality gap (at most)", f"{r.gap:.2%}"),
    ]
    cells = "".join(
        f'<div class="kpi"><div class="v">{v if k == "solver" else _e(v)}</div>'
        f'<div class="k">{_e(k)}</div></div>'
        for k, v in items
    )
    return f'<div class="kpis">{cells}</div>'


def _replicas_kpi(plan: Plan) -> list[tuple[str, str]]:
    rep = plan.replication
    return (
        [("replicas (all-reduce)", f"{rep.replicas} ({rep.reduction})")] if rep.replicas > 1 else []
    )


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
        if s.recompute:
            devs += ' <span class="muted" title="keeps only its inputs per micro-batch and '
            devs += 'recomputes its activations in backward">· recomputes</span>'
        hot = ' class="hot"' if s.time_s == bottleneck else ""
        first, last = stage_layers(plan, s.index)
        rows.append(
            f"<tr{hot}><td>{s.index}</td><td class='l'>{devs}</td>"
            f"<td class='l'><code>{_e(first)}</code> → <code>{_e(last)}</code></td>"
            f"<td>{len(plan.stage_nodes(s.index))}</td><td>{s.compute_s * 1e3:.3f}</td>"
            f"<td>{s.comm_s * 1e3:.3f}</td><td>{s.time_s * 1e3:.3f}</td><td class='l'>"
            + _bar(frac, _MEMORY, f"{human_bytes(s.memory_bytes)} / {human_bytes(cap)}")
            + "</td></tr>"
        )
    head = (
        "<tr><th>stage</th><th class='l'>devices</th><th class='l'>first → last layer</th>"
        "<th>nodes</th><th>compute ms</th>"
        "<th>comm ms</th><th>time ms</th><th class='l'>memory / cap</th></tr>"
    )
    return (
        "<section id='stages'><h2>Stages</h2><table>"
        + head
        + "".join(rows)
        + "</table><p class='muted'>times are per micro-batch (compute: forward and backward; "
        "comm: the stage's transfers in and out); highlighted: the bottleneck stage, the "
        "slowest, which sets the pipeline's pace</p></section>"
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
            f"<td class='l'>{_bar(frac, _MEMORY if frac <= 0.9 else ATTENTION_COLOR, f'{human_bytes(peak)} / {human_bytes(d.mem_cap)} ({frac:.0%})')}</td></tr>"  # noqa: E501
        )
    return (
        "<section id='devices'><h2>Devices: compute and memory</h2><table>"
        "<tr><th class='l'>device</th><th class='l'>compute (busy / step)</th>"
        "<th class='l'>memory peak / cap</th></tr>" + "".join(rows) + "</table></section>"
    )


def _timeline(plan: Plan, sim: SimulationLike | None, colors: dict[str, str]) -> str:
    if sim is None:
        return (
            "<section id='timeline'><h2>Pipeline timeline</h2><p class='muted'>no simulation "
            "was given; render the report with crosscut.viz.render to include one</p></section>"
        )
    split = any(e.kind == "W" for e in sim.events)
    key = " ".join(
        f'<span class="swatch" style="background:{action_color(colors[d], "F")}"></span>'
        f'<span class="swatch" style="background:{action_color(colors[d], "B")}"></span>'
        + (
            f'<span class="swatch" style="background:{action_color(colors[d], "W")}"></span>'
            if split
            else ""
        )
        + f"{_e(d)}"
        for d in dict.fromkeys(plan.used_devices())
    )
    return (
        "<section id='timeline'><h2>Pipeline timeline</h2>"
        f"<p class='muted'>one training step simulated: {_e(plan.options.schedule)} schedule, "
        f"{plan.options.microbatches} micro-batches · step {human_time(sim.step_time_s)} · "
        f"bubble {sim.bubble_fraction:.1%} (grey: the device waits) · box colour = device, "
        "light = forward, dark = backward, label = action and micro-batch (F3: forward of "
        "micro-batch 3)"
        + (
            " · the backward is split: B = the input gradients the stage before waits for, "
            "darkest W = the weight gradients, run where the device would idle"
            if split
            else ""
        )
        + f" · <span style='color:{TRANSFER_COLOR}'>red lane under a row = the "
        "transfer part of that action</span>"
        + (
            f" · dark grey at the end = the {plan.replication.replicas} replicas' gradient "
            f"all-reduce ({_e(plan.replication.reduction)}), counted in the bubble"
            if plan.replication.replicas > 1
            else ""
        )
        + "</p>"
        f"<p>{key}</p><div class='scroll'>{timeline_svg(plan, sim)}</div></section>"
    )


def _dag(plan: Plan, groups: list[NodeGroup] | None) -> str:
    view = (
        f"coarse view: {len(groups)} module groups for {len(plan.nodes)} nodes; click a box "
        "or a list entry below for its nodes"
        if groups is not None
        else f"{len(plan.nodes)} nodes"
    )
    tools = (
        "<div class='toolbar'><button id='zoom-out' title='zoom out'>−</button>"
        "<button id='zoom-in' title='zoom in'>+</button>"
        "<button id='zoom-fit' title='show the whole graph'>fit</button>"
        "<button id='zoom-1' title='natural size'>1:1</button>"
        "<span id='zoom-level' class='muted'></span><span class='muted'>· drag to pan, "
        "ctrl+wheel to zoom, hover a box for its details</span></div>"
    )
    return (
        f"<section id='graph'><h2>Partitioned graph</h2><p class='muted'>{_e(view)}; "
        "a band per stage (top to bottom), box colour = device, parallel branches stacked; "
        f"<span style='color:{TRANSFER_COLOR}'>red dashed arrow = a transfer</span> (one per "
        "tensor and receiving stage, with its bytes per micro-batch); dark arrow = a tensor "
        f"between stages on the same devices</p>{tools}<div id='dag' class='scroll'>"
        f"{layout_svg(plan, groups)}</div>"
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
    per = "per micro-batch" if plan.options.objective == "throughput" else "per step"
    fields = [
        ("solver", r.solver or "-"),
        ("status", r.status or "-"),
        ("objective", f"{human_time(r.objective)} {per}"),
        ("best bound", f"{human_time(r.best_bound)} {per}"),
        ("optimality gap", f"{r.gap:.2%}"),
        ("lower bound", f"{human_time(r.lower_bound)} {per}"),
        ("wall time", f"{r.wall_time_s:.2f} s"),
        ("workers / seed", f"{r.workers} / {r.seed}"),
        ("coarse nodes", str(r.coarse_nodes)),
    ]
    rec = "".join(
        f"<tr><th class='l'>{_e(k)}</th><td class='l'>{_e(v)}</td></tr>" for k, v in fields
    )
    base = "".join(
        f"<tr><td class='l'>{_e(name)}</td><td>{_e(human_time(value))}</td><td>×{ratio:.2f}</td>"
        f"<td class='l'>{_verdict(ratio)}</td></tr>"
        for name, value, ratio in baseline_ratios(plan)
    )
    notes = "".join(f"<li>{_e(n)}</li>" for n in r.notes)
    what = (
        "the slowest stage's time per micro-batch, which sets the pipeline's throughput"
        if plan.options.objective == "throughput"
        else "one input's time through every stage (latency)"
    )
    explain = (
        "<dl class='explain'>"
        f"<dt>objective</dt><dd>what the solver minimises: {what}.</dd>"
        "<dt>best bound</dt><dd>the solver's proof: no plan it could choose beats this. "
        "OPTIMAL means objective = best bound.</dd>"
        "<dt>optimality gap</dt><dd>(objective − best bound) / objective: how much faster "
        "the best possible plan could be, at most.</dd>"
        "<dt>lower bound</dt><dd>a floor for any plan, computed without the solver: the "
        "whole model's compute spread evenly over every device, or its slowest single op, "
        "whichever is larger. Usually weaker than the best bound.</dd>"
        "<dt>baselines</dt><dd>other ways to split the same model, priced by the same cost "
        "model; ×N = their objective / ours, so ×2.00 means ours is twice as fast and "
        "×1.00 a tie.</dd></dl>"
    )
    return (
        "<section id='solver'><h2>Solver record</h2><div style='display:flex;gap:40px;"
        f"flex-wrap:wrap'><div><table>{rec}</table>{explain}</div><div><table><tr>"
        "<th class='l'>baseline</th><th>objective</th><th>baseline / ours</th>"
        f"<th class='l'></th></tr>{base}</table>"
        + (f"<h3 style='font-size:14px'>Notes</h3><ul>{notes}</ul>" if notes else "")
        + "</div></div></section>"
    )


def _strategy(plan: Plan) -> str:
    """The chosen strategy in one line and the alternatives it was weighed against."""
    if not plan.strategy.alternatives:
        return ""
    rows = "".join(
        f"<tr><td class='l'>{_e(label)}</td><td>{_e(step)}</td><td>{_e(ratio)}</td>"
        f"<td class='l'>{_e(why)}</td></tr>"
        for label, step, ratio, why in alternative_rows(plan, limit=40)
    )
    return (
        f"<section id='strategy'><h2>Strategy: {_e(strategy_line(plan))}</h2>"
        "<p class='muted'>Every layout of the devices as data-parallel replicas of a "
        "pipeline, with its micro-batch counts, priced by the same cost model; the "
        "chosen one has the shortest predicted step. ×N = its step / the chosen one's.</p>"
        "<table><tr><th class='l'>considered</th><th>step</th><th>vs chosen</th>"
        f"<th class='l'>outcome</th></tr>{rows}</table></section>"
    )


def _verdict(ratio: float) -> str:
    """Beaten / tie / ours slower; only a loss draws the attention colour."""
    if ratio > 1.0005:
        return "ours faster"
    if ratio >= 0.9995:
        return "tie"
    return "<span class='warn'>ours slower</span>"


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
    shapes = ", ".join("×".join(str(x) for x in s) for s in m.input_shapes)
    sub = (
        f"{m.name} · batch {m.batch_size} · {m.mode} · {m.dtype} · input {shapes} · "
        f"{len(plan.nodes)} nodes, {len(plan.edges)} edges · cluster {c.name or '-'}: "
        + ", ".join(f"{d.name} ({d.kind}, {human_bytes(d.mem_cap)})" for d in c.devices)
        + f" · {o.objective}, {o.schedule}, {o.microbatches} micro-batches, {o.precision}, "
        f"costs {o.cost_source} · crosscut {plan.crosscut_version or '?'} "
        f"{plan.created_at}"
    )
    body = "".join(
        [
            _kpis(plan, simulation),
            _strategy(plan),
            _stages(plan, colors),
            _devices(plan, simulation, colors),
            _timeline(plan, simulation, colors),
            _dag(plan, groups),
            _transfers(plan),
            rates_html(plan),
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
