"""How a compiled module is called and inspected, as the model is (issue 27, item 6).

Keyword arguments bind to the model's own ``forward`` signature (defaults
filled in, unknown or doubled names refused as a call's ``TypeError`` would
be, by name), and a non-persistent buffer that forward never reads is still
one of ``named_buffers()``/``buffers()``, out of ``state_dict()``, as on the
model.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import crosscut
from crosscut.errors import InputError

torch.set_num_threads(1)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3)

    def forward(self, x: torch.Tensor, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * scale + shift


@pytest.mark.parametrize("m", [1, 2])
def test_keyword_arguments_and_defaults_bind_like_the_model(m: int) -> None:
    torch.manual_seed(0)
    model = Scaled()
    x = torch.randn(4, 3, 8, 8)
    c = crosscut.compile(
        model, ["cpu", "cpu"], x, microbatches=m, require_all_devices=True, replicas=1
    )
    calls = [
        ((x,), {"scale": 3.0}),
        ((x,), {"shift": 2.0, "scale": 0.5}),
        ((x, 3.0), {"shift": 1.0}),
        ((x, 3.0, 1.0), {}),
        ((x,), {}),
        ((), {"x": x, "scale": 2.0}),
    ]
    for args, kwargs in calls:
        assert torch.equal(c(*args, **kwargs), model(*args, **kwargs)), (args[1:], kwargs)
    with pytest.raises(InputError, match=r"'gain'.*scale"):
        c(x, gain=2.0)
    with pytest.raises(InputError, match="'scale' twice"):
        c(x, 2.0, scale=3.0)
    with pytest.raises(InputError, match="'x'"):
        c(scale=3.0)


class Unread(nn.Module):
    """A non-persistent buffer forward never reads, beside a persistent one it does."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)
        self.register_buffer("table", torch.arange(5.0), persistent=False)
        self.register_buffer("offset", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(x) + self.offset[:, None, None]


def test_an_unread_non_persistent_buffer_is_listed_like_the_model() -> None:
    model = Unread()
    c = crosscut.compile(model, ["cpu", "cpu"], torch.randn(2, 3, 8, 8), microbatches=1, replicas=1)
    names = [k for k, _ in c.named_buffers()]
    assert names == [k for k, _ in model.named_buffers()] == ["table", "offset"]
    assert [b.tolist() for b in c.buffers()] == [b.tolist() for b in model.buffers()]
    assert list(c.state_dict()) == list(model.state_dict())  # "table" not in it


class Gated(nn.Module):
    """A second input every sample shares: a 0-d scale (or, refused, a 2-D mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(torch.relu(self.a(x)) * gate).mean((2, 3)))


@pytest.mark.parametrize(
    "layout", [{"microbatches": 2, "replicas": 1}, {"microbatches": 1, "replicas": 2}, {}]
)
def test_a_0d_tensor_input_goes_whole_to_every_piece(layout: dict[str, int]) -> None:
    """Before: ``IndexError: slice() cannot be applied to a 0-dim tensor`` inside compile
    (the trace cut every input to the micro-batch's rows), called a crosscut bug."""
    torch.manual_seed(0)
    model = Gated()
    x, gate, y = torch.randn(8, 3, 8, 8), torch.tensor(0.5), torch.randint(0, 3, (8,))
    c = crosscut.compile(
        copy.deepcopy(model), ["cpu", "cpu"], (x, gate), time_limit=5,
        require_all_devices=True, **layout,
    )  # fmt: skip
    try:
        torch.testing.assert_close(c(x, gate), model(x, gate), rtol=1e-6, atol=1e-6)
        loss = c.train_step((x, gate), y, nn.functional.cross_entropy)
        m = c.plan.options.microbatches
        want = 0.0
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            part = nn.functional.cross_entropy(model(xs, gate), ys) / m
            part.backward()
            want += float(part.detach())
        assert abs(float(loss) - want) < 1e-6
        for (name, p), q in zip(c.named_parameters(), model.parameters()):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        c.close()


def test_an_input_every_sample_shares_is_refused_by_name() -> None:
    """Before: the trace cut the (16, 16) mask to the batch's 8 rows and compile blamed the
    model: "the model rejected the example inputs at node 'mul'"."""
    x, mask = torch.randn(8, 3, 16, 16), torch.rand(16, 16)
    with pytest.raises(InputError, match="input 1's dim 0 is not the batch") as info:
        crosscut.compile(Gated(), ["cpu", "cpu"], (x, mask), time_limit=5)
    assert "register_buffer" in str(info.value)


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_torchrun_a_0d_tensor_input_goes_whole_to_every_rank(tmp_path: Path) -> None:
    """2 gloo ranks: a 2-stage pipeline, then 2 replicas, 2 micro-batches each. Before:
    the same ``IndexError`` in ``compile_distributed``, on every rank."""
    from tests.test_recompute import run_two_ranks

    run_two_ranks("zero_d_input_check.py", tmp_path)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for layout, got in report.items():
            assert got["grads"] > 0 and got["grad_diff"] < 1e-6, (rank, layout, got)
            if rank == 0 and layout == "pipeline":
                assert got["loss_diff"] is None, got  # the first stage computes no loss
            else:
                assert got["loss_diff"] < 1e-6, (rank, layout, got)


def test_a_dict_input_is_refused_with_the_wrapper_that_works() -> None:
    """A forward that takes a dict of tensors (a data loader's batch) cannot be cut by
    samples as it is; the message names the element's type and the wrapper, which the
    second half shows compiles and equals eager."""

    class DictIn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = nn.Conv2d(3, 4, 3)
            self.meta = nn.Linear(2, 4)

        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.c(batch["image"]).mean((2, 3)) + self.meta(batch["meta"])

    class Wrapped(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, image: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
            return self.model({"image": image, "meta": meta})

    torch.manual_seed(0)
    model, image, meta = DictIn(), torch.randn(8, 3, 8, 8), torch.randn(8, 2)
    with pytest.raises(InputError, match="one per argument") as err:
        crosscut.compile(model, ["cpu", "cpu"], ({"image": image, "meta": meta},))
    assert "'elements': ['dict']" in str(err.value) and "def forward(self, image" in str(err.value)
    compiled = crosscut.compile(Wrapped(copy.deepcopy(model)), ["cpu", "cpu"], (image, meta))
    torch.testing.assert_close(compiled(image, meta), model({"image": image, "meta": meta}))
