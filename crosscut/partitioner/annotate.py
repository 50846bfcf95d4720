"""annotate: recompute a plan's stage prices, transfers and predictions from its own numbers.

Called after every solve and after loading or hand-editing a plan: what the plan
says about itself is always what :func:`~crosscut.partitioner.evaluate.evaluate`
and the simulator compute from its nodes, cluster and assignment, never a copy
of a solver's internal (integer-scaled) values.
"""

from __future__ import annotations

from crosscut.ir.plan import Plan, PlanTransfer, Prediction
from crosscut.partitioner.build import plan_groups, plan_to_problem
from crosscut.partitioner.evaluate import evaluate, recomputes
from crosscut.partitioner.replicas import reduction
from crosscut.partitioner.simulate import simulate

__all__ = ["annotate"]


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
