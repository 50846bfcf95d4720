"""Custom autograd Functions and the reentrant checkpoint (frontend/autograd_functions.py).

torch.fx traces a Function's forward and drops its backward; before this, a
gradient reversal layer trained the other way and the reentrant checkpoint lost
its block's gradients (weights off by 1e2 after one SGD step), silently.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn

import crosscut
from crosscut.errors import TraceError
from tests.test_mutation import assert_steps_like_eager

torch.set_num_threads(1)


class GradReverse(torch.autograd.Function):
    """Identity forward, ``-g / 2`` backward (domain-adversarial training)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return -0.5 * g


class Reverser(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return GradReverse.apply(x)  # type: ignore[no-any-return]


class Block(nn.Module):
    """Three convolutions with a skip; ``how`` puts a Function or a checkpoint mid-way."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.mid = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        self.rev = Reverser()
        self.c = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.a(x))
        if self.how == "reverse-in-submodule":
            z = self.mid(self.rev(y))
        elif self.how == "reverse-in-root":
            z = self.mid(GradReverse.apply(y))
        elif self.how == "checkpoint-in-root":
            z = cp.checkpoint(self.mid, y, use_reentrant=True)
        else:  # checkpoint_sequential runs the reentrant checkpoint per segment
            z = cp.checkpoint_sequential(self.mid, 2, y, use_reentrant=True)
        return self.c(z) + y


CASES = ["reverse-in-submodule", "checkpoint-in-root", "checkpoint-sequential"]


@pytest.mark.parametrize("how", CASES)
@pytest.mark.parametrize(
    ("k", "mb", "recompute"), [(1, 1, "auto"), (2, 1, "auto"), (3, 1, "always"), (2, 2, "never")]
)
def test_functions_and_reentrant_checkpoints_train_like_eager(
    how: str, k: int, mb: int, recompute: str
) -> None:
    torch.manual_seed(0)
    model = Block(how)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8)
    c = crosscut.compile(
        copy.deepcopy(model), ["cpu"] * k, x, replicas=1, microbatches=mb,
        require_all_devices=True, recompute=recompute,
    )  # fmt: skip
    assert_steps_like_eager(c, ref, x, 2, mb=mb, exact_outputs=True)


def test_a_function_in_a_submodule_makes_it_a_leaf_and_checkpoints_trace_through() -> None:
    x = torch.randn(2, 3, 8, 8)
    graph = crosscut.trace(Block("reverse-in-submodule"), x)
    assert "GradReverse" in graph.leaves["rev"], graph.leaves
    traced = crosscut.trace(Block("checkpoint-in-root"), x)
    assert not traced.leaves  # the block's own ops, each a node the planner can cut between
    assert {"mid.0", "mid.1"} <= {str(n.target) for n in traced.gm.graph.nodes}


def test_a_function_in_the_root_forward_is_refused_by_name() -> None:
    model = Block("reverse-in-root")
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(TraceError, match="custom autograd Function GradReverse") as e:
        crosscut.compile(model, ["cpu", "cpu"], torch.randn(4, 3, 8, 8))
    assert "submodule" in str(e.value) and "likely a crosscut bug" not in str(e.value)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


@pytest.mark.parametrize("fails", [False, True])
def test_the_check_is_gone_after_a_trace(fails: bool) -> None:
    """Outside a trace (and after one that failed) Functions run as torch runs them."""
    before: Callable[..., object] = torch.autograd.Function.__dict__["apply"]
    if fails:
        with pytest.raises(TraceError):
            crosscut.trace(Block("reverse-in-root"), torch.randn(2, 3, 8, 8))
    else:
        crosscut.trace(Block("reverse-in-submodule"), torch.randn(2, 3, 8, 8))
    assert torch.autograd.Function.__dict__["apply"] is before
    t = torch.ones(3, requires_grad=True)
    GradReverse.apply(t).sum().backward()
    assert torch.equal(t.grad, torch.full((3,), -0.5))
