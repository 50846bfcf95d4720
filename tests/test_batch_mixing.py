"""Ops that mix the samples of a batch are never held by a batch-split stage.

A batch-split group runs its stage on shares of the micro-batch. An op that
computes a tensor from several samples (``y - y.mean(0)``, a concatenation
along the batch, a 0-d loss) then sees one share's rows: the default plan on
3 CPU devices put such a model's centring on a group of 3 and differed from
eager by 4e-3, silently. ``partitioner/build.mixes_batch_value`` finds them
from the traced shapes; the solvers refuse a batch split holding one and the
plan validator names it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import crosscut
from crosscut.errors import PlanError
from crosscut.partitioner.build import mixing_nodes
from crosscut.verify import verify_plan
from tests.plan_factory import widen

torch.set_num_threads(1)


class Centred(nn.Module):
    """Batch centring between two convolutions: every output row reads every sample."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c1(x).relu()
        y = y - y.mean(0, keepdim=True)
        return self.head(self.c2(y).relu().mean((2, 3)))


class Shapes(nn.Module):
    """Ops that keep samples apart though their output's dim 0 is not the batch, and one
    that mixes them."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.scale = nn.Parameter(torch.ones(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c(x)  # (8, 4, 8, 8)
        windows = y.view(8, 4, 2, 4, 2, 4).permute(0, 2, 4, 3, 5, 1).reshape(-1, 4, 4, 4)
        back = windows.view(8, 2, 2, 4, 4, 4).permute(0, 5, 1, 3, 2, 4).reshape(8, 4, 8, 8)
        n = y.size(0)
        stacked = torch.cat([y, back], dim=0)  # mixes: 2B rows
        per_channel = self.scale.mean(0)  # parameters only: no sample in it
        pooled = stacked.view(2, n, 4, 8, 8).mean(0)
        return pooled.mean((2, 3)) * per_channel


class AlongTheBatch(nn.Module):
    """Ops that keep the batch's size but mix its samples, beside ones that do not."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c(x)
        mixed = (
            y.softmax(0)
            + torch.flip(y, dims=[0])
            + y[torch.arange(y.shape[0]).flip(0)]
            + y.cumsum(0)
            + torch.nn.functional.normalize(y, dim=0)
            + torch.roll(y, 1, 0)
        )
        kept = (
            y.permute(0, 2, 3, 1).permute(0, 3, 1, 2)
            + torch.nn.functional.softmax(y, dim=1)
            + y[:, :2].sum(1, keepdim=True)
            + y.flatten(1).view(y.size(0), 4, 8, 8)
        )
        return mixed + kept


def _flags(model: nn.Module, x: torch.Tensor) -> dict[str, bool]:
    graph = crosscut.trace(model, x)
    mixing = mixing_nodes(graph)
    return {n.name: n.name in mixing for n in graph.nodes}


def test_mixing_is_read_from_the_shapes() -> None:
    flags = _flags(Centred(), torch.randn(8, 3, 8, 8))
    assert [k for k, v in flags.items() if v] == ["mean"]
    flags = _flags(Shapes(), torch.randn(8, 3, 8, 8))
    # the concatenation (2B rows from B) mixes; what follows it reads no batch-major value,
    # and a stage holding the cat is refused anyway. Kept apart: the window partition and
    # its inverse, the size, and the parameters' mean (its dim 0 is 8 = the batch, but
    # no sample flows into it)
    assert {k for k, v in flags.items() if v} == {"cat"}
    # one sample: nothing to mix
    assert not any(_flags(Centred(), torch.randn(1, 3, 8, 8)).values())


def test_ops_along_the_batch_that_keep_its_size_are_read_from_the_call() -> None:
    flags = _flags(AlongTheBatch(), torch.randn(4, 3, 8, 8))
    mixing = {k for k, v in flags.items() if v}
    assert {"softmax", "flip", "cumsum", "normalize", "roll"} <= mixing, mixing
    assert any(k.startswith("getitem") for k in mixing)  # y[perm]
    assert not {"permute", "permute_1", "softmax_1", "sum_1", "flatten", "view"} & mixing, mixing


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "densenet121"])
def test_cnn_families_mix_no_samples(name: str) -> None:
    """Batch norm mixes inside (the runtime's per-share contract), nothing else does: the
    rule takes no group away from a CNN family."""
    import torchvision

    model = torchvision.models.get_model(name, weights=None, num_classes=5)
    assert not any(_flags(model, torch.randn(4, 3, 64, 64)).values())


@pytest.mark.parametrize("devices", [2, 3, 4])
def test_no_plan_splits_a_stage_that_mixes_samples(devices: int) -> None:
    """Default plans and plans with groups asked for: no batch-split stage holds the mean,
    and every plan equals eager on its micro-batches (3 devices differed by 4e-3)."""
    torch.manual_seed(0)
    model = Centred().double()
    x = torch.randn(16, 3, 16, 16, dtype=torch.float64)
    for kw in ({}, {"replicas": 1, "cross_shaped": True, "splits": ("batch",)}):
        plan = crosscut.partition(model, ["cpu"] * devices, x, time_limit=3, **kw)
        for st in plan.stages:
            if st.split == "batch" and len(st.devices) > 1:
                held = [n for n, k in plan.assignment.items() if k == st.index]
                assert "mean" not in held, (kw, plan.assignment)
        report = verify_plan(model, x, plan, rtol=1e-8, atol=1e-9)
        assert report.ok, (kw, report.text())


def test_a_hand_made_plan_that_splits_the_mean_is_refused_by_name() -> None:
    model = Centred()
    x = torch.randn(8, 3, 16, 16)
    one = crosscut.partition(model, ["cpu"], x, time_limit=3)
    assert one.nodes[[n.name for n in one.nodes].index("mean")].mixes_batch
    with pytest.raises(PlanError, match="split by batch but holds 'mean'") as e:
        crosscut.compile(model, ["cpu"] * 2, x, plan=widen(one, ((2, "batch"),)))
    assert "several samples" in str(e.value)
