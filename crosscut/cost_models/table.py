"""CostTable: what every node costs, per device kind — the cost model's one output.

Times are keyed by device *kind* (``"V100"``, ``"cpu"``), not device name:
eight identical GPUs share one column, and a profiled table measured on one
``cuda:0`` prices all of them. Memory is per node and device-independent.
The partitioner reads it through ``fwd_s / bwd_s / resident_bytes /
activation_bytes`` (``partitioner.build.CostLookup``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from crosscut.errors import CostModelError
from crosscut.fileio import parse_json, read_json, write_atomic

__all__ = ["CostTable", "NodeCost"]

SOURCES = ("analytic", "profiled", "mixed")


@dataclass
class NodeCost:
    """One node: seconds per kind for forward and backward, bytes it keeps."""

    fwd: dict[str, float] = field(default_factory=dict)
    bwd: dict[str, float] = field(default_factory=dict)
    resident: int = 0  # params, buffers (+ grads + optimizer state in train mode)
    activation: int = 0  # bytes saved for backward per micro-batch (0 in infer mode)
    # samples (a string, as JSON keys are) -> kind -> how much slower per sample the node
    # runs on that many samples of its micro-batch: what a batch-split group's share costs
    # (``CostTable.with_share_scales``); absent: its share of the time, linearly
    share_scale: dict[str, dict[str, float]] = field(default_factory=dict)
    # channel-split width (a string) -> kind -> how much more than 1/w of the node's time
    # one of w channel shards takes (analytic.channel_scales); absent: priced linearly
    channel_scale: dict[str, dict[str, float]] = field(default_factory=dict)
    # kind -> (B, W): the two passes of a split backward (zero-bubble schedules) as
    # fractions of ``bwd``, measured (context.measure_split); they may sum past 1, as the
    # passes repeat work. Absent: simulate.backward_split prices the split by rule
    split: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass
class CostTable:
    """Per-node costs for one graph. ``source`` says where the times came from."""

    nodes: dict[str, NodeCost] = field(default_factory=dict)
    source: str = "analytic"
    mode: str = "train"
    optimizer: str = "sgd"
    meta: dict[str, Any] = field(default_factory=dict)

    # ---- lookups (partitioner.build.CostLookup) ------------------------------------
    def _get(self, name: str) -> NodeCost:
        try:
            return self.nodes[name]
        except KeyError:
            raise CostModelError(
                "every node priced must be in the cost table",
                value=name,
                remedy="rebuild the table from the same OpGraph (analytic_costs / profile_costs)",
            ) from None

    def _time(self, table: dict[str, float], name: str, kind: str) -> float:
        if kind not in table:
            raise CostModelError(
                f"node {name!r} has no time for device kind {kind!r}",
                value=sorted(table),
                remedy="price the table for every kind in the cluster, or merge a profiled table",
            )
        return table[kind]

    def fwd_s(self, name: str, kind: str) -> float:
        return self._time(self._get(name).fwd, name, kind)

    def bwd_s(self, name: str, kind: str) -> float:
        return self._time(self._get(name).bwd, name, kind)

    def bwd_split(self, name: str, kind: str) -> tuple[float, float] | None:
        """(B, W) fractions of ``name``'s backward on ``kind`` when split; None: not measured."""
        return self._get(name).split.get(kind)

    def memory_rate(self, kind: str) -> float | None:
        """The memory rate (bytes/s, a peak) measured where ``kind`` was profiled; None:
        not measured (analytic tables take the preset's)."""
        rate = self.meta.get("mem_bw", {}).get(kind)
        return float(rate) if rate else None

    def resident_bytes(self, name: str) -> int:
        return self._get(name).resident

    def activation_bytes(self, name: str) -> int:
        return self._get(name).activation

    def batch_scale(self, name: str) -> dict[str, dict[str, float]]:
        """``NodeCost.share_scale`` of ``name``: samples -> kind -> per-sample slowdown."""
        return self._get(name).share_scale

    def channel_share_scale(self, name: str) -> dict[str, dict[str, float]]:
        """``NodeCost.channel_scale`` of ``name``: width -> kind -> shard slowdown."""
        return self._get(name).channel_scale

    def with_channel_scales(self, scales: dict[str, dict[str, dict[str, float]]]) -> CostTable:
        """A copy whose nodes know what one channel shard costs (``analytic.channel_scales``:
        node -> width -> kind -> scale); nodes it does not name keep theirs."""
        out = {
            name: replace(c, channel_scale={**c.channel_scale, **scales.get(name, {})})
            for name, c in self.nodes.items()
        }
        return CostTable(out, self.source, self.mode, self.optimizer, dict(self.meta))

    def with_share_scales(self, smaller: dict[int, CostTable], batch: int) -> CostTable:
        """A copy that knows what each node costs on fewer samples than ``batch``.

        ``smaller[s]`` prices the same graph traced at ``s`` samples. A
        batch-split group of ``w`` devices runs ``ceil(batch / w)`` samples on
        each, and small batches use a device less well (lower arithmetic
        intensity, fixed launch costs), so a share costs more than its
        fraction of the whole: the scale is ``time(s) / (time(batch) · s /
        batch)`` per node and kind, training time (forward + backward) as the
        table's mode has it. Nodes missing from a smaller table, or with no
        time, keep no scale (priced linearly).
        """
        training = self.mode == "train"
        out: dict[str, NodeCost] = {}
        for name, c in self.nodes.items():
            scales = dict(c.share_scale)
            for s, table in sorted(smaller.items()):
                other = table.nodes.get(name)
                if other is None or not 0 < s < batch:
                    continue
                by_kind: dict[str, float] = {}
                for kind in sorted(set(c.fwd) & set(other.fwd)):
                    full = c.fwd[kind] + (c.bwd.get(kind, 0.0) if training else 0.0)
                    part = other.fwd[kind] + (other.bwd.get(kind, 0.0) if training else 0.0)
                    if full > 0 and part > 0:
                        by_kind[kind] = part / (full * s / batch)
                if by_kind:
                    scales[str(s)] = by_kind
            out[name] = replace(c, share_scale=scales)
        return CostTable(out, self.source, self.mode, self.optimizer, dict(self.meta))

    def node_time(self, name: str, kind: str, training: bool) -> float:
        """Forward time, plus backward when ``training``."""
        t = self.fwd_s(name, kind)
        return t + self.bwd_s(name, kind) if training else t

    def total(self, kind: str, mode: str | None = None) -> float:
        """Sum over nodes of forward (+ backward when ``mode == "train"``) on ``kind``."""
        training = (mode or self.mode) == "train"
        return sum(self.node_time(n, kind, training) for n in self.nodes)

    @property
    def kinds(self) -> list[str]:
        """Device kinds every node has a time for."""
        sets = [set(c.fwd) for c in self.nodes.values()]
        return sorted(set.intersection(*sets)) if sets else []

    def merge(self, other: CostTable) -> CostTable:
        """A new table with ``other``'s times added (``other`` wins on a shared kind)."""
        if set(other.nodes) != set(self.nodes):
            raise CostModelError(
                "merged cost tables must price the same nodes",
                value=sorted(set(other.nodes) ^ set(self.nodes))[:10],
                remedy="build both tables from the same OpGraph",
            )
        out: dict[str, NodeCost] = {}
        for name, c in self.nodes.items():
            o = other.nodes[name]
            out[name] = NodeCost(
                {**c.fwd, **o.fwd},
                {**c.bwd, **o.bwd},
                c.resident,
                c.activation,
                c.share_scale,
                c.channel_scale,
                {**c.split, **o.split},
            )
        source = self.source if self.source == other.source else "mixed"
        meta = {**self.meta, **other.meta}
        if "priced" in self.meta or "priced" in other.meta:  # per kind: the other's kinds win
            meta["priced"] = {**self.meta.get("priced", {}), **other.meta.get("priced", {})}
        if "mem_bw" in self.meta or "mem_bw" in other.meta:  # per kind, as "priced"
            meta["mem_bw"] = {**self.meta.get("mem_bw", {}), **other.meta.get("mem_bw", {})}
        if "spread" in self.meta or "spread" in other.meta:  # the noisier profile counts
            meta["spread"] = max(self.meta.get("spread", 0.0), other.meta.get("spread", 0.0))
        return CostTable(out, source, self.mode, self.optimizer, meta)

    # ---- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "source": self.source,
            "mode": self.mode,
            "optimizer": self.optimizer,
            "meta": self.meta,
            "nodes": {k: asdict(v) for k, v in self.nodes.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostTable:
        try:
            nodes = {
                str(k): NodeCost(
                    fwd={str(a): float(b) for a, b in v["fwd"].items()},
                    bwd={str(a): float(b) for a, b in v["bwd"].items()},
                    resident=int(v["resident"]),
                    activation=int(v["activation"]),
                    share_scale=_scales(v.get("share_scale", {})),
                    channel_scale=_scales(v.get("channel_scale", {})),
                    split=_pairs(v.get("split", {})),
                )
                for k, v in data["nodes"].items()
            }
            _check_times(nodes)
            return cls(
                nodes=nodes,
                source=str(data["source"]),
                mode=str(data.get("mode", "train")),
                optimizer=str(data.get("optimizer", "sgd")),
                meta=dict(data.get("meta", {})),
            )
        except CostModelError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CostModelError(
                "a cost table JSON needs 'source' and 'nodes' with fwd, bwd, resident, activation",
                value=repr(exc),
                remedy="regenerate it with CostTable.to_json()",
            ) from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CostTable:
        return cls.from_dict(parse_json(text, CostModelError, "a cost table file"))

    def save(self, path: str | Path) -> None:
        write_atomic(path, self.to_json(), "the cost table")

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        return cls.from_dict(read_json(path, CostModelError, "a cost table file"))


def _scales(data: Any) -> dict[str, dict[str, float]]:
    """A ``share_scale`` / ``channel_scale`` mapping read back from JSON."""
    return {str(n): {str(a): float(b) for a, b in by.items()} for n, by in data.items()}


def _pairs(data: Any) -> dict[str, tuple[float, float]]:
    """A ``split`` mapping (kind -> [B, W]) read back from JSON."""
    return {str(k): (float(b), float(w)) for k, (b, w) in data.items()}


MAX_OP_SECONDS = 3600.0
"""No single operator of one micro-batch takes an hour: a larger time is corruption."""


MAX_SPLIT = 10.0
"""No pass of a split backward takes ten times the whole backward."""


def _check_times(nodes: dict[str, NodeCost]) -> None:
    """Every time is finite, not negative and under an hour; every byte count not negative."""
    for name, c in nodes.items():
        for what, times in (("fwd", c.fwd), ("bwd", c.bwd)):
            for kind, t in times.items():
                if not (math.isfinite(t) and 0.0 <= t <= MAX_OP_SECONDS):
                    raise CostModelError(
                        f"node {name!r} has {what} time {t} s on {kind}: times must be finite, "
                        f"not negative and under {MAX_OP_SECONDS:.0f} s",
                        value=t,
                        remedy="delete the file and profile again (the cache was corrupted or "
                        "edited)",
                    )
        for kind, pair in c.split.items():
            if not all(math.isfinite(f) and 0.0 <= f <= MAX_SPLIT for f in pair):
                raise CostModelError(
                    f"node {name!r} has backward split {pair} on {kind}: each pass is a "
                    f"fraction of the backward between 0 and {MAX_SPLIT}",
                    value=pair,
                    remedy="delete the file and profile again (the cache was corrupted or edited)",
                )
        if c.resident < 0 or c.activation < 0:
            raise CostModelError(
                f"node {name!r} has negative bytes", value=(c.resident, c.activation)
            )
