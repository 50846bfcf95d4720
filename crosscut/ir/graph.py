"""OpGraph: the model as a DAG of operators, the one IR every stage reads.

An :class:`OpGraph` is plain data: one :class:`OpNode` per torch.fx node (in a
deterministic topological order), the bytes each node produces, the parameter
and buffer bytes it owns, and its analytic FLOPs. It deliberately holds no
torch objects except the optional ``gm`` back-reference, which codegen uses to
rewrite the real module and which is never serialised.

Why one node per fx node rather than per ``nn.Module``: skip connections,
``torch.cat`` and ``+`` are functions, not modules, and the partitioner must be
able to cut around them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from crosscut.errors import InputError

__all__ = ["MODES", "GraphLintError", "OpGraph", "OpNode"]

#: what a graph was traced for: training (forward and backward) or inference
MODES = ("train", "infer")


class GraphLintError(InputError):
    """An OpGraph broke one of its invariants; the message names the node."""


@dataclass
class OpNode:
    """One operator.

    ``inputs`` names the producer nodes whose outputs this node reads, in
    argument order, without repeats. ``out_bytes`` is the size of everything the
    node returns for the traced batch. ``param_bytes`` counts a parameter shared
    by several nodes once, at the first node in topological order that uses it;
    the others list it in ``params`` too and are tied together in
    :attr:`OpGraph.ties`.
    """

    name: str
    op: str  # fx opcode: placeholder, get_attr, call_module, call_function, call_method, output
    kind: str  # short family name: conv2d, linear, batch_norm, relu, add, cat, view, ...
    target: str  # module path for call_module, function or method name otherwise
    inputs: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)  # one shape per tensor output
    dtype: str = "float32"
    out_bytes: int = 0
    param_bytes: int = 0
    buffer_bytes: int = 0
    params: list[str] = field(default_factory=list)  # qualified names of params/buffers read
    fwd_flops: int = 0
    bwd_flops: int = 0
    read_bytes: int = 0  # bytes read by the forward (inputs + weights)
    module_path: str = ""  # owning submodule path, for grouping in the visualizer
    members: list[str] = field(default_factory=list)  # original nodes, for coarse graphs
    leaf_reason: str | None = None  # set when a submodule was made a leaf automatically
    # its value holds something besides tensors (an int from ``x.size(0)``, a shape,
    # None): a batch split cannot join such a value from its shares
    non_tensor: bool = False
    # a convolution's geometry, as the cost model's rates need it (which kernels cuDNN can
    # run: Winograd for dense 3x3 stride 1; groups): groups, kernel, stride, dilation,
    # transposed; None for every other op
    conv: dict[str, Any] | None = None
    # a max pool's window, kernel and stride (its backward reads every window covering
    # an input element); None for every other op
    pool: dict[str, Any] | None = None

    @property
    def is_io(self) -> bool:
        """Placeholders and the output node carry no compute."""
        return self.op in ("placeholder", "output")


@dataclass
class OpGraph:
    """A DAG of :class:`OpNode` in deterministic topological order."""

    nodes: list[OpNode]
    batch_size: int = 1
    mode: str = "train"
    ties: list[list[str]] = field(default_factory=list)  # node groups sharing a parameter
    leaves: dict[str, str] = field(default_factory=dict)  # auto-leaf module path -> reason
    model_name: str = ""
    precision: str = "fp32"  # the autocast the shapes were propagated under (precision.py)
    # the model's convolutions run channels-last (NHWC): their weights, or the input, are so
    # laid out; PyTorch's default is NCHW (priced in cost_models/analytic.py: transposes)
    channels_last: bool = False
    # nodes a run on a few rows found mixing samples (frontend/row_probe.py); None: not probed
    row_mixing: list[str] | None = None
    gm: Any = field(default=None, repr=False, compare=False)  # torch.fx.GraphModule, not serialised
    _index: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._reindex()

    def _reindex(self) -> None:
        self._index = {n.name: i for i, n in enumerate(self.nodes)}

    # ---- lookups -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[OpNode]:
        return iter(self.nodes)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def node(self, name: str) -> OpNode:
        """The node called ``name``; a clear error if there is none."""
        try:
            return self.nodes[self._index[name]]
        except KeyError:
            raise InputError(
                "every node name must exist in the graph",
                value=name,
                remedy="use a name from OpGraph.nodes (fx node names, e.g. 'layer1_0_conv1')",
            ) from None

    def index(self, name: str) -> int:
        """Topological position of ``name``."""
        self.node(name)
        return self._index[name]

    def edges(self) -> list[tuple[str, str]]:
        """(producer, consumer) pairs, in consumer order then argument order."""
        return [(src, n.name) for n in self.nodes for src in n.inputs]

    def successors(self) -> dict[str, list[str]]:
        """Map from each node to the nodes that read its output, in topological order."""
        succ: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for src, dst in self.edges():
            succ[src].append(dst)
        return succ

    def compute_nodes(self) -> list[OpNode]:
        """Nodes that are neither placeholders nor the output."""
        return [n for n in self.nodes if not n.is_io]

    @property
    def total_param_bytes(self) -> int:
        return sum(n.param_bytes for n in self.nodes)

    @property
    def total_fwd_flops(self) -> int:
        return sum(n.fwd_flops for n in self.nodes)

    # ---- invariants ----------------------------------------------------------------
    def lint(self) -> None:
        """Check the invariants every pass must keep, naming the offender.

        Unique names; inputs refer to earlier nodes (topological order); no
        negative sizes; ties refer to existing nodes; exactly one output node,
        last. Call after every pass in tests (torch.fx ``Graph.lint()`` habit).
        """
        seen: set[str] = set()
        outputs = [n.name for n in self.nodes if n.op == "output"]
        if len(outputs) != 1 or self.nodes[-1].op != "output":
            raise GraphLintError(
                "an OpGraph has exactly one output node, and it is last",
                value=outputs,
                remedy="rebuild the graph with crosscut.trace()",
            )
        for n in self.nodes:
            if n.name in seen:
                raise GraphLintError(
                    f"node names are unique; {n.name!r} appears twice", value=n.name
                )
            for src in n.inputs:
                if src not in seen:
                    raise GraphLintError(
                        f"node {n.name!r} reads {src!r}, which is not an earlier node "
                        "(nodes must be in topological order)",
                        value=src,
                        remedy="re-sort the graph or fix the input name",
                    )
            if len(set(n.inputs)) != len(n.inputs):
                raise GraphLintError(f"node {n.name!r} lists an input twice", value=n.inputs)
            for attr in ("out_bytes", "param_bytes", "buffer_bytes", "fwd_flops", "bwd_flops"):
                if getattr(n, attr) < 0:
                    raise GraphLintError(
                        f"node {n.name!r} has negative {attr}", value=getattr(n, attr)
                    )
            seen.add(n.name)
        for group in self.ties:
            for name in group:
                if name not in seen:
                    raise GraphLintError(f"a tie group names unknown node {name!r}", value=group)
        if self._index != {n.name: i for i, n in enumerate(self.nodes)}:
            raise GraphLintError("the name index is stale", remedy="call _reindex() after editing")

    # ---- identity and serialisation --------------------------------------------------
    def fingerprint(self) -> str:
        """A hash of structure, shapes and parameter sizes (not values, not costs).

        Two models with the same architecture and input shape share it, so a
        plan can be replayed on a fresh instance but not on a different model.
        """
        h = hashlib.sha256()
        for n in self.nodes:
            h.update(
                json.dumps(
                    [n.name, n.op, n.kind, n.target, n.inputs, n.shapes, n.dtype, n.param_bytes],
                    separators=(",", ":"),
                ).encode()
            )
        return h.hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "batch_size": self.batch_size,
            "mode": self.mode,
            "ties": self.ties,
            "leaves": self.leaves,
            "precision": self.precision,
            "channels_last": self.channels_last,
            "row_mixing": self.row_mixing,
            "nodes": [asdict(n) for n in self.nodes],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OpGraph:
        return cls(
            nodes=[OpNode(**n) for n in data["nodes"]],
            batch_size=int(data.get("batch_size", 1)),
            mode=str(data.get("mode", "train")),
            ties=[list(t) for t in data.get("ties", [])],
            leaves=dict(data.get("leaves", {})),
            model_name=str(data.get("model_name", "")),
            precision=str(data.get("precision", "fp32")),
            channels_last=bool(data.get("channels_last", False)),
            row_mixing=None if data.get("row_mixing") is None else list(data["row_mixing"]),
        )

    def subgraph_names(self, names: Sequence[str]) -> list[str]:
        """``names`` sorted in this graph's topological order."""
        return sorted(names, key=self.index)
