"""The rates a plan was priced at, drawn: one row per device kind (``Plan.rates``).

Every predicted time in a plan rests on a preset's datasheet, the math modes
PyTorch runs and an achieved fraction of the peaks that was fitted to
published measurements, assumed, or measured on a device. A plan priced at an
uncalibrated default (Hopper, a device described by hand) must say so where
its numbers are read: the terminal summary and the HTML report both print
these rows. Plans made before the record have none, and print nothing.
"""

from __future__ import annotations

import html

from crosscut.ir.plan import Plan

__all__ = ["RATE_COLUMNS", "rates_html", "rates_rows"]

RATE_COLUMNS = ("device kind", "preset, costs", "math", "efficiency from")


def rates_rows(plan: Plan) -> list[tuple[str, str, str, str]]:
    """(kind, preset and costs, math modes, efficiency source) per device kind of the plan."""
    return [
        (
            r.kind,
            f"{r.preset or 'no preset'}, {r.costs}",
            ", ".join(r.math) or "no matmuls",
            r.efficiency,
        )
        for r in plan.rates
    ]


def rates_html(plan: Plan) -> str:
    """The report's "Priced at" section ("" for a plan without the record)."""
    rows = rates_rows(plan)
    if not rows:
        return ""
    head = "".join(f"<th class='l'>{c}</th>" for c in RATE_COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td class='l'>{html.escape(x)}</td>" for x in row) + "</tr>"
        for row in rows
    )
    return (
        "<section id='rates'><h2>Priced at</h2><p class='muted'>The rates every predicted "
        "time rests on: the device preset's datasheet, the math modes PyTorch runs its "
        "convolutions and matmuls in, and where the achieved fractions of the peaks came "
        "from (fitted to published measurements, an analytic default, or profiled).</p>"
        f"<table><tr>{head}</tr>{body}</table></section>"
    )
