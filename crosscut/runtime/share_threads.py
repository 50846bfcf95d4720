"""Driving a batch-split stage's group devices from one thread each.

:class:`~crosscut.runtime.batch_split.BatchSplitStage` runs its leader's share on
the calling thread (the stage's worker thread in the local executor, Mariana's
one CPU thread per device) and every other share on a
:class:`~crosscut.runtime.device_thread.DeviceThread` of its own. Three things
make that safe and keep the results those of running the shares one after
another:

* :func:`module_view` — ``torch.func.functional_call`` swaps tensors into the
  module's ``_parameters``/``_buffers`` dicts for the duration of the call, so
  two threads must never call it on the same module objects. A view is a tree
  of new module objects sharing everything with the original (attributes,
  hooks, the fx-generated ``forward``) except those dicts, so a share's swap is
  invisible to the others and no parameter memory is copied. Views are built
  per call: attributes rebound on the original between calls (the step-mode
  batch norm's record dicts after a commit) are then always current.
* :func:`draws_random` — a share that draws random numbers (dropout, stochastic
  depth) draws from a generator the shares have in common; run concurrently,
  the masks would depend on thread timing. Such stages keep the sequential
  order, which gives every share the masks it draws today.
* :func:`share_order` — per-share records made under a lock (the step-mode
  batch norm's statistics) are appended in thread-timing order; each share
  runs under a ``(call, share)`` key its records carry, and sorting by it
  restores the sequential order, so the float64 sums at the commit are
  bit-identical run to run.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import fx, nn
from torch.nn.modules.dropout import _DropoutNd

from crosscut.runtime.thread_state import ThreadState

__all__ = [
    "draws_random",
    "module_view",
    "next_call",
    "replicate",
    "share_order",
    "share_scope",
    "thread_state",
]

_local = threading.local()
_calls = itertools.count()

# names (lower case) of functions and methods that draw random numbers
_RANDOM_FN_PARTS = ("dropout", "drop_path", "drop_block", "stochastic_depth", "rrelu", "gumbel")
_RANDOM_FN_NAMES = {
    "rand",
    "randn",
    "randint",
    "rand_like",
    "randn_like",
    "randint_like",
    "randperm",
    "bernoulli",
    "bernoulli_",
    "multinomial",
    "normal",
    "normal_",
    "uniform_",
    "random_",
    "exponential_",
    "geometric_",
    "cauchy_",
    "log_normal_",
    "poisson",
}


def next_call() -> int:
    """A new serial number for one forward of a batch-split stage (chronological per stage)."""
    return next(_calls)


def share_order() -> tuple[int, ...]:
    """The ``(call, share)`` key of the share running on this thread; ``()`` outside one."""
    order: tuple[int, ...] = getattr(_local, "order", ())
    return order


@contextmanager
def share_scope(call: int, share: int) -> Iterator[None]:
    """Mark this thread as running share ``share`` of forward ``call`` (see :func:`share_order`)."""
    before = getattr(_local, "order", ())
    _local.order = (call, share)
    try:
        yield
    finally:
        _local.order = before


class _Replicate(torch.autograd.Function):
    """Parameters to every share's device; backward: their sum, in a fixed order."""

    @staticmethod
    def forward(ctx: Any, devices: tuple[torch.device, ...], *params: torch.Tensor) -> Any:
        ctx.homes = [p.device for p in params]
        # a parameter no share's loss reaches keeps grad None, as in eager (autograd would
        # otherwise hand zeros in, and an optimizer's weight decay then moves it)
        ctx.set_materialize_grads(False)
        return tuple(p.to(d) for d in devices for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        n = len(ctx.homes)
        totals: list[torch.Tensor | None] = []
        for j, home in enumerate(ctx.homes):
            total: torch.Tensor | None = None
            for g in reversed(grads[j::n]):  # last share first, as sequential autograd did
                if g is not None:
                    total = g.to(home) if total is None else total + g.to(home)
            totals.append(total)
        return (None, *totals)


def replicate(
    params: Mapping[str, torch.Tensor], devices: Sequence[torch.device]
) -> list[dict[str, torch.Tensor]]:
    """``params`` on each of ``devices``, differentiably: the gradients' all-reduce is one op.

    Without it each share's ops would accumulate into the leader's ``.grad``
    directly, in the order autograd's engine runs them — and the engine orders
    ready nodes by sequence numbers that torch counts per thread, so shares
    built on different threads would sum their gradients in a different order
    (for three or more terms, different bits). One node per forward sums them
    in a fixed order instead: the last share first, the order in which the
    engine ran sequentially built shares, whose node numbers grow share by share.
    """
    names = list(params)
    if not torch.is_grad_enabled() or not any(p.requires_grad for p in params.values()):
        return [{k: params[k].to(d) for k in names} for d in devices]
    flat = _Replicate.apply(tuple(devices), *(params[k] for k in names))
    return [
        dict(zip(names, flat[i * len(names) : (i + 1) * len(names)])) for i in range(len(devices))
    ]


def module_view(module: nn.Module) -> nn.Module:
    """A tree of new module objects over ``module``'s own tensors (module docstring).

    Same class and attributes as the original (shared, not copied), fresh
    ``_parameters`` / ``_buffers`` / ``_modules`` dicts holding the same
    tensors and views of the children. ``copy.copy`` is not used: on an
    ``fx.GraphModule`` it recompiles the code.
    """
    view = object.__new__(type(module))
    state = dict(module.__dict__)
    state["_parameters"] = dict(module._parameters)
    state["_buffers"] = dict(module._buffers)
    state["_modules"] = {
        k: (module_view(m) if m is not None else None) for k, m in module._modules.items()
    }
    object.__setattr__(view, "__dict__", state)
    return view


def _random_name(name: str) -> bool:
    low = name.lower()
    return (
        low in _RANDOM_FN_NAMES
        or any(p in low for p in _RANDOM_FN_PARTS)
        or low in _SEEDED  # an op runtime/rng.py wrapped is still a random op
    )


# the wrappers runtime/rng.py puts around random ops (they draw inside)
_SEEDED = frozenset({"seeded_call", "seeded_function", "seeded_method"})


def draws_random(module: nn.Module) -> bool:
    """Whether a forward of ``module`` may draw random numbers (conservatively).

    Dropout-like modules count in training mode with ``p > 0`` (or any module
    whose class name says it drops: timm's ``DropPath``, torchvision's
    ``StochasticDepth``); a random function or method in any fx graph counts
    always, since a traced ``training=self.training`` is a constant.
    """
    for m in module.modules():
        if isinstance(m, fx.GraphModule):
            for n in m.graph.nodes:
                if n.op == "call_function" and _random_name(getattr(n.target, "__name__", "")):
                    return True
                if n.op == "call_method" and _random_name(str(n.target)):
                    return True
        if not m.training:
            continue
        if isinstance(m, (_DropoutNd, nn.RReLU)):
            if float(getattr(m, "p", 1.0)) > 0.0 or isinstance(m, nn.RReLU):
                return True
        else:
            name = type(m).__name__.lower()
            if "drop" in name or "stochasticdepth" in name:
                return True
    return False


def thread_state(devices: Sequence[torch.device]) -> Callable[[torch.device], Any]:
    """The caller's thread-local torch state, to enter on a share's thread.

    Grad mode, inference mode, autocast and saved-tensor hooks are per thread
    in torch: the one capture the executors use
    (:class:`crosscut.runtime.thread_state.ThreadState`). The current CUDA device
    and streams are per thread too: a share's thread takes the caller's for
    every CUDA device of the group, so cross-device copies synchronise with
    the streams the caller's later ops run on.
    """
    state = ThreadState.capture(d.type for d in devices)
    cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
    streams = [torch.cuda.current_stream(d) for d in cuda]

    @contextmanager
    def enter(device: torch.device) -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(state.applied())
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
                for s in streams:
                    stack.enter_context(torch.cuda.stream(s))
            yield

    return enter
