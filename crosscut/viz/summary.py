"""A terminal summary of a plan: what runs where, how long, how full, how sure.

``crosscut show plan.json`` prints this before anything is drawn, so the
numbers a user acts on (bottleneck stage, memory headroom, solver gap, the
baseline beaten) are one command away and greppable in CI logs.
"""

from __future__ import annotations

import io

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from crosscut.ir.plan import Plan, PlanStage
from crosscut.viz.dot import human_bytes, human_time
from crosscut.viz.rates import RATE_COLUMNS, rates_rows

__all__ = [
    "alternative_rows",
    "baseline_ratios",
    "print_summary",
    "stage_cap",
    "strategy_line",
    "summary_text",
]


def stage_cap(plan: Plan, stage: PlanStage) -> int:
    """The memory cap a stage must fit: the smallest cap in its device group."""
    return min(plan.cluster.devices[plan.cluster.index(d)].mem_cap for d in stage.devices)


def baseline_ratios(plan: Plan) -> list[tuple[str, float, float]]:
    """(baseline, its objective, baseline / ours): a ratio above 1 means the plan beat it."""
    ours = plan.solver.objective
    return [
        (name, value, value / ours if ours > 0 else float("nan"))
        for name, value in sorted(plan.solver.baselines.items())
    ]


def _ms(seconds: float) -> str:
    """Milliseconds below a second (the usual stage time), seconds from there on."""
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _stages_table(plan: Plan) -> Table:
    """One line per stage, 80 columns wide; units in the cells, the meaning in the caption."""
    bottleneck = max((s.time_s for s in plan.stages), default=0.0)
    caps = {stage_cap(plan, s) for s in plan.stages}
    cap_note = f"of {human_bytes(caps.pop())}" if len(caps) == 1 else "of its cap"
    table = Table(
        title=f"stages ({plan.num_stages})",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        caption=(
            "time = compute + comm for one micro-batch; ◀ the bottleneck, the slowest "
            f"stage, sets the pipeline's pace; memory = predicted peak ({cap_note})"
            + (
                "; ↻ recomputes its activations in backward"
                if any(s.recompute for s in plan.stages)
                else ""
            )
        ),
        caption_justify="left",
    )
    for col, justify in [
        ("stage", "left"),
        ("nodes", "right"),
        ("compute", "right"),
        ("comm", "right"),
        ("time", "right"),
        ("memory", "right"),
    ]:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for s in plan.stages:
        devs = (
            "+".join(s.devices) if len(s.devices) <= 2 else f"{s.devices[0]}+{len(s.devices) - 1}"
        )
        devs += f" ({s.split})" if len(s.devices) > 1 else ""
        devs += " ↻" if s.recompute else ""
        cap = stage_cap(plan, s)
        frac = s.memory_bytes / cap if cap else 0.0
        mem = f"{human_bytes(s.memory_bytes)} ({frac:.0%})"
        table.add_row(
            escape(f"{s.index} {devs}"),
            str(len(plan.stage_nodes(s.index))),
            _ms(s.compute_s),
            _ms(s.comm_s),
            _ms(s.time_s) + (" ◀" if s.time_s == bottleneck else "  "),
            f"[red]{mem} over cap[/red]" if frac > 1 else mem,
        )
    return table


def _numbers_table(plan: Plan) -> Table:
    p, r = plan.predicted, plan.solver
    per = "per micro-batch, the bottleneck" if plan.options.objective == "throughput" else ""
    table = Table(
        title="prediction and solver",
        title_justify="left",
        show_header=False,
        box=box.SIMPLE,
        pad_edge=False,
        caption=(
            "objective: what the solver minimises; bound: a proven lower limit on it, so the "
            "gap says how far from the best possible plan this one can be at most; baselines: "
            "other ways to split, ×N = their objective / ours"
        ),
        caption_justify="left",
    )
    table.add_column("what")
    table.add_column("value")
    tx_bytes = sum(t.bytes for t in plan.transfers)
    tx_time = sum(t.time_s for t in plan.transfers)
    rows = [
        (
            "transfers",
            f"{len(plan.transfers)}, {human_bytes(tx_bytes)} and {human_time(tx_time)} "
            "per micro-batch",
        ),
        ("step time", f"{human_time(p.step_time_s)} per training step (predicted)"),
        *_replication_rows(plan),
        ("throughput", f"{p.throughput:.4g} samples/s"),
        ("bottleneck", f"{human_time(p.bottleneck_s)} per micro-batch (slowest stage)"),
        ("makespan", f"{human_time(p.makespan_s)} (one micro-batch through every stage)"),
        ("bubble", f"{p.bubble_fraction:.1%} of the step idle"),
        ("solver", f"{r.solver or '-'}, status {r.status or '-'}, {r.wall_time_s:.2f} s"),
        (
            "objective / bound",
            f"{human_time(r.objective)} / {human_time(r.best_bound)} {per} (gap {r.gap:.2%})",
        ),
    ]
    for name, value, ratio in baseline_ratios(plan):
        verdict = "beaten" if ratio > 1.0005 else ("tied" if ratio >= 0.9995 else "NOT beaten")
        rows.append((f"baseline {name}", f"{human_time(value)} (×{ratio:.2f}, {verdict})"))
    for note in r.notes:
        rows.append(("note", note))
    for what, text in rows:
        table.add_row(escape(what), escape(text))
    return table


def _replication_rows(plan: Plan) -> list[tuple[str, str]]:
    """Replicas chosen for a cluster of nodes (strategy.py), when there are any."""
    rep = plan.replication
    if rep.replicas <= 1:
        return []
    devices = len(plan.used_devices())
    return [
        (
            "replicas",
            f"{rep.replicas} × this pipeline ({devices} device(s) each, "
            f"{rep.replicas * devices} in all, {plan.cluster.nodes} nodes); "
            f"{rep.reduction} all-reduce {human_time(rep.allreduce_s)} per step",
        )
    ]


def strategy_line(plan: Plan) -> str:
    """The chosen strategy in one line: ``"8 replicas × 1 stage, M=1, 1f1b, ring all-reduce"``."""
    rep, o = plan.replication, plan.options
    stages = f"{plan.num_stages} stage{'s' if plan.num_stages > 1 else ''}"
    groups = sum(1 for s in plan.stages if len(s.devices) > 1)
    parts = [
        f"{rep.replicas} replica{'s' if rep.replicas > 1 else ''} × {stages}",
        f"M={o.microbatches}",
        o.schedule,
    ]
    if groups:  # each stage's devices and the groups' splits: "groups 1+2+4+1 (batch)"
        kinds = sorted({s.split for s in plan.stages if len(s.devices) > 1})
        widths = "+".join(str(len(s.devices)) for s in plan.stages)
        parts.append(f"groups {widths} ({', '.join(kinds)})")
    if any(s.recompute for s in plan.stages):
        parts.append(
            "recomputation on " + ", ".join(str(s.index) for s in plan.stages if s.recompute)
        )
    if rep.replicas > 1:
        parts.append(f"{rep.reduction} all-reduce")
    return ", ".join(parts)


def alternative_rows(plan: Plan, limit: int = 12) -> list[tuple[str, str, str, str]]:
    """(strategy, step, step / chosen, outcome) for the chosen plan and what it was weighed
    against: the chosen row, data parallelism (the baseline), then the rest as tried."""
    rows = plan.strategy.alternatives
    ours = plan.predicted.step_time_s
    first = [a for a in rows if a.outcome == "chosen"]
    dp = plan.strategy.data_parallel()
    if dp is not None and dp not in first:
        first.append(dp)
    ordered = first + [a for a in rows if a not in first]
    out = []
    for a in ordered[:limit]:
        step = _ms(a.step_time_s) if a.step_time_s > 0 else "—"
        ratio = f"×{a.step_time_s / ours:.2f}" if a.step_time_s > 0 and ours > 0 else ""
        why = a.outcome + (f": {a.reason}" if a.reason else "")
        out.append((a.label(), step, ratio, why))
    if len(ordered) > limit:
        out.append((f"… {len(ordered) - limit} more in the plan's strategy", "", "", ""))
    return out


def _strategy_table(plan: Plan) -> Table:
    table = Table(
        title=f"strategy: {strategy_line(plan)}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        caption="step = predicted training step (or inference batch) of every replica "
        "together; ×N = its step / the chosen one's; M = micro-batches",
    )
    table.add_column("considered", no_wrap=True)
    for col in ("step", "", "outcome"):
        table.add_column(col, overflow="fold")
    for row in alternative_rows(plan):
        table.add_row(*(escape(c) for c in row))
    return table


def _rates_table(plan: Plan) -> Table:
    table = Table(
        title="priced at",
        title_justify="left",
        box=box.SIMPLE,
        pad_edge=False,
        caption=(
            "the rates every time above rests on: the preset's datasheet, the math PyTorch "
            "runs, and where the achieved fractions of its peaks came from"
        ),
        caption_justify="left",
    )
    for col in RATE_COLUMNS:
        table.add_column(col)
    for row in rates_rows(plan):
        table.add_row(*(escape(x) for x in row))
    return table


def print_summary(plan: Plan, console: Console | None = None) -> None:
    """Print the plan's header, stage table and numbers with rich."""
    con = console if console is not None else Console()
    m, c, o = plan.model, plan.cluster, plan.options
    reps = plan.replication.replicas
    batch = (
        f"{m.batch_size * reps} ({reps} replicas × {m.batch_size})" if reps > 1 else m.batch_size
    )
    devices = len(c.devices) * reps
    con.print(
        f"[bold]{escape(m.name)}[/bold] · batch {batch} · {m.mode} · {m.dtype} · "
        f"{len(plan.nodes)} nodes\non {escape(c.name or 'cluster')} ({devices} devices) · "
        f"{o.objective}, {o.schedule}, {o.microbatches} micro-batches"
        + (f", {o.precision}" if o.precision != "fp32" else ""),
        markup=True,
        highlight=False,
    )
    if plan.strategy.alternatives:
        con.print(_strategy_table(plan))
    con.print(_stages_table(plan))
    con.print(_numbers_table(plan))
    if plan.rates:
        con.print(_rates_table(plan))


def summary_text(plan: Plan, *, width: int = 80) -> str:
    """The summary as plain text (no colour codes), for tests and logs."""
    buf = io.StringIO()
    con = Console(file=buf, width=width, color_system=None, force_terminal=False)
    print_summary(plan, con)
    return buf.getvalue()
