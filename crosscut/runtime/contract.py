"""What both runtimes' modules promise alike: the :class:`Pipeline` contract and its rules.

``crosscut.compile`` returns a :class:`~crosscut.runtime.local.compiled.CompiledModule`
in one process and a :class:`~crosscut.runtime.dist.rank_executor.DistributedPipeline`
under torchrun. Both are a :class:`Pipeline` (checked by ``isinstance`` in
``tests/contract.py``, which runs the same assertions on both), and the
rules a user meets on both live here once, so the two cannot drift:
placement comes from the plan (a device move is refused, as torchgpipe
refuses it), a dtype change is allowed; a whole checkpoint of the model is
cut to what the module holds.

One difference is inherent and refused by name rather than left silent: a
torchrun rank's ``forward`` output cannot be backpropagated, because the
graph behind it spans processes (torch's distributed autograd lives in the
RPC framework, not in the P2P messages the pipeline uses). Its floating
outputs carry a backward that raises :class:`~crosscut.errors.RuntimeError_`
naming ``train_step`` (:func:`inference_only`), instead of torch's
"does not require grad".
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import fx
from torch.utils import _pytree as pytree

from crosscut.errors import InputError, RuntimeError_

__all__ = [
    "Pipeline",
    "Signature",
    "bind_inputs",
    "dtype_of_to",
    "inference_only",
    "load_file",
    "refuse_placement",
    "save_file",
    "share_of",
    "signature_of",
]


@runtime_checkable
class Pipeline(Protocol):
    """What ``crosscut.compile`` returns, in one process and on every torchrun rank.

    * ``forward(*inputs)``: the model's outputs (micro-batches merged by the
      ``output_merge`` rules). Locally differentiable end to end; under
      torchrun, the last stage's ranks return their replica's output and the
      others ``None``, and a backward through it is refused
      (:func:`inference_only`).
    * ``train_step(inputs, targets, loss_fn)``: a pipelined forward and
      backward of the whole batch by the plan's schedule; gradients land in
      ``.grad``; returns the full-batch mean loss (``None`` on ranks that do
      not compute it).
    * ``state_dict``/``load_state_dict``/``named_parameters``/``parameters``/
      ``named_buffers``: under the model's own keys, in the model's order (a
      rank: its share; a channel shard as ``KEY#shardI``); a whole checkpoint
      of the model loads on every rank, each taking its share.
    * ``train()``/``eval()``, ``.to(dtype)`` allowed, device moves refused.
    * ``save_checkpoint``/``load_checkpoint`` (one file locally; a directory
      of per-rank files under torchrun), ``close()``, ``plan``.
    """

    plan: Any
    training: bool

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any: ...

    def forward(self, *inputs: Any, **kwargs: Any) -> Any: ...

    def train_step(self, inputs: Any, targets: Any, loss_fn: Any) -> torch.Tensor | None: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...

    def load_state_dict(
        self, state_dict: Any, strict: bool = True, assign: bool = False
    ) -> Any: ...

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any: ...

    def parameters(self, recurse: bool = True) -> Any: ...

    def named_buffers(self, *args: Any, **kwargs: Any) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...

    def to(self, *args: Any, **kwargs: Any) -> Any: ...

    def save_checkpoint(self, path: Any, optimizer: Any = None, extra: Any = None) -> None: ...

    def load_checkpoint(self, path: Any, optimizer: Any = None) -> Any: ...

    def close(self) -> None: ...


Signature = list[tuple[str, bool, Any]]  # the model's inputs: (name, has a default, default)


def signature_of(gm: fx.GraphModule) -> Signature:
    """The traced forward's inputs in order, with the defaults fx recorded on them."""
    return [
        (str(n.target), bool(n.args), n.args[0] if n.args else None)
        for n in gm.graph.nodes
        if n.op == "placeholder"
    ]


def bind_inputs(sig: Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """``args``/``kwargs`` as the model's positional inputs, defaults filled in.

    So ``c(x, scale=3.0)`` is ``model(x, scale=3.0)``: the pipeline's inputs are
    positional (one value per traced placeholder), the model's are its signature's.
    """
    if not kwargs and len(args) == len(sig):
        return args
    names = [name for name, _, _ in sig]
    unknown = [k for k in kwargs if k not in names]
    twice = [k for k in kwargs if k in names[: len(args)]]
    if unknown or twice or len(args) > len(sig):
        rule = (
            f"got an unexpected keyword argument {unknown[0]!r}"
            if unknown
            else f"got argument {twice[0]!r} twice (by position and by name)"
            if twice
            else f"takes {len(sig)} inputs but {len(args)} were given"
        )
        raise InputError(
            f"the model's forward {rule}; it takes {names}",
            value={"positional": len(args), "keywords": sorted(kwargs)},
            remedy="call the compiled module as you call the model",
        )
    out = list(args)
    for name, has_default, default in sig[len(args) :]:
        if name not in kwargs and not has_default:
            raise InputError(
                f"the model's forward is missing its input {name!r}; it takes {names}",
                value={"positional": len(args), "keywords": sorted(kwargs)},
                remedy="call the compiled module as you call the model",
            )
        out.append(kwargs.get(name, default))
    return tuple(out)


class _RefuseBackward(torch.autograd.Function):
    """Identity forward; a backward that names the rule (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError_(
            "backward through a torchrun rank's forward output is refused: the graph "
            "behind it spans ranks, and a rank cannot backpropagate into the others",
            remedy="train with pipe.train_step(inputs, targets, loss_fn), which runs the "
            "backward on every rank; use forward for inference (eval or torch.no_grad)",
        )


def inference_only(output: Any) -> Any:
    """``output`` with each floating tensor wrapped so that a backward through it is refused.

    Applied only under grad mode (outside it nothing can be backpropagated).
    """
    if not torch.is_grad_enabled():
        return output

    def wrap(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return _RefuseBackward.apply(t.detach().requires_grad_(True))
        return t

    return pytree.tree_map(wrap, output)


def refuse_placement(what: str, devices: Sequence[str]) -> RuntimeError_:
    """The error for ``.to(device)``, ``.cuda()``, ``.cpu()`` on a compiled module."""
    return RuntimeError_(
        f"{what} is refused: placement comes from the plan (one device per stage); "
        "a dtype change such as .to(torch.float64) or .half() is allowed",
        value=list(devices),
        remedy="recompile with the devices you want (crosscut.compile(model, devices))",
    )


def dtype_of_to(args: tuple[Any, ...], kwargs: dict[str, Any], devices: Sequence[str]) -> Any:
    """The dtype a ``.to(...)`` call asks for; refuses any device in it (or None: no-op)."""
    device, dtype, _non_blocking, _fmt = torch._C._nn._parse_to(*args, **kwargs)
    if device is not None:
        raise refuse_placement(f".to({device})", devices)
    return dtype


def share_of(
    state_dict: Mapping[str, Any], key: str, shape: torch.Size, piece: tuple[int, int, int] | None
) -> torch.Tensor:
    """The part of a whole checkpoint's ``key`` a module holds: the tensor, or a channel piece.

    ``piece`` is ``(dim, member, width)`` for a channel shard (cut as the width
    split cuts: ``tensor_split``, larger pieces first).
    """
    src = state_dict[key]
    if piece is not None and tuple(src.shape) != tuple(shape):
        dim, member, width = piece
        src = src.tensor_split(width, dim)[member]
    if tuple(src.shape) != tuple(shape):
        raise InputError(
            f"shape of {key!r} does not match the model",
            value={"expected": tuple(shape), "got": tuple(src.shape)},
            remedy="load a checkpoint of the same architecture",
        )
    return src  # type: ignore[no-any-return]


def save_file(state: Mapping[str, Any], path: str | Path, optimizer: Any, extra: Any) -> None:
    """A local checkpoint: one file, written to a temporary name and renamed (never torn)."""
    data = {
        "state": dict(state),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "extra": extra,
    }
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    torch.save(data, tmp)
    os.replace(tmp, target)


def load_file(path: str | Path, optimizer: Any) -> tuple[dict[str, Any], Any]:
    """(state, extra) of :func:`save_file`'s file; loads the optimizer's state when given."""
    data = torch.load(Path(path), weights_only=False)
    if optimizer is not None:
        if data.get("optimizer") is None:
            raise InputError(
                "the checkpoint holds no optimizer state",
                value=str(path),
                remedy="pass optimizer= to save_checkpoint, or load without one",
            )
        optimizer.load_state_dict(data["optimizer"])
    return data["state"], data.get("extra")
