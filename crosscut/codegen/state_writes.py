"""Model state (buffers, parameters) written in forward, and when a pipeline cannot honour it.

A buffer updated in forward (a call counter ``self.calls.add_(1)``, an EMA
``self.avg.mul_(0.9).add_(0.1 * x.mean())``) is part of the traced graph
(``frontend/tracer.py`` traces buffers as ``get_attr`` nodes, and
``frontend/alias.py`` records every node that writes one), so each stage
updates the copy it owns on every call, as eager does.

With ``M > 1`` micro-batches every stage's forward runs ``M`` times per call,
so such a write would happen ``M`` times where eager does it once, on other
values (per micro-batch instead of the whole batch). No rewrite can make that
equal, so :func:`check_state_writes` refuses it at compile time, naming the
buffer and the node. The one exception is batch norm's own running statistics
(``running_mean``, ``running_var``, ``num_batches_tracked`` of a
``_BatchNorm``, traced through as in timm's ``BatchNormAct2d``): what they do
over micro-batches is the documented ``bn_mode`` contract of
:class:`~crosscut.runtime.CompiledModule` — except that ``"step"`` and
``"exact"`` reach only batch norms called as leaf modules, so a batch norm
whose statistics the graph updates itself is refused under them.

The batch is also split *across devices*: data-parallel replicas, and a
stage run on a batch-split device group (``runtime/batch_split.py``), run
their forward on a share of the micro-batch, and only the leader's share (or
replica 0) writes the model's state. A write that does not read the batch (a
call counter) is then the same as eager; one that does (an EMA of an
activation) is computed from one share only. :func:`batch_dependent_writes`
finds those, and ``check_state_writes(..., split=...)`` refuses them where
the plan splits their stage; the planner (``crosscut/state_rules.py``) never
makes such a plan.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence, Sized

import torch
import torch.nn.functional as F
from torch import fx, nn

from crosscut.errors import CodegenError
from crosscut.frontend.alias import functional_norm_writes
from crosscut.frontend.written_state import (
    batch_dependent_writes,
    batch_norm_stat,
    model_state_writes,
    state_writes,
)

__all__ = [
    "batch_dependent_writes",
    "check_recomputed_writes",
    "check_state_writes",
    "functional_norm_writes",
    "model_state_writes",
    "recompute_honouring_writes",
    "split_nodes",
    "state_writes",
    "traced_batch_norm_writes",
    "without_parameter_writers",
]


def split_nodes(
    stage_of: Mapping[str, int],
    groups: Sequence[tuple[Sized, str]] | None,
    replicas: int = 1,
) -> set[str]:
    """The nodes a plan runs on shares of the batch: every node under data-parallel
    ``replicas``, else those of the stages whose group (devices, split) splits by batch."""
    if replicas > 1:
        return set(stage_of)
    shared = {k for k, (devs, how) in enumerate(groups or []) if how == "batch" and len(devs) > 1}
    return {n for n, k in stage_of.items() if k in shared}


def traced_batch_norm_writes(model: nn.Module, gm: fx.GraphModule) -> list[tuple[str, str]]:
    """``(node, key)`` where the graph itself updates a batch norm's statistics.

    That is a batch norm traced through rather than called as a leaf (a
    subclass with its own forward, like timm's ``BatchNormAct2d``): a
    training-mode ``F.batch_norm`` on its running buffers, or the
    ``num_batches_tracked.add_(1)`` of its forward. ``bn_mode="step"`` swaps
    leaf batch norms only, so it cannot reach these.
    """
    by_name = {n.name: n for n in gm.graph.nodes}
    out = [(n, k) for n, k in state_writes(gm) if batch_norm_stat(model, k)]
    out = [(n, k) for n, k in out if by_name[n].op != "call_module"]
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (F.batch_norm, torch.batch_norm):
            continue
        args = [*n.args, *n.kwargs.values()]
        training = n.kwargs.get("training", n.args[5] if len(n.args) > 5 else False)
        stats = [a for a in args if isinstance(a, fx.Node) and a.op == "get_attr"]
        keys = [str(a.target) for a in stats if batch_norm_stat(model, str(a.target))]
        if training is not False and keys:
            out.append((n.name, keys[0]))
    return out


def check_state_writes(
    model: nn.Module,
    gm: fx.GraphModule,
    microbatches: int,
    bn_mode: str = "micro",
    split: Collection[str] = (),
) -> None:
    """Refuse state written in forward when it would be written ``microbatches`` times per call,
    or from a share of the batch (``split``: the nodes the plan runs on a share).

    Batch norm statistics are ``bn_mode``'s: with ``"micro"`` every micro-batch
    updates them (documented); ``"step"`` and ``"exact"`` promise otherwise,
    which they cannot keep for a batch norm the graph updates itself
    (:func:`traced_batch_norm_writes`), so that is refused too.
    """
    for node, key in batch_dependent_writes(model, gm) if split else []:
        if node in split:
            raise CodegenError(
                f"state {key!r} is written in forward by node {node!r} from the batch, and "
                "the plan splits that node's batch across devices (data-parallel replicas "
                "or a batch-split group): it would be written from one share of the batch, "
                "eager mode from all of it",
                value={"state": key, "node": node},
                remedy="re-plan (the planner keeps such a node's batch whole: no replicas, "
                "no batch-split group), or move the update out of forward",
            )
    if microbatches <= 1:
        return
    if bn_mode != "micro":
        for node, key in traced_batch_norm_writes(model, gm):
            raise CodegenError(
                f"batch norm statistic {key!r} is updated by the traced graph itself (node "
                f"{node!r}: the batch norm's forward is traced through, not called as a leaf), "
                f"so bn_mode={bn_mode!r} cannot update it once per step; with microbatches="
                f"{microbatches} it would be updated once per micro-batch",
                value={"state": key, "node": node, "bn_mode": bn_mode},
                remedy="use bn_mode='micro' (per micro-batch updates, documented) or "
                "microbatches=1",
            )
    for node, key in model_state_writes(model, gm):
        raise CodegenError(
            f"state {key!r} is written in forward by node {node!r}; with microbatches="
            f"{microbatches} the compiled module would write it {microbatches} times per call "
            "(once per micro-batch, on that micro-batch's values), eager mode once",
            value={"state": key, "node": node, "microbatches": microbatches},
            remedy="compile with microbatches=1, or move the update out of forward (e.g. "
            "into the training loop after optimizer.step())",
        )


# ---- recomputation: a parameter written in forward cannot be replayed -----------------


def _parameter_writes(
    model: nn.Module, gm: fx.GraphModule, stage_of: Mapping[str, int]
) -> dict[int, tuple[str, str]]:
    """Per stage, the first ``(node, parameter key)`` its forward writes in place."""
    params = {k for k, _ in model.named_parameters(remove_duplicate=False)}
    out: dict[int, tuple[str, str]] = {}
    for node, key in state_writes(gm):
        if key in params and node in stage_of:
            out.setdefault(int(stage_of[node]), (node, key))
    return out


def without_parameter_writers(
    model: nn.Module, gm: fx.GraphModule, stage_of: Mapping[str, int], flags: bool | list[bool]
) -> bool | list[bool]:
    """``recompute="auto"``'s flags with recomputation off on every stage whose forward
    writes a parameter (``runtime/state_replay.py`` cannot replay that write)."""
    writers = _parameter_writes(model, gm, stage_of)
    if isinstance(flags, bool) or not writers:
        return flags
    return [f and k not in writers for k, f in enumerate(flags)]


def check_recomputed_writes(
    model: nn.Module, gm: fx.GraphModule, stage_of: Mapping[str, int], flags: Sequence[bool]
) -> None:
    """Refuse, at compile time, a recomputing stage whose forward writes a parameter: the
    recomputation would write it again, after autograd saved it (before, the first
    training call failed)."""
    for k, (node, key) in sorted(_parameter_writes(model, gm, stage_of).items()):
        if k < len(flags) and flags[k]:
            raise CodegenError(
                f"stage {k} recomputes its forward in backward, and its node {node!r} writes "
                f"parameter {key!r} in place: the recomputation cannot replay a parameter "
                "write without changing what autograd saved from it",
                value={"stage": k, "node": node, "parameter": key},
                remedy=f"recompute='auto' or 'never', or a list of flags with False for stage "
                f"{k}; or write the parameter outside forward (e.g. after optimizer.step())",
            )


def recompute_honouring_writes(
    model: nn.Module,
    gm: fx.GraphModule,
    stage_of: Mapping[str, int],
    requested: object,
    flags: bool | list[bool],
) -> bool | list[bool]:
    """The run's recompute ``flags``, checked against parameters written in forward, for
    both runtimes: under ``requested == "auto"`` recomputation is turned off on a writing
    stage (the plan chose it for memory only); a choice the caller made is refused at
    compile time, naming the stage and the parameter, not at the first training call."""
    if requested == "auto":
        return without_parameter_writers(model, gm, stage_of, flags)
    stages = max(stage_of.values(), default=0) + 1
    check_recomputed_writes(
        model, gm, stage_of, [flags] * stages if isinstance(flags, bool) else flags
    )
    return flags
