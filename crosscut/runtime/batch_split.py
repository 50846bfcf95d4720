"""A stage replicated over a group of devices, each on its share of the batch.

The data-parallel half of a width split (Mariana's worker group; the
model-parallel half is :mod:`crosscut.codegen.width`), exact against eager
mode. :class:`BatchSplitStage` runs the stage on every device of the group,
each on its share of the micro-batch (``tensor_split`` along dim 0, uneven
allowed). The parameters live once, on the leader; each forward broadcasts
them to the replicas with the differentiable ``Tensor.to``, so backward
reduces (sums) every replica's gradient into the leader's ``.grad`` — the
all-reduce of data parallelism, and the result equals eager because the loss
sees the concatenated batch. Batch norm in training normalises each share
with its own statistics (as micro-batches do), and only the leader's replica
updates the running statistics.

How the group's devices are driven: the shares run concurrently, one thread
per group device (the leader's share on the calling thread, the others on
threads the stage owns; see :mod:`crosscut.runtime.share_threads` for what
keeps that exact: per-share module views, a fixed-order gradient reduce,
sequential shares when the stage draws random numbers).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.func import functional_call
from torch.utils import _pytree as pytree

from crosscut.codegen.width import shard_bounds
from crosscut.errors import CodegenError, RuntimeError_
from crosscut.runtime.batch_shares import (
    batch_of,
    check_output,
    input_kind,
    join,
    share_bounds,
    split_rows,
)
from crosscut.runtime.device_thread import DeviceThread, stop_threads
from crosscut.runtime.share_threads import (
    draws_random,
    module_view,
    next_call,
    replicate,
    share_scope,
    thread_state,
)

__all__ = ["BatchSplitStage"]


def _moved(value: Any, dev: torch.device, copy: bool) -> Any:
    """``value`` with every tensor in it on ``dev`` (copied there when ``copy``)."""
    return pytree.tree_map(
        lambda t: t.to(dev, copy=copy) if isinstance(t, torch.Tensor) else t, value
    )


class BatchSplitStage(nn.Module):
    """A stage replicated over a device group, each device on its share of the batch.

    Shares run concurrently, one thread per group device: the leader's share
    on the calling thread (the stage's worker thread in the local executor),
    every other share on a persistent :class:`DeviceThread` this stage owns
    (created on first use, stopped by :meth:`close` or when the stage is
    collected). The threads belong to the stage rather than to the executor
    because the stage is what knows its group: it is called the same way
    inline, from an executor worker or directly, and the executor stays a
    one-thread-per-stage scheduler that never looks inside a stage.

    Results are those of running the shares one after another (``parallel=
    False``, kept for comparison and benchmarks): outputs are concatenated in
    share order; each share computes the same ops on the same tensors; a
    share's ``functional_call`` swaps tensors only in its own
    :func:`module_view`; the backward runs wherever the caller runs it. A stage
    that may draw random numbers in training (dropout, stochastic depth) runs
    its shares sequentially, so each share draws today's masks from the shared
    generator. On CUDA a share's thread adopts the caller's current device
    streams (current streams are per thread), so every kernel lands on the
    stream it would have used from the stage's thread. An exception in any
    share is re-raised on the caller's thread, after every share finished, as
    :class:`~crosscut.errors.RuntimeError_` naming the share and its device.
    """

    def __init__(
        self,
        inner: fx.GraphModule,
        devices: Sequence[torch.device],
        mutated: Sequence[int] = (),
        *,
        parallel: bool = True,
    ) -> None:
        """``mutated``: positions of inputs the stage changes in place (their shares are
        copied, since an in-place op on a view of the input would corrupt autograd).
        ``parallel``: run the shares concurrently (the default) or one after another."""
        super().__init__()
        self.mutated = set(mutated)
        if len(devices) < 2:
            raise CodegenError(
                "a batch split needs a group of at least two devices",
                value=[str(d) for d in devices],
                remedy="use split 'none' for a one-device stage",
            )
        self.inner = inner
        self.devices = [torch.device(d) for d in devices]
        self.parallel = parallel
        self._threads: list[DeviceThread] | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._check_traced_outputs()

    def _check_traced_outputs(self) -> None:
        """Refuse at build time what the first call would refuse (batch_shares.check_output).

        Uses the trace's values where the stage graph carries them (``meta["val"]``).
        """
        graph = self.inner.graph
        ins = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
        if any(v is None for v in ins):
            return
        batch = batch_of(ins, "a batch-split stage")
        out = next(n for n in graph.nodes if n.op == "output").args[0]
        for j, arg in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            val = arg.meta.get("val") if isinstance(arg, fx.Node) else arg
            if isinstance(arg, fx.Node) and val is None:
                continue
            check_output(val, batch, f"{j} ({getattr(arg, 'name', arg)!r})", "a batch-split stage")

    def forward(self, *args: Any) -> tuple[Any, ...]:
        batch = batch_of(args, "a batch-split stage")
        bounds = share_bounds(batch, len(self.devices))
        w = len(bounds)
        kinds = [input_kind(a, batch) for a in args]
        parts = [split_rows(a, w) if kind == "split" else None for a, kind in zip(args, kinds)]
        params = dict(self.inner.named_parameters())
        buffers = dict(self.inner.named_buffers())
        call = next_call()
        replicas = replicate(params, self.devices[:w])  # on this thread: one reduce node

        def share(i: int, module: nn.Module) -> tuple[Any, ...]:
            dev = self.devices[i]
            with share_scope(call, i):
                state: dict[str, torch.Tensor] = dict(replicas[i])
                for k, b in buffers.items():  # only the leader's replica updates running stats
                    state[k] = b if i == 0 else b.to(dev, copy=True)
                mine = [
                    # a split input's rows (copied where the stage writes them), else whole
                    _moved(a if p is None else p[i], dev, p is not None and j in self.mutated)
                    for j, (p, a) in enumerate(zip(parts, args))
                ]
                return tuple(functional_call(module, state, tuple(mine)))

        if self.parallel and not draws_random(self.inner):
            outs = self._concurrent(share, w, batch)
        else:
            outs = []
            for i in range(w):
                try:
                    outs.append(share(i, self.inner))
                except Exception as exc:
                    raise self._share_error(i, w, batch, exc) from exc
        return tuple(self._merge(j, [o[j] for o in outs], batch) for j in range(len(outs[0])))

    def _concurrent(
        self, share: Callable[[int, nn.Module], tuple[Any, ...]], w: int, batch: int
    ) -> list[tuple[Any, ...]]:
        """Shares 1.. on their device threads, share 0 here; results in share order."""
        threads = self._ensure_threads()
        views = [module_view(self.inner) for _ in range(1, w)]  # before share 0 swaps tensors
        enter = thread_state(self.devices)
        pending = []
        for i in range(1, w):

            def job(i: int = i) -> tuple[Any, ...]:
                with enter(self.devices[i]):
                    return share(i, views[i - 1])

            pending.append(threads[i - 1].submit(job))
        results: list[tuple[Any, ...] | None] = [None] * w
        errors: list[BaseException | None] = [None] * w
        try:
            results[0] = share(0, self.inner)
        except BaseException as leader_exc:
            errors[0] = leader_exc
        for i, res in enumerate(pending, start=1):
            res.done.wait()  # a plain join: every job sets it, also when it raised
            results[i], errors[i] = res.value, res.error
        for i, err in enumerate(errors):  # the first failed share, in share order
            if err is not None:
                if not isinstance(err, Exception):
                    raise err
                raise self._share_error(i, w, batch, err) from err
        return [r for r in results if r is not None]

    def _share_error(self, i: int, w: int, batch: int, exc: Exception) -> RuntimeError_:
        lo, hi = shard_bounds(batch, w)[i]  # the rows tensor_split gave this share
        return RuntimeError_(
            f"share {i} of {w} of a batch-split stage (rows {lo}:{hi} on {self.devices[i]}) "
            f"failed: {type(exc).__name__}: {exc}",
            value={"share": i, "device": str(self.devices[i]), "rows": [lo, hi]},
            remedy="the share and device locate the failure; run the stage unsplit to compare",
        )

    def _ensure_threads(self) -> list[DeviceThread]:
        if self._threads is None:
            self._threads = [
                DeviceThread(f"crosscut-share{i}-{d}") for i, d in enumerate(self.devices) if i
            ]
            self._finalizer = weakref.finalize(self, stop_threads, self._threads)
        return self._threads

    def close(self) -> None:
        """Stop the share threads (daemons, stopped at collection too; a later call restarts)."""
        if self._finalizer is not None:
            self._finalizer()
        self._threads, self._finalizer = None, None

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the threads behind (they start again on first use)."""
        state = dict(self.__dict__)
        state["_threads"], state["_finalizer"] = None, None
        return state

    def _merge(self, j: int, values: list[Any], batch: int) -> Any:
        """Join output ``j`` of the shares (the rule of :mod:`crosscut.runtime.batch_shares`)."""
        bounds = share_bounds(batch, len(self.devices))
        for (lo, hi), v in zip(bounds, values):
            check_output(v, hi - lo, str(j), "a batch-split stage")
        return join(values, self.devices[0])
