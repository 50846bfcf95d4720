"""Random ops that draw the same numbers whatever the plan: one seed per (call, micro-batch, op).

Eager mode draws dropout masks from one generator in program order. A
pipeline cannot: stages run on several threads (or ranks) at once, so draws
interleave by timing, and a different plan orders them differently. Here
every random op of a stage graph is wrapped (:func:`seed_random_ops`) so that,
while an executor runs an action inside :func:`draw_scope`, the op draws from
the generator re-seeded with a hash of (the call's seed, the micro-batch, the
op's name), under a lock, and the generator's state is put back afterwards.
The call's seed is one draw from the caller's generator when the call starts
(:func:`call_seed`), so ``torch.manual_seed`` still decides everything; the
op's name is the traced node name, the same on every plan. Two plans of one
model therefore draw identical masks, run after run, on any thread. They are
not eager's masks (eager's depend on its single sequential stream), except
with one micro-batch, where the executors run inline on the caller's thread
in program order and call no scope: there the ops draw eager's own numbers.

Wrapped: random functions and tensor methods (``dropout``, ``bernoulli_``,
``rand_like``, ...) and parameter-free random modules (``nn.Dropout*``,
``nn.RReLU``). A random module with parameters (an automatic leaf that draws
inside) is left as it is: it draws from the shared generator.
"""

from __future__ import annotations

import importlib
import itertools
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn
from torch.fx.node import _get_qualified_name
from torch.utils import _pytree as pytree

from crosscut.runtime.draw_key import _scope, current_key, draw_scope
from crosscut.runtime.share_threads import _random_name as random_name
from crosscut.runtime.share_threads import draws_random, share_order

__all__ = [
    "RandomScope",
    "call_seed",
    "current_key",
    "draw_scope",
    "has_random_ops",
    "in_program_order",
    "seed_random_ops",
    "seeded_call",
    "seeded_function",
    "seeded_method",
]

_LOCK = threading.Lock()
_MASK = (1 << 63) - 1


def call_seed() -> int:
    """The seed of one call: a draw from the caller's generator (``manual_seed`` rules it)."""
    return int(torch.randint(0, 1 << 62, (1,)).item())


def _op_seed(seed: int, microbatch: int, op: str) -> int:
    mixed = seed * 0x9E3779B97F4A7C15 + (microbatch + 1) * 0xBF58476D1CE4E5B9
    return (mixed ^ zlib.crc32(op.encode())) & _MASK


def seeded_call(op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, drawing from this op's own seed inside a :func:`draw_scope`."""
    key = getattr(_scope, "key", None)
    if key is None:
        return fn(*args, **kwargs)
    cuda = sorted(
        {t.device for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        - {torch.device("cpu")},
        key=str,
    )
    share = share_order()[1:]  # a batch-split stage's shares draw apart
    with _LOCK, torch.random.fork_rng(devices=[d for d in cuda if d.type == "cuda"]):
        torch.manual_seed(_op_seed(key[0], key[1], f"{op}#{share}"))
        return fn(*args, **kwargs)


def _call_method(name: str) -> Callable[..., Any]:
    def call(obj: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(obj, name)(*args, **kwargs)

    call.__name__ = f"method_{name}"
    return call


_METHODS: dict[str, Callable[..., Any]] = {}
_FUNCTIONS: dict[str, Callable[..., Any]] = {}


def _resolve(qualname: str) -> Callable[..., Any]:
    """``torch.nn.functional.dropout`` -> the function (generated code holds names, not objects)."""
    fn = _FUNCTIONS.get(qualname)
    if fn is None:
        module, _, attr = qualname.rpartition(".")
        obj: Any = importlib.import_module(module)
        fn = getattr(obj, attr)
        _FUNCTIONS[qualname] = fn
    return fn


def seeded_function(op: str, qualname: str, *args: Any, **kwargs: Any) -> Any:
    """A random function (``F.dropout``), named by its qualified name, under :func:`seeded_call`."""
    return seeded_call(op, _resolve(qualname), *args, **kwargs)


def seeded_method(op: str, name: str, obj: Any, *args: Any, **kwargs: Any) -> Any:
    """A random tensor method (``x.bernoulli_(p)``) under :func:`seeded_call`."""
    fn = _METHODS.setdefault(name, _call_method(name))
    return seeded_call(op, fn, obj, *args, **kwargs)


def _random_module(module: nn.Module) -> bool:
    """A parameter-free module that draws (dropout family, RReLU), whatever its mode."""
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return False
    was = module.training
    module.train(True)  # wrap by kind: it may be switched to training later
    try:
        return draws_random(module)
    finally:
        module.train(was)


def _is_random(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_function":
        wrapped = n.target in (seeded_call, seeded_function, seeded_method)
        return not wrapped and random_name(getattr(n.target, "__name__", ""))
    if n.op == "call_method":
        return random_name(str(n.target))
    if n.op == "call_module":
        return _random_module(gm.get_submodule(str(n.target)))
    return False


def in_program_order(gm: fx.GraphModule, stage_of: dict[str, int]) -> bool:
    """Whether stages run ``gm``'s random ops in program order (one micro-batch, inline)."""
    stages = [stage_of[n.name] for n in gm.graph.nodes if n.name in stage_of and _is_random(gm, n)]
    return all(a <= b for a, b in itertools.pairwise(stages))


def has_random_ops(module: nn.Module) -> bool:
    """Whether any fx graph under ``module`` holds a wrapped random op."""
    return any(
        n.op == "call_function" and n.target in (seeded_call, seeded_function, seeded_method)
        for m in module.modules()
        if isinstance(m, fx.GraphModule)
        for n in m.graph.nodes
    )


def seed_random_ops(module: nn.Module) -> int:
    """Wrap every random op of every fx graph under ``module`` in place; returns the count."""
    count = 0
    for gm in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        changed = False
        for n in list(gm.graph.nodes):
            if not _is_random(gm, n):
                continue
            with gm.graph.inserting_before(n):
                if n.op == "call_function":
                    name = _get_qualified_name(n.target)  # type: ignore[arg-type]
                    new = gm.graph.call_function(seeded_function, (n.name, name, *n.args), n.kwargs)
                elif n.op == "call_method":
                    new = gm.graph.call_function(
                        seeded_method, (n.name, str(n.target), *n.args), n.kwargs
                    )
                else:
                    mod = gm.graph.get_attr(str(n.target))
                    new = gm.graph.call_function(seeded_call, (n.name, mod, *n.args), n.kwargs)
            new.meta = dict(n.meta)
            n.replace_all_uses_with(new)
            gm.graph.erase_node(n)
            changed = True
            count += 1
        if changed:
            gm.graph.lint()
            gm.recompile()
    return count


class RandomScope:
    """Per-call seeds for the random ops of a program's stages, set by forward hooks.

    A stage runs its forwards of one call in micro-batch order under every
    schedule, so the k-th forward of a stage in a call is micro-batch k: a
    pre-hook on each stage module opens :func:`draw_scope` for it on whatever
    thread runs it, and no executor needs to know. :meth:`start` begins a call
    (one :func:`call_seed`, counters reset); ``enabled=False`` leaves the ops
    to the caller's generator (eager's draws).
    """

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        self.seed: int | None = None
        self._count: dict[int, int] = {}
        self._last: dict[int, tuple[int, int] | None] = {}  # module -> its last forward's key
        self._random = [m for m in stages if seed_random_ops(m) or has_random_ops(m)]
        for m in self._random:
            m.register_forward_pre_hook(self._enter)
            m.register_forward_hook(self._leave)

    def start(self, enabled: bool) -> None:
        """Begin a call: a fresh seed (only when enabled and something draws)."""
        self.seed = call_seed() if enabled and self._random else None
        self._count = {}

    def _enter(self, module: nn.Module, args: Any) -> None:
        replay = getattr(_scope, "replay", None)
        if replay is not None:  # a recomputation re-runs a forward: same key, not counted
            _scope.key = replay[0]
            return
        k = self._count.get(id(module), 0)
        self._count[id(module)] = k + 1
        _scope.key = None if self.seed is None else (self.seed, k)
        self._last[id(module)] = _scope.key

    def last_key(self, module: nn.Module) -> tuple[int, int] | None:
        """The draw key of ``module``'s latest forward (None: it draws eager's numbers)."""
        return self._last.get(id(module))

    @staticmethod
    @contextmanager
    def replaying(key: tuple[int, int] | None) -> Iterator[None]:
        """Re-run a stage forward with the draw key it had (activation recomputation).

        Inside, a stage's pre-hook reuses ``key`` instead of counting a new
        forward, so a recomputed dropout draws the masks of the first pass.
        """
        saved = getattr(_scope, "replay", None)
        _scope.replay = (key,)
        try:
            yield
        finally:
            _scope.replay = saved

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        _scope.key = None

    def __getstate__(self) -> dict[str, Any]:
        return {"seed": None, "_count": {}, "_last": {}, "_random": self._random}
