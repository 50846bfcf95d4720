"""The model traced and priced once per micro-batch size, and one pipeline solved on it.

The strategy search (:mod:`crosscut.strategy`) tries many (replicas,
micro-batches) pairs; many share a micro-batch size (8 replicas of one
micro-batch and 4 replicas of two read the same graph), so the graph and its
costs are kept per size (:class:`TraceCache`). :func:`solve_traced` is one
pipeline over one cluster for one traced graph: the options of a
:class:`~crosscut.options.PlanRequest` handed to the partitioner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from crosscut.errors import InputError
from crosscut.ir.graph import OpGraph
from crosscut.ir.plan import Plan, PlanOptions
from crosscut.ir.schedule import AUTO_SCHEDULE, DEFAULT_SCHEDULE, virtual_stages
from crosscut.options import PlanRequest, cross_options
from crosscut.partitioner.deadline import Deadline
from crosscut.partitioner.schedule_choice import choose_schedule

if TYPE_CHECKING:
    import torch

    from crosscut.cost_models.cluster import Cluster

__all__ = ["Progress", "TraceCache", "get_costs", "solve_traced"]

Progress = Callable[[float, float, float], None]


def get_costs(
    graph: OpGraph, cluster: Any, *, cost: str = "analytic", optimizer: str = "sgd"
) -> Any:
    """A CostTable for ``graph`` on every device kind of ``cluster``."""
    from crosscut.cost_models.analytic import analytic_costs
    from crosscut.cost_models.profiled import profile_costs

    table = analytic_costs(graph, cluster, optimizer=optimizer)
    if cost == "profiled":
        for kind in sorted({d.kind for d in cluster.devices}):
            dev = next(d for d in cluster.devices if d.kind == kind)
            table = table.merge(profile_costs(graph, dev.device, kind=kind))
    return table


class TraceCache:
    """The model traced and priced once per micro-batch size.

    ``inputs`` is the global batch; :meth:`graph` traces the first ``size``
    samples (FakeTensor shapes, nothing computed on real data) and keeps it.
    """

    def __init__(
        self,
        model: Any,
        inputs: tuple[torch.Tensor, ...],
        request: PlanRequest,
        model_name: str = "",
    ) -> None:
        self.model, self.inputs, self.request = model, inputs, request
        self.model_name = model_name or type(model).__name__
        self.batch = int(inputs[0].shape[0])
        self._graphs: dict[int, OpGraph] = {}
        self._costs: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._work: dict[tuple[int, str], float] = {}
        self._refused: dict[int, InputError] = {}

    def has(self, size: int) -> bool:
        return size in self._graphs

    def refuses(self, size: int) -> bool:
        """Whether the model rejected a micro-batch of ``size`` samples when traced
        (batch norm on one value per channel): nothing may run on that few."""
        return size in self._refused

    def graph(self, size: int) -> OpGraph:
        if size in self._refused:
            raise self._refused[size]
        if size not in self._graphs:
            from crosscut.frontend.tracer import trace

            try:
                graph = trace(
                    self.model,
                    tuple(t[:size] if t.dim() else t for t in self.inputs),  # 0-d: whole
                    mode=self.request.mode,
                    precision=self.request.precision,
                )
            except InputError as exc:
                self._refused[size] = exc
                raise
            graph.model_name = self.model_name
            self._graphs[size] = graph
        return self._graphs[size]

    def costs(self, size: int, cluster: Cluster) -> Any:
        key = (size, tuple(sorted({d.kind for d in cluster.devices})))
        if key not in self._costs:
            r = self.request
            self._costs[key] = get_costs(
                self.graph(size), cluster, cost=r.cost, optimizer=r.optimizer
            )
            from crosscut.partitioner.build import plan_nodes

            for kind in key[1]:
                nodes = plan_nodes(self.graph(size), self._costs[key], [kind])
                self._work[(size, kind)] = sum(n.time_s[kind] for n in nodes)
        return self._costs[key]

    def share_costs(self, size: int, cluster: Cluster, widths: list[int]) -> Any:
        """:meth:`costs` at ``size``, knowing what a batch split's shares cost at their
        own batch: the graph is also traced at ``ceil(size / w)`` samples for each
        width ``w`` (``CostTable.with_share_scales``). A size the model refuses (batch
        norm on one value per channel) is left out (:meth:`refuses` says so; the
        strategy then allows no group that would run shares that small)."""
        smaller: dict[int, Any] = {}
        for w in sorted(set(widths)):
            s = -(-size // w)
            if 1 <= s < size and s not in smaller:
                try:
                    smaller[s] = self.costs(s, cluster)
                except InputError:
                    continue
        base = self.costs(size, cluster)
        return base.with_share_scales(smaller, size) if smaller else base

    def spread(self, size: int) -> float:
        """How far the profiles at ``size`` could move (``meta["spread"]``, the largest
        over the clusters priced so far); 0 for analytic costs."""
        return max(
            (float(t.meta.get("spread", 0.0)) for (s, _), t in self._costs.items() if s == size),
            default=0.0,
        )

    def work_bound(self, size: int, kind: str) -> float:
        """A lower bound on one micro-batch of ``size`` samples' compute on ``kind``.

        From every size priced so far: time per sample does not grow with the
        batch (``size ≤ s``: at least ``size/s`` of it) and time does not
        shrink with it (``size ≥ s``: at least all of it). 0 before any."""
        out = 0.0
        for (s, k), work in self._work.items():
            if k == kind:
                out = max(out, work * size / s if size <= s else work)
        return out


def solve_traced(
    graph: OpGraph,
    costs: Any,
    cluster: Cluster,
    request: PlanRequest,
    *,
    input_shapes: list[list[int]] | None = None,
    progress: Progress | None = None,
    deadline: Deadline | None = None,
) -> Plan:
    """One pipeline over ``cluster`` for ``graph`` (traced at one micro-batch)."""
    from crosscut.partitioner.partition import partition_graph
    from crosscut.partitioner.solvers.settings import SolveSettings

    r = request
    interleaved = virtual_stages(r.schedule) > 1
    # "auto" groups need their shares priced at their own batch (the strategy's traces):
    # a graph given traced has one batch only, so it gets groups only when asked for
    groups, allowed = r.stage_groups(1) if r.cross_shaped is not None else (False, ())
    widths, splits = cross_options(groups, r.widths, allowed, len(cluster.devices))
    if "channel" in splits:  # each channel shard priced at its own size
        from crosscut.cost_models.analytic import channel_scales

        costs = costs.with_channel_scales(channel_scales(graph, cluster, widths))
    options = PlanOptions(
        objective=r.objective,
        # an interleaved schedule re-cuts a pipeline solved under 1F1B (partitioner/interleave.py)
        schedule=DEFAULT_SCHEDULE if r.schedule == AUTO_SCHEDULE or interleaved else r.schedule,
        microbatches=r.microbatches or 1,
        overlap_comm=r.overlap_comm,
        optimizer=r.optimizer,
        time_limit_s=float(r.time_limit),
        seed=r.seed,
        cost_source=r.cost,
        widths=widths,
        splits=splits,
        precision=r.precision,
    )
    plan = partition_graph(
        graph,
        costs,
        cluster,
        options,
        settings=SolveSettings(
            solver=r.solver,
            require_all_devices=r.require_all_devices,
            progress=progress,
            colocate=r.colocate,
            deadline=deadline,
        ),
        input_shapes=input_shapes or [],
        recompute=r.recompute,
    )
    if interleaved:
        return _interleaved(plan, r.schedule)
    # torchrun's ranks run one stage each: no interleaved re-cut for them (fill_devices)
    if r.schedule != AUTO_SCHEDULE:
        return plan
    noise = float(getattr(costs, "meta", {}).get("spread", 0.0))  # 0: analytic
    return choose_schedule(plan, not r.fill_devices, noise, deadline)


def _interleaved(plan: Plan, schedule: str) -> Plan:
    """``plan`` re-cut for the interleaved ``schedule`` the caller fixed; a clear error if none.

    A one-stage plan (data parallel, or the whole model fits one device best)
    has no pipeline to interleave: it keeps 1F1B and says so."""
    from crosscut.errors import PartitionError
    from crosscut.partitioner.interleave import interleave

    if plan.num_stages == 1:
        plan.solver.notes.append(f"schedule {schedule} asked for; one stage runs 1f1b")
        return plan
    out = interleave(plan, schedule)
    if out is None:
        v = virtual_stages(schedule)
        raise PartitionError(
            f"schedule {schedule!r} needs {v} stages per device ({v} x {plan.num_stages} in "
            "all), cut from single-device stages, each with nodes of its own, that fit the "
            "memory caps",
            value={"stages": plan.num_stages, "nodes": len(plan.assignment)},
            remedy="use schedule 'auto', '1f1b', or fewer stages per device (1f1b-v2); "
            "or devices with more memory",
        )
    return out
