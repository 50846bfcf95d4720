"""PartitionProblem: the partition problem as plain numbers — no torch past this line.

The solvers (``partitioner/solvers``) see only this object, so they can be
tested on random DAGs and checked against brute force without a model. All
times are seconds per micro-batch, all sizes bytes. ``build_problem`` (in
``partitioner/build.py``) fills it from an OpGraph, a CostTable and a Cluster.

The model (``docs/ARCHITECTURE.md``, "The partition problem"):

* node ``v`` has compute time ``compute[v][d]`` on device ``d`` (forward, or
  forward+backward when ``training``), ``resident[v]`` bytes that live on its
  device for the whole run (parameters; with gradients and optimizer state when
  training), ``activation[v]`` bytes saved per in-flight micro-batch, and an
  output of ``out_bytes[v]`` bytes per micro-batch.
* a plan puts every node in a stage ``s(v)``; every edge ``u → v`` has
  ``s(u) <= s(v)``; stage ``k`` runs on device ``stage_device[k]``.
* a node ``u`` whose output is read in a later stage ``k`` is sent once to
  each such stage, directly (not relayed), costing
  ``latencies(u) * latency[a][b] + out_bytes[u] / bandwidth[a][b]`` between
  their devices; in training its gradient flows back along the same pair.
  ``latencies(u)`` counts messages, not values: the torchrun runtime sends
  each tensor leaf of a value as its own message (``messages[u]`` of them) and
  a gradient's leaves back the same way, plus one mask message (which leaves
  had a gradient: ``runtime/dist/stage_io.send_grads``). A training round trip
  is ``2 * messages[u] + 1`` messages; half the mask is priced on each
  direction, so every price stays ``comm_multiplier * one way`` and the
  simulator's forward and backward each carry half of it. (A value with no
  gradient sends nothing back; it is priced as if it did, as before. The local
  runtime sends no mask; its links' latencies are a few microseconds.)

Cross-shaped (2-D) splits, opt-in (``partitioner/group_costs.py`` prices them): a
stage may run on a :class:`StageGroup` of ``w`` devices, split by ``batch``
(each device takes its share of the micro-batch, gradients are reduced over
the group) or by ``channel`` (conv/linear split by output channels). The solver
may use the widths in ``widths`` and the kinds in ``splits``; the per-node
fields ``shard``, ``channels`` and ``param_bytes`` say how a node splits. With
the defaults (``widths=(1,)``, no splits) nothing changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from crosscut.ir.schedule import DEFAULT_SCHEDULE, PIPELINE_SCHEDULES

__all__ = [
    "OBJECTIVES",
    "RECOMPUTE",
    "SCHEDULES",
    "SHARD_KINDS",
    "SPLITS",
    "PartitionProblem",
    "StageGroup",
    "restrict",
    "sums_like_eager",
]

OBJECTIVES = ("throughput", "latency")
SCHEDULES = PIPELINE_SCHEDULES  # defined once, in ir/schedule.py
SPLITS = ("none", "batch", "channel")
RECOMPUTE = ("auto", "never", "always")  # what a caller may ask; a plan records a bool
# how a node behaves in a channel-split stage: "split" needs its whole input and
# makes channel shards (conv2d, linear: weights sharded by output channel);
# "channel" works shard by shard (batch norm, activations, pooling);
# "full" needs its whole input and runs once, on the group's first device
SHARD_KINDS = ("split", "channel", "full")


@dataclass(frozen=True)
class StageGroup:
    """The devices (indices, first one leads) of one stage and how they split it."""

    devices: tuple[int, ...]
    split: str = "none"  # "none" (one device) | "batch" | "channel"

    @property
    def width(self) -> int:
        return len(self.devices)

    @property
    def leader(self) -> int:
        return self.devices[0]


@dataclass(frozen=True)
class PartitionProblem:
    """Everything a solver needs, as lists indexed by node and device."""

    names: list[str]  # node names, topological order
    compute: list[list[float]]  # [node][device] seconds per micro-batch
    resident: list[int]  # [node] bytes resident for the whole run
    activation: list[int]  # [node] bytes saved per in-flight micro-batch
    out_bytes: list[int]  # [node] output bytes per micro-batch
    edges: list[tuple[int, int]]  # (producer, consumer), producer < consumer
    devices: list[str]  # device names
    mem_cap: list[int]  # [device] bytes
    bandwidth: list[list[float]]  # [src][dst] bytes/s (diagonal unused)
    latency: list[list[float]]  # [src][dst] seconds
    ties: list[list[int]] = field(default_factory=list)  # node groups that share a stage
    microbatches: int = 1
    schedule: str = DEFAULT_SCHEDULE
    objective: str = "throughput"
    training: bool = True
    overlap_comm: bool = False  # count a stage as max(compute, comm) instead of their sum
    # every stage keeps one micro-batch of activations (plus its inputs per in-flight
    # micro-batch) and recomputes its forward in backward; ``compute`` already holds
    # that extra forward (build.problem_from_parts adds it)
    recompute: bool = False
    # a known solution's per-stage choice (a plan's stages; partitioner/recompute_choice.py):
    # stage k keeps one micro-batch of activations iff stage_recompute[k]; ``compute`` then
    # holds the extra forward on exactly those stages' nodes and ``recompute`` is False.
    # Empty: every stage follows ``recompute`` (what the solvers see)
    stage_recompute: tuple[bool, ...] = ()
    # ---- cross-shaped stages (opt-in; empty lists mean "all 0" / "all full") ----------
    widths: tuple[int, ...] = (1,)  # group widths the solver may use
    splits: tuple[str, ...] = ()  # split kinds the solver may use: "batch", "channel"
    shard: list[str] = field(default_factory=list)  # [node] one of SHARD_KINDS
    channels: list[int] = field(default_factory=list)  # [node] output channels (0: unknown)
    param_bytes: list[int] = field(default_factory=list)  # [node] gradient bytes to reduce
    # [node] its output is one tensor whose dim 0 is the micro-batch (empty: all are). A
    # batch-split stage concatenates its shares' copies of every value it hands on, so
    # it may not hand on any other (``x.size(0)``, a batch mean): each share would
    # compute it from its own rows (runtime/batch_shares.py refuses it at compile time)
    batch_major: list[bool] = field(default_factory=list)
    # [node] it computes a tensor from several samples (a mean over the batch): a
    # batch-split stage may not hold it at all (build.mixes_batch_value). Empty: none does
    mixes_batch: list[bool] = field(default_factory=list)
    batch: int = 0  # samples per micro-batch (0: unknown, shares priced as 1/w)
    # the model's own inputs and outputs, which a batch-split stage scatters and gathers:
    # (bytes per micro-batch, the nodes that read it) per input; nodes the model returns
    graph_inputs: list[tuple[int, list[int]]] = field(default_factory=list)
    graph_outputs: list[int] = field(default_factory=list)
    # width w -> [node][device] seconds of one share of a batch split over w devices,
    # priced at its own ceil(batch / w) samples (build.problem_from_parts, from the nodes'
    # batch_scale). A width without a table prices the share linearly: compute × share
    share_compute: dict[int, list[list[float]]] = field(default_factory=dict)
    # width w -> [node][device] seconds of one of w channel shards of a shared node (split /
    # channel), priced from the nodes' channel_scale; a width without one: compute × share
    channel_compute: dict[int, list[list[float]]] = field(default_factory=dict)
    # [node] messages its value crosses a cut as, one per tensor leaf (a tuple's
    # elements each alone: runtime/dist/stage_io.py); empty: one each
    messages: list[int] = field(default_factory=list)
    # node -> its autograd readers as (reader, node it reads: itself, or an op that hands
    # its value through), in program order, for every value codegen/fanout.py may give one
    # alias per reader (frontend/readers.py: a tensor, not written in place, 3+ readers);
    # a cut that breaks eager's gradient order sends it once per remote reader
    # (partitioner/fanout_cost.py). Empty: no such value
    fanout: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def cross_shaped(self) -> bool:
        """Whether the solver may put a stage on a group of devices."""
        return bool(self.splits) and any(w > 1 for w in self.widths)

    def shard_of(self, v: int) -> str:
        return self.shard[v] if self.shard else "full"

    def channels_of(self, v: int) -> int:
        return self.channels[v] if self.channels else 0

    def is_batch_major(self, v: int) -> bool:
        return self.batch_major[v] if self.batch_major else True

    def grad_bytes(self, v: int) -> int:
        return self.param_bytes[v] if self.param_bytes else 0

    def messages_of(self, v: int) -> int:
        return self.messages[v] if self.messages else 1

    def latencies(self, v: int) -> float:
        """The link latencies a one-way transfer of ``v``'s value pays: one per message.

        A leaf is a message each way; training's backward adds a mask message,
        half of it priced here, so ``2 * latencies(v)`` is the round trip's
        ``2 * messages + 1`` exactly (the module docstring).
        """
        return self.messages_of(v) + (0.5 if self.training else 0.0)


def sums_like_eager(home: int, reader_stages: list[int]) -> bool:
    """Whether a pipeline already adds a value's readers' gradients in eager's order.

    ``reader_stages``: the stage of each autograd reader, in program order;
    ``home``: the value's own stage. It does when the readers sit on the
    value's own stage and at most one other, and that other stage's readers
    come last in program order: its subtotal is eager's first partial sum, and
    the local readers follow in eager's order. Otherwise codegen/fanout.py gives
    every reader its own alias, and the cost model prices one transfer per
    remote reader; both read this one function.
    """
    remote = [i for i, s in enumerate(reader_stages) if s != home]
    if not remote:
        return True
    if len({reader_stages[i] for i in remote}) > 1:
        return False
    return remote == list(range(len(reader_stages) - len(remote), len(reader_stages)))


# PartitionProblem's fields by how :func:`restrict` carries them: one row per node; node
# indices (renumbered); as they are (devices, links, settings). tests/test_problem_restrict.py holds
# the three lists to the dataclass, so a new field cannot be left out of a restriction.
ROWS = (
    "names", "compute", "resident", "activation", "out_bytes", "shard", "channels",
    "param_bytes", "batch_major", "mixes_batch", "messages",
)  # fmt: skip
NODE_REFS = (
    "edges", "ties", "graph_inputs", "graph_outputs", "fanout", "share_compute",
    "channel_compute",
)  # fmt: skip
AS_IS = (
    "devices", "mem_cap", "bandwidth", "latency", "microbatches", "schedule", "objective",
    "training", "overlap_comm", "recompute", "stage_recompute", "widths", "splits", "batch",
)  # fmt: skip


def restrict(
    problem: PartitionProblem, kept: Sequence[int], stand_in: Sequence[int]
) -> PartitionProblem:
    """``problem`` over the nodes ``kept`` (ascending), every node index renumbered.

    ``stand_in[v]``: the kept node that stands for ``v`` (``v`` itself when kept;
    for a removed node, the node it joins, e.g. its consumer). Edges and fan-out
    reads keep only kept nodes (a removed node's cost is the caller's to move);
    ties, the model's input readers and its outputs move to their stand-ins.
    Every per-node field is carried, by the lists :data:`ROWS` and
    :data:`NODE_REFS`: the side-tree relaxation once kept the fan-out map of
    the whole problem, and planning timm's rdnet_tiny crashed on an index past
    the relaxation's last node."""
    index = {v: i for i, v in enumerate(kept)}
    if list(kept) != sorted(index) or any(stand_in[v] not in index for v in range(problem.n)):
        raise ValueError("kept must be ascending node indices and every stand-in a kept node")

    def to(v: int) -> int:
        return index[stand_in[v]]

    rows: dict[str, Any] = {
        f: [getattr(problem, f)[v] for v in kept] if getattr(problem, f) else [] for f in ROWS
    }
    ties = [sorted({to(v) for v in g}) for g in problem.ties]
    return replace(
        problem,
        **rows,
        edges=[(index[u], index[v]) for u, v in problem.edges if u in index and v in index],
        ties=[g for g in ties if len(g) > 1],
        graph_inputs=[(b, sorted({to(r) for r in rs})) for b, rs in problem.graph_inputs],
        graph_outputs=sorted({to(v) for v in problem.graph_outputs}),
        fanout={
            index[v]: [(index[r], index[p]) for r, p in reads]
            for v, reads in problem.fanout.items()
            if v in index and all(r in index and p in index for r, p in reads)
        },
        share_compute={w: [t[v] for v in kept] for w, t in problem.share_compute.items()},
        channel_compute={w: [t[v] for v in kept] for w, t in problem.channel_compute.items()},
    )
