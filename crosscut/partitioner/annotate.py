"""annotate: recompute a plan's stage prices, transfers and predictions from its own numbers.

Called after every solve and after loading or hand-editing a plan (and by the
strategy search when it prices a replica as ``R`` copies, or moves a spanning
replica's stages to their torchrun ranks): what the plan
says about itself is always what :func:`~crosscut.partitioner.evaluate.evaluate`
and the simulator compute from its nodes, cluster and assignment, never a copy
of a solver's internal (integer-scaled) values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from crosscut.cost_models.subclusters import slowest_link
from crosscut.ir.plan import Plan, PlanTransfer, Prediction
from crosscut.ir.schedule import placement
from crosscut.partitioner.build import plan_groups, plan_to_problem
from crosscut.partitioner.evaluate import evaluate
from crosscut.partitioner.replicas import reduction
from crosscut.partitioner.simulate import simulate
from crosscut.partitioner.stage_memory import recomputes

if TYPE_CHECKING:
    from crosscut.cost_models.cluster import Cluster

__all__ = ["annotate", "as_replicas", "in_rank_order"]


def annotate(plan: Plan) -> Plan:
    """Recompute stage prices, transfers and predictions from the plan's own numbers."""
    problem, stage_of, stage_device = plan_to_problem(plan)
    groups = plan_groups(plan)
    ev = evaluate(problem, stage_of, stage_device, groups)
    for k, stage in enumerate(plan.stages):
        stage.compute_s = ev.stage_compute[k]
        stage.comm_s = ev.stage_comm[k]
        stage.time_s = ev.stage_time[k]
        stage.recompute = recomputes(problem, k)  # the plan's own choice (training only)
        # a group's busiest device (its leader holds the whole ops and receive buffers)
        stage.memory_bytes = max(ev.device_memory[plan.cluster.index(d)] for d in stage.devices)
    mult = 2 if problem.training else 1
    plan.transfers = [
        PlanTransfer(
            tensor=problem.names[u],
            src_stage=j,
            dst_stage=k,
            src_device=plan.stages[j].devices[0],
            dst_device=plan.stages[k].devices[0],
            bytes=problem.out_bytes[u],
            time_s=t / mult,
        )
        for u, j, k, t in ev.transfers
    ]
    rep = plan.replication
    red = reduction(plan, rep.replicas)  # the replicas' gradient all-reduce (replicas.py)
    rep.reduction, rep.allreduce_s = red.algorithm, red.seconds
    sim = simulate(plan)  # overlaps the reduction with the last backwards (simulate.py)
    rep.exposed_s = sim.exposed_s
    step = sim.step_time_s
    plan.predicted = Prediction(
        stage_time_s=list(ev.stage_time),
        bottleneck_s=ev.bottleneck,
        makespan_s=ev.makespan,
        step_time_s=step,
        throughput=plan.model.batch_size * rep.replicas / step if step > 0 else 0.0,
        bubble_fraction=sim.bubble_fraction,
        device_peak_bytes=dict(sim.device_peak_bytes),
    )
    return plan


def as_replicas(plan: Plan, cluster: Cluster, replicas: int) -> Plan:
    """``plan`` (one replica) priced as ``replicas`` copies on ``cluster``'s nodes."""
    plan.cluster.nodes = cluster.nodes
    plan.cluster.network = list(cluster.network)
    plan.cluster.network_name = cluster.network_name
    plan.cluster.name = cluster.name
    plan.cluster.node_link = list(slowest_link(cluster))
    plan.replication.replicas = replicas
    return annotate(plan)  # prices the all-reduce and the step from the plan's own numbers


def in_rank_order(plan: Plan) -> Plan:
    """``plan`` with its stages moved to the devices of the ranks torchrun runs them on.

    The runtime gives stage ``s`` the replica's next ranks in order, one per
    member of a batch- or channel-split group (``runtime/dist/world.py``), and an
    interleaved stage the rank its schedule places it on. A spanning replica's
    devices are identical, so each stage keeps its compute and memory; only the
    links its transfers cross change, and ``annotate`` prices them again. A plan
    whose stages share devices (co-located stages), or a group that is not split,
    is left as it is: no rank order describes it."""
    names = [d.name for d in plan.cluster.devices]
    if all(len(st.devices) == 1 for st in plan.stages):
        # interleaved: V stages per rank, placed as the schedule runs them
        for st, worker in zip(plan.stages, placement(plan.options.schedule, plan.num_stages)):
            st.devices = [names[worker]]
    else:
        used = [d for st in plan.stages for d in st.devices]
        unsplit = any(
            len(st.devices) > 1 and st.split not in ("batch", "channel") for st in plan.stages
        )
        if len(set(used)) != len(used) or unsplit:
            return plan
        rank = 0
        for st in plan.stages:
            st.devices = names[rank : rank + len(st.devices)]
            rank += len(st.devices)
    plan.solver.notes.append("stages moved to the devices of their torchrun ranks, node by node")
    return annotate(plan)
