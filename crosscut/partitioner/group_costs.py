"""The cost model of cross-shaped (2-D) stages: a stage on a group of devices.

:func:`crosscut.partitioner.evaluate.evaluate` hands a plan here when one of its
stages runs on more than one device, so there is still one cost model; a plan
whose stages are all single devices is priced by evaluate()'s own path and
prices exactly as before. The formulas (docs/PLAN_FORMAT.md, "Cross-shaped
stages"), for stage ``k`` on group ``G`` of ``w`` devices, leader ``G[0]``:

* **share.** A node's work on one device of the group is ``share(n, w) =
  ceil(n / w) / n`` of its full work, ``n`` being the micro-batch size (batch
  split) or the node's output channels (channel split); uneven splits therefore
  cost what the largest shard costs. Unknown ``n`` prices ``1 / w``.
* **compute** = ``max`` over the group's devices of ``Σ compute[v][d] · share``.
  In a channel split only ``split``/``channel`` nodes are shared; ``full`` nodes
  run whole on the leader. Each share is priced at its own size where the
  problem knows it (:func:`node_compute`): a batch share at its own batch
  (``PartitionProblem.share_compute``, from the nodes' ``batch_scale``), a
  channel shard at its own width (``channel_compute``, from ``channel_scale``):
  a device is used less well on fewer samples or outputs, so ``w`` shares cost
  more than the whole.
* **collectives** (charged to the stage, ×2 when training: the backward moves
  the same bytes the other way), ``coll(B) = lat_G + (w - 1) / w · B / bw_G``
  with ``bw_G``/``lat_G`` the slowest link inside the group:

  - batch split: every received tensor and every model input the stage reads
    (``graph_inputs``) is scattered over the group, and every sent tensor and
    every model output it makes (``graph_outputs``) gathered on the leader,
    ``coll(B)`` each (an output that is also sent, once); when training the
    gradients are all-reduced once per step (ring: ``2 (w-1)/w · grad bytes /
    bw_G + 2 (w-1) lat_G``), amortised over the step's micro-batches;
  - channel split: a shard-producing node (``split``/``channel``) whose value is
    needed whole (by a ``split`` or ``full`` node of the stage, or by another
    stage) costs one all-gather ``coll(B)``; a whole value (received, or made
    by a ``full`` node) read by a ``split`` node costs one broadcast ``coll(B)``.
* **transfers** between stages go leader to leader, priced as for single
  devices; between co-located stages (the same group, see :func:`colocated`)
  they cost nothing: the value is already on the leader.
* **devices shared** by co-located stages are busy for each of them: the
  throughput bottleneck is the busiest device's summed stage times.
* **memory** per device, ``f`` = the node's share: batch split: ``resident +
  inflight · activation · f`` on every device, plus the receive buffers (whole
  on the leader, ``f`` of them elsewhere); channel split: ``f · (resident +
  inflight · activation)`` of shared nodes on every device, plus the ``full``
  nodes and the receive buffers on the leader. A split backward's held
  gradients (``evaluate.held_gradients``) count like activations, ``f`` of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from crosscut.ir.problem import PartitionProblem, StageGroup

__all__ = [
    "batch_split_errors",
    "batch_split_exports",
    "batch_split_mixing",
    "batch_split_refused",
    "collective_time",
    "colocated",
    "group_link",
    "group_problems",
    "node_compute",
    "node_share",
    "ring_allreduce_time",
    "share",
]


def share(total: int, width: int) -> float:
    """Fraction of ``total`` items the busiest of ``width`` near-equal parts holds."""
    if width <= 1:
        return 1.0
    if total <= 0:
        return 1.0 / width
    return math.ceil(total / width) / total


def node_share(problem: PartitionProblem, v: int, group: StageGroup) -> float:
    """Fraction of node ``v``'s work (and memory) on each device of ``group``.

    For a ``full`` node in a channel group this is 1: it runs on the leader only.
    """
    if group.width <= 1 or group.split == "none":
        return 1.0
    if group.split == "batch":
        return share(problem.batch, group.width)
    if problem.shard_of(v) == "full":
        return 1.0
    return share(problem.channels_of(v), group.width)


def node_compute(
    problem: PartitionProblem, v: int, d: int, group: StageGroup, fraction: float
) -> float:
    """Seconds node ``v`` takes on device ``d`` of ``group``, holding ``fraction`` of its work.

    A batch split's share at its own batch, a channel split's shard at its own
    size, when the problem has a table for the group's width (``share_compute``,
    ``channel_compute``), else ``compute × fraction``. A ``full`` node of a
    channel split runs whole (``fraction`` 1)."""
    if group.width > 1 and group.split == "batch":
        table = problem.share_compute.get(group.width)
        if table is not None:
            return table[v][d]
    if group.width > 1 and group.split == "channel" and problem.shard_of(v) != "full":
        table = problem.channel_compute.get(group.width)
        if table is not None:
            return table[v][d]
    return problem.compute[v][d] * fraction


def group_link(problem: PartitionProblem, devices: Sequence[int]) -> tuple[float, float]:
    """(bandwidth, latency) of the slowest link inside a group of devices."""
    pairs = [(a, b) for a in devices for b in devices if a != b]
    if not pairs:
        return math.inf, 0.0
    bw = min(problem.bandwidth[a][b] for a, b in pairs)
    lat = max(problem.latency[a][b] for a, b in pairs)
    return bw, lat


def collective_time(problem: PartitionProblem, group: StageGroup, nbytes: int) -> float:
    """One all-gather / scatter / broadcast of ``nbytes`` over the group, one way."""
    w = group.width
    if w <= 1:
        return 0.0
    bw, lat = group_link(problem, group.devices)
    return lat + (w - 1) / w * nbytes / bw


def ring_allreduce_time(problem: PartitionProblem, group: StageGroup, nbytes: int) -> float:
    """Ring all-reduce of ``nbytes`` over the group: ``2 (w-1)/w · bytes / bw + 2 (w-1) lat``."""
    w = group.width
    if w <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = group_link(problem, group.devices)
    return 2 * (w - 1) / w * nbytes / bw + 2 * (w - 1) * lat


def colocated(groups: Sequence[StageGroup], k: int) -> bool:
    """Whether stage ``k`` runs on exactly the group of stage ``k - 1`` (two or more devices).

    Co-located stages are how one set of devices runs two split kinds in turn
    (Krizhevsky's "one weird trick": batch-split convolutions, then a
    channel-split classifier on the same devices). The local executor runs
    each stage on its own worker thread, so sharing devices needs nothing
    special at run time; the cost model charges every device the sum of the
    times of the stages it serves. One device is never shared: merging the two
    stages would be at least as fast.
    """
    return k > 0 and groups[k].width > 1 and groups[k].devices == groups[k - 1].devices


def group_problems(problem: PartitionProblem, groups: Sequence[StageGroup]) -> list[str]:
    """Rules a list of stage groups breaks (disjoint devices, widths and splits that fit).

    Groups are disjoint, except that consecutive stages may share the very same
    group of two or more devices (:func:`colocated`).
    """
    errors: list[str] = []
    seen: dict[int, int] = {}
    for k, g in enumerate(groups):
        if not g.devices:
            errors.append(f"stage {k} has an empty device group")
            continue
        shared = colocated(groups, k)
        for d in g.devices:
            if not 0 <= d < problem.num_devices:
                errors.append(f"stage {k} names device {d}, outside 0..{problem.num_devices - 1}")
            elif d in seen and not shared:
                errors.append(
                    f"device {problem.devices[d]!r} is in stages {seen[d]} and {k}; only "
                    "consecutive stages on the very same group of 2+ devices may share devices"
                )
            seen.setdefault(d, k)
        if g.width == 1 and g.split != "none":
            errors.append(f"stage {k} splits by {g.split!r} over one device; use split 'none'")
        if g.width > 1 and g.split not in ("batch", "channel"):
            errors.append(
                f"stage {k} runs on {g.width} devices with split {g.split!r}; "
                "a group splits by 'batch' or 'channel'"
            )
        if g.split == "batch" and 0 < problem.batch < g.width:
            errors.append(
                f"stage {k} splits a micro-batch of {problem.batch} over {g.width} devices; "
                "some devices would get no sample"
            )
    return errors


def batch_split_exports(problem: PartitionProblem, stage_of: Sequence[int], k: int) -> list[str]:
    """Nodes of stage ``k`` that leave it (for a later stage or the model's output) and
    are not batch-major tensors: a batch-split stage cannot hand them on, because each
    share would compute its own (``x.size(0)`` of its rows, a mean of its rows)."""
    if not problem.batch_major:
        return []
    leaves = set(problem.graph_outputs)
    leaves.update(u for u, v in problem.edges if stage_of[u] == k and stage_of[v] != k)
    return [
        problem.names[v]
        for v in sorted(leaves)
        if stage_of[v] == k and not problem.is_batch_major(v)
    ]


def batch_split_mixing(problem: PartitionProblem, stage_of: Sequence[int], k: int) -> list[str]:
    """Nodes of stage ``k`` that compute a tensor from several samples (a mean over the
    batch): a batch-split stage would compute each from one share's rows."""
    mixes = problem.mixes_batch or [False] * problem.n
    return [problem.names[v] for v in range(problem.n) if stage_of[v] == k and mixes[v]]


def batch_split_errors(problem: PartitionProblem, stage_of: Sequence[int], k: int) -> list[str]:
    """Why stage ``k`` may not be split by batch: the values it hands on that shares cannot
    join, and the nodes it holds that mix samples; empty: it may."""
    return [
        f"stage {k} is split by batch but hands on {name!r}, which is not a tensor with the "
        "batch as dim 0 (each share would compute its own)"
        for name in batch_split_exports(problem, stage_of, k)
    ] + [
        f"stage {k} is split by batch but holds {name!r}, which computes a tensor from "
        "several samples of the batch (each share would use only its own)"
        for name in batch_split_mixing(problem, stage_of, k)
    ]


def batch_split_refused(problem: PartitionProblem) -> list[tuple[int, int]]:
    """``(v, last)`` for every node ``v`` no batch-split chunk may hold: a chunk ``[a, b)``
    of the node order with ``a <= v < b <= last`` is refused. ``last``: the last reader
    of a value a split cannot hand on (``n`` when the model returns it), and ``n`` for a
    node that mixes samples (:func:`batch_split_mixing`): no chunk may hold it."""
    mixes = problem.mixes_batch or [False] * problem.n
    out = [(v, problem.n) for v in range(problem.n) if mixes[v]]
    if not problem.batch_major:
        return out
    last = [-1] * problem.n
    for u, v in problem.edges:
        last[u] = max(last[u], v)
    for v in problem.graph_outputs:
        last[v] = problem.n
    return out + [
        (v, last[v])
        for v in range(problem.n)
        if not problem.is_batch_major(v) and last[v] > v and not mixes[v]
    ]
