"""The front door's shared half: options, tracing and planning.

``crosscut.compile`` (one process) and ``crosscut.distributed.compile_distributed``
(every torchrun rank) both check the caller's options, trace the model at the
micro-batch the plan is made for, partition or load a plan, and trace the
other train/eval mode. That half lives here, below both, so neither imports
the other: :mod:`crosscut.api` adds ``compile`` on top and re-exports these.

Options are checked up front, so a bad argument fails in one line naming the
rule, before minutes of tracing or solving, and any internal exception that
escapes a public function becomes a :class:`~crosscut.errors.CrosscutError`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, Unpack

import torch
from torch import nn

from crosscut.errors import CrosscutError, InputError, PlanError
from crosscut.ir.graph import OpGraph
from crosscut.ir.plan import Plan
from crosscut.options import PlanKeywords, PlanRequest, check_options, cross_options, plan_options
from crosscut.partitioner.deadline import Deadline
from crosscut.partitioner.recompute_choice import (
    check_recompute,
    recompute_flags_for,
    recompute_request,
)
from crosscut.precision import check_precision, check_precision_devices
from crosscut.state_limits import limited_request, state_limits
from crosscut.strategy import plan_strategy
from crosscut.traced import TraceCache, get_costs, solve_traced

__all__ = [
    "PlanRequest",
    "TraceCache",
    "as_tuple",
    "check_options",
    "check_plan_devices",
    "check_plan_precision",
    "check_recompute",
    "cross_options",
    "get_costs",
    "load_plan",
    "micro_inputs",
    "other_mode_graph",
    "partition",
    "plan_request",
    "public_errors",
    "recompute_flags_for",
    "recompute_request",
    "trace",
]

F = TypeVar("F", bound=Callable[..., Any])


def public_errors(fn: F) -> F:
    """Let CrosscutErrors through; wrap anything else with the stage it came from. A call
    that does not fit the signature is the caller's error, not a crosscut failure."""
    signature = inspect.signature(fn)
    plain = signature.replace(  # for the remedy: names and defaults, no annotations
        parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
        return_annotation=signature.empty,
    )

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise InputError(
                f"crosscut.{fn.__name__}() was called with arguments that do not fit it: {exc}",
                value={"positional": len(args), "keywords": sorted(kwargs)},
                remedy=f"call crosscut.{fn.__name__}{plain}; several example inputs go "
                "in one tuple, e.g. (x, y)",
            ) from None
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


def as_tuple(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    """The example inputs as a tuple of tensors, the first with a batch dimension."""
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if (
        isinstance(example_inputs, (tuple, list))
        and example_inputs
        and all(isinstance(t, torch.Tensor) for t in example_inputs)
    ):
        if example_inputs[0].dim() == 0:
            raise InputError(
                "the first example input needs a batch dimension: crosscut splits the batch "
                "along its dim 0 (micro-batches, replicas)",
                value={"shape": list(example_inputs[0].shape)},
                remedy="pass a batch, e.g. torch.randn(32, 3, 224, 224)",
            )
        _check_batch(tuple(example_inputs))
        return tuple(example_inputs)
    items = example_inputs if isinstance(example_inputs, (tuple, list)) else [example_inputs]
    kinds = [type(t).__name__ for t in items]
    nested = any(isinstance(t, (dict, tuple, list)) for t in items)
    raise InputError(
        "example_inputs must be a Tensor or a non-empty tuple of Tensors, one per argument "
        "of the model's forward",
        value={"given": type(example_inputs).__name__, "elements": kinds},
        remedy="pass e.g. torch.randn(32, 3, 224, 224)"
        + (
            "; a forward that takes a dict or list of tensors needs a wrapper that takes "
            "tensors: def forward(self, image, meta): return self.model({'image': image, "
            "'meta': meta})"
            if nested
            else ""
        ),
    )


def _check_batch(inputs: tuple[torch.Tensor, ...]) -> None:
    """Every input with a dimension is cut along dim 0 with the batch (micro-batches,
    replicas, batch-split groups: each piece gets its rows); a 0-d tensor goes whole to
    every piece. So an input shared by every sample (a mask, a table) is refused here,
    where the trace would otherwise cut it and the model fail on the cut."""
    batch = int(inputs[0].shape[0])
    for i, t in enumerate(inputs[1:], 1):
        if t.dim() > 0 and int(t.shape[0]) != batch:
            raise InputError(
                f"every example input with dimensions is cut along dim 0 as the batch "
                f"({batch}, dim 0 of the first); input {i}'s dim 0 is not the batch",
                value={"input": i, "shape": list(t.shape), "batch": batch},
                remedy="register a tensor every sample shares as a buffer of the model "
                "(self.register_buffer(name, t)), pass it as a 0-d tensor, or give it one "
                "row per sample (t.expand(batch, *t.shape))",
            )


def micro_inputs(example_inputs: Any, microbatches: int) -> tuple[torch.Tensor, ...]:
    """The first micro-batch of ``example_inputs``: what the graph is traced and priced at."""
    inputs = as_tuple(example_inputs)
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
    return tuple(t[:size] if t.dim() else t for t in inputs)  # a 0-d input goes whole


@public_errors
def trace(
    model: nn.Module,
    example_inputs: Any,
    *,
    mode: str = "train",
    leaf_modules: Sequence[str] = (),
    precision: str = "fp32",
) -> OpGraph:
    """Trace ``model`` into an :class:`OpGraph` (shapes from FakeTensors, no real compute)."""
    from crosscut.frontend.tracer import trace as _trace

    check_precision(precision)
    return _trace(model, example_inputs, mode=mode, leaf_modules=leaf_modules, precision=precision)


@public_errors
def partition(
    model_or_graph: nn.Module | OpGraph,
    cluster: Any,
    example_inputs: Any = None,
    *,
    model_name: str = "",
    progress: Callable[[float, float, float], None] | None = None,
    options: PlanRequest | None = None,
    **keywords: Unpack[PlanKeywords],
) -> Plan:
    """Find the fastest plan for a model (or an already traced OpGraph) on ``cluster``.

    ``cluster`` is anything :meth:`crosscut.Cluster.from_any` accepts: a spec
    string (``"4xV100"``), a list of devices (``["cpu", "cpu"]``), an int, a
    cluster JSON path or a Cluster.

    Given a model and its (global) batch, the planner chooses the whole
    strategy for the shortest predicted step (:mod:`crosscut.strategy`):
    ``replicas`` data-parallel copies (data parallelism on every device is
    always priced), the pipeline each runs, and ``microbatches``. The plan
    lists every strategy considered (``plan.strategy``). Given an OpGraph
    (traced at one micro-batch), only the pipeline is planned.

    The options are :class:`~crosscut.options.PlanRequest`'s fields, given
    as keywords (``microbatches=8``, ``cross_shaped=True``, ...) or as one
    ``options=`` object with keywords put over it; its docstring says what
    each does. ``None`` leaves a count to the planner; a number is a
    constraint. ``progress(wall_s, objective_s, bound_s)`` is called for each
    new solver incumbent; ``model_name`` is recorded in the plan.
    """
    request = plan_options(options, keywords)
    return plan_request(
        model_or_graph, cluster, example_inputs, request, model_name=model_name, progress=progress
    )


def plan_request(
    model_or_graph: nn.Module | OpGraph,
    cluster: Any,
    example_inputs: Any,
    request: PlanRequest,
    *,
    model_name: str = "",
    progress: Callable[[float, float, float], None] | None = None,
    deadline: Deadline | None = None,
    traces: TraceCache | None = None,
) -> Plan:
    """:func:`partition` for checked options, by ``deadline`` (tracing included).

    ``traces``: a cache of the model's graphs by micro-batch size, which the
    caller keeps to read the chosen plan's graph without tracing again.
    """
    from crosscut.cost_models.cluster import Cluster

    r = request
    deadline = Deadline.of(deadline, float(r.time_limit))
    cl = Cluster.from_any(cluster)
    check_precision_devices(r.precision, cl.devices)
    if isinstance(model_or_graph, OpGraph):
        if cl.nodes > 1 or (r.replicas or 1) > 1:
            raise InputError(
                "replicas are planned from the model (each layout traces its own replica "
                "batch), not from a traced graph",
                value={"cluster": cl.name, "replicas": r.replicas},
                remedy="pass the nn.Module and the global batch",
            )
        graph = model_or_graph
        if graph.gm is not None:  # what its state writes allow (state_limits.py)
            r = limited_request(r, state_limits(graph.gm))
        costs = get_costs(graph, cl, cost=r.cost, optimizer=r.optimizer)
        return solve_traced(graph, costs, cl, r, progress=progress, deadline=deadline)
    if example_inputs is None:
        raise InputError(
            "partition(model, ...) needs example_inputs to trace the model",
            remedy="pass e.g. torch.randn(32, 3, 224, 224)",
        )
    micro_inputs(example_inputs, r.microbatches or 1)  # a batch the fixed count divides
    if traces is None:
        traces = TraceCache(model_or_graph, as_tuple(example_inputs), r, model_name)
    return plan_strategy(traces, cl, r, deadline, progress)


def load_plan(plan: Plan | str | Path) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    raise PlanError("plan= takes a Plan or a path to a plan JSON file", value=type(plan).__name__)


def check_plan_precision(plan: Plan, precision: str | None) -> None:
    """A replayed plan runs in the precision it was priced and traced for."""
    if precision is not None and check_precision(precision) != plan.options.precision:
        raise PlanError(
            f"the plan was made for precision={plan.options.precision!r}, not {precision!r}",
            value={"plan": plan.options.precision, "given": precision},
            remedy="leave precision out to use the plan's, or re-partition with this precision",
        )


def check_plan_devices(plan: Plan, cluster: Any) -> None:
    """A replayed plan maps its cluster's devices, in order, onto the given devices.

    Kinds may differ on purpose (``crosscut verify`` replays a GPU plan on CPU
    devices), but the count must match so device ``i`` of the plan has a home:
    the plan's devices times its replicas (``local_groups``).
    """
    given = [d.name for d in cluster.devices]
    planned = [d.name for d in plan.cluster.devices]
    reps = plan.replication.replicas
    if len(given) != len(planned) * reps:
        times = f" × {reps} replicas" if reps > 1 else ""
        raise PlanError(
            f"the plan was made for {len(planned)} devices{times} but {len(given)} were given",
            value={"plan": planned, "replicas": reps, "given": given},
            remedy="pass one device per plan device and replica (in order), or re-partition "
            "for these devices",
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
