"""Tensor factories sized by the traced batch, one dimension at a time (frontend/factory_sizes.py).

Before: ``torch.zeros(x.size(0), 4)`` in a forward failed the whole trace at the
root ("zeros() takes 1 positional argument but 2 were given": torch's argument
parser rejects a Proxy among varargs sizes), though ``torch.zeros((b, 4))`` traces.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import crosscut
from crosscut.errors import TraceError
from crosscut.frontend.factory_sizes import FACTORIES
from tests.test_mutation import assert_steps_like_eager

torch.set_num_threads(1)


class Sized(nn.Module):
    """Builds per-sample tensors from its batch size, as varargs."""

    def __init__(self, noise: bool = False, broken: bool = False) -> None:
        super().__init__()
        self.noise, self.broken = noise, broken
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.size(0)
        y = self.head(torch.relu(self.conv(x)).mean((2, 3)))
        bias = torch.ones(b, 4, dtype=y.dtype) + torch.zeros(b, 1) * torch.empty(b, 4).fill_(3.0)
        if self.noise:
            bias = bias + 0.1 * torch.randn(b, 4)
        if self.broken:
            bias = bias + torch.tensor(b)  # not a factory with sizes: still untraceable
        return y * bias


@pytest.mark.parametrize(("mb", "replicas"), [(1, 1), (2, 1), (1, 2)])
def test_factories_sized_by_the_batch_trace_and_train_as_eager(mb: int, replicas: int) -> None:
    torch.manual_seed(0)
    model = Sized()
    x = torch.randn(4, 3, 8, 8)
    c = crosscut.compile(
        copy.deepcopy(model), ["cpu", "cpu"], x, replicas=replicas, microbatches=mb,
        require_all_devices=True,
    )  # fmt: skip
    # one step where micro-batches or replicas sum gradients in another order: SGD at lr=1
    # grows conv.bias 40x in two, and float rounding with it
    assert_steps_like_eager(c, model, x, steps=2 if mb == replicas == 1 else 1)
    traced = crosscut.trace(model, x).gm.graph.nodes
    assert {torch.ones, torch.zeros, torch.empty} <= {n.target for n in traced}  # ops, not leaves


def test_a_random_factory_draws_eagers_numbers_with_one_micro_batch() -> None:
    torch.manual_seed(0)
    model = Sized(noise=True)
    x = torch.randn(4, 3, 8, 8)
    c = crosscut.compile(copy.deepcopy(model), ["cpu", "cpu"], x, replicas=1, microbatches=1)
    try:
        torch.manual_seed(1)
        out = c(x)
        torch.manual_seed(1)
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    finally:
        c.close()


def test_the_factories_are_torchs_own_after_a_trace() -> None:
    before = {name: getattr(torch, name) for name in FACTORIES}
    crosscut.trace(Sized(), torch.randn(2, 3, 8, 8))
    with pytest.raises(TraceError):
        crosscut.trace(Sized(broken=True), torch.randn(2, 3, 8, 8))
    assert {name: getattr(torch, name) for name in FACTORIES} == before
    assert torch.zeros(2, 3).shape == (2, 3)
