"""Cost models: devices and clusters, analytic and profiled per-node costs, memory, links.

The partitioner reads a :class:`CostTable` (seconds per node per device kind,
bytes per node) and a :class:`Cluster` (devices, caps, links); this package
makes both, and knows nothing about solvers.

The names below load their module on first use: the simulator and the drawings
read the torch-free parts (device presets, calibration) without loading torch,
which the analytic and profiled costs need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from crosscut.cost_models.analytic import analytic_costs
    from crosscut.cost_models.cluster import Cluster
    from crosscut.cost_models.devices import DeviceSpec, preset_names
    from crosscut.cost_models.memory import peak_memory
    from crosscut.cost_models.profiled import profile_costs
    from crosscut.cost_models.table import CostTable, NodeCost

__all__ = [
    "Cluster",
    "CostTable",
    "DeviceSpec",
    "NodeCost",
    "analytic_costs",
    "peak_memory",
    "preset_names",
    "profile_costs",
]

_HOME = {
    "Cluster": "cluster",
    "CostTable": "table",
    "DeviceSpec": "devices",
    "NodeCost": "table",
    "analytic_costs": "analytic",
    "peak_memory": "memory",
    "preset_names": "devices",
    "profile_costs": "profiled",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
