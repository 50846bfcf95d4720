"""The public front door: ``trace``, ``partition`` and ``compile``.

This is the only module that strings the stages together (trace → costs →
partition → codegen → runtime). It checks the caller's options up front, so
a bad argument fails in one line naming the rule, before minutes of tracing or
solving, and it turns any internal exception that escapes into a
:class:`~crosscut.errors.CrosscutError` so users never see a raw traceback
from deep inside torch or OR-Tools.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from crosscut.errors import CrosscutError, InputError, PlanError
from crosscut.graph import OpGraph
from crosscut.partitioner.plan import Plan, PlanOptions
from crosscut.partitioner.problem import OBJECTIVES, SCHEDULES

__all__ = ["compile", "get_costs", "micro_inputs", "other_mode_graph", "partition", "trace"]

F = TypeVar("F", bound=Callable[..., Any])
MODES = ("train", "infer")
OPTIMIZERS = ("sgd", "momentum", "adam")
COSTS = ("analytic", "profiled")


def _public_errors(fn: F) -> F:
    """Let CrosscutErrors through; wrap anything else with the stage it came from."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CrosscutError:
            raise
        except (KeyboardInterrupt, MemoryError):
            raise
        except Exception as exc:  # the boundary: nothing raw escapes
            raise CrosscutError(
                f"crosscut.{fn.__name__} failed inside a dependency: {type(exc).__name__}: {exc}",
                remedy="this is likely a crosscut bug; please report it with the model and options",
            ) from exc

    return wrapper  # type: ignore[return-value]


def _as_tuple(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if (
        isinstance(example_inputs, (tuple, list))
        and example_inputs
        and all(isinstance(t, torch.Tensor) for t in example_inputs)
    ):
        return tuple(example_inputs)
    raise InputError(
        "example_inputs must be a Tensor or a non-empty tuple of Tensors",
        value=type(example_inputs).__name__,
        remedy="pass e.g. torch.randn(32, 3, 224, 224)",
    )


def micro_inputs(example_inputs: Any, microbatches: int) -> tuple[torch.Tensor, ...]:
    """The first micro-batch of ``example_inputs``: what the graph is traced and priced at."""
    inputs = _as_tuple(example_inputs)
    batch = int(inputs[0].shape[0]) if inputs[0].dim() > 0 else 0
    if batch < 1:
        raise InputError(
            "the batch (dim 0 of the first input) must be at least 1",
            value=tuple(inputs[0].shape),
            remedy="add a batch dimension: x.unsqueeze(0)",
        )
    if batch % microbatches:
        raise InputError(
            f"microbatches must divide the batch: {batch} is not a multiple of {microbatches}",
            value={"batch": batch, "microbatches": microbatches},
            remedy=f"use microbatches in {[m for m in range(1, batch + 1) if batch % m == 0][:8]}",
        )
    size = batch // microbatches
    return tuple(t[:size] for t in inputs)


def _check_options(
    *,
    mode: str,
    objective: str,
    schedule: str,
    microbatches: int,
    time_limit: float,
    optimizer: str = "sgd",
    cost: str = "analytic",
) -> None:
    for label, value, allowed in (
        ("mode", mode, MODES),
        ("objective", objective, OBJECTIVES),
        ("schedule", schedule, SCHEDULES),
        ("optimizer", optimizer, OPTIMIZERS),
        ("cost", cost, COSTS),
    ):
        if value not in allowed:
            raise InputError(f"{label} must be one of {list(allowed)}", value=value)
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise InputError(
            "microbatches must be a positive integer",
            value=microbatches,
            remedy="use 1 for no pipelining, or e.g. 4 or 8",
        )
    if not isinstance(time_limit, (int, float)) or not time_limit > 0:
        raise InputError(
            "time_limit must be a positive number of seconds",
            value=time_limit,
            remedy="e.g. time_limit=10",
        )


def _check_recompute(recompute: Any) -> None:
    """``recompute`` is one bool or a sequence of bools (its length is checked on the plan)."""
    flags = [recompute] if isinstance(recompute, bool) else recompute
    if not isinstance(flags, (list, tuple)) or not all(isinstance(f, bool) for f in flags):
        raise InputError(
            "recompute must be True/False or one bool per stage",
            value=repr(recompute)[:80],
            remedy="pass recompute=True (every stage), False, or e.g. [True, False]",
        )


@_public_errors
def trace(
    model: nn.Module,
    example_inputs: Any,
    *,
    mode: str = "train",
    leaf_modules: Sequence[str] = (),
) -> OpGraph:
    """Trace ``model`` into an :class:`OpGraph` (shapes from FakeTensors, no real compute)."""
    from crosscut.partitioner.trace import trace as _trace

    return _trace(model, example_inputs, mode=mode, leaf_modules=leaf_modules)


def get_costs(
    graph: OpGraph, cluster: Any, *, cost: str = "analytic", optimizer: str = "sgd"
) -> Any:
    """A CostTable for ``graph`` on every device kind of ``cluster``."""
    from crosscut.cost_models import analytic_costs, profile_costs

    table = analytic_costs(graph, cluster, optimizer=optimizer)
    if cost == "profiled":
        for kind in sorted({d.kind for d in cluster.devices}):
            dev = next(d for d in cluster.devices if d.kind == kind)
            table = table.merge(profile_costs(graph, dev.device, kind=kind))
    return table


@_public_errors
def partition(
    model_or_graph: nn.Module | OpGraph,
    cluster: Any,
    example_inputs: Any = None,
    *,
    mode: str = "train",
    objective: str = "throughput",
    schedule: str = "1f1b",
    microbatches: int = 1,
    time_limit: float = 10.0,
    optimizer: str = "sgd",
    cost: str = "analytic",
    overlap_comm: bool = False,
    seed: int = 0,
    solver: str = "cpsat",
    require_all_devices: bool = False,
    model_name: str = "",
    progress: Callable[[float, float, float], None] | None = None,
    cross_shaped: bool = False,
    widths: Sequence[int] | None = None,
    splits: Sequence[str] = ("batch", "channel"),
    colocate: bool = True,
) -> Plan:
    """Find the best plan for a model (or an already traced OpGraph) on ``cluster``.

    ``cluster`` is anything :meth:`crosscut.Cluster.from_any` accepts: a spec
    string (``"4xV100"``), a list of devices (``["cpu", "cpu"]``), an int, a
    cluster JSON path or a Cluster.

    ``cross_shaped=True`` lets a stage run on a group of devices split by
    ``splits`` (``"batch"``: data parallel inside the stage; ``"channel"``:
    conv/linear split by output channels) with group widths from ``widths``
    (default: 2, 4, 8, ... up to the device count, and the count itself).
    ``colocate=False`` forbids the last stage from sharing the previous stage's
    device group (needed for plans run under torchrun: one stage per rank).
    """
    from crosscut.cost_models import Cluster
    from crosscut.partitioner.partition import partition_graph

    _check_options(
        mode=mode,
        objective=objective,
        schedule=schedule,
        microbatches=microbatches,
        time_limit=time_limit,
        optimizer=optimizer,
        cost=cost,
    )
    cl = Cluster.from_any(cluster)
    group_widths, group_splits = _cross_options(cross_shaped, widths, splits, len(cl.devices))
    shapes: list[list[int]] = []
    if isinstance(model_or_graph, OpGraph):
        graph = model_or_graph
    else:
        if example_inputs is None:
            raise InputError(
                "partition(model, ...) needs example_inputs to trace the model",
                remedy="pass e.g. torch.randn(32, 3, 224, 224)",
            )
        shapes = [list(t.shape) for t in _as_tuple(example_inputs)]
        graph = trace(model_or_graph, micro_inputs(example_inputs, microbatches), mode=mode)
        graph.model_name = model_name or type(model_or_graph).__name__
    options = PlanOptions(
        objective=objective,
        schedule=schedule,
        microbatches=microbatches,
        overlap_comm=overlap_comm,
        optimizer=optimizer,
        time_limit_s=float(time_limit),
        seed=seed,
        cost_source=cost,
        widths=group_widths,
        splits=group_splits,
    )
    costs = get_costs(graph, cl, cost=cost, optimizer=optimizer)
    return partition_graph(
        graph,
        costs,
        cl,
        options,
        input_shapes=shapes,
        solver=solver,
        require_all_devices=require_all_devices,
        progress=progress,
        colocate=colocate,
    )


def _distributed_run() -> bool:
    """True inside a torchrun job with more than one rank (see crosscut.distributed.init)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _cross_options(
    cross_shaped: bool, widths: Sequence[int] | None, splits: Sequence[str], devices: int
) -> tuple[list[int], list[str]]:
    """PlanOptions.widths/splits for the cross-shaped switch, checked up front."""
    if not cross_shaped:
        return [1], []
    bad = [x for x in splits if x not in ("batch", "channel")]
    if bad or not splits:
        raise InputError(
            "splits must name 'batch' and/or 'channel'",
            value=list(splits),
            remedy="e.g. splits=('batch', 'channel')",
        )
    if widths is None:
        out, w = [1], 2
        while w <= devices:
            out.append(w)
            w *= 2
        widths = sorted({*out, devices})
    if any(not isinstance(w, int) or w < 1 for w in widths):
        raise InputError("widths must be positive integers", value=list(widths), remedy="(1, 2, 4)")
    return sorted({1, *widths}), sorted(set(splits))


def _load_plan(plan: Plan | str | Path) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    raise PlanError("plan= takes a Plan or a path to a plan JSON file", value=type(plan).__name__)


def _check_plan_devices(plan: Plan, cluster: Any) -> None:
    """A replayed plan maps its cluster's devices, in order, onto the given devices.

    Kinds may differ on purpose (``crosscut verify`` replays a GPU plan on CPU
    devices), but the count must match so device ``i`` of the plan has a home.
    """
    given = [d.name for d in cluster.devices]
    planned = [d.name for d in plan.cluster.devices]
    if len(given) != len(planned):
        raise PlanError(
            f"the plan was made for {len(planned)} devices but {len(given)} were given",
            value={"plan": planned, "given": given},
            remedy="pass one device per plan device (in order), or re-partition for these devices",
        )


@_public_errors
def compile(
    model: nn.Module,
    devices: Any,
    example_inputs: Any,
    *,
    mode: str = "train",
    schedule: str = "1f1b",
    microbatches: int = 1,
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
    recompute: bool | Sequence[bool] = False,
) -> Any:
    """Partition ``model`` over ``devices`` and return a CompiledModule that trains.

    ``recompute``: stages keep only their inputs per micro-batch and recompute
    their activations in backward (``True``: every stage; or one bool per
    stage of the plan), with the same numbers (:mod:`crosscut.runtime.recompute`).
    The planner does not price it yet: it trades compute for memory at run time.

    ``bn_mode`` (``"micro"``, ``"step"``, ``"exact"``): batch norm over
    micro-batches, see :mod:`crosscut.runtime.compiled`.

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
    :class:`~crosscut.runtime.distributed.DistributedPipeline` running its own
    stage instead: every option is validated on every rank first, and
    without ``plan`` rank 0 partitions with these options for ``devices`` (one
    per stage; ``None``: the ranks' own device kind). ``require_all_devices`` makes the solver
    use every device even where fewer stages would be faster (useful for tests
    and for models that must be spread for memory).
    """
    from crosscut.cost_models import Cluster
    from crosscut.runtime import CompiledModule

    if not isinstance(model, nn.Module):
        raise InputError(
            "model must be a torch.nn.Module",
            value=type(model).__name__,
            remedy="pass the module itself, not its class or a function",
        )
    from crosscut.runtime.output_merge import normalize_merge

    normalize_merge(output_merge)  # a bad rule fails here, before tracing
    # every option is checked here, on every rank alike under torchrun: the same error
    # everywhere, before any rank waits on another
    _check_options(
        mode=mode,
        objective=objective,
        schedule=schedule,
        microbatches=microbatches,
        time_limit=time_limit,
        optimizer=optimizer,
        cost=cost,
    )
    _cross_options(cross_shaped, widths, splits, 2)
    _check_recompute(recompute)
    if _distributed_run():
        # Under torchrun every rank runs its own stage; the devices come from the ranks
        # (or, given, say what rank 0 plans for).
        from crosscut.distributed import compile_distributed

        return compile_distributed(
            model,
            example_inputs,
            plan,
            schedule=None if plan is not None else schedule,
            microbatches=None if plan is not None else microbatches,
            bn_mode=bn_mode,
            output_merge=output_merge,
            recompute=recompute,
            devices=devices,
            partition_options={
                "mode": mode,
                "objective": objective,
                "time_limit": time_limit,
                "optimizer": optimizer,
                "cost": cost,
                "seed": seed,
                "cross_shaped": cross_shaped,
                "widths": widths,
                "splits": splits,
            },
        )
    cl = Cluster.from_any(devices)
    if plan is None:
        graph = trace(model, micro_inputs(example_inputs, microbatches), mode=mode)
        graph.model_name = type(model).__name__
        the_plan = partition(
            graph,
            cl,
            mode=mode,
            objective=objective,
            schedule=schedule,
            microbatches=microbatches,
            time_limit=time_limit,
            optimizer=optimizer,
            cost=cost,
            seed=seed,
            require_all_devices=require_all_devices,
            progress=progress,
            cross_shaped=cross_shaped,
            widths=widths,
            splits=splits,
        )
        the_plan.model.input_shapes = [list(t.shape) for t in _as_tuple(example_inputs)]
    else:
        the_plan = _load_plan(plan)
        graph = trace(
            model,
            micro_inputs(example_inputs, the_plan.options.microbatches),
            mode=the_plan.model.mode,
        )
        the_plan.validate(graph)
        _check_plan_devices(the_plan, cl)
    other_gm = other_mode_graph(model, graph)
    given = list(cl.devices)
    groups = [
        (
            [torch.device(given[the_plan.cluster.index(d)].device) for d in stage.devices],
            stage.split,
        )
        for stage in the_plan.stages
    ]
    stage_devices = [devs[0] for devs, _ in groups]
    return CompiledModule(
        model,
        graph.gm,
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
        recompute=recompute,
    )


def other_mode_graph(model: nn.Module, graph: OpGraph) -> Any:
    """``model`` traced in the other train/eval mode than ``graph``, or None when they agree.

    A model that cannot be traced in the other mode returns that error: the
    compiled module raises it when run in that mode.

    fx freezes ``self.training`` into the graph (codegen/modes.py); tracing
    both modes is the only way to know whether ``.eval()``/``.train()`` on the
    compiled module needs a second program. Traced on meta tensors of the
    graph's input shapes: nothing is computed.
    """
    from crosscut.codegen.modes import mode_differences

    assert graph.gm is not None
    inputs = []
    for n in graph.gm.graph.nodes:
        val = n.meta.get("val") if n.op == "placeholder" else None
        if not isinstance(val, torch.Tensor):
            break  # the given inputs come first; later placeholders keep their defaults
        inputs.append(torch.empty(val.shape, dtype=val.dtype, device="meta"))
    try:
        other = trace(model, inputs, mode="infer" if graph.mode == "train" else "train")
    except CrosscutError as exc:  # e.g. an auxiliary head too small for these inputs
        return exc  # the compiled module refuses that mode, naming why
    return other.gm if mode_differences(graph.gm, other.gm) else None
