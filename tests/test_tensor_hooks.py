"""Tensor hooks registered inside a forward (frontend/tensor_hooks.py).

Before: a submodule whose forward called ``y.register_hook(fn)`` was made a leaf
(fx cannot record the function), and then shape propagation, which runs a leaf
without autograd, failed with an InputError blaming the example inputs ("cannot
register a hook on a tensor that doesn't require gradient"); in the root's
forward the trace failed with fx's "argument of type: <class 'method'>".
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import crosscut
from crosscut.errors import TraceError
from tests.test_mutation import assert_steps_like_eager

torch.set_num_threads(1)


class Hooked(nn.Module):
    """A convolution whose output's gradient is halved, then recorded (Grad-CAM style)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.grads: list[torch.Tensor] = []

    def record(self, g: torch.Tensor) -> None:
        self.grads.append(g.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        y.register_hook(self.record)  # registered first, runs last
        y.register_hook(lambda g: g * 0.5)
        return y


class Net(nn.Module):
    def __init__(self, in_root: bool = False) -> None:
        super().__init__()
        self.in_root = in_root
        self.a = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.hooked = Hooked()
        self.b = nn.Sequential(nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        self.c = nn.Conv2d(4, 2, 1)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        if self.in_root:
            y.register_hook(lambda g: g * 2.0)
        return self.c(self.b(self.hooked(y)) + y)


def _recorded(model: nn.Module) -> list[torch.Tensor]:
    """Every gradient a ``Hooked`` module of ``model`` (or of its compiled stages) recorded."""
    return [g for m in model.modules() if isinstance(m, Hooked) for g in m.grads]


@pytest.mark.parametrize(
    ("k", "mb", "recompute"), [(1, 1, "auto"), (2, 1, "never"), (3, 2, "always"), (2, 2, "never")]
)
def test_hooks_in_a_submodule_run_as_eager_runs_them(k: int, mb: int, recompute: str) -> None:
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8)
    c = crosscut.compile(
        copy.deepcopy(model), ["cpu"] * k, x, replicas=1, microbatches=mb,
        require_all_devices=True, recompute=recompute,
    )  # fmt: skip
    try:
        assert_steps_like_eager(c, ref, x, 2, mb=mb, exact_outputs=True, close=False)
        mine, theirs = _recorded(c), _recorded(ref)
        assert len(mine) == len(theirs) == 2 * mb  # once per call: per micro-batch, per step
        # eager's backward may reach the micro-batches in either order: compare the totals
        torch.testing.assert_close(sum(g.sum() for g in mine), sum(g.sum() for g in theirs))
    finally:
        c.close()


def test_a_hook_in_a_submodule_makes_it_a_leaf() -> None:
    graph = crosscut.trace(Net(), torch.randn(2, 3, 8, 8))
    assert "register_hook" in graph.leaves["hooked"], graph.leaves
    # the probe for ops that mix samples ran the leaf too (with autograd), and found none
    assert graph.row_mixing == [], graph.row_mixing
    assert not _recorded(Net()), "tracing records no gradient"


def test_a_hook_in_the_root_forward_is_refused_by_name() -> None:
    model = Net(in_root=True)
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(TraceError, match=r"Tensor\.register_hook") as e:
        crosscut.compile(model, ["cpu", "cpu"], torch.randn(4, 3, 8, 8))
    message = str(e.value)
    assert "Net" in message and "submodule" in message, message
    assert "argument of type" not in message and "likely a crosscut bug" not in message
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_an_eval_call_with_autograd_on_runs_the_hook_as_eager() -> None:
    """The eval program is traced in inference mode; the leaf's hook needs autograd there
    too (before: "this module was compiled in train mode and the model cannot be traced
    in the other")."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model).eval()
    x = torch.randn(4, 3, 8, 8)
    c = crosscut.compile(
        copy.deepcopy(model), ["cpu", "cpu"], x, replicas=1, microbatches=2,
        require_all_devices=True, cross_shaped=False,
    )  # fmt: skip
    try:
        c.eval()
        out, want = c(x), ref(x)
        torch.testing.assert_close(out, want)  # micro-batches: oneDNN's rounding per batch
        out.sum().backward()
        want.sum().backward()
        assert len(_recorded(c)) == 2 and len(_recorded(ref)) == 1  # per micro-batch, per call
    finally:
        c.close()
