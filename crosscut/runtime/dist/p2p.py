"""Point-to-point messaging between pipeline ranks, with timeouts and named failures.

Why a layer of its own: every send and receive of the distributed executor
must (a) be matched with its partner by a tag both sides compute from static
data, (b) be waited on with a bounded timeout, and (c) turn gloo/NCCL's raw
``RuntimeError`` ("Connection closed by peer", "Timed out waiting 3000ms") into
a :class:`~crosscut.errors.DistributedError` that names the rank that was lost
and what this rank was doing when it noticed. Keeping that here leaves the
executor to read like its schedule.

The routes (which value goes from which stage to which, its shapes from the
trace, its tags, whether a gradient comes back) live here too: they are the
static half of the same contract between two ranks.

Root cause across a cascade: when rank 2 dies, rank 1 notices first; rank 0,
waiting on rank 1, only sees rank 1 go away. The first rank to notice a loss
writes one line into the job's c10d store (best effort, short timeout), and
every later failure quotes it, so every rank's error names the rank that was
really lost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.utils import _pytree as pytree

from crosscut.errors import DistributedError

__all__ = [
    "FAILURE_KEY",
    "Edge",
    "Messenger",
    "PendingRecv",
    "Routes",
    "build_routes",
    "describe_failure",
    "grad_free",
    "traced_value",
]

FAILURE_KEY = "crosscut/first_failure"
"""c10d store key of the first loss any rank noticed (see the module docstring)."""


def traced_value(nodes: Mapping[str, fx.Node], name: str, what: str) -> Any:
    """The traced value (``meta["val"]``) of node ``name``: the shape both ends of a
    message agree on; ``what`` names the value when the trace has no shapes."""
    val = nodes[name].meta.get("val") if name in nodes else None
    if val is None:
        raise DistributedError(
            f"the shape of {what} is unknown",
            remedy="compile with crosscut.distributed.compile_distributed, which traces "
            "the model with shapes",
        )
    return val


def describe_failure(exc: BaseException, timeout_s: float) -> str:
    """A plain-words reason from a backend exception's text."""
    text = str(exc)
    low = text.lower()
    if "closed" in low or "reset by peer" in low or "broken pipe" in low or "eof" in low:
        return "closed its connection (its process died or exited)"
    if "timed out" in low or "timeout" in low:
        return f"did not answer within {timeout_s:g} s (hung, or itself waiting on a lost rank)"
    return f"failed ({text.splitlines()[0][:200] if text else type(exc).__name__})"


@dataclass
class PendingRecv:
    """Buffers posted for one value from one peer, and the requests filling them."""

    value: str
    peer: int
    what: str
    tensors: list[torch.Tensor]
    works: list[Any] = field(default_factory=list)
    loop_tags: list[int] = field(default_factory=list)  # a message from this rank to itself


class Messenger:
    """Posts tagged isend/irecv for one rank and waits on them with a timeout.

    Sends are not waited on at once (gloo completes a send only once the peer
    has posted the matching receive); they are kept, with their tensors alive,
    until :meth:`drain` or :meth:`flush`.

    A message to this rank itself (an interleaved schedule's value from stage
    ``s`` to stage ``s + W``, both on this rank) never reaches the backend,
    which refuses a send to oneself: it is kept by tag until its receive is
    waited on, which the schedule's order puts after the send.
    """

    def __init__(self, rank: int, timeout_s: float, describe_self: str) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.timeout = timedelta(seconds=timeout_s)
        self.me = describe_self
        self._sends: list[tuple[Any, torch.Tensor, int, str]] = []
        self._loop: dict[int, torch.Tensor] = {}  # tag -> a message to this rank itself

    # ---- failures ------------------------------------------------------------------
    def _store(self) -> Any:
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            return _get_default_store()
        except Exception:  # no store (not initialised, or a backend without one)
            return None

    def lost(self, peer: int | None, what: str, exc: BaseException) -> DistributedError:
        """The error to raise when talking to ``peer`` about ``what`` failed with ``exc``."""
        reason = describe_failure(exc, self.timeout_s)
        who = f"rank {peer}" if peer is not None else "a peer rank"
        rule = f"{who} lost: it {reason} while {self.me} waited for {what}"
        root = self._first_failure(rule)
        if root and root != rule:
            rule += f"; first failure reported in this job: {root}"
        return DistributedError(
            rule,
            value=str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__,
            remedy=f"check the log of {who} (and of the first failure above) for its own "
            "error; a rank that is merely slow needs a larger timeout_s",
        )

    def _first_failure(self, mine: str) -> str:
        """Publish ``mine`` as the job's first failure unless one is there; return it."""
        store = self._store()
        if store is None:
            return ""
        try:
            store.set_timeout(timedelta(seconds=2))
            if store.check([FAILURE_KEY]):
                return bytes(store.get(FAILURE_KEY)).decode(errors="replace")
            store.set(FAILURE_KEY, mine)
        except Exception:  # the store's host may be the rank that died
            return ""
        return mine

    # ---- messages ------------------------------------------------------------------
    def post_recv(
        self,
        value: str,
        peer: int,
        tags: list[int],
        templates: list[torch.Tensor],
        what: str,
        group: Any = None,
    ) -> PendingRecv:
        """Post one irecv per template (shape/dtype/device) from global rank ``peer``.

        ``group``: the process group the message travels in (``None``: the
        default group); a device group's own messages use the group's, so
        their tags can never meet the pipeline's.
        """
        if peer == self.rank and group is None:
            return PendingRecv(value, peer, what, [], loop_tags=list(tags))
        pending = PendingRecv(value, peer, what, [torch.empty_like(t) for t in templates])
        try:
            for buf, tag in zip(pending.tensors, tags):
                pending.works.append(dist.irecv(buf, src=peer, tag=tag, group=group))
        except RuntimeError as exc:
            raise self.lost(peer, what, exc) from exc
        return pending

    def wait_recv(self, pending: PendingRecv) -> list[torch.Tensor]:
        """Wait for every request of ``pending``; a failure names its peer."""
        if pending.loop_tags:
            missing = [t for t in pending.loop_tags if t not in self._loop]
            if missing:
                raise DistributedError(
                    f"{self.me} waited for {pending.what} from itself before sending it",
                    value={"tags": missing},
                    remedy="the schedule runs a reader before its producer on one rank; "
                    "validate it with crosscut.ir.schedule.validate_schedule",
                )
            return [self._loop.pop(t) for t in pending.loop_tags]
        for w in pending.works:
            try:
                w.wait(timeout=self.timeout)
            except RuntimeError as exc:
                raise self.lost(pending.peer, pending.what, exc) from exc
        pending.works.clear()
        return pending.tensors

    def send(self, tensor: torch.Tensor, peer: int, tag: int, what: str, group: Any = None) -> None:
        """Post an isend of ``tensor`` (made contiguous, kept alive until flushed)."""
        t = tensor.detach().contiguous()
        if peer == self.rank and group is None:  # to itself: a copy, as the wire would make
            self._loop[tag] = t.clone()
            return
        try:
            work = dist.isend(t, dst=peer, tag=tag, group=group)
        except RuntimeError as exc:
            raise self.lost(peer, f"the send of {what}", exc) from exc
        self._sends.append((work, t, peer, what))

    def drain(self) -> None:
        """Forget sends that already completed (frees their tensors)."""
        keep = []
        for item in self._sends:
            work = item[0]
            done = False
            try:
                done = bool(work.is_completed())
            except RuntimeError:
                done = False  # surfaces in flush() with the peer's name
            if not done:
                keep.append(item)
        self._sends = keep

    def flush(self) -> None:
        """Wait for every outstanding send."""
        sends, self._sends = self._sends, []
        for work, _t, peer, what in sends:
            try:
                work.wait(timeout=self.timeout)
            except RuntimeError as exc:
                raise self.lost(peer, f"the peer to receive {what}", exc) from exc

    def wait_collective(self, work: Any, ranks: list[int], what: str) -> None:
        """Wait for a collective among ``ranks``; a failure names the group."""
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            others = [r for r in ranks if r != self.rank]
            peer = others[0] if len(others) == 1 else None
            err = self.lost(peer, f"{what} (group ranks {ranks})", exc)
            raise err from exc


# ---- routes: which values travel between which stages, with what shapes and tags ----------


@dataclass(frozen=True)
class Edge:
    """``value`` travels from ``src`` stage to ``dst`` stage (one per value and reader)."""

    value: str
    src: int
    dst: int


def grad_free(gm: fx.GraphModule) -> set[str]:
    """Nodes whose value cannot carry a gradient: computed from inputs and buffers only.

    Both ends of a transfer evaluate this same rule on the same graph, so a
    receiver and its producer always agree on which gradients travel back.
    """
    params = {id(p) for p in gm.parameters()}
    free: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            free.add(n.name)
        elif n.op == "get_attr":
            obj: Any = gm
            for part in str(n.target).split("."):
                obj = getattr(obj, part)
            if id(obj) not in params:
                free.add(n.name)
        elif n.op in ("call_function", "call_method", "call_module"):
            own = n.op == "call_module" and any(
                True for _ in gm.get_submodule(str(n.target)).parameters()
            )
            if not own and all(u.name in free for u in n.all_input_nodes):
                free.add(n.name)
    return free


@dataclass
class Routes:
    """Every cross-stage edge with its static leaves (from the trace) and gradient flags.

    Built identically on every rank from the same graph and staged program,
    so both ends of an edge agree on buffers, tags and which gradients return.
    """

    edges: list[Edge]
    meta: dict[str, tuple[Any, list[Any]]]  # value -> (pytree spec, leaves from the trace)
    grad_leaf: dict[str, list[bool]]  # value -> per leaf: does a gradient travel back
    leaf_count: int

    def tag(self, edge: int, mb: int, leaf: int, backward: bool) -> int:
        """A tag unique per (edge, micro-batch, leaf, direction) within one step."""
        return ((mb * len(self.edges) + edge) * self.leaf_count + leaf) * 2 + int(backward)

    @property
    def mask_leaf(self) -> int:
        """The leaf index that tags a gradient message's presence mask (no value has it)."""
        return self.leaf_count - 1

    def tensor_leaves(self, value: str) -> list[int]:
        return [j for j, t in enumerate(self.meta[value][1]) if isinstance(t, torch.Tensor)]

    def grad_leaves(self, value: str) -> list[int]:
        return [j for j, g in enumerate(self.grad_leaf[value]) if g]


def build_routes(
    gm: fx.GraphModule,
    stage_inputs: list[list[tuple[str, int]]],
    output_sources: dict[str, int],
    aliases: Mapping[str, str] | None = None,
) -> Routes:
    """One edge per (value, reading stage), plus edges that bring outputs to the last stage.

    ``aliases`` (alias -> value) names values codegen added after tracing
    (per-reader aliases, ``codegen/fanout.py``): they take the traced value's shapes.
    """
    last = len(stage_inputs) - 1
    edges: list[Edge] = []
    seen: set[tuple[str, int]] = set()
    for dst, inputs in enumerate(stage_inputs):
        for value, src in inputs:
            if src >= 0 and src != dst and (value, dst) not in seen:
                seen.add((value, dst))
                edges.append(Edge(value, src, dst))
    for value, src in output_sources.items():
        if src >= 0 and src != last and (value, last) not in seen:
            seen.add((value, last))
            edges.append(Edge(value, src, last))
    nodes = {n.name: n for n in gm.graph.nodes}
    free = grad_free(gm)
    meta: dict[str, tuple[Any, list[Any]]] = {}
    flags: dict[str, list[bool]] = {}
    aliases = aliases or {}
    for e in edges:
        name = aliases.get(e.value, e.value)
        val = traced_value(nodes, name, f"{e.value!r} (sent stage {e.src} -> {e.dst})")
        leaves, spec = pytree.tree_flatten(val)
        meta[e.value] = (spec, leaves)
        flags[e.value] = [
            isinstance(t, torch.Tensor) and t.is_floating_point() and name not in free
            for t in leaves
        ]
    # one more leaf index than any value has: it tags a gradient message's presence mask
    count = max([len(v[1]) for v in meta.values()] + [1]) + 1
    return Routes(edges, meta, flags, count)
