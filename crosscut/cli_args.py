"""Argument types of the ``crosscut`` commands: a bad value fails in argparse's one line.

Shared by the main CLI (:mod:`crosscut.cli`) and ``crosscut run``
(:mod:`crosscut.launch`), so every command refuses the same values the same way.
"""

from __future__ import annotations

import argparse
import math

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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {value}")
    return value


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _port(text: str) -> int:
    value = _nonnegative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(
            f"a TCP port is 0..65535 (0: pick a free one), got {value}"
        )
    return value
