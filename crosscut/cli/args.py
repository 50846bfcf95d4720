"""Argument types of the ``crosscut`` commands: a bad value fails in argparse's one line.

Shared by the main CLI (:mod:`crosscut.cli`) and ``crosscut run``
(:mod:`crosscut.cli.launch`), so every command refuses the same values the same way.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

_N = TypeVar("_N", int, float)

__all__ = ["_nonnegative_int", "_port", "_positive_float", "_positive_int", "_shape"]


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--input-shape wants CxHxW like 3x224x224, got {text!r}"
        ) from None
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"--input-shape dimensions must be positive, got {text!r}")
    return dims


def _number(text: str, convert: Callable[[str], _N], ok: Callable[[_N], bool], rule: str) -> _N:
    """``text`` converted and checked; argparse prints the one-line error naming ``rule``."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {rule}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {rule}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def _positive_float(text: str) -> float:
    return _number(text, float, lambda v: v > 0 and math.isfinite(v), "a positive finite number")


def _nonnegative_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def _port(text: str) -> int:
    value = _nonnegative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(
            f"a TCP port is 0..65535 (0: pick a free one), got {value}"
        )
    return value
