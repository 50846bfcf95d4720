"""Cost models: devices and clusters, analytic and profiled per-node costs, memory, links.

The partitioner reads a :class:`CostTable` (seconds per node per device kind,
bytes per node) and a :class:`Cluster` (devices, caps, links); this package
makes both, and knows nothing about solvers.
"""

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
