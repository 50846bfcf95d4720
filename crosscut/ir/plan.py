"""The Plan: a partition result that anyone can read, replay and re-check.

A plan is plain JSON. It carries enough to recompute every prediction without
crosscut: the cluster (devices, caps, links), every node with its cost per
device kind and its memory, every edge with its bytes, the assignment
node → stage → device, the transfers, the schedule, the predictions and the
solver's record (status, bound, gap, baselines). ``schema_version`` is bumped on
any incompatible change; loading checks the JSON Schema beside this file and names
the offending field."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from crosscut.errors import PlanError
from crosscut.fileio import parse_json, read_json, write_atomic
from crosscut.ir.schedule import DEFAULT_SCHEDULE

__all__ = [
    "SCHEMA_VERSION",
    "Alternative",
    "ModelInfo",
    "Plan",
    "PlanCluster",
    "PlanDevice",
    "PlanNode",
    "PlanOptions",
    "PlanStage",
    "PlanTransfer",
    "Prediction",
    "PricedRate",
    "Replication",
    "SolverRecord",
    "Strategy",
    "plan_schema",
]

SCHEMA_VERSION = 1


@dataclass
class PlanDevice:
    name: str  # unique id within the cluster ("gpu0", "cpu1", "cuda:0")
    kind: str  # preset / device kind; node costs are keyed by it
    device: str  # torch device string to run on ("cuda:0", "cpu")
    mem_cap: int  # bytes
    peak_flops: float = 0.0  # float32 FLOP/s, for the record
    mem_bw: float = 0.0  # bytes/s, for the record


@dataclass
class PlanCluster:
    devices: list[PlanDevice]
    bandwidth: list[list[float]]  # [src][dst] bytes/s
    latency: list[list[float]]  # [src][dst] seconds
    name: str = ""
    # identical nodes of ``devices`` joined by ``network`` (bytes/s, latency s) per node
    nodes: int = 1
    network: list[float] = field(default_factory=lambda: [0.0, 0.0])
    network_name: str = ""
    # a node's slowest device-to-device link (bytes/s, latency s), for replicas that
    # share a node; [0, 0]: the plan's own devices are the node
    node_link: list[float] = field(default_factory=lambda: [0.0, 0.0])
    nics: int = 1  # network interfaces per node, each ``network``'s bandwidth

    def index(self, name: str) -> int:
        for i, d in enumerate(self.devices):
            if d.name == name:
                return i
        raise PlanError(
            "every device a plan names must be in its cluster",
            value=name,
            remedy=f"use one of {[d.name for d in self.devices]}",
        )


@dataclass
class PlanNode:
    name: str
    op: str
    kind: str
    target: str
    inputs: list[str]
    out_bytes: int  # per micro-batch
    resident_bytes: int  # params (+grads, optimizer state when training)
    activation_bytes: int  # saved per in-flight micro-batch
    time_s: dict[str, float]  # device kind -> seconds per micro-batch (fwd, or fwd+bwd)
    module_path: str = ""
    bwd_s: dict[str, float] = field(default_factory=dict)  # the backward part of time_s
    param_bytes: int = 0  # parameter (= gradient) bytes: what a batch-split group all-reduces
    shard: str = "full"  # in a channel split: "split" | "channel" | "full" (problem.SHARD_KINDS)
    channels: int = 0  # output channels a channel split divides (0: unknown)
    batch_major: bool = True  # one tensor, micro-batch as dim 0: a batch split may hand it on
    mixes_batch: bool = False  # computed from several samples: no batch split may hold it
    messages: int = 1  # its tensor leaves: the messages it crosses a cut as, each way
    # [reader, node it reads] per reader, if codegen/fanout.py may alias each (program order)
    fanout: list[list[str]] = field(default_factory=list)
    # samples (as a string) -> device kind -> per-sample slowdown of running only that many
    # samples of the micro-batch: a batch-split share's cost beyond its fraction of time_s
    batch_scale: dict[str, dict[str, float]] = field(default_factory=dict)
    # channel width (str) -> kind -> a shard's excess over 1/w of time_s (analytic.py)
    channel_scale: dict[str, dict[str, float]] = field(default_factory=dict)
    # kind -> [B, W]: a split backward's passes as fractions of bwd_s, where profiled
    # (may sum past 1); absent: priced by rule (partitioner/simulate.py, backward_split)
    bwd_split: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class PlanStage:
    index: int
    devices: list[str]  # one device for a pipeline stage; a group for cross-shaped stages
    split: str = "none"  # "none" | "channel" | "batch"
    compute_s: float = 0.0
    comm_s: float = 0.0
    time_s: float = 0.0
    memory_bytes: int = 0
    recompute: bool = False  # keeps its inputs only and recomputes in backward


@dataclass
class PlanTransfer:
    tensor: str  # producer node
    src_stage: int
    dst_stage: int
    src_device: str
    dst_device: str
    bytes: int  # per micro-batch
    time_s: float = 0.0


@dataclass
class PlanOptions:
    objective: str = "throughput"
    schedule: str = DEFAULT_SCHEDULE
    microbatches: int = 1
    overlap_comm: bool = False
    optimizer: str = "sgd"
    time_limit_s: float = 10.0
    seed: int = 0
    cost_source: str = "analytic"
    widths: list[int] = field(default_factory=lambda: [1])  # group widths the solver may use
    splits: list[str] = field(default_factory=list)  # "batch", "channel": cross-shaped stages
    # stages keep only their inputs per in-flight micro-batch and recompute the rest in
    # backward (priced: one micro-batch of activations, one more forward; runtime/recomputing.py)
    recompute: bool = False
    # ops run under autocast with this dtype (crosscut/precision.py): "fp32" | "bf16" | "fp16"
    precision: str = "fp32"


@dataclass
class ModelInfo:
    name: str
    fingerprint: str
    batch_size: int
    input_shapes: list[list[int]]
    mode: str  # "train" | "infer"
    dtype: str = "float32"


@dataclass
class Prediction:
    stage_time_s: list[float] = field(default_factory=list)
    bottleneck_s: float = 0.0
    makespan_s: float = 0.0  # one micro-batch through the whole graph
    step_time_s: float = 0.0  # one batch (all micro-batches) under the schedule
    throughput: float = 0.0  # samples per second
    bubble_fraction: float = 0.0
    device_peak_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class SolverRecord:
    solver: str = ""
    status: str = ""  # OPTIMAL | FEASIBLE | FALLBACK | REPLAYED | MANUAL
    objective: float = 0.0
    best_bound: float = 0.0
    gap: float = 0.0
    lower_bound: float = 0.0  # max(total/devices, largest node): solver-independent
    wall_time_s: float = 0.0
    seed: int = 0
    workers: int = 1
    coarse_nodes: int = 0
    baselines: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class Replication:
    """Data-parallel copies of the pipeline, chosen by the planner (partitioner/replicas.py).

    Each replica runs the plan's stages on its own devices with ``1/replicas`` of
    the global batch; after backward every stage position all-reduces its
    gradients over the replicas, by ``reduction``: ``"ring"`` over all of them,
    ``"tree"`` between nodes, or ``"2d"`` (reduce-scatter inside a node, all-reduce
    across nodes, all-gather inside). ``allreduce_s`` is that reduction's time per
    step alone on the wire; ``exposed_s`` what the step waits for after the
    backward it overlaps.
    """

    replicas: int = 1
    reduction: str = "none"  # "none" | "ring" | "tree" | "2d"
    allreduce_s: float = 0.0  # the reduction alone on the wire
    exposed_s: float = 0.0  # what is left of it after the backward it overlaps (simulate.py)
    grad_bytes: float = 4.0  # bytes per gradient element on the wire (2: fp16/bf16 reduced)


@dataclass
class Alternative:
    """One strategy the planner considered: ``replicas`` × a pipeline over ``devices``.

    ``outcome``: ``"chosen"`` (this plan), ``"slower"`` (priced at
    ``step_time_s``), ``"within noise"`` (predicted quicker than the chosen
    plan, by less than its profiled costs' spread: the simpler one is kept),
    ``"no fit"`` (no plan fits the memory caps),
    ``"pruned"`` (a lower bound already at or above the best step),
    ``"refused"`` (the model or a rule refused it), ``"excluded"`` (ruled out
    before planning: the batch does not split, the caller fixed another
    count, the devices differ), ``"not tried"`` (the time limit). ``devices
    == 1`` is data parallelism on every device.
    """

    replicas: int
    devices: int
    microbatches: int
    outcome: str
    reason: str = ""
    stages: int = 0
    step_time_s: float = 0.0
    reduction: str = "none"
    allreduce_s: float = 0.0
    # devices of each stage where some stage runs on a group (a stage's own data
    # parallelism); empty: one device per stage
    widths: list[int] = field(default_factory=list)
    # the pipeline schedule the step was priced under ("": no plan, or plans written before)
    schedule: str = ""

    @property
    def data_parallel(self) -> bool:
        return self.devices == 1

    def label(self) -> str:
        """``"2 replicas × 4 devices (4 stages), M=8"``; groups (``"1 replica, stages on
        1+2+4+1, M=16"``) and data parallelism say so."""
        if self.data_parallel:
            shape = f"data parallel, {self.replicas} replicas"
        elif self.widths:  # stages on groups: each stage's devices
            many = "s" if self.replicas > 1 else ""
            shape = f"{self.replicas} replica{many}, stages on {'+'.join(map(str, self.widths))}"
        else:
            each = f"{self.devices} devices" + (f" ({self.stages} stages)" if self.stages else "")
            shape = f"{self.replicas} replica{'s' if self.replicas > 1 else ''} × {each}"
        pipelined = self.schedule and (self.stages > 1 or self.widths)
        return f"{shape}, M={self.microbatches}" + (f", {self.schedule}" if pipelined else "")

    def text(self) -> str:
        """The label, then the step (and all-reduce) or why there is none."""
        if self.step_time_s > 0:
            red = (
                f", {self.reduction} all-reduce {self.allreduce_s * 1e3:.3g} ms"
                if self.reduction != "none"
                else ""
            )
            what = f"step {self.step_time_s * 1e3:.4g} ms{red}, {self.outcome}"
        else:
            what = self.outcome + (f" ({self.reason})" if self.reason else "")
        return f"{self.label()}: {what}"


@dataclass
class PricedRate:
    """What one device kind was priced at: the ``preset`` its datasheet came from ("": a
    device described by hand), the ``math`` modes of its convolutions and matmuls,
    where its achieved fractions came from (``efficiency``: fitted to which published
    figures, an analytic default, or profiled where) and ``costs`` (analytic|profiled)."""

    kind: str
    preset: str = ""
    math: list[str] = field(default_factory=list)
    efficiency: str = ""
    costs: str = "analytic"


@dataclass
class Strategy:
    """Every strategy the planner considered for this plan, in the order it tried them."""

    alternatives: list[Alternative] = field(default_factory=list)
    wall_time_s: float = 0.0

    def data_parallel(self) -> Alternative | None:
        """The best row of data parallelism on every device (the baseline), if listed."""
        rows = [a for a in self.alternatives if a.data_parallel]
        priced = [a for a in rows if a.step_time_s > 0]
        if priced:
            return min(priced, key=lambda a: a.step_time_s)
        return rows[0] if rows else None


@dataclass
class Plan:
    """A partition of one model over one cluster; see docs/PLAN_FORMAT.md."""

    model: ModelInfo
    cluster: PlanCluster
    options: PlanOptions
    nodes: list[PlanNode]
    edges: list[tuple[str, str, int]]  # producer, consumer, bytes per micro-batch
    assignment: dict[str, int]  # node -> stage
    stages: list[PlanStage]
    transfers: list[PlanTransfer] = field(default_factory=list)
    ties: list[list[str]] = field(default_factory=list)  # nodes sharing a parameter: one stage
    predicted: Prediction = field(default_factory=Prediction)
    solver: SolverRecord = field(default_factory=SolverRecord)
    replication: Replication = field(default_factory=Replication)
    strategy: Strategy = field(default_factory=Strategy)
    rates: list[PricedRate] = field(default_factory=list)  # per device kind: what was priced
    schema_version: int = SCHEMA_VERSION
    crosscut_version: str = ""
    created_at: str = ""

    # ---- derived views ---------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_nodes(self, stage: int) -> list[str]:
        """Names of the nodes in ``stage``, in topological order (see :meth:`placement`)."""
        placed = self.placement()
        return [n.name for n in self.nodes if placed[n.name] == stage]

    def placed_stage(self, name: str) -> int:
        """The stage one node belongs to for display and counting (see :meth:`placement`)."""
        return self.placement()[name]

    def placement(self) -> dict[str, int]:
        """Every node's stage, the unassigned ones included, in one O(nodes + edges) pass.

        Placeholders are not assigned (the runtime hands inputs to every stage
        that reads them), so they show with their first reader; the output
        shows with its last producer.
        """
        placed = dict(self.assignment)
        first_reader: dict[str, int] = {}
        for n in self.nodes:
            if n.name in self.assignment:
                for src in n.inputs:
                    k = self.assignment[n.name]
                    first_reader[src] = min(k, first_reader.get(src, k))
        for n in self.nodes:
            if n.name in placed:
                continue
            if n.op == "output":
                placed[n.name] = max((placed.get(i, 0) for i in n.inputs), default=0)
            else:
                placed[n.name] = first_reader.get(n.name, 0)
        return placed

    def device_of(self, node: str) -> list[str]:
        return self.stages[self.assignment[node]].devices

    def used_devices(self) -> list[str]:
        return [d for s in self.stages for d in s.devices]

    # ---- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["edges"] = [list(e) for e in self.edges]
        return data

    def to_json(self, *, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON; ``created_at`` is stamped here, not at solve time."""
        if not self.created_at:
            self.created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return write_atomic(path, self.to_json() + "\n", "the plan")

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        """Build a plan from parsed JSON, checking the schema first."""
        _check_schema(data)
        _check_numbers(data, "plan")
        try:
            return cls(
                model=ModelInfo(**data["model"]),
                cluster=PlanCluster(
                    devices=[PlanDevice(**d) for d in data["cluster"]["devices"]],
                    bandwidth=data["cluster"]["bandwidth"],
                    latency=data["cluster"]["latency"],
                    name=data["cluster"].get("name", ""),
                    nodes=int(data["cluster"].get("nodes", 1)),
                    network=[float(v) for v in data["cluster"].get("network", [0.0, 0.0])],
                    network_name=str(data["cluster"].get("network_name", "")),
                    node_link=[float(v) for v in data["cluster"].get("node_link", [0.0, 0.0])],
                    nics=int(data["cluster"].get("nics", 1)),
                ),
                options=PlanOptions(**data["options"]),
                nodes=[PlanNode(**n) for n in data["nodes"]],
                edges=[(str(e[0]), str(e[1]), int(e[2])) for e in data["edges"]],
                assignment={str(k): int(v) for k, v in data["assignment"].items()},
                stages=[PlanStage(**s) for s in data["stages"]],
                transfers=[PlanTransfer(**t) for t in data.get("transfers", [])],
                ties=[[str(n) for n in t] for t in data.get("ties", [])],
                predicted=Prediction(**data.get("predicted", {})),
                solver=SolverRecord(**data.get("solver", {})),
                replication=Replication(**data.get("replication", {})),
                strategy=Strategy(
                    alternatives=[
                        Alternative(**a) for a in data.get("strategy", {}).get("alternatives", [])
                    ],
                    wall_time_s=float(data.get("strategy", {}).get("wall_time_s", 0.0)),
                ),
                rates=[PricedRate(**r) for r in data.get("rates", [])],
                schema_version=int(data["schema_version"]),
                crosscut_version=str(data.get("crosscut_version", "")),
                created_at=str(data.get("created_at", "")),
            )
        except (TypeError, KeyError) as exc:  # a field the schema allowed but the class did not
            raise PlanError(
                "a plan's fields must match the schema of its version",
                value=str(exc),
                remedy="re-create the plan with `crosscut partition`",
            ) from exc

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(parse_json(text, PlanError, "a plan file", remedy=_REMAKE, obj=False))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        remedy = "check the path, or create one with `crosscut partition MODEL -o plan.json`"
        data = read_json(path, PlanError, "a plan file", remedy=remedy, obj=False)
        return cls.from_dict(data)


_REMAKE = "the file may be truncated; re-create it with `crosscut partition`"


def _check_numbers(data: Any, path: str) -> None:
    """Every number of a plan is finite and not negative (times, bytes, counts, ids).

    JSON from Python may hold NaN or Infinity, which the schema's "number"
    accepts; a plan with them would only fail later, deep in a drawing or a
    simulation.
    """
    if isinstance(data, dict):
        for k, v in data.items():
            _check_numbers(v, f"{path}.{k}")
    elif isinstance(data, list):
        for i, v in enumerate(data):
            _check_numbers(v, f"{path}[{i}]")
    elif (
        isinstance(data, (int, float))
        and not isinstance(data, bool)
        and (not math.isfinite(data) or data < 0)
    ):
        raise PlanError(
            f"every number in a plan must be finite and not negative, but {path} is {data}",
            value=data,
            remedy="re-create the plan with `crosscut partition` (the file was edited or "
            "written by another tool)",
        )


def plan_schema() -> dict[str, Any]:
    """The JSON Schema of the current ``schema_version``, shipped in the package."""
    text = resources.files("crosscut.ir").joinpath("plan_schema.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema


def _check_schema(data: Any) -> None:
    import jsonschema

    if not isinstance(data, dict):
        raise PlanError("a plan must be a JSON object", value=type(data).__name__)
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PlanError(
            f"this crosscut reads plan schema_version {SCHEMA_VERSION}",
            value=version,
            remedy="re-create the plan with this crosscut, or use the crosscut version "
            "that wrote it",
        )
    validator = jsonschema.Draft202012Validator(plan_schema())
    error = jsonschema.exceptions.best_match(validator.iter_errors(data))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise PlanError(
            f"plan field {where!r} breaks the schema: {error.message}",
            value=where,
            remedy="fix that field or re-create the plan with `crosscut partition`",
        )
