"""The public exception hierarchy.

Every error crosscut raises at its API or CLI surface is a :class:`CrosscutError`
whose message states the rule that was broken, the values that broke it and a
remedy (torchgpipe's habit). Internal code raises these directly where it knows
all three; ``crosscut.api`` translates anything else at the boundary.
"""

from __future__ import annotations

__all__ = [
    "CodegenError",
    "CostModelError",
    "CrosscutError",
    "DeviceError",
    "DistributedError",
    "InfeasiblePlanError",
    "InputError",
    "PartitionError",
    "PlanError",
    "RuntimeError_",
    "TraceError",
]


class CrosscutError(Exception):
    """Base class of every error crosscut raises on purpose."""

    def __init__(self, rule: str, *, value: object = None, remedy: str | None = None) -> None:
        self.rule = rule
        self.value = value
        self.remedy = remedy
        parts = [rule]
        if value is not None:
            parts.append(f"got: {value}")
        if remedy:
            parts.append(f"remedy: {remedy}")
        super().__init__("; ".join(parts))


class InputError(CrosscutError, ValueError):
    """A caller passed an argument that breaks a documented rule."""


class TraceError(CrosscutError):
    """torch.fx could not turn the model into a graph, even with automatic leaves."""


class DeviceError(CrosscutError, ValueError):
    """A device or cluster specification is unknown, unavailable or inconsistent."""


class CostModelError(CrosscutError):
    """Costs could not be computed or loaded (profiling failed, cache corrupt)."""


class PartitionError(CrosscutError):
    """The partitioner could not produce a plan for a reason other than infeasibility."""


class InfeasiblePlanError(PartitionError):
    """No assignment of the graph to the devices fits the memory caps.

    Like networkx's ``NetworkXUnfeasible``, this is its own class so callers can
    catch "there is no plan" apart from "something went wrong".
    """


class PlanError(CrosscutError, ValueError):
    """A plan file or object is malformed, of an unknown version, or does not match."""


class CodegenError(CrosscutError):
    """A plan could not be turned into stage modules."""


class RuntimeError_(CrosscutError, RuntimeError):
    """Executing a compiled module failed (named with a trailing underscore so it
    does not shadow the builtin)."""


class DistributedError(RuntimeError_):
    """A distributed run failed: a lost rank, a timeout, or mismatched plans."""
