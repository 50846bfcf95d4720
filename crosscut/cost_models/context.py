"""In-context profiling: per-node times measured inside real training steps.

Timing each node alone (``profiled.py``'s isolated method) over-prices forward
ops that, in a real step, run back to back on data the previous op just
wrote: on resnet50 at batch 16 on a CPU, isolated convolution forwards summed
to 1.20 s against 0.87 s inside the step (torch.profiler), batch norm 0.35 s
against 0.22 s. PipeDream's profiler times layers inside real iterations for
the same reason. Here each repeat runs the whole graph forward and backward:

* forward: a :class:`torch.fx.Interpreter` marks the clock before and after
  every node (the interpreter's own work between nodes is no op's: compiled
  stages run generated code without it);
* backward: a hook on every node output marks when its gradient is ready —
  the moment autograd starts that node's backward — and the time up to the
  next hook is charged to it. On one device autograd runs the graph in
  reverse order on one thread, so the intervals tile the backward pass.

The clock (:class:`_Clock`) is the host's on a CPU. On a GPU it is CUDA events
recorded on the stream, read after one synchronisation at the end of the
step: the kernels then run back to back as in a real step. Synchronising
around every node, as this module first did, charged each node a launch and a
round trip: on an H100 a ResNet-50 fp16 step at batch 256 summed to 70 ms
against 52 ms measured, and EfficientNet-B0's to 87 ms against 47 ms.

The median over repeats is kept per node and direction. The whole steps'
times are handed back too (``steps``): how far they spread says how far one
profile may be from another taken a moment later, which is what the strategy
search needs to know before it prefers one plan to another by a few per cent.

A zero-bubble schedule runs each backward as two passes (``split_backward.py``):
``B``, the gradients a stage sends upstream, and ``W``, its weight gradients.
How a node's backward divides between them is not a fixed half: on a CPU a
convolution's weight gradient at small spatial size costs twice its data
gradient, and batch norm runs its reductions in both passes.
:func:`measure_split` times the two passes as the runtime runs them — the
same hooks tile ``B``; each of ``W``'s restarts is charged to the operator
owning its parameters.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from crosscut.split_backward import backward_input, weight_steps

__all__ = ["host_bound", "measure_in_context", "measure_split"]

_SKIP = ("placeholder", "get_attr", "output")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _Clock:
    """Marks in a step's time line: host seconds on a CPU, CUDA events on a GPU.

    A mark costs no synchronisation, so the device runs as in a real step;
    :meth:`seconds` reads an interval once :meth:`done` has waited for the device.
    """

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.cuda = dev.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.dev))
        return event

    def done(self) -> None:
        _sync(self.dev)

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return float(end - start)
        return float(start.elapsed_time(end)) / 1e3


class _Timer(fx.Interpreter):
    """Runs the graph, marking the clock after each compute node and hooking its
    outputs' gradients.

    The hooks capture only the clock and the ``stamps`` list, never the timer: a
    hook lives in the autograd graph, and a hook holding the interpreter (whose
    environment holds the graph's tensors) makes a cycle through C++ that
    Python's collector cannot see. Each profile then kept its device copy of
    the model alive; the fourth ResNet-50 profile in one process ran out of an
    H100's 80 GB.
    """

    def __init__(self, gm: fx.GraphModule, clock: _Clock, hooks: bool) -> None:
        super().__init__(gm)
        self.clock = clock
        self.hooks = hooks
        self.marks: list[tuple[str, Any, Any]] = []  # (node, marks around its forward)
        self.stamps: list[tuple[Any, str]] = []  # (mark when its gradient was ready, node)

    def run_node(self, n: fx.Node) -> Any:
        if n.op in _SKIP:
            return super().run_node(n)
        before = self.clock.mark()
        out = super().run_node(n)
        self.marks.append((n.name, before, self.clock.mark()))
        if self.hooks:
            hook = _stamper(self.clock, self.stamps, n.name)
            fx.node.map_aggregate(out, lambda t: _register(t, hook))
        return out

    def forward_times(self) -> dict[str, float]:
        """Each node's forward seconds (read after :meth:`_Clock.done`)."""
        return {name: self.clock.seconds(a, b) for name, a, b in self.marks}


def _stamper(clock: _Clock, stamps: list[tuple[Any, str]], name: str) -> Any:
    def stamp(_grad: torch.Tensor) -> None:
        stamps.append((clock.mark(), name))

    return stamp


def _register(t: Any, hook: Any) -> None:
    if isinstance(t, torch.Tensor) and t.requires_grad:
        t.register_hook(hook)  # type: ignore[no-untyped-call]


def _loss(out: Any) -> torch.Tensor | None:
    parts: list[torch.Tensor] = []
    fx.node.map_aggregate(
        out,
        lambda t: (
            parts.append(t.float().mean())
            if isinstance(t, torch.Tensor) and t.requires_grad
            else None
        ),
    )
    return torch.stack(parts).sum() if parts else None


def _backward_times(clock: _Clock, stamps: list[tuple[Any, str]], end: Any) -> dict[str, float]:
    """Charge each interval between consecutive gradient hooks to the node that fired
    first. The hooks run in order on autograd's one thread per device, so the list is
    already in time order."""
    out: dict[str, float] = defaultdict(float)
    for (mark, name), nxt in zip(stamps, [*stamps[1:], (end, "")]):
        out[name] += clock.seconds(mark, nxt[0])
    return out


def measure_in_context(
    gm: fx.GraphModule,
    inputs: list[torch.Tensor],
    dev: torch.device,
    training: bool,
    warmup: int,
    repeats: int,
    steps: list[float] | None = None,
    plain: bool | None = None,
) -> dict[str, tuple[float, float]]:
    """(forward s, backward s) of every compute node, medians over ``repeats`` full steps.

    ``steps``, if given, receives each timed repeat's whole-step seconds.

    ``plain`` (default: on a GPU) also times ``repeats`` uninstrumented steps — the
    module's generated code, no interpreter, no hooks — and where the nodes' times
    sum past their median, scales every node down to it (:func:`host_bound`);
    ``steps`` then receives the plain steps."""
    fwd: dict[str, list[float]] = defaultdict(list)
    bwd: dict[str, list[float]] = defaultdict(list)
    names = [n.name for n in gm.graph.nodes if n.op not in _SKIP]
    clock = _Clock(dev)
    timed: list[float] = []
    for i in range(warmup + repeats):
        timer = _Timer(gm, clock, hooks=training)
        _sync(dev)
        start = clock.mark()
        _step(lambda: timer.run(*inputs), gm, training)  # noqa: B023 (called at once)
        end = clock.mark()
        clock.done()
        if i < warmup:
            continue
        timed.append(clock.seconds(start, end))
        ahead = timer.forward_times()
        back = _backward_times(clock, timer.stamps, end)
        for name in names:
            fwd[name].append(ahead.get(name, 0.0))
            bwd[name].append(back.get(name, 0.0))
    times = {n: (statistics.median(fwd[n]), statistics.median(bwd[n])) for n in names}
    if dev.type == "cuda" if plain is None else plain:
        timed = _plain_steps(gm, inputs, clock, training, warmup, repeats)
        times = host_bound(times, statistics.median(timed))
    if steps is not None:
        steps.extend(timed)
    return times


def _step(forward: Callable[[], Any], gm: fx.GraphModule, training: bool) -> None:
    """One whole step: ``forward``, then, in training, the backward of :func:`_loss`."""
    with torch.enable_grad() if training else torch.no_grad():
        loss = _loss(forward()) if training else None
        if loss is not None:
            gm.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)


def _plain_steps(
    gm: fx.GraphModule,
    inputs: list[torch.Tensor],
    clock: _Clock,
    training: bool,
    warmup: int,
    repeats: int,
) -> list[float]:
    """Seconds of ``repeats`` whole steps as a compiled stage runs them: no interpreter,
    no hooks."""
    out: list[float] = []
    for i in range(warmup + repeats):
        _sync(clock.dev)
        start = clock.mark()
        _step(lambda: gm(*inputs), gm, training)
        end = clock.mark()
        clock.done()
        if i >= warmup:
            out.append(clock.seconds(start, end))
    return out


def host_bound(
    times: dict[str, tuple[float, float]], step_s: float
) -> dict[str, tuple[float, float]]:
    """``times`` scaled down, all alike, so that they sum to ``step_s`` if they sum past it.

    On a GPU the clock is the device's, and the device waits whenever the host falls
    behind it. The interpreter and the hooks cost the host tens of microseconds a
    node that a compiled stage does not pay, so where kernels are short the
    instrumented step is host-bound and every interval grows by waiting: on an H100,
    ResNet-50 fp16 channels-last at batch 256 summed to 61.6 ms against a 52.0 ms
    step, EfficientNet-B0 to 80.4 ms against 48.4 ms (fp32 and bf16 steps, whose
    kernels are longer, were within 1 %). The waits fall mostly on short nodes, so
    scaling all alike keeps the step's total right and errs on how it divides.
    """
    total = sum(f + b for f, b in times.values())
    if total <= step_s or total <= 0:
        return times
    k = step_s / total
    return {n: (f * k, b * k) for n, (f, b) in times.items()}


def _param_owners(gm: fx.GraphModule) -> dict[int, str]:
    """id of each parameter -> the node that uses it: its module's call, or the first
    user of the ``get_attr`` that reads it."""
    owners: dict[int, str] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            for p in gm.get_submodule(str(n.target)).parameters():
                owners.setdefault(id(p), n.name)
        elif n.op == "get_attr" and n.users:
            obj: Any = gm
            for part in str(n.target).split("."):
                obj = getattr(obj, part)
            if isinstance(obj, torch.Tensor):
                owners.setdefault(id(obj), next(iter(n.users)).name)
    return owners


def measure_split(
    gm: fx.GraphModule, inputs: list[torch.Tensor], dev: torch.device, warmup: int, repeats: int
) -> dict[str, tuple[float, float]]:
    """(``B`` s, ``W`` s) of every compute node when its backward is split, medians over
    ``repeats`` steps; a node with no parameters has all its backward in ``B``.

    The inputs get gradients as a middle stage's received values do, so every
    convolution computes its data gradient in ``B`` and its weight gradient in ``W``.
    """
    names = [n.name for n in gm.graph.nodes if n.op not in _SKIP]
    owners = _param_owners(gm)
    b_all: dict[str, list[float]] = defaultdict(list)
    w_all: dict[str, list[float]] = defaultdict(list)
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    wanted = [t for t in leaves if t.requires_grad]
    clock = _Clock(dev)
    for i in range(warmup + repeats):
        timer = _Timer(gm, clock, hooks=True)
        gm.zero_grad(set_to_none=True)
        for t in wanted:
            t.grad = None
        with torch.enable_grad():
            loss = _loss(timer.run(*leaves))
            if loss is None:
                return {}
            pending = backward_input([loss], [None], wanted)
            end_b = clock.mark()
            b_stamps = list(timer.stamps)  # W's restarts may fire the hooks again
            restarts: list[tuple[str, Any, Any]] = []
            for params, run in weight_steps(pending):
                t0 = clock.mark()
                run()
                owner = next((owners[id(p)] for p in params if id(p) in owners), "")
                restarts.append((owner, t0, clock.mark()))
        clock.done()
        if i < warmup:
            continue
        back = _backward_times(clock, b_stamps, end_b)
        wgt: dict[str, float] = defaultdict(float)
        for owner, t0, t1 in restarts:
            wgt[owner] += clock.seconds(t0, t1)
        for name in names:
            b_all[name].append(back.get(name, 0.0))
            w_all[name].append(wgt.get(name, 0.0))
    return {n: (statistics.median(b_all[n]), statistics.median(w_all[n])) for n in names}
