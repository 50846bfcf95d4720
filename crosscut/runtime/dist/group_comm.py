"""Messages inside one device group: autograd-aware sends and receives on a token chain.

A cross-shaped stage runs on a device group; in the distributed runtime every
member of the group is a rank, and the group's gathers, scatters and
broadcasts (``codegen/width.py``) become point-to-point messages between the
leader and one member. Two autograd functions of our own carry all of them
(:func:`send`/:func:`recv`, or the fx-callable modules :class:`SendOp` and
:class:`RecvOp`):

* send: forward posts an ``isend`` of ``x`` to the peer; backward waits for
  the gradient of ``x`` from the peer.
* receive: forward waits for a tensor from the peer; backward sends its
  gradient back.

A gather is a receive per member plus ``torch.cat`` (autograd slices the
gradient back), a scatter a send of each member's ``narrow`` slice (autograd
adds the slices' gradients up), a broadcast a send (autograd sums the returned
gradient into the value's other uses: the reduce).

**Why a token chain.** A receive inside ``backward`` blocks the autograd
engine. Members run different local graphs (the leader runs the whole ops,
the others only their shards), and the engine picks ready nodes by its own
priorities, so without help a leader could block waiting for a member's
gradient that the member can only compute after a gradient the leader has
not sent yet: a deadlock. Every op therefore takes a scalar *token* and
returns a new one, threading all of a member's messages into one chain in
program order. Backward must then run them in exactly the reverse order on
every member, the order in which their partners produce what they wait for
(each op's partner reaches it after its own later ops, by induction from the
last op), so no wait is ever circular. The final token is one more root of
the member's backward (with a zero gradient).

**Why point-to-point and not collectives.** Messages are matched by (peer,
tag) in the group's own process group, with tags computed from static data
(op index, micro-batch, direction), so two messages can never be confused
even when ranks post them in different orders; collectives match by call
order only. Collectives are used where every member calls them in the same
order anyway: the end-of-step gradient all-reduce and buffer broadcast.

**Static shapes.** Receivers allocate from shapes fixed at build time (the
trace), as between stages. Every wait has the runtime's timeout, and a
failure is a :class:`~crosscut.errors.DistributedError` naming the peer
(:class:`~crosscut.runtime.dist.p2p.Messenger`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from crosscut.runtime.dist.p2p import Messenger

__all__ = ["GroupLink", "RecvOp", "SendOp", "new_token", "recv", "send"]


@dataclass
class GroupLink:
    """What every message of one group member needs, shared by all its ops.

    ``microbatch`` is set by the executor before each forward; each op keeps
    the value it ran with, so its backward uses the same tags whenever the
    schedule runs it.
    """

    msg: Messenger
    group: Any  # the device group's process group
    ranks: list[int]  # global ranks of the group, leader first
    stage: int
    member: int
    device: torch.device
    ops: int = 0  # messages per micro-batch (fixed once the member program is built)
    microbatch: int = 0

    def tag(self, op: int, microbatch: int, backward: bool) -> int:
        """Unique per (op, micro-batch, direction) within one step of this group."""
        return ((microbatch * max(1, self.ops) + op) * 2) + int(backward)

    def describe(self, op: int, value: str, member: int, microbatch: int, grad: bool) -> str:
        kind = "the gradient of" if grad else ""
        return (
            f"{kind} {value!r} (group message {op}, member {member} = rank "
            f"{self.ranks[member]}) for micro-batch {microbatch} of stage {self.stage}"
        ).strip()


def new_token(device: torch.device, training: bool) -> torch.Tensor:
    """The first token of one micro-batch's chain (a leaf that wants a gradient)."""
    return torch.zeros((), device=device, requires_grad=training and torch.is_grad_enabled())


@dataclass(frozen=True)
class _Spec:
    link: GroupLink
    op: int
    peer: int  # member index of the partner
    value: str
    grad: bool  # does a gradient travel back (floating and not free of parameters)


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, token: torch.Tensor, x: torch.Tensor, spec: _Spec) -> torch.Tensor:
        link, mb = spec.link, spec.link.microbatch
        what = link.describe(spec.op, spec.value, spec.peer, mb, False)
        link.msg.send(x, link.ranks[spec.peer], link.tag(spec.op, mb, False), what, link.group)
        ctx.spec, ctx.mb = spec, mb
        ctx.shape, ctx.dtype, ctx.device = tuple(x.shape), x.dtype, x.device
        return torch.zeros_like(token)

    @staticmethod
    def backward(ctx: Any, g_token: torch.Tensor) -> tuple[Any, ...]:
        spec: _Spec = ctx.spec
        if not spec.grad:
            return g_token, None, None
        link = spec.link
        template = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        pend = link.msg.post_recv(
            spec.value,
            link.ranks[spec.peer],
            [link.tag(spec.op, ctx.mb, True)],
            [template],
            link.describe(spec.op, spec.value, spec.peer, ctx.mb, True),
            link.group,
        )
        (grad,) = link.msg.wait_recv(pend)
        return g_token, grad, None


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, token: torch.Tensor, spec: _Spec, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        link, mb = spec.link, spec.link.microbatch
        template = torch.empty(shape, dtype=dtype, device=link.device)
        pend = link.msg.post_recv(
            spec.value,
            link.ranks[spec.peer],
            [link.tag(spec.op, mb, False)],
            [template],
            link.describe(spec.op, spec.value, spec.peer, mb, False),
            link.group,
        )
        (value,) = link.msg.wait_recv(pend)
        ctx.spec, ctx.mb = spec, mb
        if not spec.grad:
            ctx.mark_non_differentiable(value)
        return torch.zeros_like(token), value

    @staticmethod
    def backward(ctx: Any, g_token: torch.Tensor, g_value: torch.Tensor | None) -> tuple[Any, ...]:
        spec: _Spec = ctx.spec
        if spec.grad:
            link = spec.link
            assert g_value is not None  # gradients are materialised (zeros when unused)
            link.msg.send(
                g_value,
                link.ranks[spec.peer],
                link.tag(spec.op, ctx.mb, True),
                link.describe(spec.op, spec.value, spec.peer, ctx.mb, True),
                link.group,
            )
        return g_token, None, None, None


def send(
    token: torch.Tensor,
    x: torch.Tensor,
    link: GroupLink,
    op: int,
    peer: int,
    value: str,
    grad: bool,
) -> torch.Tensor:
    """Send ``x`` to member ``peer`` as message ``op``; returns the next token."""
    out: torch.Tensor = _Send.apply(token, x, _Spec(link, op, peer, value, grad))
    return out


def recv(
    token: torch.Tensor,
    link: GroupLink,
    op: int,
    peer: int,
    value: str,
    grad: bool,
    shape: Sequence[int],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Receive message ``op`` (static ``shape``/``dtype``) from member ``peer``: (token, value)."""
    spec = _Spec(link, op, peer, value, grad)
    out: tuple[torch.Tensor, torch.Tensor] = _Recv.apply(
        token, spec, tuple(int(d) for d in shape), dtype
    )
    return out


class SendOp(nn.Module):
    """``token' = SendOp(token, x)``: send ``x`` to one group member (fx-callable)."""

    def __init__(self, link: GroupLink, op: int, peer: int, value: str, grad: bool) -> None:
        super().__init__()
        self.spec = _Spec(link, op, peer, value, grad)

    def forward(self, token: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _Send.apply(token, x, self.spec)
        return out

    def extra_repr(self) -> str:
        return f"op={self.spec.op}, to_member={self.spec.peer}, value={self.spec.value!r}"


class RecvOp(nn.Module):
    """``token', y = RecvOp(token)``: receive ``y`` (static shape) from one group member."""

    def __init__(
        self,
        link: GroupLink,
        op: int,
        peer: int,
        value: str,
        grad: bool,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.spec = _Spec(link, op, peer, value, grad)
        self.shape, self.dtype = tuple(int(d) for d in shape), dtype

    def forward(self, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out: tuple[torch.Tensor, torch.Tensor] = _Recv.apply(
            token, self.spec, self.shape, self.dtype
        )
        return out

    def extra_repr(self) -> str:
        return (
            f"op={self.spec.op}, from_member={self.spec.peer}, value={self.spec.value!r}, "
            f"shape={self.shape}"
        )
