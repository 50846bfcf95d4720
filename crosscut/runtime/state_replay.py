"""A recomputed forward sees the state its first pass saw, and writes none of it.

A stage that recomputes runs its forward twice per micro-batch: once in the
step (the first pass) and again when backward reaches it. Every write the
forward makes to model state — batch norm's running statistics and batch
counter (a leaf ``nn.BatchNorm2d``, or traced through as in timm's
``BatchNormAct2d`` and ``F.batch_norm(..., training=True)`` on buffers), a
call counter ``self.calls.add_(1)``, an EMA ``self.avg.mul_(0.9).add_(...)`` —
would otherwise happen twice, and the recomputation would read the state
*after* later micro-batches moved it (an EMA multiplied into the output gives
other gradients).

The mechanism does not look at op names, so it covers every kind of write:

* before the first pass, every buffer the stage's forward writes is cloned
  (:meth:`StateReplay.before`); which ones it writes is learned on the first
  call in each train/eval mode, which clones every buffer and keeps the ones
  whose version counter moved (views and in-place ops of any name move it) or
  whose value changed (batch norm's kernel updates its running statistics
  without moving their counter); later calls clone those only;
* the recomputation runs against copies of those clones
  (:meth:`StateReplay.replaying`): the stage's modules hold the copies in
  their ``_buffers`` for its duration, so it reads the first pass's values and
  its writes land in tensors thrown away afterwards. The buffers themselves
  are never written, so nothing autograd saved from them goes stale, and no
  version counter of theirs moves.

A write the first call did not make (a data-dependent leaf that writes only
sometimes) or a parameter written in forward cannot be replayed; both are
refused by name at the call that finds them, before backward runs twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from crosscut.errors import RuntimeError_

__all__ = ["Snapshot", "StateReplay"]

Snapshot = dict[str, torch.Tensor]  # buffer key (stage-local) -> its value before the pass


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b.detach()))


class StateReplay:
    """What one stage module's forward writes, learned per train/eval mode (module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.written: dict[bool, set[str]] = {}  # training flag -> buffer keys its forward writes

    def _buffers(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_buffers())

    def _versions(self) -> dict[str, int]:
        out = {"buffer:" + k: b._version for k, b in self._buffers().items()}
        out.update({"parameter:" + k: p._version for k, p in self.module.named_parameters()})
        return out

    def before(self) -> tuple[dict[str, int], Snapshot]:
        """Version counters of the stage's state, and clones of what its forward writes."""
        known = self.written.get(self.module.training)
        snap = {
            k: b.detach().clone() for k, b in self._buffers().items() if known is None or k in known
        }
        return self._versions(), snap

    def after(self, versions: dict[str, int], snap: Snapshot) -> Snapshot:
        """The clones of the buffers the first pass wrote (others dropped); refusals."""
        moved = [k for k, v in self._versions().items() if versions.get(k) != v]
        if self.module.training not in self.written:  # learning: every buffer was cloned
            now = self._buffers()
            moved += [
                "buffer:" + k
                for k, b in snap.items()
                if "buffer:" + k not in moved and not _same(b, now[k])
            ]
        params = [k.removeprefix("parameter:") for k in moved if k.startswith("parameter:")]
        if params:
            raise RuntimeError_(
                f"a recomputing stage writes parameter {params[0]!r} in forward: the "
                "recomputation cannot replay a parameter write without changing what "
                "autograd saved from it",
                value={"parameters": params},
                remedy="recompute=False for this stage (a list of flags, one per stage), or "
                "write the parameter outside forward (e.g. after optimizer.step())",
            )
        bufs = [k.removeprefix("buffer:") for k in moved]
        missing = [k for k in bufs if k not in snap]
        if missing:
            raise RuntimeError_(
                f"a recomputing stage's forward wrote buffer {missing[0]!r}, which an earlier "
                "call in this mode did not write (a data-dependent write), so its value before "
                "this pass was not kept and the recomputation cannot replay it",
                value={"buffers": missing},
                remedy="recompute=False for this stage (a list of flags, one per stage)",
            )
        mode = self.module.training
        self.written[mode] = self.written.get(mode, set()) | set(bufs)
        return {k: v for k, v in snap.items() if k in self.written[mode]}

    @contextmanager
    def replaying(self, snap: Snapshot) -> Iterator[None]:
        """Every module of the stage holds a copy of ``snap``'s value in place of the buffer.

        Copies, not ``snap`` itself: a second backward over a retained graph
        recomputes again from the same values.
        """
        originals = self._buffers()
        swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
        for key, value in snap.items():
            old = originals[key]
            new = value.clone()
            for mod in self.module.modules():
                for name, b in list(mod._buffers.items()):
                    if b is old:
                        mod._buffers[name] = new
                        swapped.append((mod, name, old))
        try:
            yield
        finally:
            for mod, name, old in reversed(swapped):
                mod._buffers[name] = old
