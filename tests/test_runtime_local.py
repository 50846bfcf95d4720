"""Local executor: micro-batching, pipelined train steps, failure propagation, prefetch."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator

import pytest
import torch
import torchvision
from torch import fx, nn

from crosscut.errors import InputError, RuntimeError_
from crosscut.runtime import CompiledModule, Prefetcher, gather, scatter

SKIP = ("placeholder", "output", "get_attr")


def chunks(gm: fx.GraphModule, k: int) -> dict[str, int]:
    comp = [n.name for n in gm.graph.nodes if n.op not in SKIP]
    return {name: i * k // len(comp) for i, name in enumerate(comp)}


def compile_(model: nn.Module, k: int, schedule: str = "gpipe", mb: int = 1) -> CompiledModule:
    gm = fx.symbolic_trace(model)
    return CompiledModule(model, gm, chunks(gm, k), ["cpu"] * k, schedule, mb)


class Net(nn.Module):
    """No batch norm: micro-batching changes nothing but summation order."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.c3 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.c1(x))
        b = torch.relu(self.c2(a))
        c = self.c3(b) + a  # skip from stage 0 over stage 1
        return self.fc(c.mean((2, 3)))


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def compiled_grads(c: CompiledModule) -> dict[str, torch.Tensor]:
    out = {}
    for s, local, p in c.named_stage_parameters():
        for key in c.program.stages[s].param_keys[local]:
            assert p.grad is not None
            out[key] = p.grad.clone()
    return out


def test_scatter_gather_and_uneven_batches() -> None:
    x = torch.arange(12.0).reshape(6, 2)
    parts = scatter([x, 3], 3)
    assert [p[0].shape[0] for p in parts] == [2, 2, 2] and parts[1][1] == 3
    assert torch.equal(gather([p[0] for p in parts], torch.device("cpu")), x)
    with pytest.raises(InputError, match="divisible by the number of micro-batches"):
        scatter([x], 4)
    with pytest.raises(InputError, match="same batch size"):
        scatter([x, torch.zeros(5)], 2)


@pytest.mark.parametrize(("k", "schedule", "mb"), [(3, "gpipe", 2), (3, "1f1b", 4), (2, "1f1b", 1)])
def test_forward_and_train_step_match_eager(k: int, schedule: str, mb: int) -> None:
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    c = compile_(model, k, schedule, mb)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))
    loss_fn = nn.functional.cross_entropy
    out = c(x)
    expected = ref(x)
    torch.testing.assert_close(out, expected)
    loss_fn(out, y).backward()
    loss_fn(expected, y).backward()
    eager = grads(ref)
    got = compiled_grads(c)
    assert set(got) == set(eager)
    for key in eager:
        torch.testing.assert_close(got[key], eager[key])
    c.zero_grad()
    loss = c.train_step(x, y, loss_fn)
    torch.testing.assert_close(loss, loss_fn(expected, y).detach())
    for key, g in compiled_grads(c).items():
        torch.testing.assert_close(g, eager[key])


def test_optimizer_over_compiled_parameters() -> None:
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    c = compile_(model, 2, "1f1b", 2)
    opt_c = torch.optim.Adam(c.parameters(), lr=1e-2)
    opt_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    for _ in range(3):
        for opt, mod in ((opt_c, c), (opt_r, ref)):
            opt.zero_grad()
            nn.functional.cross_entropy(mod(x), y).backward()
            opt.step()
    sd = c.state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(sd[key], value)


def test_bn_micro_semantics_equal_per_chunk_eager() -> None:
    """Default bn_mode: each micro-batch normalised alone, running stats updated M times."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    ref = copy.deepcopy(model)
    c = compile_(model, 2, "gpipe", 2)
    x = torch.randn(4, 3, 32, 32)
    out = c(x)
    expected = torch.cat([ref(x[:2]), ref(x[2:])])
    torch.testing.assert_close(out, expected)
    sd = c.state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(sd[key], value)


def test_bn_exact_mode_is_honest() -> None:
    model = torchvision.models.resnet18(num_classes=10)
    gm = fx.symbolic_trace(model)
    c = CompiledModule(model, gm, chunks(gm, 2), ["cpu"] * 2, "gpipe", 2, bn_mode="exact")
    x = torch.randn(4, 3, 32, 32)
    with pytest.raises(RuntimeError_, match="cannot match single-device batch statistics"):
        c(x)
    c.eval()
    assert c(x).shape == (4, 10)  # eval uses running stats: exact for any M


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < 0:
            return x
        raise ValueError("kaboom")


class Failing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.boom = Boom()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.boom(self.b(self.a(x)))


class Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, Boom) or super().is_leaf_module(m, qualname)


@pytest.mark.parametrize("mb", [1, 2])
def test_worker_exception_names_the_stage_and_does_not_hang(mb: int) -> None:
    model = Failing()
    gm = fx.GraphModule(model, Tracer().trace(model))
    c = CompiledModule(model, gm, {"a": 0, "b": 1, "boom": 2}, ["cpu"] * 3, "1f1b", mb, timeout=20)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError_, match=r"stage2@cpu at action 2F0 failed: ValueError: kaboom"):
        c(torch.randn(4, 4))
    with pytest.raises(RuntimeError_, match="stage2@cpu"):
        c.train_step(torch.randn(4, 4), torch.randn(4, 4), nn.functional.mse_loss)
    assert time.perf_counter() - t0 < 15


def test_mixed_dtypes_between_stages() -> None:
    class Cast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 2).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x).double())

    torch.manual_seed(0)
    model = Cast()
    ref = copy.deepcopy(model)
    c = compile_(model, 2, "1f1b", 2)
    x = torch.randn(4, 4)
    out = c(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref(x))
    loss = c.train_step(x, torch.zeros(4, 2, dtype=torch.float64), nn.functional.mse_loss)
    assert loss.dtype == torch.float64


# ---- prefetcher -------------------------------------------------------------------


def test_prefetcher_keeps_order_and_applies_preprocess() -> None:
    data = [(torch.full((2, 3), float(i)), torch.tensor([i, i])) for i in range(7)]
    seen = list(Prefetcher(data, "cpu", preprocess=lambda b: (b[0] * 2, b[1]), depth=2))
    assert len(seen) == 7
    for i, (x, y) in enumerate(seen):
        assert torch.equal(x, torch.full((2, 3), 2.0 * i)) and torch.equal(y, torch.tensor([i, i]))
    c = compile_(Net(), 2)
    assert Prefetcher(data, c).device == torch.device("cpu")


def test_prefetcher_propagates_loader_errors_and_stops_early() -> None:
    def loader() -> Iterator[torch.Tensor]:
        yield torch.zeros(1)
        raise OSError("disk gone")

    it = iter(Prefetcher(loader(), "cpu"))
    assert torch.equal(next(it), torch.zeros(1))
    with pytest.raises(OSError, match="disk gone"):
        next(it)
    endless = (torch.zeros(1) for _ in iter(int, 1))
    t0 = time.perf_counter()
    for i, _ in enumerate(Prefetcher(endless, "cpu", depth=1)):
        if i == 3:
            break
    assert time.perf_counter() - t0 < 5
