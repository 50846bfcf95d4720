"""The staged program: what codegen hands a runtime, as data.

A plan says which node runs where; codegen turns it into stage modules and
records, per stage, what it reads, what it exports, which original
``state_dict`` keys its tensors stand for, and every transfer and collective.
Those records are defined here, below codegen and the runtimes, so a runtime
reads a :class:`StagedProgram` without importing the code generator, and the
transfer records mean the same thing to codegen, the runtimes and the
drawings. Nothing here imports torch at run time (the stage modules and
devices are torch objects, named in annotations only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import fx

__all__ = [
    "INPUT",
    "OUTPUT",
    "Collective",
    "Stage",
    "StagedProgram",
    "Transfer",
    "ValueRef",
    "map_structure",
]

INPUT = -1
"""Pseudo-stage of the model's inputs (placeholders): they come from the caller."""

OUTPUT = -2
"""Pseudo-stage of the model's output: values gathered for the caller."""


@dataclass(frozen=True)
class Transfer:
    """Move ``value`` (an fx node name) from ``src_stage`` to ``dst_stage``.

    ``src_stage`` is :data:`INPUT` for model inputs and ``dst_stage`` is
    :data:`OUTPUT` for values the model returns. ``nbytes`` is 0 for
    non-tensor values (e.g. a ``size()`` integer), which are passed as-is.
    """

    name: str
    value: str
    src_stage: int
    dst_stage: int
    src_device: str
    dst_device: str
    nbytes: int

    @property
    def is_local(self) -> bool:
        """Both ends on the same physical device: the runtime copies nothing."""
        return self.src_device == self.dst_device


@dataclass(frozen=True)
class Collective:
    """One collective a group stage runs per micro-batch (forward direction)."""

    kind: str  # "all_gather" | "broadcast" | "scatter" | "gather" | "all_reduce"
    value: str  # fx node (or parameter set) it moves
    nbytes: int  # bytes of the whole value
    devices: tuple[str, ...]


@dataclass(frozen=True)
class ValueRef:
    """A leaf of the output template: the value of fx node ``name``."""

    name: str


@dataclass
class Stage:
    """One stage: its module on its device, what it reads and what it exports."""

    index: int
    device: torch.device
    module: fx.GraphModule
    inputs: list[tuple[str, int]]  # (value, source stage or INPUT), in argument order
    outputs: list[str]  # values it returns, in tuple order
    param_keys: dict[str, list[str]] = field(default_factory=dict)  # local name -> original keys
    mutated_inputs: set[str] = field(default_factory=set)  # inputs the stage changes in place
    devices: list[torch.device] = field(default_factory=list)  # the group (leader = device)
    split: str = "none"  # "none" | "channel" | "batch"
    collectives: list[Collective] = field(default_factory=list)  # per micro-batch, forward

    @property
    def name(self) -> str:
        if len(self.devices) > 1:
            return f"stage{self.index}@{self.device}+{len(self.devices) - 1}({self.split})"
        return f"stage{self.index}@{self.device}"


@dataclass
class StagedProgram:
    """Everything the runtime needs to run a split model."""

    stages: list[Stage]
    placeholders: list[str]  # the model's inputs, in signature order
    output_template: Any  # the output structure with ValueRef leaves
    output_sources: dict[str, int]  # returned value -> producing stage (INPUT for inputs)
    transfers: list[Transfer]
    node_bytes: dict[str, int]
    key_sources: dict[str, tuple[int, str]]  # original state_dict key -> (stage, local name)
    clones: list[str] = field(default_factory=list)  # clone nodes inserted for in-place safety
    # original key of a channel-sharded tensor -> (stage, shard local names, cat dim or None)
    shard_sources: dict[str, tuple[int, list[str], int | None]] = field(default_factory=dict)
    # per-reader aliases of a fanned-out value (codegen/fanout.py): alias -> aliased value
    aliases: dict[str, str] = field(default_factory=dict)


def map_structure(fn: Any, obj: Any) -> Any:
    """Apply ``fn`` to the leaves of nested tuples (incl. namedtuples), lists and dicts."""
    if isinstance(obj, tuple):
        items = [map_structure(fn, o) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [map_structure(fn, o) for o in obj]
    if isinstance(obj, dict):
        return {k: map_structure(fn, v) for k, v in obj.items()}
    return fn(obj)
