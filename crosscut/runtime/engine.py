"""One stage's forward and backward of one micro-batch, written once for both transports.

Why one engine: the local runtime (one thread per stage, values in memory)
and the torchrun runtime (one rank per stage, values over torch.distributed
P2P) run the same schedule actions. What an action *computes* — which
inputs to gather, which to clone because the stage writes them in place, the
output structure the last stage rebuilds, the ``1/M`` loss scaling, the
roots and gradients of the backward, which input gradients go back — must
not depend on how values travel, or the two runtimes drift apart (they did:
two copies of this logic disagreed on clones, scaling and gradient sums).
So it lives here once, in :class:`StageEngine`, and each runtime supplies a
:class:`Transport` that only moves things:

* ``receive_values(a, training)``: every value the stage reads from another
  stage for micro-batch ``a.microbatch`` — and, on the last stage, every
  model output produced elsewhere — rebuilt on the stage's device. When
  ``training``, each is a fresh leaf whose tensors require grad where the
  producer's did (the stage's backward stops there and hands the gradient
  back); otherwise a plain value (the local runtime keeps it attached, so its
  whole forward is one differentiable graph).
* ``send_values(a, outs)``: hand the stage's exported values to their readers.
* ``receive_grads(a)``: for each exported value, the gradient of each of its
  pytree leaves summed over the value's readers (``None`` where no reader
  sent one), in a fixed reader order so sums are deterministic.
* ``send_grads(a, received)``: send the gradient of every received leaf back
  to its producer — as autograd handed it to the leaf (:func:`incoming_grad`),
  strides included, not the ``.grad`` it accumulated.

Why strides travel: a gradient's bits can depend on its layout. A
concatenation's backward hands each input a channel slice of its gradient (a
view with gaps), and on CPU batch norm's backward sums a gapped gradient in
another order than a contiguous one. ``.grad`` of a leaf is a contiguous
clone of such a view (autograd's layout contract), so a stage that sent it
made the producer's batch norms differ from eager in the last bits — every
parameter before a cut through a concatenation (nasnet on 3 stages: 685 of
1,018 gradients). The producer rebuilds the layout the reader's backward made
(:func:`with_strides`), and its backward runs the kernels eager runs. Values
going forward keep their strides the same way: in memory they are the
producer's tensor; over torchrun the receiver lays the message out with the
strides the trace recorded (``stage_io``).

The engine also keeps, per micro-batch, what its backward needs (the received
leaves, the outputs, the loss and an optional ordering token of a
cross-shaped group), which is what pipelining's ``forward_one_chunk`` /
``backward_one_chunk`` split does in torch.distributed.pipelining.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from crosscut.ir.program import INPUT, StagedProgram, ValueRef, map_structure
from crosscut.ir.schedule import Action
from crosscut.split_backward import WeightPass, backward_input, backward_weight

__all__ = [
    "Autograd",
    "RunStage",
    "Saved",
    "StageEngine",
    "Transport",
    "consumers",
    "incoming_grad",
    "keep_incoming",
    "sum_leaves",
    "with_strides",
]

_INCOMING = "_crosscut_incoming"


def keep_incoming(leaf: torch.Tensor) -> torch.Tensor:
    """Make ``leaf`` (a received value that requires grad) remember the gradient autograd
    hands it, with the layout its readers' backward made; returns ``leaf``.

    The hook keeps the tensor in a box the leaf holds (not the leaf itself: no
    reference cycle that would keep a device's memory until the collector runs)."""
    box: list[torch.Tensor] = []

    def hook(grad: torch.Tensor) -> None:
        box[:] = [grad]

    leaf.register_hook(hook)  # type: ignore[no-untyped-call]
    setattr(leaf, _INCOMING, box)
    return leaf


def incoming_grad(leaf: Any) -> torch.Tensor | None:
    """The gradient ``leaf`` received in backward, as autograd handed it (else ``.grad``;
    ``None`` when none arrived). Its ``.grad`` copy is dropped: nothing reads it."""
    if not isinstance(leaf, torch.Tensor):
        return None
    box: list[torch.Tensor] | None = getattr(leaf, _INCOMING, None)
    if box:
        leaf.grad = None
        return box[0]
    return leaf.grad


def with_strides(grad: torch.Tensor, device: torch.device, strides: Sequence[int]) -> torch.Tensor:
    """``grad`` on ``device`` laid out with ``strides`` (a copy only where either differs).

    ``Tensor.to`` gives a gapped view a contiguous copy on another device, and a
    message arrives contiguous: the producer's backward would then run another
    kernel than eager's on a stride-sensitive op (module docstring)."""
    if grad.device == device and tuple(grad.stride()) == tuple(strides):
        return grad
    out = torch.empty_strided(grad.shape, tuple(strides), dtype=grad.dtype, device=device)
    return out.copy_(grad)


LossFn = Callable[[Any, Any], torch.Tensor]
RunStage = Callable[[list[Any], int, bool], tuple[Sequence[Any], torch.Tensor | None]]
Autograd = Callable[[list[torch.Tensor], list[torch.Tensor | None]], None]


class Transport(Protocol):
    """How one stage's values and gradients travel (module docstring)."""

    def receive_values(self, a: Action, training: bool) -> dict[str, Any]: ...

    def send_values(self, a: Action, outs: dict[str, Any]) -> None: ...

    def receive_grads(self, a: Action) -> dict[str, list[torch.Tensor | None]]: ...

    def send_grads(self, a: Action, received: dict[str, Any]) -> None: ...


@dataclass
class Saved:
    """What a micro-batch's backward needs from its forward."""

    received: dict[str, Any]
    outs: dict[str, Any]
    loss: torch.Tensor | None
    token: torch.Tensor | None = None
    pending: WeightPass | None = None  # what W still owes (split backward only)


def consumers(program: StagedProgram) -> dict[str, list[int]]:
    """value -> the stages that read it from another stage, in stage order.

    The last stage counts once for a model output produced elsewhere (it
    rebuilds the output structure), whether or not it also reads the value
    as an input: one leaf per (value, reading stage), on both transports.
    """
    readers: dict[str, list[int]] = {}
    last = len(program.stages) - 1
    for st in program.stages:
        for value, src in st.inputs:
            if src != INPUT and st.index not in readers.setdefault(value, []):
                readers[value].append(st.index)
    for value, src in program.output_sources.items():
        if src not in (INPUT, last) and last not in readers.setdefault(value, []):
            readers[value].append(last)
    return {v: sorted(r) for v, r in readers.items() if r}


@dataclass
class StageEngine:
    """Forward and backward of one stage, one micro-batch at a time.

    ``run(inputs, microbatch, training)`` calls the stage and returns its
    outputs (in ``outputs`` order) and an optional token whose backward must
    run too (a cross-shaped group's message chain); the plain case is
    :meth:`plain`.
    """

    index: int
    inputs: list[tuple[str, int]]
    outputs: list[str]
    mutated: frozenset[str]
    last: bool
    template: Any
    output_sources: dict[str, int]
    placeholders: list[str]
    microbatches: int
    run: RunStage
    saved: dict[int, Saved] = field(default_factory=dict)
    split: bool = False  # the schedule runs each backward as a B and a later W

    @classmethod
    def for_stage(
        cls,
        program: StagedProgram,
        index: int,
        microbatches: int,
        run: RunStage | None = None,
    ) -> StageEngine:
        """The engine of ``program.stages[index]`` (``run`` defaults to its module)."""
        st = program.stages[index]
        return cls(
            index=index,
            inputs=list(st.inputs),
            outputs=list(st.outputs),
            mutated=frozenset(st.mutated_inputs),
            last=index == len(program.stages) - 1,
            template=program.output_template,
            output_sources=dict(program.output_sources),
            placeholders=list(program.placeholders),
            microbatches=microbatches,
            run=run or cls.plain(st.module),
        )

    @staticmethod
    def plain(module: Callable[..., Any]) -> RunStage:
        """Run a stage module as is (no token)."""
        return lambda ins, m, training: (list(module(*ins)), None)

    def forward(
        self,
        a: Action,
        transport: Transport,
        model_input: Callable[[str], Any],
        *,
        training: bool,
        target: Any = None,
        loss_fn: LossFn | None = None,
    ) -> tuple[Any, torch.Tensor | None]:
        """Run ``F(stage, m)``; returns the output structure and loss (last stage only).

        ``model_input(name)`` is micro-batch ``m``'s model input ``name`` on
        this stage's device. With ``training``, the loss is
        ``loss_fn(output, target) / M`` (equal micro-batches, so the summed
        gradients are the whole batch's mean-loss gradients) and the state
        the backward needs is kept until :meth:`backward`.
        """
        m = a.microbatch
        received = transport.receive_values(a, training)
        ins = []
        for v, src in self.inputs:
            val = model_input(v) if src == INPUT else received[v]
            if training and v in self.mutated:  # in-place on a leaf is illegal: mutate a copy
                val = pytree.tree_map(
                    lambda t: t.clone() if isinstance(t, torch.Tensor) else t, val
                )
            ins.append(val)
        results, token = self.run(ins, m, training)
        outs = dict(zip(self.outputs, results))
        transport.send_values(a, outs)
        out: Any = None
        loss: torch.Tensor | None = None
        if self.last:

            def fetch(leaf: Any) -> Any:
                if not isinstance(leaf, ValueRef):
                    return leaf
                if leaf.name in outs:
                    return outs[leaf.name]
                if self.output_sources.get(leaf.name) == INPUT:
                    return model_input(leaf.name)
                return received[leaf.name]

            out = map_structure(fetch, self.template)
            if training:
                assert loss_fn is not None
                loss = loss_fn(out, target)
                if self.microbatches > 1:
                    loss = loss * (1.0 / self.microbatches)
        if training:
            self.saved[m] = Saved(received, outs, loss, token)
        return out, loss

    def backward(self, a: Action, transport: Transport, autograd: Autograd | None = None) -> None:
        """Run ``B(stage, m)``: backpropagate the loss and the readers' gradients.

        ``autograd(roots, grads)`` runs the backward itself (default
        ``torch.autograd.backward``): the torchrun runtime's last backward of a
        step arms DDP's reducer on exactly these roots (runtime/dist/overlap.py).
        With :attr:`split`, only the gradients of the received values are
        computed here and the weight gradients wait for :meth:`weight`
        (crosscut/split_backward.py); a cross-shaped group's stage (a token:
        its members' messages run in its backward) still runs all of it here.
        """
        saved = self.saved[a.microbatch] if self.split else self.saved.pop(a.microbatch)
        grads_in = transport.receive_grads(a)
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if saved.loss is not None:
            roots.append(saved.loss)
            grads.append(None)
        for name, val in saved.outs.items():
            sums = grads_in.get(name)
            if sums is None:
                continue
            for t, g in zip(pytree.tree_leaves(val), sums):
                if isinstance(t, torch.Tensor) and t.requires_grad and g is not None:
                    roots.append(t)
                    grads.append(with_strides(g, t.device, g.stride()))
        if saved.token is not None and saved.token.requires_grad:  # the group's messages
            roots.append(saved.token)
            grads.append(torch.zeros_like(saved.token))
        if roots and self.split and saved.token is None:
            leaves = [
                t
                for t in pytree.tree_leaves(saved.received)
                if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf
            ]
            saved.pending = backward_input(roots, grads, leaves)
        elif roots:
            (autograd or torch.autograd.backward)(roots, grads)
        transport.send_grads(a, saved.received)

    def weight(self, a: Action) -> None:
        """Run ``W(stage, m)``: the weight gradients :meth:`backward` left (split backward)."""
        saved = self.saved.pop(a.microbatch)
        if saved.pending is not None:
            backward_weight(saved.pending)


def sum_leaves(
    contributions: Sequence[Sequence[torch.Tensor | None]],
) -> list[torch.Tensor | None]:
    """Sum per-leaf gradients over readers, in the given (fixed) order; ``None`` if none."""
    if not contributions:
        return []
    out: list[torch.Tensor | None] = []
    for i in range(len(contributions[0])):
        parts = [g for c in contributions if (g := c[i]) is not None]
        total: torch.Tensor | None = None
        for p in parts:
            total = p if total is None else total + p.to(total.device)
        out.append(total)
    return out
