"""Model state (buffers, parameters) written in forward, and when a pipeline cannot honour it.

A buffer updated in forward (a call counter ``self.calls.add_(1)``, an EMA
``self.avg.mul_(0.9).add_(0.1 * x.mean())``) is part of the traced graph
(``partitioner/trace.py`` traces buffers as ``get_attr`` nodes, and
``partitioner/alias.py`` records every node that writes one), so each stage
updates the copy it owns on every call, as eager does.

With ``M > 1`` micro-batches every stage's forward runs ``M`` times per call,
so such a write would happen ``M`` times where eager does it once, on other
values (per micro-batch instead of the whole batch). No rewrite can make that
equal, so :func:`check_state_writes` refuses it at compile time, naming the
buffer and the node. The one exception is batch norm's own running statistics
(``running_mean``, ``running_var``, ``num_batches_tracked`` of a
``_BatchNorm``, traced through as in timm's ``BatchNormAct2d``): what they do
over micro-batches is the documented ``bn_mode`` contract of
:class:`~crosscut.runtime.CompiledModule`.
"""

from __future__ import annotations

from torch import fx, nn

from crosscut.errors import CodegenError
from crosscut.partitioner.alias import MUTATES, STATE

__all__ = ["check_state_writes", "state_writes"]


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
    return out


def _batch_norm_stat(model: nn.Module, key: str) -> bool:
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


def check_state_writes(model: nn.Module, gm: fx.GraphModule, microbatches: int) -> None:
    """Refuse state written in forward when it would be written ``microbatches`` times per call."""
    if microbatches <= 1:
        return
    for node, key in state_writes(gm):
        if _batch_norm_stat(model, key):
            continue
        raise CodegenError(
            f"state {key!r} is written in forward by node {node!r}; with microbatches="
            f"{microbatches} the compiled module would write it {microbatches} times per call "
            "(once per micro-batch, on that micro-batch's values), eager mode once",
            value={"state": key, "node": node, "microbatches": microbatches},
            remedy="compile with microbatches=1, or move the update out of forward (e.g. "
            "into the training loop after optimizer.step())",
        )
