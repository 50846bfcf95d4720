"""The partitioner: tracing, the problem, the solvers, plans, validation and simulation.

``trace`` is resolved lazily: importing ``crosscut.partitioner.plan`` (which the
visualizer does) must not pull in torch. The function shares its name with the
submodule ``crosscut.partitioner.trace``; once that submodule is imported, Python
binds the package attribute to the module, so the module is made callable (it
forwards to the function) and ``from crosscut.partitioner import trace`` works in
either order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["trace"]

if TYPE_CHECKING:
    from crosscut.partitioner.trace import trace


def __getattr__(name: str) -> Any:
    if name == "trace":
        from crosscut.partitioner.trace import trace

        globals()["trace"] = trace
        return trace
    raise AttributeError(f"module 'crosscut.partitioner' has no attribute {name!r}")
