"""What both runtimes' modules promise alike: the rules of ``.to()`` and checkpoints.

``crosscut.compile`` returns a :class:`~crosscut.runtime.compiled.CompiledModule`
in one process and a :class:`~crosscut.runtime.distributed.DistributedPipeline`
under torchrun; the rules a user meets on both live here once, so the two
cannot drift: placement comes from the plan (a device move is refused, as
torchgpipe refuses it), a dtype change is allowed; a whole checkpoint of the
model is cut to what the module holds.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from crosscut.errors import InputError, RuntimeError_

__all__ = ["dtype_of_to", "load_file", "refuse_placement", "save_file", "share_of"]


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
