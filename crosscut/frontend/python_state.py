"""Python-level state a forward changes: kept where the graph can hold it, else refused.

The trace turns tensor work into graph nodes, buffers included (a counter
``self.calls.add_(1)`` is a node that runs on every call). Python code runs
once, while tracing: ``self.step += 1`` bumps an int attribute then, and the
graph holds the value it had at that moment as a constant — the compiled
module would compute with it frozen, call after call, where eager counts.

A buffer rebound to a value the forward computes (``self.calls += 1`` on a
tensor buffer, ``self.ema = 0.9 * self.ema + 0.1 * m``: the tracer reads
buffers as graph values, so both are rebindings) is different: the graph has
the new value, only nothing would carry it to the next call.
:func:`rebound_buffers` finds such rebindings after each trace (and binds the
buffer back), and :func:`persist_rebound` ends the graph with an in-place
write of the last value into the buffer — what ``self.ema.copy_(...)`` would
do, so the rules for buffers written in forward then apply to it (with
several micro-batches it is refused by name, as every such write is). Later
reads in the same forward already read the new value's node; earlier ones
read a clone, since eager leaves the old tensor unchanged (autograd may have
saved it). The value is
detached: a buffer holding a gradient path would backpropagate into the
previous call, which eager refuses on the next ``backward``.
:func:`refuse_changed_layout` refuses a rebinding that changes the buffer's
shape or dtype, which an in-place write cannot reproduce.

What no rewrite reproduces, :func:`refusing_python_state` refuses: it records
every module's attributes (their identity) and buffer bindings around the
trace, and afterwards — also when the trace failed on the change itself —
puts them back as they were (the caller's model is left unchanged) and raises
:class:`~crosscut.errors.TraceError` naming the first one that changed, with
the remedy: hold the state in a buffer updated in place.

A draw from Python's or NumPy's global generator while fx traces
(``if random.random() < self.p: return x``, stochastic depth written in
Python) would be frozen into the graph — that block dropped on every call,
or never — so it is refused, naming the function, with torch's generator as
the remedy (crosscut traces torch's random ops and replays them).

A random op given a generator of the model's own (``torch.rand(shape,
generator=self.g)``, or a module-level one) is refused too: the compiled
stages hold a copy of that generator (fx keeps it as a constant of the graph),
so the model's own is never advanced by a call and re-seeding it changes
nothing, where eager draws from it in order. The remedy is torch's default
generator, which crosscut seeds per call, micro-batch and op. Every
generator the model holds gets its state back after tracing (propagation and
the probe for ops that mix samples draw from it).

The same holds for what forward stores in a list, dict or set a module keeps
(``self.feats.append(y)``): it runs once, storing a Proxy, and never on a
call. Their contents are put back too (nothing traced, fake or probed is left
in the caller's model), and a stored value computed from the inputs is
refused, with the remedy of an output or a hook. A stored value made from
parameters alone is a cache (timm's attention-bias caches in eval): the graph
already computes it, so only the contents are put back.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.fx
from torch import Tensor, nn
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.utils._pytree import tree_flatten

from crosscut.errors import TraceError

__all__ = [
    "persist_rebound",
    "rebound_buffers",
    "refuse_changed_layout",
    "refuse_own_generators",
    "refusing_python_state",
]

_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None))


def _attributes(m: nn.Module) -> dict[str, Any]:
    """A module's own Python attributes (torch's bookkeeping and ``training`` aside)."""
    return {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training"}


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    return type(a) is type(b) and isinstance(a, _IMMUTABLE) and bool(a == b)


def _rederived(m: nn.Module) -> set[str]:
    """Attributes a module's own pre-hook sets afresh before every call, from its parameters:
    torch's hook-based ``spectral_norm`` (``weight`` from ``weight_orig`` and its ``u``/``v``
    buffers). Such a module runs whole (a leaf: ``stock.hooked``), so the hook runs on every
    call of the compiled module and nothing is frozen. (The hook-based ``weight_norm`` is
    refused before tracing: ``model_check.py``.)"""
    return {h.name for h in m._forward_pre_hooks.values() if isinstance(h, SpectralNorm)}


def _changes(
    model: nn.Module, saved: list[tuple[str, nn.Module, dict[str, Any], dict[str, Any]]]
) -> list[tuple[str, str]]:
    """``(key, kind)`` for each attribute or buffer binding that moved, in module order."""
    out: list[tuple[str, str]] = []
    for path, m, attrs, buffers in saved:
        prefix = f"{path}." if path else ""
        now = _attributes(m)
        for k in sorted((set(attrs) | set(now)) - _rederived(m)):
            if k not in now or k not in attrs or not _same(attrs[k], now[k]):
                out.append((prefix + k, "attribute"))
        for k in sorted(set(buffers) | set(m._buffers)):
            if buffers.get(k) is not m._buffers.get(k):
                out.append((prefix + k, "buffer"))
    return out


def _refusal(key: str, kind: str, every: list[str]) -> TraceError:
    if kind == "buffer":
        return TraceError(
            f"forward rebinds buffer {key!r} (self.{key.rpartition('.')[2]} = ...) to a tensor "
            "the traced graph does not compute (made from constants, None, or set by a leaf "
            "module's own forward, which runs as Python): the compiled "
            "module would not carry it to the next call, which would start from the old value",
            value={"rebound": every},
            remedy=f"update the buffer in place: self.{key.rpartition('.')[2]}.add_(1), "
            ".copy_(new_value), .mul_(...) (crosscut traces in-place writes to buffers)",
        )
    return TraceError(
        f"forward changes the Python attribute {key!r}: tracing runs Python code once, so "
        "the compiled module would keep the value it had while tracing, frozen, where eager "
        "changes it on every call",
        value={"changed": every},
        remedy="keep the value in a buffer updated in place (self.register_buffer('step', "
        "torch.zeros((), dtype=torch.long)) and self.step.add_(1) in forward), or change "
        "the attribute outside forward",
    )


_CONTAINERS = (list, dict, set)


def _containers(model: nn.Module) -> list[tuple[str, Any, Any]]:
    """``(qualified name, container, shallow copy)`` of every list, dict and set attribute."""
    out = []
    for path, m in model.named_modules():
        for k, v in _attributes(m).items():
            if isinstance(v, _CONTAINERS):
                copy = dict(v) if isinstance(v, dict) else list(v)
                out.append((f"{path}.{k}" if path else k, v, copy))
    return out


def _stored(now: Any, before: Any) -> list[Any] | None:
    """What was stored in a container since ``before`` (its shallow copy); None: unchanged."""
    if isinstance(now, dict):
        if now.keys() == before.keys() and all(now[k] is before[k] for k in now):
            return None
        return [v for k, v in now.items() if k not in before or v is not before[k]]
    old = {id(x) for x in before}
    if len(now) == len(before) and all(id(x) in old for x in now):
        return None
    return [x for x in now if id(x) not in old] or [None]


def _from_inputs(value: Any) -> bool:
    """Whether a stored value (or a tuple, list or dict of them) is a traced value
    computed from the forward's inputs."""
    if isinstance(value, dict):
        value = list(value.values())
    items = value if isinstance(value, (tuple, list)) else [value]
    todo = [a.node for a in items if isinstance(a, torch.fx.Proxy)]
    seen = set()
    while todo:
        node = todo.pop()
        if node.op == "placeholder":
            return True
        seen.add(node)
        todo += [n for n in node.all_input_nodes if n not in seen]
    return False


def _put_back(containers: list[tuple[str, Any, Any]]) -> list[str]:
    """Restore every container's contents; the names of those a value from the inputs
    was stored in."""
    fed = []
    for key, now, before in containers:
        stored = _stored(now, before)
        if stored is None:
            continue
        if any(_from_inputs(v) for v in stored):
            fed.append(key)
        now.clear()
        if isinstance(now, list):
            now.extend(before)
        else:
            now.update(before)
    return fed


_DRAWS = ("random", "uniform", "randint", "randrange", "choice", "choices", "sample", "shuffle",
          "gauss", "normalvariate", "betavariate", "expovariate", "triangular")  # fmt: skip
_NUMPY_DRAWS = ("rand", "randn", "random", "random_sample", "uniform", "randint", "choice",
                "binomial", "normal", "beta", "permutation", "shuffle")  # fmt: skip
_patch_lock = threading.Lock()
_patched: list[tuple[Any, str, Any]] = []
_watchers = 0


class _PythonDraw(BaseException):
    """A Python or NumPy draw while fx traces. A BaseException: the tracer makes a
    submodule that raises an ``Exception`` a leaf, and a leaf's draw would be replayed
    (with other numbers) when its stage recomputes."""


def _symbolic_tracing() -> bool:
    from torch.fx import _symbolic_trace as st

    return bool(st._get_is_fx_tracing())  # per thread: other threads draw as usual


def _watch(module: Any, name: str) -> None:
    draw = getattr(module, name)

    def watched(*args: Any, **kwargs: Any) -> Any:
        if _symbolic_tracing():
            raise _PythonDraw(f"{module.__name__}.{name}")
        return draw(*args, **kwargs)

    _patched.append((module, name, draw))
    setattr(module, name, watched)


@contextmanager
def _watching_python_draws() -> Iterator[None]:
    """Python's and NumPy's module-level draws raise :class:`_PythonDraw` while fx traces
    in this thread (installed once for nested or concurrent traces)."""
    global _watchers
    with _patch_lock:
        if _watchers == 0:
            numpy = sys.modules.get("numpy")  # a model using it has imported it
            for name in _DRAWS:
                _watch(random, name)
            for name in _NUMPY_DRAWS:
                if numpy is not None:
                    _watch(numpy.random, name)
        _watchers += 1
    try:
        yield
    finally:
        with _patch_lock:
            _watchers -= 1
            while _watchers == 0 and _patched:
                module, name, draw = _patched.pop()
                setattr(module, name, draw)


def _draw_refusal(draw: _PythonDraw) -> TraceError:
    return TraceError(
        f"forward draws from {draw.args[0]}() while it is traced: tracing runs Python once, "
        "so the draw would be frozen into the graph (a block dropped on every call, or "
        "never), where eager draws on every call",
        value={"draw": draw.args[0]},
        remedy="draw with torch instead (torch.rand(()) < p, torch.bernoulli, F.dropout): "
        "crosscut traces torch's random ops and replays them per micro-batch and under "
        "recomputation",
    )


@contextmanager
def refusing_python_state(model: nn.Module) -> Iterator[None]:
    """Refuse (and undo) Python attributes and buffer bindings the traced forward changed,
    and values from the inputs it stored in a module's list, dict or set."""
    saved = [(path, m, _attributes(m), dict(m._buffers)) for path, m in model.named_modules()]
    containers = _containers(model)
    generators = [(g, g.get_state()) for _, g in _generators(model)]
    failure: BaseException | None = None
    draw: _PythonDraw | None = None
    try:
        with _watching_python_draws():
            yield
    except _PythonDraw as exc:
        draw = exc
    except Exception as exc:  # the rebinding may itself be what failed the trace
        failure = exc
    for g, state in generators:
        g.set_state(state)
    moved = _changes(model, saved)
    fed = _put_back(containers)
    if draw is not None:
        raise _draw_refusal(draw) from None
    if fed and not moved:
        raise TraceError(
            f"forward stores a value computed from its inputs in {fed[0]!r} (a Python "
            f"{type(next(c for k, c, _ in containers if k == fed[0])).__name__}, e.g. "
            "self.feats.append(y)): tracing runs Python code once, so it stored a traced "
            "stand-in (a Proxy) then, and the compiled module would store nothing on a call",
            value={"stored in": fed},
            remedy="return the value from forward (an extra output), or store it from a "
            "forward hook on a submodule (crosscut keeps that submodule whole, so the hook "
            "runs on every call, on each micro-batch)",
        ) from failure
    for _, m, attrs, buffers in saved:  # the caller's model as it was
        for k in [k for k in _attributes(m) if k not in attrs]:
            del vars(m)[k]
        vars(m).update(attrs)
        m._buffers.clear()
        m._buffers.update(buffers)
    if moved:
        key, kind = moved[0]
        raise _refusal(key, kind, [k for k, _ in moved]) from failure
    if failure is not None:
        raise failure


# ---- a model's own torch.Generator --------------------------------------------------------


def _generators(model: nn.Module) -> list[tuple[str, torch.Generator]]:
    """Every ``torch.Generator`` a module of ``model`` holds as an attribute, by path (not
    the ``_opaque_obj<N>`` attributes fx stows a graph's constant generators in)."""
    return [
        (f"{path}.{k}" if path else k, v)
        for path, m in model.named_modules()
        for k, v in vars(m).items()
        if isinstance(v, torch.Generator) and not k.startswith("_opaque_obj")
    ]


def _is_get_attr(a: Any) -> bool:
    return isinstance(a, torch.fx.Node) and a.op == "get_attr"


def refuse_own_generators(model: nn.Module, gm: torch.fx.GraphModule) -> None:
    """Raise a TraceError for a graph op given a generator of its own (module docstring)."""
    names = {id(g): path for path, g in _generators(model)}
    for node in gm.graph.nodes:
        args = tree_flatten((node.args, node.kwargs))[0]
        consts = [getattr(gm, str(a.target), None) if _is_get_attr(a) else a for a in args]
        found = [g for g in consts if isinstance(g, torch.Generator)]
        if found:
            where = names.get(id(found[0]), "one outside the model, e.g. a module-level one")
            op = getattr(node.target, "__name__", node.target)
            raise TraceError(
                f"{node.name} ({op}) draws from a torch.Generator of its own "
                f"({where!r}): the compiled stages would draw from a copy of it, which a call "
                "never advances and re-seeding it does not reach, where eager draws from it "
                "call after call",
                value={"op": node.name, "generator": where},
                remedy="draw from torch's default generator (torch.manual_seed rules it; "
                "crosscut seeds each random op per call, micro-batch and op)",
            )


# ---- buffers rebound to a traced value -------------------------------------------------

_REBOUND = "crosscut_rebound"  # node.meta key of the write that keeps a rebound buffer


@contextmanager
def rebound_buffers(model: nn.Module) -> Iterator[dict[str, torch.fx.Proxy]]:
    """Around one trace: yields a dict that gets ``{qualified buffer name: new value}``
    for every buffer the forward rebound to a traced value; each is bound back to its
    tensor, so a retrace (or the caller) sees the model as it was."""
    saved = [(path, m, dict(m._buffers)) for path, m in model.named_modules()]
    found: dict[str, torch.fx.Proxy] = {}
    try:
        yield found
    finally:
        for path, m, buffers in saved:
            for k, old in buffers.items():
                now = m._buffers.get(k, vars(m).get(k))
                if now is not old and isinstance(now, torch.fx.Proxy):
                    found[f"{path}.{k}" if path else k] = now
                    vars(m).pop(k, None)
                    m._buffers[k] = old


def persist_rebound(graph: torch.fx.Graph, rebound: dict[str, torch.fx.Proxy]) -> None:
    """End ``graph`` with ``buffer.copy_(value.detach())`` for each rebound buffer.

    At the end, so every read of the old value (before the rebinding in program
    order) comes first; a value that is itself a parameter or buffer would alias two
    names, which a copy does not, and is refused."""
    if not rebound:
        return
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    for key, value in rebound.items():
        if value.node.graph is not graph or value.node.op == "get_attr":
            raise TraceError(
                f"forward binds buffer {key!r} to another parameter or buffer "
                f"({value.node.target!r}): two names for one tensor, which the stages "
                "cannot share",
                value={"rebound": sorted(rebound)},
                remedy=f"copy the values instead: self.{key.rpartition('.')[2]}.copy_(...)",
            )
        _snapshot_old_reads(graph, key)
        with graph.inserting_before(out):
            kept = graph.call_method("detach", (value.node,))
            write = graph.call_method("copy_", (graph.get_attr(key), kept))
        write.meta[_REBOUND] = key


def _snapshot_old_reads(graph: torch.fx.Graph, key: str) -> None:
    """Reads of the buffer before its rebinding read a clone: eager leaves the old tensor
    as it was, and autograd may have saved it (``y * self.avg``) or an output may be it,
    so the write at the end must not reach them."""
    for n in [n for n in graph.nodes if n.op == "get_attr" and n.target == key]:
        with graph.inserting_after(n):
            snapshot = graph.call_method("clone", (n,))
        for user in [u for u in n.users if u is not snapshot]:
            user.replace_input_with(n, snapshot)


def refuse_changed_layout(gm: torch.fx.GraphModule) -> None:
    """After shape propagation: a rebound value must have its buffer's shape and dtype."""
    for n in gm.graph.nodes:
        if _REBOUND not in n.meta:
            continue
        buf, new = (a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in n.args)
        if (
            isinstance(new, Tensor)
            and isinstance(buf, Tensor)
            and (new.shape, new.dtype) == (buf.shape, buf.dtype)
        ):
            continue
        key = n.meta[_REBOUND]
        raise TraceError(
            f"forward rebinds buffer {key!r} to a value of another shape or dtype: crosscut "
            "keeps a rebound buffer by writing the new value into it in place, which "
            "cannot change its layout",
            value={
                "buffer": _layout(buf),
                "new value": _layout(new),
            },
            remedy=f"register {key!r} with the shape and dtype it gets in forward, or "
            "compute the new value in that dtype (e.g. .to(self.<buffer>.dtype))",
        )


def _layout(v: Any) -> str:
    if isinstance(v, Tensor):
        return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
    return type(v).__name__
