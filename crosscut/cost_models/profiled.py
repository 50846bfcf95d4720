"""Profiled costs: time every node of the traced GraphModule on a real device.

Analytic rooflines miss what matters on real hardware (cuDNN algorithm choice,
memory-bound elementwise ops, per-op dispatch), so ``profile_costs`` runs each
fx node alone with real random tensors of the traced shapes: forward, then
backward through ``torch.autograd.grad`` on that node's output with a random
gradient. Each is warmed up, then the median of ``repeats`` timed runs is kept
(synchronized on a GPU). Results are cached as JSON, keyed by graph fingerprint,
device kind, batch size, dtype and mode, and by what else sets the times (the
torch version, the CPU thread count, the GPU's name), because a ResNet-50
profile takes tens of seconds on a CPU; a corrupt cache file is rewritten.

A cached profile is a measurement of the machine as it was. Before one is
reused, a few whole steps are timed again (:func:`_still_holds`): moved further
than both measurements' own noise (the cache written while the machine was busy,
or busy now), the graph is profiled again and ``meta["recheck"]`` says why.
Without it one search compared a data-parallel price profiled under load (7.8 s
a step) with pipeline prices profiled quiet, and chose a pipeline that ran 18 %
slower than DistributedDataParallel; profiled afresh, that step was 5.8 s.
"""

from __future__ import annotations

import copy
import hashlib
import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx

from crosscut.cost_models.context import measure_in_context, measure_split
from crosscut.cost_models.efficiency import efficiency_of
from crosscut.cost_models.memory import activation_bytes, is_alias, resident_bytes
from crosscut.cost_models.table import MAX_SPLIT, CostTable, NodeCost
from crosscut.cpu_malloc import keep_freed_memory
from crosscut.errors import CostModelError
from crosscut.ir.graph import OpGraph
from crosscut.precision import autocast

__all__ = [
    "CACHE_FORMAT",
    "DRIFT",
    "cache_key",
    "device_kind",
    "profile_costs",
    "step_spread",
    "stream_rate",
]

#: How far a re-timed step may move from a cached profile's before the cache is
#: stale, unless the steps' own spread is larger (:func:`_still_holds`).
DRIFT = 0.10

#: in the cache file's name: a profile written before a change to what a profile
#: holds (v2: the split backward's B and W) is taken again, not read without it
CACHE_FORMAT = "v2"

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}


def device_kind(device: torch.device) -> str:
    """The preset kind a device prices as ("cpu", "V100", ...)."""
    if device.type == "cpu":
        return "cpu"
    from crosscut.cost_models.cluster import Cluster

    return Cluster.from_devices([device]).devices[0].kind


def _machine(dev: torch.device | None) -> list[Any]:
    """What besides the graph sets a profile's times: torch's version, and the CPU
    threads or the GPU's name (a profile on 2 threads prices a 1-thread rank at half)."""
    if dev is not None and dev.type == "cuda":
        return [torch.__version__, torch.cuda.get_device_name(dev)]
    return [torch.__version__, torch.get_num_threads()]


def cache_key(graph: OpGraph, kind: str, device: torch.device | None = None) -> str:
    """File stem for the cache: fingerprint, kind, batch size, dtype, mode, and the
    machine state that sets the times (:func:`_machine`)."""
    dtypes = sorted({n.dtype for n in graph.nodes if n.op == "placeholder"}) or ["float32"]
    raw = json.dumps(
        [
            graph.fingerprint(),
            kind,
            graph.batch_size,
            dtypes,
            graph.mode,
            graph.precision,
            *_machine(device),
            *(["channels_last"] if graph.channels_last else []),
        ]
    )
    return f"{kind}-b{graph.batch_size}-{hashlib.sha256(raw.encode()).hexdigest()[:16]}"


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _median_time(
    fn: Callable[[Any], Any], prep: Callable[[], Any], dev: torch.device, warmup: int, repeats: int
) -> float:
    """Median seconds of ``fn(prep())`` with the preparation left out of the timing."""
    samples: list[float] = []
    for i in range(warmup + repeats):
        state = prep()
        _sync(dev)
        t0 = time.perf_counter()
        fn(state)
        _sync(dev)
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples) if samples else 0.0


def _tensors(x: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    torch.fx.node.map_aggregate(x, lambda v: out.append(v) if isinstance(v, torch.Tensor) else None)
    return out


def _placeholder(shape: list[int], dtype: str, dev: torch.device) -> torch.Tensor:
    dt = _DTYPES.get(dtype, torch.float32)
    if dt.is_floating_point:
        return torch.randn(shape, dtype=dt, device=dev)
    return torch.zeros(shape, dtype=dt, device=dev)


def _runner(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Callable[..., Any]:
    if node.op == "call_module":
        mod: Callable[..., Any] = gm.get_submodule(str(node.target))
        return mod
    if node.op == "call_method":
        name = str(node.target)
        return lambda self, *a, **k: getattr(self, name)(*a, **k)
    fn: Callable[..., Any] = node.target  # type: ignore[assignment]
    return fn


def _time_node(
    gm: torch.fx.GraphModule,
    node: torch.fx.Node,
    env: dict[str, Any],
    dev: torch.device,
    training: bool,
    clone: bool,
    warmup: int,
    repeats: int,
) -> tuple[float, float, Any]:
    """(fwd s, bwd s, output) of one fx node with inputs taken from ``env``."""
    run = _runner(gm, node)
    grad_src = {n.name for n in node.all_input_nodes if n.op not in ("placeholder", "get_attr")}

    def prep() -> tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor]]:
        leaves: list[torch.Tensor] = []

        def load(n: torch.fx.Node) -> Any:
            v = env[n.name]
            if not isinstance(v, torch.Tensor):
                return v
            if training and n.name in grad_src and v.is_floating_point():
                v = v.detach().requires_grad_(True)
                leaves.append(v)
            return v.clone() if clone else v

        args = torch.fx.node.map_arg(node.args, load)
        kwargs = torch.fx.node.map_arg(node.kwargs, load)
        return tuple(args), dict(kwargs), leaves

    def fwd(state: tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor]]) -> Any:
        return run(*state[0], **state[1])

    with torch.no_grad():
        out = fwd(prep())
    if not training:
        with torch.no_grad():
            return _median_time(fwd, prep, dev, warmup, repeats), 0.0, out
    t_fwd = _median_time(fwd, prep, dev, warmup, repeats)
    params = (
        [p for p in gm.get_submodule(str(node.target)).parameters()]
        if node.op == "call_module"
        else []
    )
    params += [env[n.name] for n in node.all_input_nodes if n.op == "get_attr"]
    params = [p for p in params if isinstance(p, torch.Tensor) and p.requires_grad]

    def with_graph() -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        args, kwargs, leaves = prep()
        outs = [t for t in _tensors(run(*args, **kwargs)) if t.requires_grad]
        return outs, [torch.randn_like(t) for t in outs], leaves + params

    def bwd(state: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]) -> None:
        torch.autograd.grad(state[0], state[2], state[1], allow_unused=True)

    probe = with_graph()
    if not probe[0] or not probe[2]:
        return t_fwd, 0.0, out
    return t_fwd, _median_time(bwd, with_graph, dev, warmup, repeats), out


def _measure(
    graph: OpGraph, dev: torch.device, warmup: int, repeats: int
) -> dict[str, tuple[float, float]]:
    gm: torch.fx.GraphModule = copy.deepcopy(graph.gm).to(dev)
    training = graph.mode == "train"
    gm.train(training)
    env: dict[str, Any] = {}
    times: dict[str, tuple[float, float]] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if node.name not in graph:
            raise CostModelError(
                "every fx node must have an OpNode of the same name",
                value=node.name,
                remedy="profile the OpGraph that trace() returned with this GraphModule",
            )
        op = graph.node(node.name)
        if node.op == "placeholder":
            env[node.name] = _placeholder(op.shapes[0] if op.shapes else [], op.dtype, dev)
        elif node.op == "get_attr":
            env[node.name] = _fetch(gm, str(node.target))
        else:
            clone = is_alias(graph, op)
            f, b, out = _time_node(gm, node, env, dev, training, clone, warmup, repeats)
            env[node.name] = torch.fx.node.map_aggregate(
                out, lambda v: v.detach() if isinstance(v, torch.Tensor) else v
            )
            times[node.name] = (f, b)
    return times


def _measure_context(
    graph: OpGraph,
    dev: torch.device,
    warmup: int,
    repeats: int,
    steps: list[float] | None = None,
) -> dict[str, tuple[float, float]]:
    gm, inputs = _runnable(graph, dev)
    return measure_in_context(gm, inputs, dev, graph.mode == "train", warmup, repeats, steps)


def _runnable(graph: OpGraph, dev: torch.device) -> tuple[torch.fx.GraphModule, list[Any]]:
    """A copy of the traced module on ``dev`` in the graph's mode, and random inputs."""
    gm: torch.fx.GraphModule = copy.deepcopy(graph.gm).to(dev)
    gm.train(graph.mode == "train")
    inputs = [
        _placeholder(op.shapes[0] if op.shapes else [], op.dtype, dev)
        for op in graph.nodes
        if op.op == "placeholder"
    ]
    return gm, inputs


def _split_fractions(
    graph: OpGraph, dev: torch.device, warmup: int, repeats: int, times: dict[str, Any]
) -> dict[str, tuple[float, float]]:
    """(B, W) of each node with parameters as fractions of its backward in ``times``,
    from the split backward timed as the runtime runs it (context.measure_split); half
    the repeats: a ratio needs less than an absolute time."""
    gm, inputs = _runnable(graph, dev)
    passes = measure_split(gm, inputs, dev, min(warmup, 1), max(1, (repeats + 1) // 2))
    out: dict[str, tuple[float, float]] = {}
    for n in graph.nodes:
        full = times.get(n.name, (0.0, 0.0))[1]
        if n.param_bytes <= 0 or full <= 0 or n.name not in passes:
            continue
        b, w = passes[n.name]
        out[n.name] = (min(b / full, MAX_SPLIT), min(w / full, MAX_SPLIT))
    return out


def step_spread(steps: list[float]) -> float:
    """How far a profile's whole-step times spread: (slowest − quickest) ÷ median.

    0 for fewer than two steps. A profile taken a moment later may differ by as
    much, so plans whose predictions differ by less are not told apart by it."""
    if len(steps) < 2:
        return 0.0
    mid = statistics.median(steps)
    return (max(steps) - min(steps)) / mid if mid > 0 else 0.0


def _fetch(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _load_cache(path: Path, graph: OpGraph) -> CostTable | None:
    if not path.is_file():
        return None
    try:
        table = CostTable.from_json(path.read_text())
        if table.meta.get("fingerprint") != graph.fingerprint() or set(table.nodes) != set(
            n.name for n in graph.nodes
        ):
            raise CostModelError("the cached table is for another graph", value=str(path))
    except (CostModelError, OSError, UnicodeDecodeError) as exc:
        warnings.warn(f"ignoring unreadable cost cache {path}: {exc}", RuntimeWarning, stacklevel=3)
        return None
    table.meta["cache_hit"] = True
    return table


def _priced(kind: str, dev: str, method: str, precision: str) -> dict[str, dict[str, Any]]:
    """``meta["priced"]`` of a profiled table: measured on ``dev``, no preset, no fractions."""
    return {
        kind: {
            "kind": kind,
            "preset": "",
            "math": [f"as run under {precision}"],
            "efficiency": f"profiled on {dev} ({method} timing)",
            "costs": "profiled",
        }
    }


def profile_costs(
    graph: OpGraph,
    device: str | torch.device = "cpu",
    *,
    repeats: int = 5,
    warmup: int = 2,
    cache_dir: str | Path | None = ".crosscut-cache",
    optimizer: str = "sgd",
    kind: str | None = None,
    method: str = "context",
) -> CostTable:
    """Measured forward/backward seconds of every node on ``device``.

    ``kind`` names the column the times go in (default: the device's preset
    kind, e.g. "cpu" or "V100"); ``cache_dir=None`` turns the cache off.
    ``method="context"`` (default) times every node inside whole training steps
    (``context.py``); ``"isolated"`` runs each node alone, which needs no memory
    for a whole step but over-prices ops that normally run back to back.
    """
    if method not in ("context", "isolated"):
        raise CostModelError(
            "method is 'context' or 'isolated'", value=method, remedy="use method='context'"
        )
    if graph.gm is None:
        raise CostModelError(
            "profiling needs the traced GraphModule (OpGraph.gm)",
            value=graph.model_name or "OpGraph without gm",
            remedy="build the graph with crosscut.frontend.tracer.trace(), or use analytic_costs",
        )
    if repeats < 1 or warmup < 0:
        raise CostModelError("repeats >= 1 and warmup >= 0", value=(repeats, warmup))
    dev = torch.device(device)
    kind = kind or device_kind(dev)
    stem = f"{cache_key(graph, kind, dev)}-{method}-{CACHE_FORMAT}"
    path = Path(cache_dir) / f"{stem}.json" if cache_dir is not None else None
    cached = _load_cache(path, graph) if path is not None else None
    recheck = None
    if cached is not None and method == "context" and not _still_holds(cached, graph, dev, path):
        recheck, cached = cached.meta.get("recheck"), None  # profiled again below: say why
    if cached is not None:  # a cache written before the record: say how it was priced
        cached.meta.setdefault("priced", _priced(kind, str(dev), method, graph.precision))
        return _with_memory(cached, graph, optimizer)
    table = _measured(graph, dev, kind, method, warmup, repeats)
    table.optimizer = optimizer
    if recheck is not None:
        table.meta["recheck"] = recheck
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(table.to_json())
        except OSError as exc:
            warnings.warn(f"could not write cost cache {path}: {exc}", RuntimeWarning, stacklevel=2)
    return _with_memory(table, graph, optimizer)


def _measured(
    graph: OpGraph, dev: torch.device, kind: str, method: str, warmup: int, repeats: int
) -> CostTable:
    """A fresh profile of ``graph`` on ``dev``: the times in column ``kind``, and in
    ``meta`` how they were taken (and, in context, the whole steps a reuse re-times)."""
    t0 = time.perf_counter()
    steps: list[float] = []
    if dev.type == "cpu":
        keep_freed_memory()  # as the runtimes run (cpu_malloc.py): W page-faulted otherwise
    with autocast(graph.precision, dev.type):  # time the ops as the plan will run them
        if method == "context":
            times = _measure_context(graph, dev, warmup, repeats, steps)
        else:
            times = _measure(graph, dev, warmup, repeats)
        training = graph.mode == "train" and method == "context"
        split = _split_fractions(graph, dev, warmup, repeats, times) if training else {}
    rate = stream_rate(dev) / efficiency_of(kind, str(dev)).memory
    return CostTable(
        nodes={
            n.name: NodeCost(
                {kind: times.get(n.name, (0.0, 0.0))[0]},
                {kind: times.get(n.name, (0.0, 0.0))[1]},
                split={kind: split[n.name]} if n.name in split else {},
            )
            for n in graph.nodes
        },
        source="profiled",
        mode=graph.mode,
        meta={
            "fingerprint": graph.fingerprint(),
            "batch_size": graph.batch_size,
            "device": str(dev),
            "kind": kind,
            "repeats": repeats,
            "method": method,
            "warmup": warmup,
            "profile_s": time.perf_counter() - t0,
            # whole steps' relative spread over the repeats (in-context only; 0: unknown)
            "spread": step_spread(steps),
            # the whole steps themselves: what a later reuse of this cache re-times
            "steps": steps,
            "cache_hit": False,
            "priced": _priced(kind, str(dev), method, graph.precision),
            # the peak memory rate that this machine's achieved streaming rate implies:
            # what the simulator prices a pass over the gradients at (update, accumulation)
            "mem_bw": {kind: rate},
        },
    )


def stream_rate(dev: torch.device, mib: int = 64, repeats: int = 5) -> float:
    """Bytes per second of ``a += b`` over two ``mib`` MiB fp32 tensors on ``dev`` (read
    two, write one), the median of ``repeats`` after one warm-up: the rate of the passes
    over gradients and parameters that a step makes besides its operators."""
    n = mib * 2**20 // 4
    a = torch.zeros(n, device=dev)
    b = torch.ones(n, device=dev)
    times: list[float] = []
    for i in range(repeats + 1):
        _sync(dev)
        t0 = time.perf_counter()
        a.add_(b)
        _sync(dev)
        if i > 0:
            times.append(time.perf_counter() - t0)
    return 3.0 * n * 4 / max(statistics.median(times), 1e-9)


def _still_holds(cached: CostTable, graph: OpGraph, dev: torch.device, path: Path | None) -> bool:
    """Whether the machine still runs ``graph`` as fast as when ``cached`` was profiled.

    Three whole steps are timed again (after one warm-up) and their median is
    compared with the cached steps' median. They agree when the larger is less
    than :data:`DRIFT` above the smaller, or than three times either series' own spread
    (:func:`step_spread`): noise that large cannot be told from a change. A
    cache with no steps recorded (written before they were) cannot be checked
    and is profiled again. The outcome goes in ``meta["recheck"]``.
    """
    old = [float(s) for s in cached.meta.get("steps") or []]
    if not old:
        return False
    now: list[float] = []
    with autocast(graph.precision, dev.type):  # as the cached steps were timed
        _measure_context(graph, dev, warmup=1, repeats=3, steps=now)
    ratio = statistics.median(now) / statistics.median(old)
    tolerance = max(DRIFT, 3.0 * step_spread(old), 3.0 * step_spread(now))
    cached.meta["recheck"] = {"ratio": ratio, "tolerance": tolerance, "steps": now}
    if max(ratio, 1.0 / ratio) - 1.0 <= tolerance:  # 3x quicker moved as far as 3x slower
        return True
    warnings.warn(
        f"cost cache {path.name if path else ''} was profiled at "
        f"{statistics.median(old):.3g} s a step and the same step now takes "
        f"{statistics.median(now):.3g} s ({ratio:.2f}x, beyond the {tolerance:.0%} noise): "
        "profiling again so every price compared comes from the machine as it is now",
        RuntimeWarning,
        stacklevel=3,
    )
    return False


def _with_memory(table: CostTable, graph: OpGraph, optimizer: str) -> CostTable:
    """Fill the device-independent bytes from the memory model (never cached)."""
    acts = activation_bytes(graph)
    for n in graph.nodes:
        c = table.nodes[n.name]
        c.resident = 0 if n.is_io else resident_bytes(n, graph.mode, optimizer)
        c.activation = acts.get(n.name, 0)
    table.optimizer = optimizer
    return table
