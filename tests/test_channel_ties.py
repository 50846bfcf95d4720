"""Channel-split stages with shared weights: a module called twice, a weight two modules tie,
a weight also read whole.

Why: a channel split copies each sharded module's slice of its weights onto the group's
devices. Before, every call of a module made new copies: a module called twice held two
sets of shards (its ``state_dict`` entry came out twice as long, the optimizer saw each
shard twice), and a weight tied between two modules became two untied sets of shards, of
which the optimizer stepped one — training drifted from the model's without an error. Now
a module has one shard per device however often it is called, a tied tensor one piece per
device, and a module whose weight is also read whole (``F.conv2d(x, self.conv.weight)``)
runs whole. Each model trains three SGD steps with momentum on a 2- and a 3-device channel
group against eager on the same micro-batches.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import crosscut
from tests.plan_factory import widen


class Twice(nn.Module):
    """One convolution and one batch norm, each called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv, self.bn = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        h = torch.relu(self.bn(self.conv(h)))
        h = torch.relu(self.bn(self.conv(h)))
        return self.head(h.mean((2, 3)))


class Tied(nn.Module):
    """Two linears and two convolutions sharing their weights (``b.weight = a.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.c2.weight = self.c1.weight
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c2(torch.relu(self.c1(torch.relu(self.stem(x))))))
        h = h.mean((2, 3))
        return self.head(torch.relu(self.b(torch.relu(self.a(h)))))


class ReadWhole(nn.Module):
    """A convolution whose weight a functional call also reads (weight sharing by hand)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        h = torch.relu(self.conv(h)) + F.conv2d(h, self.conv.weight, padding=1)
        return self.head(h.mean((2, 3)))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 3, 10, 10, generator=g), torch.randint(0, 4, (8,), generator=g)


@pytest.mark.parametrize("width", [2, 3])
@pytest.mark.parametrize("make", [Twice, Tied, ReadWhole], ids=lambda m: m.__name__)
def test_channel_split_keeps_shared_weights_shared(make: type[nn.Module], width: int) -> None:
    torch.manual_seed(0)
    eager = make()
    x, y = _batch()
    plan = crosscut.partition(copy.deepcopy(eager), ["cpu"], x, microbatches=2, time_limit=5)
    compiled = crosscut.compile(
        copy.deepcopy(eager), ["cpu"] * width, x, plan=widen(plan, ((width, "channel"),))
    )
    try:
        params = list(compiled.parameters())
        assert len({id(p) for p in params}) == len(params), "a shard listed twice"
        assert any("#shard" in name for name, _ in compiled.named_parameters())
        opt = torch.optim.SGD(compiled.parameters(), lr=0.1, momentum=0.9)
        eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
        for _ in range(3):
            opt.zero_grad()
            compiled.train_step(x, y, F.cross_entropy)
            opt.step()
            eager_opt.zero_grad()
            for xs, ys in zip(x.chunk(2), y.chunk(2)):
                (F.cross_entropy(eager(xs), ys) / 2).backward()
            eager_opt.step()
        trained = compiled.state_dict()
        for key, value in eager.state_dict().items():
            assert trained[key].shape == value.shape, key
            assert torch.allclose(trained[key].double(), value.double(), atol=1e-6), key
    finally:
        compiled.close()
