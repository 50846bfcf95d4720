"""A local compiled module's state under the model's own keys, names and order.

The stages hold the model's tensors under stage-local names (and a
channel-split stage holds a tensor as shards on several devices), but a user
sees the model: ``state_dict()`` with exactly its keys and order,
``load_state_dict()`` of its checkpoints (cut into shards where needed),
``named_parameters()``/``named_buffers()`` in its order, so an optimizer built
on the compiled module indexes its state like one built on the model. This
mixin maps between the two for :class:`~crosscut.runtime.local.compiled.CompiledModule`;
the torchrun counterpart (a rank's share) is
:class:`~crosscut.runtime.dist.state_files.RankState`.

A key resolves, in order, to: a tensor of the model no stage reads (an
"orphan", kept as is), a tensor only the other train/eval mode's program
reads, the concatenation of a channel-split stage's shards, or one stage's
own tensor.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from crosscut.codegen.dotted_attrs import get_attr
from crosscut.errors import CrosscutError, InputError
from crosscut.ir.program import StagedProgram
from crosscut.runtime.grad_norm import Piece

__all__ = ["ModelKeyedState"]


class ModelKeyedState:
    """State access under the model's keys (see the module docstring).

    The host class sets ``_program`` (and ``_other``, the other mode's
    program or None), ``stages``, ``_orphans``, ``_keys`` and the parameter and
    buffer name lists ``_param_names``/``_unique_params``/``_buffer_names``/
    ``_unique_buffers``.
    """

    _program: StagedProgram
    _other: StagedProgram | None
    stages: nn.ModuleList
    _orphans: dict[str, torch.Tensor]
    _keys: list[str]
    _param_names: list[str]
    _unique_params: list[str]
    _buffer_names: list[str]
    _unique_buffers: list[str]

    def _shards(self, key: str) -> tuple[list[torch.Tensor], int | None]:
        s, names, dim = self._program.shard_sources[key]
        mod = self.stages[s]
        return [
            mod.get_parameter(n) if self._is_param(s, n) else mod.get_buffer(n) for n in names
        ], dim

    def _source(self, key: str) -> torch.Tensor:
        if key in self._orphans:
            return self._orphans[key]
        if (
            self._other is not None
            and key not in self._program.key_sources
            and key not in self._program.shard_sources
        ):  # read only in the other train/eval mode: that program holds it
            if key in self._other.shard_sources:
                raise CrosscutError(
                    f"{key!r} is read only in the other train/eval mode, and channel-sharded",
                    value=key,
                    remedy="compile in the mode that reads it, or without cross_shaped=True",
                )
            s_other, local_other = self._other.key_sources[key]
            t_other = get_attr(self._other.stages[s_other].module, local_other)
            assert isinstance(t_other, torch.Tensor)
            return t_other
        if key in self._program.shard_sources:
            parts, dim = self._shards(key)
            if dim is None:  # a replicated scalar (batch norm's step count): shard 0 speaks
                return parts[0]
            return torch.cat([p.detach().to(parts[0].device) for p in parts], dim)
        s, local = self._program.key_sources[key]
        t = (
            self.stages[s].get_parameter(local)
            if self._is_param(s, local)
            else (self.stages[s].get_buffer(local))
        )
        return t

    def _is_param(self, s: int, local: str) -> bool:
        mod_path, _, leaf = local.rpartition(".")
        mod = self.stages[s].get_submodule(mod_path) if mod_path else self.stages[s]
        return leaf in mod._parameters

    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """Exactly the original model's keys, in its order.

        As ``nn.Module.state_dict``, a value shares storage with the tensor the
        stages hold, on its device: a write through it changes the module (an
        EMA that updates ``ema.state_dict()`` in place, as timm's does, needs
        that). A channel-sharded tensor is its shards concatenated: a copy.
        """
        out: dict[str, Any] = OrderedDict() if destination is None else destination
        for key in self._keys:
            t = self._source(key)
            out[prefix + key] = t if keep_vars else t.detach()
        return out

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Scatter an original-model checkpoint onto the stages (strict by default)."""
        missing = [k for k in self._keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in set(self._keys)]
        if strict and (missing or unexpected):
            raise InputError(
                "load_state_dict needs exactly the original model's keys",
                value={"missing": missing[:10], "unexpected": unexpected[:10]},
                remedy="load a state_dict of the original model, or pass strict=False",
            )
        with torch.no_grad():
            for key in self._keys:
                if key not in state_dict:
                    continue
                dst, src = self._source(key), state_dict[key]
                if key in self._program.shard_sources and dst.shape == src.shape:
                    parts, dim = self._shards(key)
                    pieces = [src] * len(parts) if dim is None else None
                    if pieces is None:
                        assert dim is not None
                        pieces = list(src.split([p.shape[dim] for p in parts], dim))
                    for part, piece in zip(parts, pieces):
                        part.copy_(piece.to(part.device))
                    continue
                if dst.shape != src.shape:
                    raise InputError(
                        f"shape of {key!r} does not match the model",
                        value={"expected": tuple(dst.shape), "got": tuple(src.shape)},
                        remedy="load a checkpoint of the same architecture",
                    )
                dst.copy_(src.to(dst.device))
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    # ---- the model's names and order ---------------------------------------------------
    def _named_state(self, names: list[str], prefix: str, recurse: bool) -> Iterator[Any]:
        """(name, tensor) under the model's own names, in the model's order.

        A channel-sharded tensor has no single stage tensor: its shards follow
        under ``KEY#shardI`` (they are what the optimizer must update).
        """
        for key in names:
            if not recurse and "." in key:
                continue
            if key in self._program.shard_sources:
                parts, _ = self._shards(key)
                for i, part in enumerate(parts):
                    yield f"{prefix}{key}#shard{i}", part
            else:
                yield prefix + key, self._source(key)

    def named_parameters(  # type: ignore[override]
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The original model's parameters, names and order, whatever the plan.

        So an optimizer built from ``parameters()`` indexes its state like one
        built on the model: its ``state_dict()`` moves between eager training
        and any plan.
        """
        names = self._unique_params if remove_duplicate else self._param_names
        yield from self._named_state(names, prefix, recurse)

    def named_buffers(  # type: ignore[override]
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The original model's buffers, names and order."""
        names = self._unique_buffers if remove_duplicate else self._buffer_names
        yield from self._named_state(names, prefix, recurse)

    def grad_pieces(self) -> tuple[list[Piece], int]:
        """Every parameter's gradient as a piece of the model's keys, and the key count.

        For ``runtime/grad_norm.py``. One process holds the whole model: each
        parameter once (a tied one under its first name), a channel-sharded one
        as its shards (a replicated scalar's shard 0 only).
        """
        index = {key: i for i, key in enumerate(self._keys)}
        out: list[Piece] = []
        for name, param in self.named_parameters():
            key, _, shard = name.partition("#shard")
            if param.grad is None:
                continue
            if not shard:
                out.append(Piece(index[key], False, param.grad))
                continue
            dim = self._program.shard_sources[key][2]
            if dim is None and int(shard) > 0:
                continue
            out.append(Piece(index[key], dim is not None, param.grad, speaks=int(shard) == 0))
        return out, len(self._keys)
