"""Applying a plan's device groups to built stages (cross-shaped plans).

``build_stages`` first splits the model into one GraphModule per stage as for
a pipeline, then hands every stage whose group has several devices to
:func:`apply_groups`, which swaps in its width-split module
(``codegen/width.py``) and remaps the stage's parameters to the ORIGINAL
``state_dict`` keys: whole tensors stay in ``key_sources``; tensors cut into
channel shards move to ``shard_sources`` (key → stage, shard names, dim), from
which ``CompiledModule.state_dict()`` re-assembles them.

A batch split is not rewritten here: how a group's shares run (threads, one
per device) is the runtime's business, so the caller passes the wrapper that
holds the stage as ``inner`` (:data:`BatchStage`, the runtime's
``BatchSplitStage``) and this module only renames the keys to match. That
callback is what keeps codegen below the runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import fx, nn

from crosscut.codegen.width import channel_split
from crosscut.errors import CodegenError
from crosscut.ir.program import Collective

if TYPE_CHECKING:
    from crosscut.ir.plan import Plan
    from crosscut.ir.program import Stage

__all__ = ["BatchStage", "ShardSources", "apply_groups", "check_groups", "local_groups"]

#: wraps a stage module for a batch split: (stage, group devices, indices of the inputs
#: the stage writes in place) -> a module holding the stage as ``inner``
BatchStage = Callable[[fx.GraphModule, list[torch.device], list[int]], nn.Module]

Group = tuple[Sequence[torch.device | str], str]
ShardSources = dict[str, tuple[int, list[str], int | None]]


def check_groups(groups: Sequence[Group] | None, devices: list[torch.device]) -> None:
    """One group per stage, a known split, the stage's device first in its group."""
    if groups is None:
        return
    if len(groups) != len(devices):
        raise CodegenError(
            f"{len(groups)} device groups for {len(devices)} stages",
            value=len(groups),
            remedy="pass one (devices, split) group per stage",
        )
    for k, (group_devs, kind) in enumerate(groups):
        if kind not in ("none", "channel", "batch"):
            raise CodegenError(
                f"stage {k} has unknown split {kind!r}", value=kind, remedy="use none/channel/batch"
            )
        if not group_devs or torch.device(group_devs[0]) != devices[k]:
            raise CodegenError(
                f"stage {k}'s group must start with its stage device {devices[k]}",
                value=[str(d) for d in group_devs],
                remedy="list the stage device first in its group",
            )
        if len(group_devs) == 1 and kind != "none":
            raise CodegenError(
                f"stage {k} splits by {kind!r} over one device",
                value=[str(d) for d in group_devs],
                remedy="give the stage two or more devices, or use split 'none'",
            )


def apply_groups(
    stages: list[Stage],
    groups: Sequence[Group],
    origin: dict[int, list[str]],
    key_sources: dict[str, tuple[int, str]],
    batch_stage: BatchStage | None = None,
) -> ShardSources:
    """Width-split every multi-device stage in place; returns the shard sources.

    ``batch_stage`` wraps a batch-split stage (the runtime's; required when a
    group splits by batch).
    """
    shards: ShardSources = {}
    for s, (group_devs, kind) in enumerate(groups):
        if len(group_devs) > 1 and kind != "none":
            devs = [torch.device(d) for d in group_devs]
            if kind == "batch" and batch_stage is None:
                raise CodegenError(
                    f"stage {s} splits by batch but no batch-split wrapper was given",
                    value=[str(d) for d in devs],
                    remedy="pass batch_stage=BatchSplitStage (crosscut.runtime.batch_split)",
                )
            shards.update(_split_stage(stages[s], devs, kind, origin, key_sources, batch_stage))
    return shards


def _split_stage(
    stage: Stage,
    devs: list[torch.device],
    kind: str,
    origin: dict[int, list[str]],
    key_sources: dict[str, tuple[int, str]],
    batch_stage: BatchStage | None,
) -> ShardSources:
    sub = stage.module
    old_keys = stage.param_keys
    stage.devices, stage.split = devs, kind
    names = tuple(str(d) for d in devs)
    if kind == "batch" and batch_stage is not None:
        mutated = [j for j, (v, _) in enumerate(stage.inputs) if v in stage.mutated_inputs]
        stage.module = batch_stage(sub, devs, mutated)  # type: ignore[assignment]
        stage.param_keys = {f"inner.{k}": v for k, v in old_keys.items()}
        for local, originals in stage.param_keys.items():
            for k in originals:
                if key_sources.get(k, (-1, ""))[0] == stage.index:
                    key_sources[k] = (stage.index, local)
        grads = sum(p.numel() * p.element_size() for p in sub.parameters() if p.requires_grad)
        stage.collectives = [
            *(Collective("scatter", v, 0, names) for v, _ in stage.inputs),
            *(Collective("gather", v, 0, names) for v in stage.outputs),
            Collective("all_reduce", "gradients", int(grads), names),
        ]
        return {}
    cs = channel_split(sub, devs)
    stage.module = cs.module
    sharded = {name for shard_names, _ in cs.shards.values() for name in shard_names}
    keys: dict[str, list[str]] = {}
    for local, t in [
        *cs.module.named_parameters(remove_duplicate=False),
        *cs.module.named_buffers(remove_duplicate=False),
    ]:
        keys[local] = [] if local in sharded else origin.get(id(t), [])
        for k in keys[local]:
            if key_sources.get(k, (-1, ""))[0] == stage.index:
                key_sources[k] = (stage.index, local)
    stage.param_keys = keys
    stage.collectives = cs.collectives
    out: ShardSources = {}
    for old_local, (shard_names, dim) in cs.shards.items():
        for k in old_keys.get(old_local, []):
            key_sources.pop(k, None)
            out[k] = (stage.index, shard_names, dim)
    return out


T = TypeVar("T")


def local_groups(plan: Plan, given: list[T]) -> list[tuple[list[T], str]]:
    """Each stage's devices among ``given`` and its split, for one process running every replica.

    ``given`` lists the plan's devices replica by replica (replica ``r`` of a
    plan over ``d`` devices is ``given[r·d .. r·d + d − 1]``, as ``crosscut
    run`` numbers ranks). With one replica a stage keeps its own devices;
    with several, a stage position's replicas become one batch-split group
    (the data parallelism of the replicas, reduced inside the group).
    """
    d, reps = len(plan.cluster.devices), plan.replication.replicas
    if len(given) != d * reps:
        raise CodegenError(
            f"the plan runs {reps} replica(s) of {d} device(s): {d * reps} devices, "
            f"but {len(given)} were given",
            value={"plan devices": d, "replicas": reps, "given": len(given)},
            remedy=f"pass {d * reps} devices, or re-partition for these devices",
        )
    out: list[tuple[list[T], str]] = []
    for st in plan.stages:
        idx = [plan.cluster.index(name) for name in st.devices]
        if reps == 1:
            out.append(([given[i] for i in idx], st.split))
        elif len(idx) > 1:
            raise CodegenError(
                "a replicated plan's stages each run on one device per replica",
                value={"stage": st.index, "devices": st.devices, "replicas": reps},
                remedy="re-partition with replicas=1 for device groups inside a stage",
            )
        else:
            out.append(([given[r * d + idx[0]] for r in range(reps)], "batch"))
    return out
