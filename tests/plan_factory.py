"""Synthetic but realistic Plans (and simulations) for tests that only read plans.

Why: the visualizer, the CLI's ``show`` and the simulator must be testable
without tracing a model or running a solver. ``make_plan`` builds a
ResNet-like DAG (stem, residual blocks with skip ``add`` nodes and downsample
branches, head) with fx-style names and ``module_path``s, cuts it into
contiguous stages balanced by time over 2-8 devices (optionally one
cross-shaped stage on a device group), and fills transfers, predictions and
a solver record the way the partitioner would. Every plan round-trips through
the JSON schema (``Plan.from_dict(plan.to_dict())``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from crosscut.ir.plan import (
    ModelInfo,
    Plan,
    PlanCluster,
    PlanDevice,
    PlanNode,
    PlanOptions,
    PlanStage,
    PlanTransfer,
    Prediction,
    SolverRecord,
)

__all__ = [
    "SimEvent",
    "SimpleSimulation",
    "make_plan",
    "make_simulation",
    "rename_node",
    "reprice",
    "widen",
]

GiB = 1 << 30
_KINDS = {"V100": 1.0, "T4": 2.2}  # relative slowness per device kind


def _graph(n_nodes: int, rng: random.Random) -> list[PlanNode]:
    """Nodes in topological order: stem, residual blocks until ``n_nodes``, head."""
    nodes: list[PlanNode] = []

    def add(name: str, kind: str, inputs: list[str], path: str, act: int, params: int) -> str:
        t = 1e-4 * (4 if kind == "conv2d" else 1) * rng.uniform(0.5, 1.5)
        nodes.append(
            PlanNode(
                name=name,
                op="call_module" if path else "call_function",
                kind=kind,
                target=path or kind,
                inputs=inputs,
                out_bytes=act,
                resident_bytes=params,
                activation_bytes=act if kind in ("conv2d", "batch_norm", "linear") else 0,
                time_s={k: t * s for k, s in _KINDS.items()},
                module_path=path,
                bwd_s={k: t * s * 2 / 3 for k, s in _KINDS.items()},
            )
        )
        return name

    act = 32 * 64 * 56 * 56 * 4 // 8
    x = add("x", "placeholder", [], "", act, 0)
    x = add("conv1", "conv2d", [x], "conv1", act, 37_632)
    x = add("bn1", "batch_norm", [x], "bn1", act, 512)
    x = add("relu", "relu", [x], "relu", act, 0)
    x = add("maxpool", "max_pool2d", [x], "maxpool", act, 0)
    layer, block = 1, 0
    while len(nodes) < n_nodes - 13:
        p = f"layer{layer}.{block}"
        u = p.replace(".", "_")
        skip = x
        params = 4096 * 64 * layer
        y = add(f"{u}_conv1", "conv2d", [x], f"{p}.conv1", act, params)
        y = add(f"{u}_bn1", "batch_norm", [y], f"{p}.bn1", act, 256)
        y = add(f"{u}_relu", "relu", [y], f"{p}.relu", act, 0)
        y = add(f"{u}_conv2", "conv2d", [y], f"{p}.conv2", act, params)
        y = add(f"{u}_bn2", "batch_norm", [y], f"{p}.bn2", act, 256)
        if block == 0:
            skip = add(f"{u}_downsample_0", "conv2d", [x], f"{p}.downsample.0", act, params)
            skip = add(f"{u}_downsample_1", "batch_norm", [skip], f"{p}.downsample.1", act, 256)
        y = add(f"add_{len(nodes)}", "add", [y, skip], "", act, 0)
        x = add(f"{u}_relu_1", "relu", [y], f"{p}.relu", act, 0)
        block += 1
        if block >= 2 + n_nodes // 40 and layer < 4:
            layer, block, act = layer + 1, 0, act // 2
    x = add("avgpool", "adaptive_avg_pool2d", [x], "avgpool", 32 * 2048 * 4, 0)
    x = add("flatten", "flatten", [x], "", 32 * 2048 * 4, 0)
    x = add("fc", "linear", [x], "fc", 32 * 1000 * 4, 8_196_000)
    add("output", "output", [x], "", 0, 0)
    return nodes


def make_plan(
    n_nodes: int = 120,
    n_devices: int = 4,
    *,
    cross_shaped: bool = True,
    microbatches: int = 4,
    mode: str = "train",
    seed: int = 0,
    name: str = "resnet_like",
) -> Plan:
    """A schema-valid Plan of a ResNet-like DAG over ``n_devices`` devices.

    With ``cross_shaped`` (and ≥ 3 devices) the middle stage runs on a group of
    two devices split by channel, so there are ``n_devices - 1`` stages.
    """
    assert 2 <= n_devices <= 10
    rng = random.Random(seed)
    nodes = _graph(n_nodes, rng)
    if mode != "train":  # time_s is forward only; there is no backward part
        for n in nodes:
            n.time_s = {k: v - n.bwd_s[k] for k, v in n.time_s.items()}
            n.bwd_s = {}
    kinds = ["V100" if i % 3 != 2 else "T4" for i in range(n_devices)]
    devices = [
        PlanDevice(f"gpu{i}", k, f"cuda:{i}", 16 * GiB if k == "V100" else 8 * GiB, 15.7e12, 9e11)
        for i, k in enumerate(kinds)
    ]
    bw = [[300e9 if i == j else 12e9 for j in range(n_devices)] for i in range(n_devices)]
    lat = [[0.0 if i == j else 1e-5 for j in range(n_devices)] for i in range(n_devices)]
    cluster = PlanCluster(devices, bw, lat, name=f"{n_devices}x mixed V100/T4")

    groups = [[d.name] for d in devices]
    splits = ["none"] * n_devices
    if cross_shaped and n_devices >= 3:
        mid = n_devices // 2
        groups[mid - 1 : mid + 1] = [[devices[mid - 1].name, devices[mid].name]]
        splits = ["none"] * len(groups)
        splits[mid - 1] = "channel"
    n_stages = len(groups)
    total = sum(n.time_s["V100"] for n in nodes)
    assignment: dict[str, int] = {}
    acc = 0.0
    for n in nodes:  # contiguous in topological order => every edge goes forward
        assignment[n.name] = min(n_stages - 1, int(acc / total * n_stages))
        acc += n.time_s["V100"]
    out_bytes = {n.name: n.out_bytes for n in nodes}
    edges = [(i, n.name, out_bytes[i]) for n in nodes for i in n.inputs]
    dev = {d.name: d for d in devices}
    transfers: dict[tuple[str, int], PlanTransfer] = {}
    for src, dst, nbytes in edges:
        a, b = assignment[src], assignment[dst]
        if a != b and (src, b) not in transfers:
            i, j = cluster.index(groups[a][0]), cluster.index(groups[b][0])
            secs = lat[i][j] + nbytes / bw[i][j]
            transfers[(src, b)] = PlanTransfer(src, a, b, groups[a][0], groups[b][0], nbytes, secs)

    stages, peaks = [], {}
    for k, (grp, split) in enumerate(zip(groups, splits)):
        members = [n for n in nodes if assignment[n.name] == k]
        kind = dev[grp[0]].kind
        compute = sum(n.time_s[kind] for n in members) / len(grp)
        comm = sum(t.time_s for t in transfers.values() if t.dst_stage == k)
        in_flight = microbatches if mode == "train" else 1
        mem = sum(n.resident_bytes * 4 + n.activation_bytes * in_flight for n in members)
        mem //= len(grp)
        stages.append(PlanStage(k, list(grp), split, compute, comm, compute + comm, mem))
        for d in grp:
            peaks[d] = mem
    stage_times = [s.time_s for s in stages]
    bottleneck = max(stage_times)
    step = (microbatches + n_stages - 1) * bottleneck
    solver = SolverRecord(
        solver="cpsat",
        status="FEASIBLE",
        objective=bottleneck,
        best_bound=bottleneck * 0.96,
        gap=0.04,
        lower_bound=sum(stage_times) / n_devices,
        wall_time_s=3.2,
        seed=seed,
        workers=8,
        coarse_nodes=min(len(nodes), 200),
        baselines={
            "greedy": bottleneck * 1.31,
            "dp_chain": bottleneck * 1.07,
            "single_device": sum(stage_times),
        },
        notes=[
            "time limit reached; best plan found is reported with its gap",
            "hint from dp_chain accepted",
        ],
    )
    plan = Plan(
        model=ModelInfo(name, f"sha256:{seed:08x}", 32, [[32, 3, 224, 224]], mode),
        cluster=cluster,
        options=PlanOptions(microbatches=microbatches, seed=seed),
        nodes=nodes,
        edges=edges,
        assignment=assignment,
        stages=stages,
        transfers=list(transfers.values()),
        predicted=Prediction(
            stage_time_s=stage_times,
            bottleneck_s=bottleneck,
            makespan_s=sum(stage_times),
            step_time_s=step,
            throughput=32 / step,
            bubble_fraction=(n_stages - 1) / (microbatches + n_stages - 1),
            device_peak_bytes=peaks,
        ),
        solver=solver,
        crosscut_version="0.1.0",
        created_at="2024-01-01T00:00:00Z",
    )
    return Plan.from_dict(plan.to_dict())  # schema check on every synthetic plan


def rename_node(plan: Plan, old: str, new: str) -> Plan:
    """A copy of ``plan`` with node ``old`` called ``new`` everywhere it is named."""
    data = plan.to_dict()
    for n in data["nodes"]:
        n["name"] = new if n["name"] == old else n["name"]
        n["inputs"] = [new if i == old else i for i in n["inputs"]]
    data["edges"] = [
        [new if a == old else a, new if b == old else b, c] for a, b, c in data["edges"]
    ]
    data["assignment"] = {(new if k == old else k): v for k, v in data["assignment"].items()}
    for t in data["transfers"]:
        t["tensor"] = new if t["tensor"] == old else t["tensor"]
    return Plan.from_dict(data)


@dataclass
class SimEvent:
    device: str
    stage: int
    kind: str  # "F" | "B" | "T"
    microbatch: int
    start: float
    end: float


@dataclass
class SimpleSimulation:
    events: list[SimEvent] = field(default_factory=list)
    step_time_s: float = 0.0
    bubble_fraction: float = 0.0
    device_busy_s: dict[str, float] = field(default_factory=dict)
    device_peak_bytes: dict[str, int] = field(default_factory=dict)


def make_simulation(plan: Plan) -> SimpleSimulation:
    """A GPipe timeline by hand (all forwards, then backwards in reverse), with transfers."""
    m_count, stages = plan.options.microbatches, plan.stages
    free = {d: 0.0 for d in plan.used_devices()}
    comm = [0.0] + [s.comm_s for s in stages[1:]]
    events: list[SimEvent] = []

    def run(k: int, kind: str, mb: int, ready: float) -> float:
        st = stages[k]
        start = max([ready] + [free[d] for d in st.devices])
        for d in st.devices:
            events.append(SimEvent(d, k, kind, mb, start, start + st.compute_s))
            free[d] = start + st.compute_s
        return start + st.compute_s

    def send(k_from: int, mb: int, at: float, secs: float) -> float:
        if secs > 0:
            events.append(SimEvent(stages[k_from].devices[0], k_from, "T", mb, at, at + secs))
        return at + secs

    done = 0.0
    for mb in range(m_count):
        t = 0.0
        for k in range(len(stages)):
            t = run(k, "F", mb, send(k - 1, mb, t, comm[k]) if k else t)
        done = max(done, t)
    if plan.model.mode == "train":
        for mb in range(m_count):
            t = 0.0
            for k in reversed(range(len(stages))):
                ready = send(k + 1, mb, t, comm[k + 1]) if k + 1 < len(stages) else t
                t = run(k, "B", mb, ready)
            done = max(done, t)
    busy = {
        d: sum(e.end - e.start for e in events if e.device == d and e.kind != "T") for d in free
    }
    bubble = 1 - sum(busy.values()) / (done * len(busy)) if done else 0.0
    return SimpleSimulation(events, done, bubble, busy, dict(plan.predicted.device_peak_bytes))


def reprice(plan: Plan, clear: str = "") -> Any:
    """``plan`` read back from its JSON and priced by the evaluator (an ``Evaluation``),
    with the per-node field ``clear`` (``"batch_scale"``, ``"channel_scale"``) emptied
    first: what the plan's own numbers price, and what they would without that field."""
    from crosscut.partitioner.build import plan_groups, plan_to_problem
    from crosscut.partitioner.evaluate import evaluate

    back = Plan.from_dict(plan.to_dict())
    if clear:
        for n in back.nodes:
            setattr(n, clear, {})
    problem, stage_of, stage_device = plan_to_problem(back)
    return evaluate(problem, stage_of, stage_device, plan_groups(back))


def widen(plan: Plan, groups: tuple[tuple[int, str], ...]) -> Plan:
    """``plan`` with stage ``k`` on ``groups[k][0]`` devices split by ``groups[k][1]``.

    Why: which stages the planner gives a group depends on the prices, so a test
    that must run groups on a given model builds them itself from a plain
    pipeline plan. The cluster becomes ``cpu0 ..`` with the plan's fastest link
    between every two devices.
    """
    data = plan.to_dict()
    cluster = data["cluster"]
    template = cluster["devices"][0]
    total = sum(w for w, _ in groups)
    bw = max(max(row) for row in cluster["bandwidth"])
    lat = max(max(row) for row in cluster["latency"]) or 1e-5
    cluster["devices"] = [dict(template, name=f"cpu{i}") for i in range(total)]
    cluster["bandwidth"] = [[bw] * total for _ in range(total)]
    cluster["latency"] = [[0.0 if i == j else lat for j in range(total)] for i in range(total)]
    first = 0
    for stage, (width, split) in zip(data["stages"], groups):
        stage["devices"] = [f"cpu{first + i}" for i in range(width)]
        stage["split"] = split
        first += width
    data["options"]["widths"] = sorted({1, *(w for w, _ in groups)})
    data["options"]["splits"] = sorted({s for _, s in groups if s != "none"})
    return Plan.from_dict(data)
