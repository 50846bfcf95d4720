"""In-context profiling: per-node times measured inside real training steps.

Timing each node alone (``profiled.py``'s isolated method) over-prices forward
ops that, in a real step, run back to back on data the previous op just
wrote: on resnet50 at batch 16 on a CPU, isolated convolution forwards summed
to 1.20 s against 0.87 s inside the step (torch.profiler), batch norm 0.35 s
against 0.22 s. PipeDream's profiler times layers inside real iterations for
the same reason. Here each repeat runs the whole graph forward and backward:

* forward: a :class:`torch.fx.Interpreter` times every node as it runs
  (synchronising CUDA around it);
* backward: a hook on every node output records when its gradient is ready —
  the moment autograd starts that node's backward — and the time up to the
  next hook is charged to it. On one device autograd runs the graph in
  reverse order on one thread, so the intervals tile the backward pass.

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
from typing import Any

import torch
from torch import fx

from crosscut.split_backward import backward_input, weight_steps

__all__ = ["measure_in_context", "measure_split"]

_SKIP = ("placeholder", "get_attr", "output")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _Timer(fx.Interpreter):
    """Runs the graph, timing each compute node and hooking its outputs' gradients."""

    def __init__(self, gm: fx.GraphModule, dev: torch.device, hooks: bool) -> None:
        super().__init__(gm)
        self.dev = dev
        self.hooks = hooks
        self.fwd: dict[str, float] = {}
        self.stamps: list[tuple[float, str]] = []

    def run_node(self, n: fx.Node) -> Any:
        if n.op in _SKIP:
            return super().run_node(n)
        _sync(self.dev)
        t0 = time.perf_counter()
        out = super().run_node(n)
        _sync(self.dev)
        self.fwd[n.name] = time.perf_counter() - t0
        if self.hooks:
            fx.node.map_aggregate(out, lambda t: self._hook(n.name, t))
        return out

    def _hook(self, name: str, t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.requires_grad:

            def stamp(_grad: torch.Tensor) -> None:
                _sync(self.dev)
                self.stamps.append((time.perf_counter(), name))

            t.register_hook(stamp)  # type: ignore[no-untyped-call]


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


def _backward_times(stamps: list[tuple[float, str]], end: float) -> dict[str, float]:
    """Charge each interval between consecutive gradient hooks to the node that fired first."""
    out: dict[str, float] = defaultdict(float)
    ordered = sorted(stamps)
    for (t, name), nxt in zip(ordered, [*ordered[1:], (end, "")]):
        out[name] += nxt[0] - t
    return out


def measure_in_context(
    gm: fx.GraphModule,
    inputs: list[torch.Tensor],
    dev: torch.device,
    training: bool,
    warmup: int,
    repeats: int,
    steps: list[float] | None = None,
) -> dict[str, tuple[float, float]]:
    """(forward s, backward s) of every compute node, medians over ``repeats`` full steps.

    ``steps``, if given, receives each timed repeat's whole-step seconds."""
    fwd: dict[str, list[float]] = defaultdict(list)
    bwd: dict[str, list[float]] = defaultdict(list)
    names = [n.name for n in gm.graph.nodes if n.op not in _SKIP]
    for i in range(warmup + repeats):
        timer = _Timer(gm, dev, hooks=training)
        _sync(dev)
        start = time.perf_counter()
        with torch.enable_grad() if training else torch.no_grad():
            out = timer.run(*inputs)
            loss = _loss(out) if training else None
            if loss is not None:
                gm.zero_grad(set_to_none=True)
                torch.autograd.backward(loss)
        _sync(dev)
        end = time.perf_counter()
        if i < warmup:
            continue
        if steps is not None:
            steps.append(end - start)
        back = _backward_times(timer.stamps, end)
        for name in names:
            fwd[name].append(timer.fwd.get(name, 0.0))
            bwd[name].append(back.get(name, 0.0))
    return {n: (statistics.median(fwd[n]), statistics.median(bwd[n])) for n in names}


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
    for i in range(warmup + repeats):
        timer = _Timer(gm, dev, hooks=True)
        gm.zero_grad(set_to_none=True)
        for t in wanted:
            t.grad = None
        with torch.enable_grad():
            loss = _loss(timer.run(*leaves))
            if loss is None:
                return {}
            pending = backward_input([loss], [None], wanted)
            _sync(dev)
            back = _backward_times(timer.stamps, time.perf_counter())
            wgt: dict[str, float] = defaultdict(float)
            for params, run in weight_steps(pending):
                t0 = time.perf_counter()
                run()
                _sync(dev)
                owner = next((owners[id(p)] for p in params if id(p) in owners), "")
                wgt[owner] += time.perf_counter() - t0
        if i < warmup:
            continue
        for name in names:
            b_all[name].append(back.get(name, 0.0))
            w_all[name].append(wgt.get(name, 0.0))
    return {n: (statistics.median(b_all[n]), statistics.median(w_all[n])) for n in names}
