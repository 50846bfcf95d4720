"""The group DP's stage prices as chunk matrices: entry ``[a, b]`` prices nodes ``a..b-1``.

:mod:`crosscut.partitioner.solvers.cross` searches stage boundaries with a
min-max DP; every stage it considers is a chunk ``[a, b)`` of the node order
on a group of devices. These tables hold, for every chunk at once, the
quantities :func:`crosscut.partitioner.evaluate.evaluate` computes for one
stage (compute on the busiest group device, memory on the leader and on the
other devices, collectives and transfers), written on prefix sums so that a
shape (width, split) costs a handful of numpy operations instead of a loop
over chunks. They are exact on chains with uniform links; the DP re-prices its
candidates with evaluate() anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from crosscut.ir.problem import PartitionProblem, StageGroup
from crosscut.partitioner.evaluate import comm_multiplier, consumers
from crosscut.partitioner.group_costs import group_link, node_compute, node_share
from crosscut.partitioner.solvers.baselines import _comm_matrices

__all__ = ["ChunkTables", "StageShape"]


def _span(n: int, items: list[tuple[int, int, float]]) -> np.ndarray:
    """``M[a, b] = Σ val`` over items ``(u, last, val)`` with ``a <= u < b <= last``."""
    mat = np.zeros((n + 2, n + 2))
    for u, last, val in items:
        mat[0, u + 1] += val
        mat[0, last + 1] -= val
        mat[u + 1, u + 1] -= val
        mat[u + 1, last + 1] += val
    return np.cumsum(np.cumsum(mat, axis=0), axis=1)[: n + 1, : n + 1]


def _inside_before(n: int, items: list[tuple[int, int, float]]) -> np.ndarray:
    """``M[a, b] = Σ val`` over items ``(u, first, val)`` with ``a <= u`` and ``first < b``."""
    mat = np.zeros((n + 2, n + 2))
    for u, first, val in items:
        mat[0, first + 1] += val
        mat[u + 1, first + 1] -= val
    return np.cumsum(np.cumsum(mat, axis=0), axis=1)[: n + 1, : n + 1]


def _received(n: int, cons: list[list[int]], out: list[float]) -> np.ndarray:
    """``M[a, b] = Σ out[u]`` over ``u < a`` with a consumer (of ``cons[u]``) in ``[a, b)``."""
    return _read_in(n, [(u + 1, cs, out[u]) for u, cs in enumerate(cons)])


def _read_in(n: int, items: list[tuple[int, list[int], float]]) -> np.ndarray:
    """``M[a, b] = Σ val`` over items ``(start, readers, val)`` with ``start <= a`` and a
    reader in ``[a, b)`` (``readers`` sorted)."""
    mat = np.zeros((n + 1, n + 2))
    for start, cs, val in items:
        if not cs:
            continue
        arr = np.asarray(cs)
        rows = np.arange(start, cs[-1] + 1)
        nxt = arr[np.searchsorted(arr, rows)]
        np.add.at(mat, (rows, nxt + 1), val)
    return np.cumsum(mat, axis=1)[:, : n + 1]


@dataclass
class ChunkTables:
    """Prefix sums and chunk matrices shared by every stage shape."""

    problem: PartitionProblem
    cons: list[list[int]]
    rc: np.ndarray
    rb: np.ndarray
    sc: np.ndarray
    sb: np.ndarray
    chan: tuple[np.ndarray, np.ndarray]  # channel split: (count, bytes) of collectives
    io: tuple[np.ndarray, np.ndarray]  # batch split: (count, bytes) of model inputs/outputs
    # the latencies the link between stages charges for what ``rc``/``sc`` count: a value
    # is one collective inside a group but a message per leaf (and mask) on that link
    rl: np.ndarray
    sl: np.ndarray

    @classmethod
    def build(cls, pb: PartitionProblem) -> ChunkTables:
        n, cons = pb.n, consumers(pb)
        rc, rb, sc, sb = _comm_matrices(pb)
        rl, _, sl, _ = _comm_matrices(pb, [pb.latencies(u) for u in range(n)])
        sharded = [pb.shard_of(u) != "full" for u in range(n)]
        needs = [any(pb.shard_of(v) != "channel" for v in cons[u]) for u in range(n)]
        items: list[tuple[int, int, float]] = []
        counts: list[tuple[int, int, float]] = []
        fixed_b = np.zeros(n + 1)
        fixed_c = np.zeros(n + 1)
        for u in range(n):
            if sharded[u] and needs[u]:
                fixed_b[u + 1] += pb.out_bytes[u]
                fixed_c[u + 1] += 1.0
            elif sharded[u] and cons[u]:
                items.append((u, cons[u][-1], float(pb.out_bytes[u])))
                counts.append((u, cons[u][-1], 1.0))
        pre_b, pre_c = np.cumsum(fixed_b), np.cumsum(fixed_c)
        gather_b = pre_b[None, :] - pre_b[:, None] + _span(n, items)
        gather_c = pre_c[None, :] - pre_c[:, None] + _span(n, counts)
        split_cons = [[v for v in cs if pb.shard_of(v) == "split"] for cs in cons]
        recv_b = _received(n, split_cons, [float(b) for b in pb.out_bytes])
        recv_c = _received(n, split_cons, [1.0] * n)
        whole = [(u, sc_[0]) for u, sc_ in enumerate(split_cons) if sc_ and not sharded[u]]
        bcast_b = _inside_before(n, [(u, f, float(pb.out_bytes[u])) for u, f in whole])
        bcast_c = _inside_before(n, [(u, f, 1.0) for u, f in whole])
        # a batch-split chunk scatters the model inputs it reads and gathers the model
        # outputs no later chunk reads (those are counted in ``sb`` already)
        ins = [(0, sorted(cs), float(b)) for b, cs in pb.graph_inputs]
        outs = [(u, cons[u][-1] if cons[u] else u) for u in pb.graph_outputs]
        out_b = [(u, f, float(pb.out_bytes[u])) for u, f in outs]
        io_b = _read_in(n, ins) + _inside_before(n, out_b)
        io_c = _read_in(n, [(s, cs, 1.0) for s, cs, _ in ins]) + _inside_before(
            n, [(u, f, 1.0) for u, f, _ in out_b]
        )
        chan = (gather_c + recv_c + bcast_c, gather_b + recv_b + bcast_b)
        return cls(pb, cons, rc, rb, sc, sb, chan, (io_c, io_b), rl, sl)


def _prefix(values: list[float]) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=float))])


def _diff(pre: np.ndarray) -> np.ndarray:
    out: np.ndarray = pre[None, :] - pre[:, None]
    return out


class StageShape:
    """Chunk matrices of one stage shape (devices, split), independent of the stage index."""

    def __init__(self, tb: ChunkTables, group: StageGroup) -> None:
        pb = tb.problem
        self.group = group
        shares = [node_share(pb, v, group) for v in range(pb.n)]
        full = [group.split == "channel" and pb.shard_of(v) == "full" for v in range(pb.n)]
        cmp = None
        for d in group.devices:
            lead = d == group.leader
            col = _prefix(
                [
                    node_compute(pb, v, d, group, shares[v]) if lead or not full[v] else 0.0
                    for v in range(pb.n)
                ]
            )
            cmp = _diff(col) if cmp is None else np.maximum(cmp, _diff(col))
        assert cmp is not None
        self.compute = cmp
        chan = group.split == "channel"
        self.res_shared = _diff(
            _prefix(
                [pb.resident[v] * (shares[v] if chan else 1.0) * (not full[v]) for v in range(pb.n)]
            )
        )
        self.act_shared = _diff(
            _prefix([pb.activation[v] * shares[v] * (not full[v]) for v in range(pb.n)])
        )
        self.res_full = _diff(_prefix([pb.resident[v] * full[v] for v in range(pb.n)]))
        self.act_full = _diff(_prefix([pb.activation[v] * full[v] for v in range(pb.n)]))
        self.coll = np.zeros_like(cmp)
        w = group.width
        if w > 1:
            bw, lat = group_link(pb, group.devices)
            frac = (w - 1) / w
            mult = comm_multiplier(pb)
            if group.split == "batch":
                cnt, byt = tb.rc + tb.sc + tb.io[0], tb.rb + tb.sb + tb.io[1]
            else:
                cnt, byt = tb.chan
            self.coll = mult * (cnt * lat + byt * frac / bw)
            if pb.training and group.split == "batch":
                grads = _diff(_prefix([float(pb.grad_bytes(v)) for v in range(pb.n)]))
                ring = 2 * frac * grads / bw + np.where(grads > 0, 2 * (w - 1) * lat, 0.0)
                self.coll = self.coll + ring / max(1, pb.microbatches)
        self.batch_share = shares[0] if group.split == "batch" and pb.n else 1.0

    def memory(self, tb: ChunkTables, af: int, bf: int) -> tuple[np.ndarray, np.ndarray]:
        """Bytes on the leader and on each other device for every chunk ``[a, b)``."""
        shared = self.res_shared + af * self.act_shared
        leader = shared + self.res_full + af * self.act_full + bf * tb.rb
        if self.group.split == "batch":
            return leader, shared + bf * tb.rb * self.batch_share
        return leader, shared
