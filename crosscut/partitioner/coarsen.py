"""Coarsening: merge operator chains that no sensible plan would cut.

A traced ResNet-50 has ~180 nodes, most of them batch norms, ReLUs and views
glued to a conv. Giving the solver each of them multiplies variables without
adding a single useful cut, so the partitioner solves on the coarse graph and
maps the answer back with :func:`expand_assignment`. The merge rule is chosen
so that it can never hide a branch or a join (see :func:`coarsen`).
"""

from __future__ import annotations

from dataclasses import replace

from crosscut.errors import InputError
from crosscut.ir.graph import OpGraph, OpNode

__all__ = ["FOLLOWER_KINDS", "coarsen", "expand_assignment"]

#: Node kinds cheap enough, and tied enough to their producer, that no plan would
#: cut right before them: normalisations, activations, views, dropout, tuple access.
FOLLOWER_KINDS = frozenset(
    {
        "batch_norm", "layer_norm", "group_norm", "instance_norm", "local_response_norm",
        "relu", "relu6", "leaky_relu", "prelu", "rrelu", "silu", "gelu", "elu", "celu",
        "selu", "glu", "sigmoid", "hardsigmoid", "hardswish", "hardtanh", "tanh", "mish",
        "softplus", "view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze",
        "contiguous", "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
        "identity", "getitem", "getattr", "stochastic_depth",
    }
)  # fmt: skip


def _is_meta(n: OpNode) -> bool:
    """Nodes that carry no tensor data: parameter fetches and size/shape arithmetic."""
    return n.op == "get_attr" or (not n.is_io and not n.shapes)


def coarsen(graph: OpGraph) -> tuple[OpGraph, dict[str, list[str]]]:
    """Merge chains no sensible plan separates; return the coarse graph and coarse -> members.

    The rules of :func:`_coarsen_once` are applied until nothing merges: folding
    size arithmetic into its reader can expose a chain the first pass could not
    see (``conv -> size -> batch_norm``), and a coarse graph should not coarsen
    further. Members always name nodes of the original ``graph``.
    """
    coarse, mapping = _coarsen_once(graph)
    while True:
        again, mapping_again = _coarsen_once(coarse)
        if len(again) == len(coarse):
            return coarse, mapping
        coarse, mapping = again, mapping_again


def _coarsen_once(graph: OpGraph) -> tuple[OpGraph, dict[str, list[str]]]:
    """One pass of the merge rules.

    Why only chains: a node ``v`` in :data:`FOLLOWER_KINDS` joins its producer
    ``u`` only when ``u``'s sole consumer is ``v`` and ``u`` is ``v``'s sole data
    input, so every cut the coarse graph loses is a cut through a single edge in
    the middle of a conv-bn-relu chain, never one at a branch or join. Parameter
    fetches and size arithmetic (no tensor output) join the group that reads them
    when exactly one group does.
    Placeholders and the output stay alone. A coarse node is named after its
    first data member, sits where its last member sat (still topological: only
    the last member has consumers outside), sums FLOPs, bytes and parameters,
    and keeps the last member's output shapes and bytes.
    """
    succ = graph.successors()
    group = {n.name: n.name for n in graph.nodes}

    def find(x: str) -> str:
        while group[x] != x:
            group[x] = group[group[x]]
            x = group[x]
        return x

    for v in graph.nodes:
        if v.is_io:
            continue
        data_ins = [u for u in v.inputs if not _is_meta(graph.node(u))]
        if v.kind in FOLLOWER_KINDS and len(data_ins) == 1:
            u = graph.node(data_ins[0])
            if not u.is_io and not _is_meta(u) and succ[u.name] == [v.name]:
                group[find(v.name)] = find(u.name)
    # after the chains, so a fetch read by one whole chain joins it; consumers first, so
    # size arithmetic on a fetch joins before the fetch is considered
    for g in reversed(graph.nodes):
        heads = {find(s) for s in succ[g.name]}
        if _is_meta(g) and len(heads) == 1:
            head = heads.pop()
            if not graph.node(head).is_io:  # the output node stays alone
                group[find(g.name)] = head

    members: dict[str, list[str]] = {}
    for n in graph.nodes:
        members.setdefault(find(n.name), []).append(n.name)
    ordered = sorted(members.values(), key=lambda ms: graph.index(ms[-1]))
    rename: dict[str, str] = {}
    for ms in ordered:
        head = next((m for m in ms if not _is_meta(graph.node(m))), ms[0])
        for m in ms:
            rename[m] = head
    nodes = [_merge(graph, ms, rename) for ms in ordered]
    mapping = {n.name: n.members for n in nodes}
    ties: list[list[str]] = []
    for tie in graph.ties:
        names = list(dict.fromkeys(rename[t] for t in tie))
        if len(names) > 1:
            ties.append(names)
    coarse = replace(graph, nodes=nodes, ties=ties, leaves=dict(graph.leaves))
    coarse.lint()
    return coarse, mapping


def _merge(graph: OpGraph, names: list[str], rename: dict[str, str]) -> OpNode:
    """One coarse node from ``names`` (topological order)."""
    parts = [graph.node(m) for m in names]
    head = graph.node(rename[names[0]])
    last = parts[-1]
    inside = set(names)
    inputs = [rename[i] for p in parts for i in p.inputs if i not in inside]
    kinds = [p.kind for p in parts if not _is_meta(p)] or [head.kind]
    originals = [o for p in parts for o in (p.members or [p.name])]
    return OpNode(
        name=head.name,
        op=head.op,
        kind="+".join(kinds),
        target=head.target,
        inputs=list(dict.fromkeys(inputs)),
        shapes=[list(s) for s in last.shapes],
        dtype=last.dtype,
        out_bytes=last.out_bytes,
        param_bytes=sum(p.param_bytes for p in parts),
        buffer_bytes=sum(p.buffer_bytes for p in parts),
        params=list(dict.fromkeys(q for p in parts for q in p.params)),
        fwd_flops=sum(p.fwd_flops for p in parts),
        bwd_flops=sum(p.bwd_flops for p in parts),
        read_bytes=sum(p.read_bytes for p in parts),
        module_path=head.module_path,
        members=originals,
        leaf_reason=next((p.leaf_reason for p in parts if p.leaf_reason), None),
    )


def expand_assignment(
    mapping: dict[str, list[str]], coarse_assignment: dict[str, int]
) -> dict[str, int]:
    """Give every original node the stage (or device) of the coarse node that holds it."""
    out: dict[str, int] = {}
    for name, stage in coarse_assignment.items():
        if name not in mapping:
            raise InputError(
                "every assigned name must be a coarse node from coarsen()",
                value=name,
                remedy="pass the mapping returned together with the coarse graph",
            )
        for member in mapping[name]:
            out[member] = stage
    return out
