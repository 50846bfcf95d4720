"""Which model state (buffers, parameters) a traced forward writes, and from what.

Read by codegen (``codegen/state_writes.py`` refuses a plan that would write
such state more often than eager, or from a share of the batch) and by the
planner (``crosscut/layouts.state_limits`` never makes such a plan), so the
two apply one rule. Batch norm's own running statistics are apart: what they
do over micro-batches and batch shares is the documented ``bn_mode``
contract of the runtime.

``model`` is the module the graph was traced from. A functional batch norm on
a ``BatchNorm2d``'s buffers counts as batch norm only when that module is
known, and a ``GraphModule`` keeps only the attributes its graph reads (a
plain ``nn.Module`` stands in for an owner it never calls), so the tracer
marks each such buffer's ``get_attr`` node (:func:`mark_bn_stats`): a graph
planned without its model (``crosscut.partition(graph, ...)``) still knows.
"""

from __future__ import annotations

from torch import fx, nn

from crosscut.frontend.alias import MUTATES, STATE, functional_norm_writes

__all__ = [
    "BN_STAT",
    "batch_dependent_writes",
    "batch_norm_stat",
    "mark_bn_stats",
    "model_state_writes",
    "state_writes",
]

BN_STAT = "crosscut_bn_stat"  # meta of a get_attr node: a _BatchNorm's running statistic


def mark_bn_stats(model: nn.Module, gm: fx.GraphModule) -> None:
    """Mark each ``get_attr`` node of ``gm`` that reads a batch norm's statistic of ``model``."""
    for n in gm.graph.nodes:
        if n.op == "get_attr" and batch_norm_stat(model, str(n.target)):
            n.meta[BN_STAT] = True


def state_writes(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """``(node, state key)`` for every node of ``gm`` that writes a buffer or parameter."""
    by_name = {n.name: n for n in gm.graph.nodes}
    out: list[tuple[str, str]] = []
    for n in gm.graph.nodes:
        for base in n.meta.get(MUTATES, []):
            b = by_name.get(base)
            if b is not None and b.op == "get_attr":
                out.append((n.name, str(b.target)))
        out.extend((n.name, key) for key in n.meta.get(STATE, []))
    return out + [w for w in functional_norm_writes(gm) if w not in out]


def model_state_writes(model: nn.Module, gm: fx.GraphModule) -> list[tuple[str, str]]:
    """:func:`state_writes` but batch norm's own statistics (the ``bn_mode`` contract)."""
    marked = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and n.meta.get(BN_STAT)}
    return [
        (n, k) for n, k in state_writes(gm) if k not in marked and not batch_norm_stat(model, k)
    ]


def batch_dependent_writes(model: nn.Module, gm: fx.GraphModule) -> list[tuple[str, str]]:
    """:func:`model_state_writes` whose node reads a graph input, directly or not.

    Such a write (an EMA of an activation) computes a different value on a
    share of the batch; one that reads only state and constants (a call
    counter) does not, so the leader's share writing it once equals eager."""
    reads_batch: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" or any(a.name in reads_batch for a in n.all_input_nodes):
            reads_batch.add(n.name)
    return [(n, k) for n, k in model_state_writes(model, gm) if n in reads_batch]


def batch_norm_stat(model: nn.Module, key: str) -> bool:
    """Whether state ``key`` is a running statistic of a ``_BatchNorm`` of ``model``: what it
    does over micro-batches and shares is the documented ``bn_mode`` contract."""
    owner, _, name = key.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and name in (
        "running_mean",
        "running_var",
        "num_batches_tracked",
    )
