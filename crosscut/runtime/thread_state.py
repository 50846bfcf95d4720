"""The caller's thread-local torch state, carried to the threads that run its work.

torch keeps several switches per thread: grad mode, inference mode, autocast
(per device type: enabled and dtype, plus whether autocast caches its casts)
and the default saved-tensor hooks (``torch.autograd.graph.save_on_cpu`` and
friends). A compiled module's work runs on threads that are not the caller's
— a stage worker of the local executor, a share thread of a batch-split stage
— and a fresh thread starts with torch's defaults. Without this module,
``with torch.autocast("cpu", dtype=torch.bfloat16): compiled(x)`` ran in
bfloat16 only where a stage happened to run on the caller's thread (one
micro-batch, inline) and in float32 on worker threads: the same call gave
different dtypes and numbers depending on ``microbatches``.

So every call captures the state once, on the caller's thread
(:meth:`ThreadState.capture`), and each thread that runs part of the call
enters it (:meth:`ThreadState.applied`) around its work. Under torchrun the
distributed executor runs its schedule on the caller's thread, so the state
holds there by construction and nothing is captured.

Not carried, on purpose: torch function/dispatch modes (``FlopCounterMode``,
``TorchDispatchMode`` subclasses) and the profiler. Their objects are not
written for concurrent use from several threads; run such tools on an
uncompiled model, or with one micro-batch on CPU (inline on the caller's
thread). Global (not per-thread) settings — default dtype, deterministic
algorithms, anomaly mode, random generators — need no carrying.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from crosscut.runtime.draw_key import current_key, draw_scope

__all__ = ["ThreadState"]

# device types whose autocast state is always captured (others when a stage runs on them)
_ALWAYS = ("cpu", "cuda")


@dataclass(frozen=True)
class ThreadState:
    """A snapshot of one thread's torch switches, to be entered on another thread."""

    grad: bool
    inference: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]  # (device type, enabled, dtype)
    autocast_cache: bool
    saved_tensor_hooks: tuple[Callable[..., Any], Callable[..., Any]] | None
    draw_key: tuple[int, int] | None = None  # random ops' (call seed, micro-batch): runtime/rng.py

    @classmethod
    def capture(cls, device_types: Iterable[str] = ()) -> ThreadState:
        """The calling thread's state; autocast for CPU, CUDA and ``device_types``."""
        kinds = sorted(
            {*_ALWAYS, *device_types} - {"meta"},
        )
        autocast = tuple(
            (k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k))
            for k in kinds
            if torch.amp.is_autocast_available(k)
        )
        return cls(
            grad=torch.is_grad_enabled(),
            inference=torch.is_inference_mode_enabled(),
            autocast=autocast,
            autocast_cache=torch.is_autocast_cache_enabled(),
            saved_tensor_hooks=torch._C._autograd._top_saved_tensors_default_hooks(False),
            draw_key=current_key(),
        )

    @property
    def autocasting(self) -> bool:
        """Whether autocast is on for any device type."""
        return any(on for _, on, _ in self.autocast)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Enter this state on the current thread (and restore the thread's own on exit)."""
        with ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self.inference))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            # Autocast's cast cache shares one 16-bit copy of a weight among every use in
            # the region, here all of a stage's micro-batches: a differentiable forward then
            # sums their gradients at that copy in an order set by which thread created
            # which autograd node first, so fp16 gradients changed from run to run
            # (tests/test_precision.py). Uncached, each use casts anew and its gradient
            # reaches the fp32 weight on its own: the same numbers every run.
            cache = self.autocast_cache and not self.grad
            for kind, on, dtype in self.autocast:
                stack.enter_context(
                    torch.autocast(kind, dtype=dtype, enabled=on, cache_enabled=cache)
                )
            if self.saved_tensor_hooks is not None:
                pack, unpack = self.saved_tensor_hooks
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
            stack.enter_context(draw_scope(self.draw_key))
            yield
