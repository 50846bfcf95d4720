"""The dtypes values cross ranks in when the caller runs under autocast.

Under torchrun each rank runs its stage on the caller's thread, so the
caller's ``torch.autocast`` holds there by itself — but the messages between
ranks do not follow it. A receiver posts its buffer before the sender has
computed anything, with the shape and dtype the trace recorded
(:mod:`crosscut.runtime.dist.stage_io`), and the trace ran in float32: under
bfloat16 autocast a stage sends a bfloat16 activation into a float32 buffer
(and its gradient back the same way), which is no longer the model.

Autocast's dtype rules depend only on the op and its inputs' dtypes, so the
dtype of every value under a given autocast state is as static as its shape:
:class:`WireDtypes` runs the traced graph once per autocast state on fake
tensors (no compute, no memory, parameters and buffers untouched) and both
ends of every edge post and check that dtype. Every rank derives the same map
from the same graph, so nothing is exchanged at run time.

Cross-shaped groups exchange their members' shares with dtypes fixed the same
way (:mod:`crosscut.runtime.dist.group_members`); autocast there is refused by
:class:`~crosscut.errors.DistributedError` rather than run with mismatched
buffers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils import _pytree as pytree

from crosscut.errors import DistributedError
from crosscut.runtime.thread_state import ThreadState

__all__ = ["WireDtypes"]

Dtypes = dict[str, list[torch.dtype | None]]


class _Recorder(fx.Interpreter):
    """Runs a graph on fake tensors and notes each node's leaf dtypes (None: not a tensor).

    Parameters and buffers are read as fakes too (``functional_call`` on each
    leaf module), so an in-place update in a forward (batch norm's
    ``num_batches_tracked``) touches a fake, never the model.
    """

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode) -> None:
        super().__init__(gm)
        self.mode = mode
        self.dtypes: Dtypes = {}

    def _fake(self, value: Any) -> Any:
        return pytree.tree_map(
            lambda t: self.mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, value
        )

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self._fake(super().get_attr(target, args, kwargs))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        mod = self.fetch_attr(str(target))
        state: dict[str, torch.Tensor] = {
            k: self.mode.from_tensor(v) for k, v in [*mod.named_parameters(), *mod.named_buffers()]
        }
        return functional_call(mod, state, tuple(args), kwargs)

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        self.dtypes[n.name] = [
            t.dtype if isinstance(t, torch.Tensor) else None for t in pytree.tree_leaves(out)
        ]
        return out


class WireDtypes:
    """Per autocast state, each value's leaf dtypes (``{}`` when autocast is off)."""

    def __init__(self, gm: fx.GraphModule, device: torch.device, cross_shaped: bool) -> None:
        self._gm = gm
        self._device = device
        self._cross_shaped = cross_shaped
        self._cache: dict[Any, Dtypes] = {}

    def for_state(self, state: ThreadState) -> Dtypes:
        if not state.autocasting:
            return {}
        if self._cross_shaped:
            raise DistributedError(
                "autocast under torchrun is not supported with cross-shaped (device-group) "
                "stages: their members' messages have the traced float32 dtypes",
                value=[k for k, on, _ in state.autocast if on],
                remedy="run this plan without autocast, use a plan without device groups, or "
                "compile it locally (crosscut.compile) where autocast reaches every stage",
            )
        key = state.autocast
        if key not in self._cache:
            self._cache[key] = self._propagate(state)
        return self._cache[key]

    def _propagate(self, state: ThreadState) -> Dtypes:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        recorder = _Recorder(self._gm, mode)
        try:
            with mode, state.applied():
                inputs = [
                    torch.empty(tuple(v.shape), dtype=v.dtype, device=self._device)
                    if isinstance(v := n.meta.get("val"), torch.Tensor)
                    else v
                    for n in self._gm.graph.nodes
                    if n.op == "placeholder"
                ]
                recorder.run(*inputs)
        except Exception as exc:
            raise DistributedError(
                "the dtypes of the values sent between ranks under this autocast state could "
                f"not be derived from the traced graph: {type(exc).__name__}: {exc}",
                value=[k for k, on, _ in state.autocast if on],
                remedy="run without autocast under torchrun, or compile locally",
            ) from exc
        return recorder.dtypes
