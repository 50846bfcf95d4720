"""What one pipeline rank takes in and hands on per schedule action: the P2P transport.

Why separate from the executor: :class:`~crosscut.runtime.dist.rank_executor.DistributedPipeline`
should read like its schedule — receive, run the stage, send; receive
gradients, backpropagate, send gradients — while the bookkeeping of each
message lives here: which edges an action touches, the buffers posted from
the trace's static shapes, the tags, the pytree (re)assembly of a value from
its tensor leaves, the shape check before a send, the sum of a value's
gradients over its consumers, and this replica's micro-batches of the global
batch. Everything is keyed by the static :class:`~crosscut.runtime.dist.p2p.Routes`,
so both ends of an edge agree without exchanging anything at run time.

:class:`StageIO` is the torchrun :class:`~crosscut.runtime.engine.Transport`
of the stage engine (the local runtime's is an in-process value table): it
posts each action's receives one action ahead (:meth:`StageIO.start`), so a
peer's sends for the next action find their buffers already posted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from crosscut.errors import DistributedError, InputError
from crosscut.ir.schedule import Action
from crosscut.runtime.dist.p2p import Edge, Messenger, PendingRecv, Routes
from crosscut.runtime.engine import incoming_grad, keep_incoming, with_strides
from crosscut.runtime.microbatch import batch_leaves, scatter, share

__all__ = ["Posted", "StageIO"]

Posted = list[tuple[int, PendingRecv]]  # (edge index, receive) for one action


@dataclass
class StageIO:
    """The messages and batch shards of stage ``stage`` in one replica (its leader rank).

    ``rank_of(stage)`` is the global rank of that stage's leader in this
    replica; ``micro_batch`` the traced micro-batch size (0 when unknown).
    """

    routes: Routes
    msg: Messenger
    stage: int
    rank_of: Callable[[int], int]
    device: torch.device
    micro_batch: int
    replica: int
    replicas: int
    microbatches: int
    # value -> leaf dtypes under the caller's autocast (runtime/dist/wire_dtypes.py); {}: traced
    dtypes: dict[str, list[torch.dtype | None]] = field(default_factory=dict)
    posted: dict[Action, Posted] = field(default_factory=dict)  # receives posted ahead

    def start(self, row: Sequence[Action]) -> Iterator[Action]:
        """Yield ``row``'s actions, each with its own and the next action's receives posted."""
        self.posted.clear()
        for pos, a in enumerate(row):
            for b in row[pos : pos + 2]:
                if b not in self.posted:
                    self.posted[b] = self.post(b)
            yield a

    def _dtype(self, value: str, j: int, traced: torch.dtype) -> torch.dtype:
        want = self.dtypes.get(value)
        got = want[j] if want is not None and j < len(want) else None
        return got if got is not None else traced

    # ---- model inputs -----------------------------------------------------------------
    def split_batch(self, inputs: Any, what: str) -> list[list[Any]] | None:
        """This replica's shard of the global batch, split into micro-batches."""
        if inputs is None:
            return None
        args = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
        need = self.replicas * self.microbatches * self.micro_batch
        for t in batch_leaves(args, need) if need else []:
            if t.shape[0] != need:
                raise InputError(
                    f"the global batch of {what} must be replicas × microbatches × micro-batch "
                    f"= {self.replicas} × {self.microbatches} × {self.micro_batch} = {need}",
                    value=tuple(t.shape),
                    remedy="pass the batch size the plan was compiled for (shapes are static)",
                )
        if self.replicas > 1:  # a per-sample list of dicts (detection targets) by samples
            args = share(args, self.replicas, self.replica, need)
        args = pytree.tree_map(
            lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t, args
        )
        return scatter(args, self.microbatches, batch=need // self.replicas or None)

    # ---- receives -----------------------------------------------------------------------
    def post(self, a: Action) -> Posted:
        """Post the receives action ``a`` needs: inputs for F, output gradients for B."""
        out: Posted = []
        for i, e in enumerate(self.routes.edges):
            if a.kind == "F" and e.dst == self.stage:
                idx = self.routes.tensor_leaves(e.value)
                peer = self.rank_of(e.src)
            elif a.kind == "B" and e.src == self.stage:
                idx = self.routes.grad_leaves(e.value)
                peer = self.rank_of(e.dst)
            else:
                continue
            if not idx:
                continue
            leaves = self.routes.meta[e.value][1]
            templates = [
                torch.empty(
                    tuple(leaves[j].shape),
                    dtype=self._dtype(e.value, j, leaves[j].dtype),
                    device=self.device,
                )
                for j in idx
            ]
            tags = [self.routes.tag(i, a.microbatch, j, a.kind == "B") for j in idx]
            if a.kind == "B":  # which of them the reader had, and their strides (send_grads)
                size = sum(1 + leaves[j].dim() for j in idx)
                templates.append(torch.empty(size, dtype=torch.int64, device=self.device))
                tags.append(self.routes.tag(i, a.microbatch, self.routes.mask_leaf, True))
            pend = self.msg.post_recv(
                e.value, peer, tags, templates, self._what(a, e, a.kind == "B")
            )
            out.append((i, pend))
        return out

    def receive_values(self, a: Action, grad: bool) -> dict[str, Any]:
        """Wait for an F action's inputs and rebuild each value (leaves needing grad if ``grad``).

        Values with no tensor leaves were never posted; they are rebuilt from the trace.
        """
        pend = self.posted.pop(a)
        received: dict[str, Any] = {}
        for _i, p in pend:
            received[p.value] = self._assemble(p.value, self.msg.wait_recv(p), grad)
        for e in self.routes.edges:
            if e.dst == self.stage and e.value not in received:
                received[e.value] = self._assemble(e.value, [], grad)
        return received

    def receive_grads(self, a: Action) -> dict[str, list[torch.Tensor | None]]:
        """Wait for a B action's output gradients, summed over each value's consumers.

        One entry per pytree leaf of the value (``None`` for leaves that carry
        no gradient), summed in edge order — the reading stages' order. A leaf
        no reader had a gradient for (an output the loss never reads) stays
        ``None``, as in eager: its zeros on the wire would give the parameters
        behind it zero gradients, which weight decay and momentum then act on.
        """
        sums: dict[str, list[torch.Tensor | None]] = {}
        for _i, p in self.posted.pop(a):
            *got, mask = self.msg.wait_recv(p)
            have = _laid_out(got, mask.tolist(), self.device)
            if p.value in sums:
                sums[p.value] = [_add(x, y) for x, y in zip(sums[p.value], have)]
            else:
                sums[p.value] = have
        full: dict[str, list[torch.Tensor | None]] = {}
        for value, gs in sums.items():
            it = iter(gs)
            full[value] = [next(it) if f else None for f in self.routes.grad_leaf[value]]
        return full

    def _assemble(self, value: str, tensors: list[torch.Tensor], grad: bool) -> Any:
        spec, leaves = self.routes.meta[value]
        it = iter(tensors)
        built = []
        for j, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                # a message arrives contiguous; the reader gets the producer's strides, as the
                # trace recorded them (a channel slice: batch norm reads it in another order)
                t = with_strides(next(it), self.device, leaf.stride())
                if grad and self.routes.grad_leaf[value][j]:
                    keep_incoming(t.requires_grad_(True))
                built.append(t)
            else:
                built.append(leaf)
        return pytree.tree_unflatten(built, spec)

    # ---- sends --------------------------------------------------------------------------
    def send_values(self, a: Action, outs: dict[str, Any]) -> None:
        """Send every value this stage exports to each stage that reads it."""
        for i, e in enumerate(self.routes.edges):
            if e.src == self.stage:
                self._send_value(a, i, e, outs[e.value])

    def send_grads(self, a: Action, received: dict[str, Any]) -> None:
        """Send the gradient of each received input back to its producer, then a mask of
        which leaves had one (zeros travel for the others: the receives are posted ahead)
        with each one's strides as autograd handed it over (engine.py: layouts)."""
        for i, e in enumerate(self.routes.edges):
            if e.dst != self.stage:
                continue
            leaves = pytree.tree_leaves(received[e.value])
            present: list[int] = []
            for j, (t, f) in enumerate(zip(leaves, self.routes.grad_leaf[e.value])):
                if not f:
                    continue
                got = incoming_grad(t)
                g = got if got is not None else torch.zeros_like(t)
                present += [int(got is not None), *g.stride()]
                self.msg.send(
                    g,
                    self.rank_of(e.src),
                    self.routes.tag(i, a.microbatch, j, True),
                    self._what(a, e, True),
                )
            if present:
                self.msg.send(
                    torch.tensor(present, dtype=torch.int64, device=self.device),
                    self.rank_of(e.src),
                    self.routes.tag(i, a.microbatch, self.routes.mask_leaf, True),
                    self._what(a, e, True),
                )

    def _send_value(self, a: Action, i: int, e: Edge, value: Any) -> None:
        leaves = pytree.tree_leaves(value)
        expected = self.routes.meta[e.value][1]
        for j, (t, ref) in enumerate(zip(leaves, expected)):
            if not isinstance(ref, torch.Tensor):
                continue
            dtype = self._dtype(e.value, j, ref.dtype)
            if isinstance(t, torch.Tensor) and t.dtype != dtype and tuple(t.shape) == ref.shape:
                raise DistributedError(
                    f"stage {e.src} produced {e.value!r} as {t.dtype} but its receiver "
                    f"posted {dtype} (the trace's dtype under the caller's autocast)",
                    value={"value": e.value, "microbatch": a.microbatch},
                    remedy="enter the same torch.autocast state on every rank around the call",
                )
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(ref.shape):
                raise DistributedError(
                    f"stage {e.src} produced {e.value!r} with shape "
                    f"{tuple(getattr(t, 'shape', ()))} but the plan traced "
                    f"{tuple(ref.shape)}; shapes are fixed by the trace",
                    value={"value": e.value, "microbatch": a.microbatch},
                    remedy=f"pass a global batch of replicas × microbatches × {self.micro_batch} "
                    "samples, the size the plan was compiled for",
                )
            self.msg.send(
                t,
                self.rank_of(e.dst),
                self.routes.tag(i, a.microbatch, j, False),
                self._what(a, e, False),
            )

    @staticmethod
    def _what(a: Action, e: Edge, grad: bool) -> str:
        kind = "the gradient" if grad else "the value"
        return f"{kind} of {e.value!r} for micro-batch {a.microbatch} (action {a})"


def _laid_out(
    got: list[torch.Tensor], mask: list[int], device: torch.device
) -> list[torch.Tensor | None]:
    """The gradients of one message, each ``None`` if its reader had none, else laid out
    with the strides its reader's backward gave it (``mask``: per leaf, a presence flag
    then one stride per dimension)."""
    out: list[torch.Tensor | None] = []
    at = 0
    for g in got:
        present, strides = mask[at], mask[at + 1 : at + 1 + g.dim()]
        at += 1 + g.dim()
        out.append(with_strides(g, device, strides) if present else None)
    return out


def _add(x: torch.Tensor | None, y: torch.Tensor | None) -> torch.Tensor | None:
    """Two readers' gradients of one leaf: their sum, either one, or ``None`` if neither."""
    if x is None:
        return y
    return x if y is None else x + y
