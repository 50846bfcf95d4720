"""The public front door: ``trace``, ``partition`` and ``compile``.

This is the only module that strings the stages together (trace → costs →
partition → codegen → runtime). The shared half — options checked up front,
tracing, planning — is :mod:`crosscut.planning`, which the torchrun path
(:mod:`crosscut.distributed`) uses too; ``compile`` checks every option there
before it decides between a local :class:`~crosscut.runtime.local.compiled.CompiledModule`
and a torchrun rank's :class:`~crosscut.runtime.dist.rank_executor.DistributedPipeline`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Unpack

import torch
from torch import nn

from crosscut.codegen.grouped_stages import local_groups
from crosscut.errors import InputError
from crosscut.ir.plan import Plan
from crosscut.ir.schedule import AUTO_SCHEDULE
from crosscut.options import CompileKeywords, RunOptions, split_options
from crosscut.partitioner.validate import validate_plan
from crosscut.planning import (
    PlanRequest,
    TraceCache,
    as_tuple,
    check_plan_devices,
    check_plan_precision,
    get_costs,
    load_plan,
    micro_inputs,
    other_mode_graph,
    partition,
    plan_request,
    public_errors,
    recompute_flags_for,
    trace,
)
from crosscut.precision import check_precision_devices

__all__ = ["compile", "get_costs", "micro_inputs", "other_mode_graph", "partition", "trace"]


def _distributed_run() -> bool:
    """True inside a torchrun job with more than one rank (see crosscut.distributed.init)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@public_errors
def compile(
    model: nn.Module,
    devices: Any,
    example_inputs: Any,
    *,
    plan: Plan | str | Path | None = None,
    progress: Callable[[float, float, float], None] | None = None,
    options: PlanRequest | None = None,
    run: RunOptions | None = None,
    **keywords: Unpack[CompileKeywords],
) -> Any:
    """Partition ``model`` over ``devices`` and return a CompiledModule that trains.

    The planner chooses the strategy with the shortest predicted step
    (:func:`partition`): data-parallel ``replicas`` (run here as batch-split
    device groups, one per stage position), the pipeline and ``microbatches``;
    a number given for either is kept.

    Options: :class:`~crosscut.options.PlanRequest`'s fields (how to plan:
    ``microbatches``, ``schedule``, ``cross_shaped``, ``time_limit``, ...) and
    :class:`~crosscut.options.RunOptions`' (how to run: ``bn_mode``,
    ``output_merge``, ``recompute``, ``precision``), as keywords or as the
    ``options=`` and ``run=`` objects with keywords put over them; each
    class's docstring says what its fields do. ``bn_mode="exact"`` fixes
    micro-batches and replicas at 1 unless given (whole-batch statistics rule
    out splitting the batch). Stages that run on device groups
    (``cross_shaped=True``) are width-split by ``codegen/width.py``.

    With ``plan=`` the saved plan is replayed after checking that it was made
    for this model (fingerprint) and that enough devices are given; its stages
    run on the given devices in order. Inside a torchrun job (after
    ``crosscut.distributed.init()``, world size > 1) each rank gets a
    :class:`~crosscut.runtime.dist.rank_executor.DistributedPipeline` running its own
    stage instead: every option is validated on every rank first, and
    without ``plan`` rank 0 partitions with these options for ``devices`` (one
    per stage; ``None``: the ranks' own device kind).
    """
    if not isinstance(model, nn.Module):
        raise InputError(
            "model must be a torch.nn.Module",
            value=type(model).__name__,
            remedy="pass the module itself, not its class or a function",
        )
    from crosscut.runtime.output_merge import normalize_merge

    # every option is checked here, once, on every rank alike under torchrun: the same
    # error everywhere, before any rank waits on another
    request, the_run = split_options(options, run, keywords)
    normalize_merge(the_run.output_merge)  # a bad rule fails here, before tracing
    _check_materialised(model)
    if _distributed_run():
        # Under torchrun every rank runs its own stage; the devices come from the ranks
        # (or, given, say what rank 0 plans for).
        from crosscut.distributed import compile_distributed

        # a plan (given, or from `crosscut run`'s CROSSCUT_PLAN) brings its own schedule
        # and micro-batches: the model is traced at the plan's micro-batch
        if plan is not None or os.environ.get("CROSSCUT_PLAN"):
            request = dataclasses.replace(
                request, schedule=AUTO_SCHEDULE, microbatches=None, replicas=None
            )
        return compile_distributed(
            model, example_inputs, plan, devices=devices, options=request, run=the_run
        )
    return _compile_local(model, devices, example_inputs, plan, request, the_run, progress)


def _check_materialised(model: Any) -> None:
    """A model on the ``meta`` device can be traced and partitioned, not run."""
    meta = [k for k, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise InputError(
            f"compile runs the model, and {len(meta)} of its parameters and buffers are on "
            "the meta device (shapes without data)",
            value=meta[:8],
            remedy="crosscut.partition plans a meta model; to compile, materialise it first "
            "(model.to_empty(device='cpu'), then initialise or load_state_dict)",
        )


def _compile_local(
    model: nn.Module,
    devices: Any,
    example_inputs: Any,
    plan: Plan | str | Path | None,
    request: PlanRequest,
    run: RunOptions,
    progress: Callable[[float, float, float], None] | None,
) -> Any:
    """:func:`compile` in this process: plan (or replay ``plan``), trace, build the module."""
    from crosscut.cost_models.cluster import Cluster
    from crosscut.runtime import CompiledModule

    cl = Cluster.from_any(devices)
    if cl.nodes > 1:
        raise InputError(
            "compile runs on this machine's devices; a cluster of several nodes is planned "
            "with partition() and run under torchrun",
            value=cl.name,
            remedy="`crosscut partition MODEL --devices 32x8xV100 -o plan.json`, then "
            "`crosscut run --plan plan.json train.py` on every node",
        )
    inputs = as_tuple(example_inputs)
    traces = TraceCache(model, inputs, request)
    if plan is None:
        check_precision_devices(request.precision, cl.devices)
        the_plan = plan_request(model, cl, inputs, request, progress=progress, traces=traces)
    else:
        the_plan = load_plan(plan)
        check_plan_precision(the_plan, run.precision)
        check_plan_devices(the_plan, cl)
        traces = TraceCache(
            model,
            inputs,
            dataclasses.replace(
                request, mode=the_plan.model.mode, precision=the_plan.options.precision
            ),
        )
    reps, m = the_plan.replication.replicas, the_plan.options.microbatches
    micro_inputs(inputs, reps * m)  # the batch splits into replicas × micro-batches
    graph = traces.graph(int(inputs[0].shape[0]) // (reps * m))
    if plan is not None:
        validate_plan(the_plan, graph)
    # replicas run as batch-split groups over one micro-batch of the whole batch
    run_graph = graph if reps == 1 else traces.graph(int(inputs[0].shape[0]) // m)
    groups = local_groups(the_plan, [torch.device(d.device) for d in cl.devices])
    return CompiledModule(
        model,
        run_graph.gm,
        dict(the_plan.assignment),
        [devs[0] for devs, _ in groups],
        schedule=the_plan.options.schedule,
        microbatches=m,
        plan=the_plan,
        groups=groups if any(len(devs) > 1 for devs, _ in groups) else None,
        output_merge=run.output_merge,
        bn_mode=run.bn_mode,
        other_gm=other_mode_graph(model, run_graph),
        gm_training=the_plan.model.mode == "train",
        recompute=_recompute_flags(model, run, the_plan, run_graph),
        precision=the_plan.options.precision,
    )


def _recompute_flags(model: nn.Module, run: RunOptions, plan: Plan, graph: Any) -> Any:
    """The run's flags; under "auto", off on stages that write a parameter in forward,
    which a recomputation cannot replay (``codegen/state_writes.py``)."""
    from crosscut.codegen.state_writes import recompute_honouring_writes

    flags = recompute_flags_for(run.recompute, plan)
    stage_of = dict(plan.assignment)
    return recompute_honouring_writes(model, graph.gm, stage_of, run.recompute, flags)
