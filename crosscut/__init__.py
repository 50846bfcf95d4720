"""crosscut: split convolutional networks across devices.

``crosscut.compile(model, devices, example_inputs)`` traces the model with
torch.fx, prices every op, solves a CP-SAT integer program for the placement
and returns a module that trains as a pipeline across the devices. See
README.md for a tour and docs/ARCHITECTURE.md for the map of the code.

Public names are resolved lazily so that ``import crosscut`` (and the CLI's
``--help``) does not pay for OR-Tools or the runtime until they are used.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from crosscut.errors import (
    CodegenError,
    CostModelError,
    CrosscutError,
    DeviceError,
    DistributedError,
    InfeasiblePlanError,
    InputError,
    PartitionError,
    PlanError,
    TraceError,
)
from crosscut.version import __version__

__all__ = [
    "Cluster",
    "CodegenError",
    "CompiledModule",
    "CostModelError",
    "CrosscutError",
    "DeviceError",
    "DeviceSpec",
    "DistributedError",
    "InfeasiblePlanError",
    "InputError",
    "OpGraph",
    "PartitionError",
    "Plan",
    "PlanError",
    "TraceError",
    "__version__",
    "clip_grad_norm_",
    "compile",
    "partition",
    "simulate",
    "trace",
]

_LAZY = {
    "compile": "crosscut.api",
    "clip_grad_norm_": "crosscut.distributed",
    "trace": "crosscut.api",
    "partition": "crosscut.api",
    "simulate": "crosscut.partitioner.simulate",
    "Plan": "crosscut.ir.plan",
    "OpGraph": "crosscut.ir.graph",
    "CompiledModule": "crosscut.runtime",
    "Cluster": "crosscut.cost_models.cluster",
    "DeviceSpec": "crosscut.cost_models.devices",
}

if TYPE_CHECKING:
    from crosscut.api import compile, partition, trace
    from crosscut.cost_models.cluster import Cluster
    from crosscut.cost_models.devices import DeviceSpec
    from crosscut.distributed import clip_grad_norm_
    from crosscut.ir.graph import OpGraph
    from crosscut.ir.plan import Plan
    from crosscut.partitioner.simulate import simulate
    from crosscut.runtime import CompiledModule


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'crosscut' has no attribute {name!r}")
