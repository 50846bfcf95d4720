"""Event simulation of a Plan under its pipeline schedule.

The solver optimises a steady-state bottleneck; a user wants to know the time of
one training step, how much of it is bubble, and which device does what when.
This module replays the plan's schedule (``crosscut.ir.schedule``: GPipe, 1F1B,
zero-bubble, interleaved or forward-only) action by action on one timeline per
device, each worker's row in its order (an interleaved worker's row mixes its
stages' actions):

* ``F(k, m)`` takes the stage's forward compute plus its one-way transfer time
  (or their max with ``overlap_comm``), and starts once the device is free and
  every stage that sends to ``k`` has finished ``F(·, m)``;
* ``B(k, m)`` takes the backward compute plus the transfer time of the
  gradients, after ``F(k, m)`` and ``B(·, m)`` of every stage ``k`` sends to;
* in a split backward (``zb-h1``) ``B`` is the input-gradient part and
  ``W(k, m)``, after ``B(k, m)``, the weight-gradient part
  (:func:`backward_split`); the replicas' all-reduce then starts after the
  stage's last ``W`` (the torchrun runtime reduces after the schedule);
* the action that fills a stage's weight gradients (``W`` where the backward
  is split, else ``B``) takes longer for every micro-batch after the step's
  first: autograd adds the new gradients into ``.grad`` (a pass over them at
  the device's memory rate, ``calibration.accumulate_seconds``);
* an action also waits until every device of its stage is free: co-located
  stages (one device group, two stages) take turns on their devices;
* every action also pays the stage engine's host work
  (``calibration.action_overhead_s``: about a third of a millisecond on a CPU,
  nothing on a GPU, where it hides behind queued kernels), so a schedule with
  more actions per micro-batch, or more micro-batches, pays it more often.

The transfer time inside an action is also reported as its own ``"T"`` event
(after the compute, or from the action's start when ``overlap_comm`` lets it
run alongside), so a timeline can show when the wire is busy. ``T`` events
never add time: they lie inside their ``F``/``B`` action.

Stage prices come from :func:`crosscut.partitioner.evaluate.evaluate` on the
problem rebuilt from the plan, so the simulation, the solver and validation all
use one cost model; in steady state ``F + B`` of a stage equals its
``stage_time``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crosscut.errors import PlanError
from crosscut.ir import schedule as sched
from crosscut.ir.plan import Plan
from crosscut.partitioner.build import plan_groups, plan_to_problem
from crosscut.partitioner.evaluate import Evaluation, evaluate
from crosscut.partitioner.replicas import reduction

__all__ = ["Event", "Simulation", "backward_split", "simulate", "stage_durations"]

# node kinds whose backward is two products of the same size: a data gradient (B) and a
# weight gradient (W), half of the backward each
_MATMUL_KINDS = ("conv", "linear", "matmul", "mm", "addmm", "bmm", "einsum")


@dataclass(frozen=True)
class Event:
    device: str
    stage: int
    kind: str  # "F" | "B" | "W"; "T": the transfer part of the F/B action just before it;
    # "R": the stage's gradient all-reduce, from its last backward's start (stage -1);
    # "U": the stage's optimizer update (stage -1)
    microbatch: int
    start: float
    end: float


@dataclass
class Simulation:
    events: list[Event]
    step_time_s: float
    bubble_fraction: float
    device_busy_s: dict[str, float]
    device_peak_bytes: dict[str, int]
    stage_fwd_s: list[float] = field(default_factory=list)
    stage_bwd_s: list[float] = field(default_factory=list)
    stage_wgt_s: list[float] = field(default_factory=list)  # W of a split backward (else 0)
    evaluation: Evaluation | None = None
    exposed_s: float = 0.0  # the all-reduce left after the backward it overlaps
    update_s: float = 0.0  # the slowest stage's optimizer update


def _forward_compute(plan: Plan, ev: Evaluation) -> list[float]:
    """Seconds of one stage's forward compute per micro-batch, transfers excluded."""
    kinds = {d.name: d.kind for d in plan.cluster.devices}
    fwd = [0.0] * plan.num_stages
    for node in plan.nodes:
        k = plan.assignment.get(node.name)
        if k is None:
            continue
        kind = kinds[plan.stages[k].devices[0]]
        fwd[k] += node.time_s[kind] - node.bwd_s.get(kind, 0.0)
    for k, stage in enumerate(plan.stages):
        if len(stage.devices) > 1:  # a group: its F share of the (shared) compute
            whole = sum(
                n.time_s[kinds[stage.devices[0]]]
                for n in plan.nodes
                if plan.assignment.get(n.name) == k
            )
            fwd[k] = ev.stage_compute[k] * (fwd[k] / whole if whole > 0 else 1.0)
    return fwd


def stage_durations(plan: Plan, ev: Evaluation) -> tuple[list[float], list[float]]:
    """Duration of one F and one B action per stage, transfers included."""
    fwd = _forward_compute(plan, ev)
    mult = 2 if plan.model.mode == "train" else 1
    f_out: list[float] = []
    b_out: list[float] = []
    for k in range(plan.num_stages):
        bwd = max(0.0, ev.stage_compute[k] - fwd[k])
        one_way = ev.stage_comm[k] / mult
        if plan.options.overlap_comm:
            f_out.append(max(fwd[k], one_way))
            b_out.append(max(bwd, one_way) if mult == 2 else 0.0)
        else:
            f_out.append(fwd[k] + one_way)
            b_out.append(bwd + one_way if mult == 2 else 0.0)
    return f_out, b_out


def backward_split(plan: Plan, k: int, backward_s: float, receives: bool) -> tuple[float, float]:
    """(moved, W): the seconds of stage ``k``'s backward compute ``backward_s`` that leave
    ``B`` for ``W``, and ``W``'s seconds, when the backward is split.

    What ``crosscut/split_backward.py`` does, priced per node. Where the costs
    were profiled, a node carries the two passes as measured (``bwd_split``:
    on a CPU, resnet18's convolutions run ``B`` at ~0.5 and ``W`` at ~0.9 of one
    backward, so ``B + W`` is ~1.4 of it: docs/BENCHMARKS.md). Otherwise by
    rule: a convolution's or a matmul's backward is a data gradient in ``B`` and
    a weight gradient of the same size in ``W`` (half each); another node with
    parameters (batch norm, a learned scale) runs whole in ``B`` and again for
    its weights in ``W``, whose reductions it repeats (half its backward). A
    stage that receives nothing to differentiate (the first) sends nothing
    upstream: all of its backward is ``W``. A group's stage (several devices)
    is not split. ``moved`` is negative where ``B`` is measured longer than the
    whole backward.
    """
    if len(plan.stages[k].devices) > 1:
        return 0.0, 0.0
    if not receives:
        return backward_s, backward_s
    kind = next(d.kind for d in plan.cluster.devices if d.name == plan.stages[k].devices[0])
    moved = wgt = 0.0
    for n in plan.nodes:
        if plan.assignment.get(n.name) != k:
            continue
        full = n.bwd_s.get(kind, 0.0)
        measured = n.bwd_split.get(kind)
        if measured is not None:
            moved += (1.0 - measured[0]) * full
            wgt += measured[1] * full
        elif n.param_bytes <= 0:
            continue
        elif any(t in n.kind for t in _MATMUL_KINDS):
            moved += 0.5 * full
            wgt += 0.5 * full
        else:
            wgt += 0.5 * full
    return min(moved, backward_s), wgt


def _actions(plan: Plan) -> list[list[sched.Action]]:
    s, m = plan.num_stages, plan.options.microbatches
    if plan.model.mode != "train":
        return sched.inference(s, m)
    return sched.make_schedule(plan.options.schedule, s, m)


def _action_durations(
    plan: Plan, ev: Evaluation, queues: list[list[sched.Action]], senders: list[set[int]]
) -> tuple[list[float], list[float], list[float]]:
    """Seconds of one F, B and W action per stage; W is 0 unless the schedule splits
    the backward, and then B keeps only what the stage before waits for."""
    fwd, bwd = stage_durations(plan, ev)
    wgt = [0.0] * plan.num_stages
    split = sched.splits_backward(queues)
    if split:  # only then: the compute part of each backward
        fwd_compute = _forward_compute(plan, ev)
        bwd_compute = [max(0.0, c - f) for c, f in zip(ev.stage_compute, fwd_compute)]
        for k in range(plan.num_stages):
            moved, wgt[k] = backward_split(plan, k, bwd_compute[k], bool(senders[k]))
            bwd[k] -= moved
    training = plan.model.mode == "train"
    for k in range(plan.num_stages):  # the engine's own work, once per action
        host = _action_overhead(plan, k)
        fwd[k] += host
        bwd[k] += host if training else 0.0
        wgt[k] += host if split else 0.0
    return fwd, bwd, wgt


def _action_overhead(plan: Plan, k: int) -> float:
    """The engine's host seconds per action of stage ``k`` (``calibration.action_overhead_s``)."""
    from crosscut.cost_models.calibration import action_overhead_s  # see _gradient_pass

    return action_overhead_s(
        plan.cluster.devices[plan.cluster.index(plan.stages[k].devices[0])].device
    )


def simulate(plan: Plan) -> Simulation:
    """Replay ``plan``'s schedule; see the module docstring for the rules."""
    problem, stage_of, stage_device = plan_to_problem(plan)
    ev = evaluate(problem, stage_of, stage_device, plan_groups(plan))
    mult = 2 if plan.model.mode == "train" else 1
    comm = [c / mult for c in ev.stage_comm]  # one direction's transfers, per action
    senders, receivers = _links(plan.num_stages, ev)
    queues = _actions(plan)
    fwd, bwd, wgt = _action_durations(plan, ev, queues, senders)
    # the action that fills .grad: W where the backward is split, else B; every one
    # after a stage's first adds into the gradients before it
    fills = ["W" if w > 0 else "B" for w in wgt]
    training = plan.model.mode == "train"
    accum = [_stage_accumulate(plan, k) if training else 0.0 for k in range(plan.num_stages)]
    filled = [False] * plan.num_stages
    done: dict[tuple[int, str, int], float] = {}
    free = {d.name: 0.0 for d in plan.cluster.devices}  # co-located stages share devices
    head = [0] * len(queues)  # one queue per worker (row): its stages' actions in order
    events: list[Event] = []
    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for r, queue in enumerate(queues):
            while head[r] < len(queue):
                a = queue[head[r]]
                k = a.stage
                deps = _deps(a, senders, receivers)
                if any(d not in done for d in deps):
                    break
                devs = plan.stages[k].devices
                start = max([*(free[x] for x in devs), *(done[d] for d in deps)])
                end = start + {"F": fwd[k], "B": bwd[k], "W": wgt[k]}[a.kind]
                if a.kind == fills[k]:
                    end += accum[k] if filled[k] else 0.0
                    filled[k] = True
                done[(k, a.kind, a.microbatch)] = end
                wire = (
                    comm[k]
                    if a.kind == "F" or (a.kind == "B" and plan.model.mode == "train")
                    else 0.0
                )
                for dev in devs:  # every device of a group is busy
                    free[dev] = end
                    events.append(Event(dev, k, a.kind, a.microbatch, start, end))
                    if wire > 0:
                        t0 = start if plan.options.overlap_comm else max(start, end - wire)
                        events.append(Event(dev, k, "T", a.microbatch, t0, min(end, t0 + wire)))
                head[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [str(q[head[r]]) for r, q in enumerate(queues) if head[r] < len(q)]
            raise PlanError(
                "a schedule must not deadlock: every action's inputs come from earlier actions",
                value=stuck,
                remedy="use schedule 'gpipe' or '1f1b'",
            )
    step, exposed, update = _step_tail(plan, events)
    busy: dict[str, float] = {}
    for e in events:
        if e.kind in ("T", "R"):
            continue  # inside an F/B action, or the replicas' all-reduce: not compute
        busy[e.device] = busy.get(e.device, 0.0) + (e.end - e.start)
    capacity = step * len({d for s in plan.stages for d in s.devices})
    bubble = 1.0 - sum(busy.values()) / capacity if capacity > 0 else 0.0
    peaks = {d: ev.device_memory[plan.cluster.index(d)] for s in plan.stages for d in s.devices}
    return Simulation(
        events=sorted(events, key=lambda e: (e.start, e.stage)),
        step_time_s=step,
        bubble_fraction=min(1.0, max(0.0, bubble)),
        device_busy_s=busy,
        device_peak_bytes=peaks,
        stage_fwd_s=fwd,
        stage_bwd_s=bwd,
        stage_wgt_s=wgt,
        evaluation=ev,
        exposed_s=exposed,
        update_s=update,
    )


def _stage_update(plan: Plan, k: int) -> float:
    """Seconds of stage ``k``'s optimizer update on its leading device."""
    return _gradient_pass(plan, k, accumulate=False)


def _stage_accumulate(plan: Plan, k: int) -> float:
    """Seconds stage ``k`` spends adding one micro-batch's weight gradients to ``.grad``."""
    return _gradient_pass(plan, k, accumulate=True)


def _gradient_pass(plan: Plan, k: int, accumulate: bool) -> float:
    """A pass over stage ``k``'s gradients at its leading device's memory rate."""
    # imported here: the cost models' package loads torch, and the simulator (which
    # the drawings use) must not (tests/test_viz.py)
    from crosscut.cost_models.calibration import accumulate_seconds, update_seconds
    from crosscut.cost_models.devices import PRESETS

    dev = plan.cluster.devices[plan.cluster.index(plan.stages[k].devices[0])]
    params = [n.param_bytes for n in plan.nodes if plan.assignment.get(n.name) == k]
    preset = PRESETS.get(dev.kind)
    mem_bw = dev.mem_bw or (preset.mem_bw if preset else 1e11)
    launch_s = preset.launch_overhead_s if preset else 5e-6
    tensors = sum(1 for b in params if b > 0)
    if accumulate:
        return accumulate_seconds(
            sum(params), tensors, kind=dev.kind, device=dev.device, mem_bw=mem_bw,
            launch_s=launch_s,
        )  # fmt: skip
    return update_seconds(
        sum(params),
        tensors,
        kind=dev.kind,
        device=dev.device,
        mem_bw=mem_bw,
        launch_s=launch_s,
        optimizer=plan.options.optimizer,
        precision=plan.options.precision,
    )


def _step_tail(plan: Plan, events: list[Event]) -> tuple[float, float, float]:
    """Append each stage's all-reduce (overlapping its last backward) and update events.

    Returns (step, exposed all-reduce, slowest update). A training step ends
    when every stage has finished its last backward, the buckets of its
    reduction and its optimizer update, plus the per-iteration overhead."""
    step = max((e.end for e in events), default=0.0)
    if plan.model.mode != "train":
        return step, 0.0, 0.0
    red = reduction(plan, plan.replication.replicas)
    exposed = update = 0.0
    end_all = step
    split = any(e.kind == "W" for e in events)
    # an interleaved rank reduces all its stages after its whole row, one after another
    shared = sched.virtual_stages(plan.options.schedule) > 1
    free: dict[str, float] = {}
    for e in events:
        free[e.device] = max(free.get(e.device, 0.0), e.end)
    for k, stage in enumerate(plan.stages):
        last = [e for e in events if e.stage == k and e.kind == ("W" if split else "B")]
        if not last:
            continue
        b = max(last, key=lambda e: e.end)
        done = b.end
        if red.positions and red.positions[k].buckets:
            kind = plan.cluster.devices[plan.cluster.index(stage.devices[0])].kind
            back = sum(
                n.bwd_s.get(kind, 0.0) for n in plan.nodes if plan.assignment.get(n.name) == k
            )
            # overlapped with the last backward; after the last W of a split backward
            start = b.end if split else b.start
            if shared:
                start = free[stage.devices[0]]
            tail = 0.0 if split or shared else back
            done = max(done, red.positions[k].finish(start, max(start, b.end), tail))
            free[stage.devices[0]] = done
            for dev in stage.devices:
                events.append(Event(dev, -1, "R", k, start, done))
        exposed = max(exposed, done - b.end)
        up = _stage_update(plan, k)
        update = max(update, up)
        if up > 0:
            for dev in stage.devices:
                events.append(Event(dev, -1, "U", k, done, done + up))
        end_all = max(end_all, done + up)
    from crosscut.cost_models.calibration import step_overhead_s  # see _stage_update

    lead = plan.cluster.devices[plan.cluster.index(plan.stages[0].devices[0])]
    return end_all + step_overhead_s(lead.device), exposed, update


def _links(count: int, ev: Evaluation) -> tuple[list[set[int]], list[set[int]]]:
    """Per stage: the stages that send to it, and the stages it sends to."""
    senders: list[set[int]] = [set() for _ in range(count)]
    receivers: list[set[int]] = [set() for _ in range(count)]
    for _, j, k, _t in ev.transfers:
        senders[k].add(j)
        receivers[j].add(k)
    return senders, receivers


def _deps(
    a: sched.Action, senders: list[set[int]], receivers: list[set[int]]
) -> list[tuple[int, str, int]]:
    if a.kind == "F":
        return [(j, "F", a.microbatch) for j in sorted(senders[a.stage])]
    if a.kind == "W":
        return [(a.stage, "B", a.microbatch)]
    return [(a.stage, "F", a.microbatch)] + [
        (j, "B", a.microbatch) for j in sorted(receivers[a.stage])
    ]
