"""Ops that mix samples found by running them (``frontend/row_probe.py``).

The traced shapes and the call arguments miss ops that keep the batch as dim 0
and have no ``dim`` to read: ``y @ y.T``, ``torch.cdist(y, y)``, a leaf module
that centres the batch. Before the probe, the
default plan on 3 CPU devices put ``Gram``'s similarity on a batch-split group
and its outputs differed from eager with no error.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision.ops import stochastic_depth

import crosscut
from crosscut.frontend.row_probe import row_mixing_ops
from crosscut.partitioner.build import mixing_nodes
from crosscut.verify import verify_plan

torch.set_num_threads(1)


class Gram(nn.Module):
    """Each sample's output reads its similarity to every other sample."""

    def __init__(self, similarity: str = "matmul", width: int = 16) -> None:
        super().__init__()
        self.similarity = similarity
        self.c1, self.c2 = nn.Conv2d(3, width, 3, padding=1), nn.Conv2d(width, width, 3, padding=1)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c2(self.c1(x).relu()).relu().mean((2, 3))
        s = y @ y.t() if self.similarity == "matmul" else torch.cdist(y, y)
        return self.head(y) + s.softmax(1) @ y[:, :3]


class _Centre(torch.autograd.Function):
    """A custom function: its submodule is a leaf (frontend/autograd_functions.py), which
    only the probe sees mixing."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return g - g.mean(0, keepdim=True)


class CentreFn(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Centre.apply(x)  # type: ignore[no-any-return]


class CentreLeaf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True)


class Opaque(nn.Module):
    """Mixing in a custom function and hidden in a leaf module; row-local ops beside."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.leaf = CentreLeaf()
        self.centre = CentreFn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c(x)
        kept = torch.nn.functional.dropout(y, 0.5, training=True) + y.clone().add_(1)
        # drops whole rows, rarely: two runs often agree, a share's rows by chance not
        kept = kept + stochastic_depth(y, 0.05, "row", training=True)
        return self.centre(y) + self.leaf(y) + kept + y.squeeze() * 0


def _mixing(model: nn.Module, x: torch.Tensor, **kw: object) -> set[str]:
    return mixing_nodes(crosscut.trace(model, x, **kw))  # type: ignore[arg-type]


def test_similarities_and_opaque_mixers_are_found_by_running_them() -> None:
    mixing = _mixing(Gram(), torch.randn(8, 3, 8, 8))
    # y.t() (16, 8 at batch 8) only looks like 2 rows a sample: at 4 rows it is (16, 4)
    assert {"t"} <= mixing, mixing
    assert {"cdist"} <= _mixing(Gram("cdist"), torch.randn(8, 3, 8, 8))
    opaque = crosscut.trace(Opaque(), torch.randn(6, 3, 8, 8), leaf_modules=[CentreLeaf])
    found = mixing_nodes(opaque)
    assert "leaf" in opaque.row_mixing and "leaf" in found, found  # only the probe sees it
    assert "centre" in opaque.leaves and "centre" in found, found  # the custom function's
    # dropout is random, not mixing; an in-place add and a squeeze keep rows
    assert not {"dropout", "stochastic_depth", "add_", "squeeze", "clone", "c"} & found, found


def test_without_the_probe_the_static_rules_miss_them() -> None:
    """The probe is what finds them: the same graph without its result flags nothing."""
    for similarity, op in (("cdist", "cdist"), ("matmul", "t")):
        graph = crosscut.trace(Gram(similarity), torch.randn(8, 3, 8, 8))
        assert graph.row_mixing is not None and op in graph.row_mixing
        graph.row_mixing = None
        assert not mixing_nodes(graph), mixing_nodes(graph)


@pytest.mark.parametrize("similarity", ["matmul", "cdist"])
@pytest.mark.parametrize("devices", [2, 3])
def test_default_and_grouped_plans_equal_eager(similarity: str, devices: int) -> None:
    """Without the probe, batch-split plans held the similarity on 2, 3 and 4 devices
    (``y.t()`` is ``(16, 8)``: a batch-major fold by its shape) and all six differed."""
    torch.manual_seed(0)
    model = Gram(similarity).double()
    x = torch.randn(8, 3, 16, 16, dtype=torch.float64)
    for kw in ({}, {"replicas": 1, "cross_shaped": True, "splits": ("batch",)}):
        plan = crosscut.partition(model, ["cpu"] * devices, x, time_limit=3, **kw)
        report = verify_plan(model, x, plan, rtol=1e-8, atol=1e-9)
        assert report.ok, (kw, report.text())


@pytest.mark.parametrize(
    "name", ["resnet18", "mobilenet_v3_small", "densenet121", "squeezenet1_0", "googlenet"]
)
def test_cnn_families_have_no_mixing_ops(name: str) -> None:
    """No false alarm on the families (batch norm is the bn_mode contract, not mixing):
    the probe takes no batch-split group away from them."""
    import torchvision

    kw = {"aux_logits": False, "init_weights": False} if name == "googlenet" else {}
    model = torchvision.models.get_model(name, weights=None, num_classes=5, **kw)
    graph = crosscut.trace(model, torch.randn(4, 3, 64, 64))
    assert graph.row_mixing == [], graph.row_mixing


def test_the_probe_gives_back_weights_buffers_and_random_streams() -> None:
    class Writes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = nn.Conv2d(3, 4, 3)
            self.bn = nn.BatchNorm2d(4)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.add_(1)
            with torch.no_grad():
                self.c.bias.add_(1.0)
            return torch.nn.functional.dropout(self.bn(self.c(x)), 0.3)

    model = Writes()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 3, 8, 8)
    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    graph = crosscut.trace(model, x)
    assert torch.equal(torch.rand(3), want)  # the caller's random stream is untouched
    assert graph.row_mixing is not None  # it did run
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_no_probe_where_nothing_real_can_run() -> None:
    """Meta tensors, and shapes fixed at the traced batch: the static rules alone."""
    with torch.device("meta"):
        meta = Gram()
    assert crosscut.trace(meta, torch.randn(8, 3, 8, 8, device="meta")).row_mixing is None

    class Fixed(nn.Module):
        def __init__(self, shape: tuple[int, ...]) -> None:
            super().__init__()
            self.shape = shape

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.view(self.shape).relu()

    x = torch.randn(8, 3, 4, 4)
    graph = crosscut.trace(Fixed((8, 48)), x)  # 4 rows cannot take this view: no probe
    assert graph.row_mixing is None
    assert row_mixing_ops(Fixed((8, 48)), graph.gm, [x]) is None
    # 4 rows can, but dim 0 stays 8: not the batch's rows, so no batch split may hold it
    assert {"view", "relu"} <= set(crosscut.trace(Fixed((8, -1)), x).row_mixing or [])


def test_window_folds_keep_samples_only_in_sample_major_order() -> None:
    """``(B*n, ...)`` with each sample's windows together is rows of the batch; the same
    windows ordered window-major interleave the samples, and a batch split joining its
    shares' ``(n*B/2, ...)`` would misplace them."""

    class Windows(nn.Module):
        def __init__(self, window_major: bool) -> None:
            super().__init__()
            self.window_major = window_major
            self.c = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.c(x)
            b = y.size(0)
            w = y.view(b, 4, 2, 4, 2, 4).permute(0, 2, 4, 1, 3, 5)
            if self.window_major:
                w = w.permute(1, 2, 0, 3, 4, 5)
            return w.reshape(-1, 4, 4, 4).relu()

    sample_major = crosscut.trace(Windows(False), torch.randn(8, 3, 8, 8))
    assert sample_major.row_mixing == [], sample_major.row_mixing
    window_major = crosscut.trace(Windows(True), torch.randn(8, 3, 8, 8))
    assert "reshape" in (window_major.row_mixing or []), window_major.row_mixing
