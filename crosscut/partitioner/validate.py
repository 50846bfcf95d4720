"""Validation of a Plan against its own rules and, optionally, a traced graph.

Each check names the rule, the offending node, edge or device, and the fix, so
a plan edited by hand into something invalid is refused with a message a user
can act on. The memory check recomputes the per-device peak from the plan's own
numbers through :func:`crosscut.partitioner.evaluate.evaluate`, the same cost
model the solver optimised.
"""

from __future__ import annotations

from typing import Any

from crosscut.errors import PlanError
from crosscut.ir.plan import Plan
from crosscut.ir.schedule import V_SHAPED, placement, virtual_stages, workers
from crosscut.partitioner.build import assigned_names, plan_groups, plan_to_problem

__all__ = ["plan_problems", "validate_plan"]

# nodes that run no code of their own (codegen/split.py skips them)
_NO_CODE = ("placeholder", "get_attr", "output")
_REMEDY = "re-create the plan with `crosscut partition`, or fix the field by hand"


def plan_problems(plan: Plan, graph: Any = None) -> list[str]:
    """Every rule the plan breaks, as sentences; empty when the plan is valid."""
    problems = _structure_problems(plan)
    if graph is not None:
        problems += _graph_problems(plan, graph)
    if problems:
        return problems
    from crosscut.partitioner.evaluate import check

    problem, stage_of, stage_device = plan_to_problem(plan)
    return [f"{msg}" for msg in check(problem, stage_of, stage_device, plan_groups(plan))]


def validate_plan(plan: Plan, graph: Any = None) -> None:
    """Raise :class:`PlanError` naming the first broken rule (and how many more)."""
    problems = plan_problems(plan, graph)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise PlanError(problems[0] + more, value=None, remedy=_REMEDY)


def _structure_problems(plan: Plan) -> list[str]:
    out: list[str] = []
    names = [n.name for n in plan.nodes]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        out.append(f"node names must be unique; repeated: {dup[:5]}")
    known = set(names)
    for n in plan.nodes:
        for src in n.inputs:
            if src not in known:
                out.append(f"node {n.name!r} reads {src!r}, which is not a node of the plan")
    for src, dst, _ in plan.edges:
        if src not in known or dst not in known:
            out.append(f"edge {src!r} -> {dst!r} names a node that is not in the plan")
    n_dev = len(plan.cluster.devices)
    for label, matrix in (("bandwidth", plan.cluster.bandwidth), ("latency", plan.cluster.latency)):
        if len(matrix) != n_dev or any(len(row) != n_dev for row in matrix):
            out.append(f"cluster {label} must be a {n_dev}x{n_dev} matrix")
    dev_names = [d.name for d in plan.cluster.devices]
    if len(set(dev_names)) != len(dev_names):
        out.append(f"cluster device names must be unique: {dev_names}")
    used: dict[str, int] = {}
    training = plan.model.mode == "train"
    interleaved = virtual_stages(plan.options.schedule) > 1
    if interleaved:
        out += _interleaved_problems(plan)
    for i, stage in enumerate(plan.stages):
        if stage.recompute and not training:
            # nothing is kept for backward in inference, so there is nothing to recompute
            out.append(
                f"stage {i} says recompute=True in a {plan.model.mode!r} plan; only training "
                "stages recompute (set it to false)"
            )
        if stage.index != i:
            out.append(f"stage {i} is numbered {stage.index}; stages are numbered 0..S-1 in order")
        # co-located stages (partitioner/group_costs.py): the same group of 2+ devices as the last
        shared = i > 0 and len(stage.devices) > 1 and stage.devices == plan.stages[i - 1].devices
        for d in stage.devices:
            if d not in dev_names:
                out.append(f"stage {i} runs on {d!r}, which is not in the cluster {dev_names}")
            elif d in used and not shared and not interleaved:
                out.append(
                    f"device {d!r} runs stages {used[d]} and {i}; a device runs one stage, "
                    "unless consecutive stages share the very same group of 2+ devices"
                )
            used[d] = i
    must = assigned_names(plan.nodes)
    missing = [n for n in must if n not in plan.assignment]
    if missing:
        out.append(f"every compute node needs a stage; missing: {missing[:5]}")
    extra = [n for n in plan.assignment if n not in set(must)]
    if extra:
        out.append(f"the assignment names nodes that are not compute nodes: {extra[:5]}")
    for name, k in plan.assignment.items():
        if not 0 <= k < len(plan.stages):
            out.append(f"node {name!r} is on stage {k}, but the plan has {len(plan.stages)}")
    ops = {n.name: n.op for n in plan.nodes}
    holding = {k for name, k in plan.assignment.items() if ops.get(name) not in _NO_CODE}
    idle = [k for k in range(len(plan.stages)) if k not in holding]
    if idle and plan.assignment:  # codegen builds a stage from its ops: none, no stage
        out.append(
            f"stages {idle[:5]} hold no op of their own (at most buffers): every stage "
            "computes something; use fewer stages"
        )
    return out


def _interleaved_problems(plan: Plan) -> list[str]:
    """An interleaved plan's rule: ``W`` distinct devices, stage ``k`` on the device of
    stage ``placement[k]`` (``k % W`` round-robin; a V for ``"zbv"``)."""
    name, count = plan.options.schedule, plan.num_stages
    virtual = virtual_stages(name)
    if plan.model.mode != "train":
        return [f"schedule {name!r} is a training schedule; an inference plan uses '1f1b'"]
    if count % virtual or count < 2 * virtual:
        return [
            f"schedule {name!r} runs {virtual} stages per device: the plan's {count} stages "
            f"must be a multiple of {virtual}, on 2 or more devices"
        ]
    w = workers(name, count)
    first = [st.devices for st in plan.stages[:w]]
    out: list[str] = []
    if any(len(d) != 1 for d in first) or len({d[0] for d in first}) != w:
        out.append(f"an interleaved plan's first {w} stages run on {w} distinct single devices")
    where = placement(name, count)
    for k, st in enumerate(plan.stages[w:], start=w):
        if st.devices != plan.stages[where[k]].devices:
            out.append(
                f"stage {k} runs on {st.devices}; under {name!r} it runs on stage "
                f"{where[k]}'s device {plan.stages[where[k]].devices} "
                f"({'in a V' if name.lower() == V_SHAPED else 'round-robin'})"
            )
    return out


def _graph_problems(plan: Plan, graph: Any) -> list[str]:
    out: list[str] = []
    fp = graph.fingerprint()
    if fp != plan.model.fingerprint:
        out.append(
            f"the plan was made for model {plan.model.name!r} (fingerprint "
            f"{plan.model.fingerprint}) but this model's fingerprint is {fp}: a different "
            "architecture, input shape or micro-batch size"
        )
        plan_names = {n.name for n in plan.nodes}
        graph_names = {n.name for n in graph.nodes}
        only_plan = sorted(plan_names - graph_names)[:3]
        only_graph = sorted(graph_names - plan_names)[:3]
        if only_plan or only_graph:
            out.append(f"nodes only in the plan: {only_plan}; only in the model: {only_graph}")
    return out
