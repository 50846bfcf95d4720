"""What a model's writes to its own state in forward allow the planner to do with the batch.

A forward that writes model state (a call counter ``self.calls.add_(1)``, an
EMA of an activation) is traced with the write (``frontend/written_state.py``).
Codegen refuses a plan that cannot keep eager's result for it
(``codegen/state_writes.check_state_writes``); the planner must therefore
never make one, or ``crosscut.compile`` fails on the plan the planner chose:

* **micro-batches**: every stage runs ``M`` times per step, so any such write
  would happen ``M`` times: ``M`` is fixed at 1.
* **shares of the batch across devices** (data-parallel replicas, a stage on
  a batch-split group): only the leader's share (replica 0) writes the state,
  once per step. A counter is then eager's; a write computed from the batch
  is not (it sees one share): such a model gets one replica and no batch
  groups (channel groups split no batch and stay allowed).

Batch norm's own running statistics are apart: the runtime's ``bn_mode``
contract says what they do over micro-batches and shares. Each rule that
rules something out is shown with the plan's strategy rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import fx

from crosscut.errors import InputError
from crosscut.frontend.written_state import batch_dependent_writes, model_state_writes
from crosscut.options import PlanRequest

if TYPE_CHECKING:
    from crosscut.traced import TraceCache

__all__ = ["StateLimits", "limited_request", "state_limits", "traced_limits"]


@dataclass(frozen=True)
class StateLimits:
    """Why the planner may not use more than one micro-batch (``micro``), and why it may not
    split the batch across devices (``shares``); empty: allowed."""

    micro: str = ""
    shares: str = ""


def state_limits(gm: fx.GraphModule) -> StateLimits:
    """The limits the state writes of the traced ``gm`` set (module docstring)."""
    # the graph stands in for its model: the tracer marked batch norms' statistics on it
    writes = model_state_writes(gm, gm)
    shared = batch_dependent_writes(gm, gm)
    micro = shares = ""
    if writes:
        node, key = writes[0]
        micro = (
            f"state {key!r} is written in forward by node {node!r}: with micro-batches it "
            "would be written once per micro-batch"
        )
    if shared:
        node, key = shared[0]
        shares = (
            f"state {key!r} is written in forward by node {node!r} from the batch: split "
            "over replicas or a batch-split group it would be written from one share"
        )
    return StateLimits(micro, shares)


def traced_limits(cache: TraceCache, devices: int) -> StateLimits:
    """:func:`state_limits` of the model, traced at the data-parallel share of the batch
    (the size the first layout traces anyway); the graph's writes do not depend on it."""
    fixed = cache.request.microbatches or 1
    size = cache.batch // (devices * fixed) if cache.batch % (devices * fixed) == 0 else 0
    try:
        graph = cache.graph(size or cache.batch)
    except InputError:  # too small a share for the model (batch norm on one value)
        graph = cache.graph(cache.batch)
    return state_limits(graph.gm)


def limited_request(request: PlanRequest, limits: StateLimits) -> PlanRequest:
    """``request`` with the limits applied: ``microbatches`` fixed at 1 and batch groups
    left out where they are ruled out; a caller's option that breaks one is refused."""
    remedy = "move the update out of forward (e.g. into the training loop after optimizer.step())"
    if limits.micro and (request.microbatches or 1) > 1:
        raise InputError(
            f"microbatches={request.microbatches} cannot be kept: {limits.micro}",
            value={"microbatches": request.microbatches},
            remedy=f"use microbatches=1 (or leave it to the planner), or {remedy}",
        )
    if limits.shares and (request.replicas or 1) > 1:
        raise InputError(
            f"replicas={request.replicas} cannot be kept: {limits.shares}",
            value={"replicas": request.replicas},
            remedy=f"use replicas=1 (or leave it to the planner), or {remedy}",
        )
    out = request
    if limits.micro:
        out = dataclasses.replace(out, microbatches=1)
    if limits.shares and "batch" in out.splits:
        splits = tuple(s for s in out.splits if s != "batch")
        out = dataclasses.replace(
            out,
            splits=splits or out.splits,
            cross_shaped=out.cross_shaped if splits else False,
        )
    return out
