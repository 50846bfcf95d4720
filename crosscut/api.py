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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from crosscut.codegen.grouped_stages import local_groups
from crosscut.errors import InputError
from crosscut.ir.plan import Plan
from crosscut.ir.schedule import AUTO_SCHEDULE
from crosscut.partitioner.validate import validate_plan
from crosscut.planning import (
    PlanRequest,
    TraceCache,
    as_tuple,
    check_plan_devices,
    check_plan_precision,
    check_recompute,
    get_costs,
    load_plan,
    micro_inputs,
    other_mode_graph,
    partition,
    plan_request,
    public_errors,
    recompute_flags_for,
    recompute_request,
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
    mode: str = "train",
    schedule: str = AUTO_SCHEDULE,
    microbatches: int | None = None,
    replicas: int | None = None,
    objective: str = "throughput",
    plan: Plan | str | Path | None = None,
    time_limit: float = 10.0,
    optimizer: str = "sgd",
    cost: str = "analytic",
    seed: int = 0,
    require_all_devices: bool = False,
    progress: Callable[[float, float, float], None] | None = None,
    cross_shaped: bool = False,
    widths: Sequence[int] | None = None,
    splits: Sequence[str] = ("batch", "channel"),
    bn_mode: str = "micro",
    output_merge: Any = None,
    recompute: str | bool | Sequence[bool] = "auto",
    precision: str | None = None,
) -> Any:
    """Partition ``model`` over ``devices`` and return a CompiledModule that trains.

    The planner chooses the strategy with the shortest predicted step
    (:func:`partition`): data-parallel ``replicas`` (run here as batch-split
    device groups, one per stage position), the pipeline and ``microbatches``;
    a number given for either is kept. ``bn_mode="exact"`` fixes both at 1
    unless given (whole-batch statistics rule out splitting the batch).

    ``recompute``: stages keep only their inputs per micro-batch and recompute
    their activations in backward, with the same numbers
    (:mod:`crosscut.runtime.recomputing`). ``"auto"`` (default): the planner
    decides, pricing the memory saved and the extra forward (see
    :func:`partition`), and a given plan runs as it says; ``"always"``/``True``
    and ``"never"``/``False`` plan and run every stage that way; one bool per
    stage overrides the run time only (the plan does not price that).

    ``precision`` (``"fp32"``, ``"bf16"``, ``"fp16"``; default: fp32, or a given
    plan's): the plan is priced and every call runs under autocast with that
    dtype (:mod:`crosscut.precision`); fp16 training wants a loss scaler.

    ``bn_mode`` (``"micro"``, ``"step"``, ``"exact"``): batch norm over
    micro-batches, see :mod:`crosscut.runtime.local.compiled`.

    ``output_merge``: how the micro-batches' outputs become one output
    (:mod:`crosscut.runtime.output_merge`): batch-major outputs are
    concatenated on dim 0; any other output needs a rule (``"sum"``,
    ``"mean"``, ``"same"``, ``"cat"`` or a callable over the list of
    micro-batch values) at its path, e.g. ``{1: "sum"}`` or ``{"aux.count":
    "sum"}``, or it is refused here when ``microbatches > 1``.

    ``cross_shaped``/``widths``/``splits``: see :func:`partition`; stages of the
    plan that run on device groups are width-split by ``codegen/width.py``.

    With ``plan=`` the saved plan is replayed after checking that it was made
    for this model (fingerprint) and that enough devices are given; its stages
    run on the given devices in order. Inside a torchrun job (after
    ``crosscut.distributed.init()``, world size > 1) each rank gets a
    :class:`~crosscut.runtime.dist.rank_executor.DistributedPipeline` running its own
    stage instead: every option is validated on every rank first, and
    without ``plan`` rank 0 partitions with these options for ``devices`` (one
    per stage; ``None``: the ranks' own device kind). ``require_all_devices`` makes the solver
    use every device even where fewer stages would be faster (useful for tests
    and for models that must be spread for memory).
    """
    from crosscut.cost_models.cluster import Cluster
    from crosscut.runtime import CompiledModule

    if not isinstance(model, nn.Module):
        raise InputError(
            "model must be a torch.nn.Module",
            value=type(model).__name__,
            remedy="pass the module itself, not its class or a function",
        )
    from crosscut.runtime.output_merge import normalize_merge

    normalize_merge(output_merge)  # a bad rule fails here, before tracing
    # every option is checked here, once, on every rank alike under torchrun: the same
    # error everywhere, before any rank waits on another (planning.PlanRequest)
    if bn_mode == "exact":  # the whole batch's statistics: one micro-batch on one device
        microbatches = 1 if microbatches is None else microbatches
        replicas = 1 if replicas is None else replicas
    request = PlanRequest(
        mode=mode,
        objective=objective,
        schedule=schedule,
        microbatches=microbatches,
        replicas=replicas,
        time_limit=time_limit,
        optimizer=optimizer,
        cost=cost,
        seed=seed,
        require_all_devices=require_all_devices,
        cross_shaped=cross_shaped,
        widths=None if widths is None else tuple(widths),
        splits=tuple(splits),
        recompute=recompute_request(recompute, bn_mode),
        precision=precision or "fp32",
    )
    check_recompute(recompute)
    if _distributed_run():
        # Under torchrun every rank runs its own stage; the devices come from the ranks
        # (or, given, say what rank 0 plans for).
        from crosscut.distributed import compile_distributed

        # a plan (given, or from `crosscut run`'s CROSSCUT_PLAN) brings its own schedule
        # and micro-batches: the model is traced at the plan's micro-batch
        planned = plan is not None or bool(os.environ.get("CROSSCUT_PLAN"))
        return compile_distributed(
            model,
            example_inputs,
            plan,
            schedule=None if planned else schedule,
            microbatches=None if planned else microbatches,
            replicas=None if planned else replicas,
            bn_mode=bn_mode,
            output_merge=output_merge,
            recompute=recompute,
            precision=precision,
            devices=devices,
            partition_options={
                k: v
                for k, v in request.partition_options().items()
                if k not in ("schedule", "microbatches", "replicas", "fill_devices")
            },
        )
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
        check_plan_precision(the_plan, precision)
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
    other_gm = other_mode_graph(model, run_graph)
    groups = local_groups(the_plan, [torch.device(d.device) for d in cl.devices])
    stage_devices = [devs[0] for devs, _ in groups]
    return CompiledModule(
        model,
        run_graph.gm,
        dict(the_plan.assignment),
        stage_devices,
        schedule=the_plan.options.schedule,
        microbatches=the_plan.options.microbatches,
        plan=the_plan,
        groups=groups if any(len(devs) > 1 for devs, _ in groups) else None,
        output_merge=output_merge,
        bn_mode=bn_mode,
        other_gm=other_gm,
        gm_training=the_plan.model.mode == "train",
        recompute=recompute_flags_for(recompute, the_plan),
        precision=the_plan.options.precision,
    )
