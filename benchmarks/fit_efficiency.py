"""Refit the achieved fractions of ``efficiency.py`` to the published points, reproducibly.

Each large-op fraction (``fma``, ``tensor``, ``tf32``) of a generation governs
the fitted points that run in its math mode on that generation's GPUs (V100
fp32: Volta's ``fma``; A100 fp16: Ampere's ``tensor``; ...). The fit sets
each one so that the geometric mean of predicted ÷ published over its points
is 1 (a bisection: a larger fraction only ever predicts more images/s), one
field at a time in the order of :data:`FIELDS`, which touch disjoint points.
It prints the committed fractions beside the fitted ones and each point's
ratio under both.

Why a tool: the fractions were first fitted by hand. Every later change to
the physics (how an op's bytes or FLOPs are counted) moves the fit, and must
be followed by a refit, or the fractions quietly absorb the change.
``tests/test_calibration.py`` checks that the committed fractions stay within
:data:`TOLERANCE` of what this gives.

    .venv/bin/python benchmarks/fit_efficiency.py
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import calibration as bench

from crosscut.cost_models import efficiency
from crosscut.cost_models.calibration import PUBLISHED, Published

__all__ = ["FIELDS", "TOLERANCE", "fit", "geomean_ratio", "main"]

#: how far a committed fraction may sit from the fitted one (relative)
TOLERANCE = 0.10


def _points(kinds: tuple[str, ...], precision: str) -> Callable[[], list[Published]]:
    def pick() -> list[Published]:
        return [p for p in PUBLISHED if p.fitted and p.kind in kinds and p.precision == precision]

    return pick


#: (generation, field, the fitted points it governs)
FIELDS: list[tuple[str, str, Callable[[], list[Published]]]] = [
    ("pascal", "fma", _points(("P100",), "fp32")),
    ("volta", "fma", _points(("V100",), "fp32")),
    ("volta", "tensor", _points(("V100",), "fp16")),
    ("ampere", "tf32", _points(("A100-80GB", "A100-40GB"), "fp32")),
    ("ampere", "tensor", _points(("A100-80GB", "A100-40GB"), "fp16")),
]


def geomean_ratio(points: list[Published]) -> float:
    """Geometric mean of predicted ÷ published images/s over ``points``."""
    logs = [math.log(bench.predict(p) / p.images_per_s) for p in points]
    return math.exp(sum(logs) / len(logs))


def _with(generation: str, field: str, value: float) -> None:
    old = efficiency.EFFICIENCIES[generation]
    efficiency.EFFICIENCIES[generation] = dataclasses.replace(old, **{field: value})


def fit(generation: str, field: str, points: list[Published], iters: int = 30) -> float:
    """The value of ``generation``'s ``field`` whose points' geometric-mean ratio is 1
    (left set to it)."""
    lo, hi = 0.02, 1.0
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        _with(generation, field, mid)
        if geomean_ratio(points) > 1.0:
            hi = mid
        else:
            lo = mid
    value = math.sqrt(lo * hi)
    _with(generation, field, value)
    return value


def main(argv: list[str] | None = None) -> dict[tuple[str, str], tuple[float, float]]:
    """Fit every field of :data:`FIELDS`; return (generation, field) -> (committed, fitted).
    The committed fractions are restored before returning."""
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    committed = dict(efficiency.EFFICIENCIES)
    out: dict[tuple[str, str], tuple[float, float]] = {}
    try:
        for generation, field, pick in FIELDS:
            points = pick()
            before = [bench.predict(p) / p.images_per_s for p in points]
            value = fit(generation, field, points)
            after = [bench.predict(p) / p.images_per_s for p in points]
            was = float(getattr(committed[generation], field))
            out[generation, field] = (was, value)
            flag = "" if abs(value / was - 1) <= TOLERANCE else f"  (beyond {TOLERANCE:.0%})"
            print(f"{generation}.{field}: committed {was:.3f}, fitted {value:.3f}{flag}")
            for p, b, a in zip(points, before, after):
                print(f"    {p.model:<18}{p.kind:<11}{p.precision:<6}{b:6.2f} -> {a:5.2f}")
    finally:
        efficiency.EFFICIENCIES.clear()
        efficiency.EFFICIENCIES.update(committed)
    return out


if __name__ == "__main__":
    main()
