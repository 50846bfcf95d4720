"""The contract both runtimes keep, as one function the local and the torchrun tests call.

``crosscut.compile`` returns a ``CompiledModule`` in one process and a
``DistributedPipeline`` per rank under torchrun; each must: name its
parameters and state by the model's keys in the model's order (a rank: its
share), load a whole checkpoint of the model, refuse device moves and allow
dtype changes, switch train/eval, train with ``train_step`` to eager's loss,
and save/load a checkpoint with the optimizer. Not a test module: imported by
``tests/test_contract.py`` and ``tests/dist_scripts/contract_check.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from crosscut.errors import CrosscutError
from crosscut.runtime.contract import Pipeline
from crosscut.runtime.dist.rank_executor import DistributedPipeline

__all__ = ["Small", "batch", "check_contract", "eager_loss"]


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.c3 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)
        self.register_buffer("scale", torch.full((), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.c1(x))
        y = torch.relu(self.c2(y)) + y * self.scale
        return self.fc(torch.relu(self.c3(y)).mean((2, 3)))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)


def eager_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int) -> float:
    with torch.no_grad():
        return float(sum(F.cross_entropy(model(a), b) / m for a, b in zip(x.chunk(m), y.chunk(m))))


def _raises(call: Any, kind: type[Exception] = CrosscutError) -> str:
    try:
        call()
    except kind as exc:
        return str(exc)
    raise AssertionError(f"{call} did not raise {kind.__name__}")


def check_contract(pipe: Any, model: nn.Module, m: int, tmp: Path) -> float | None:
    """Run the contract on ``pipe`` (compiled from ``model``); returns train_step's loss."""
    x, y = batch()
    assert isinstance(pipe, Pipeline), type(pipe)
    assert pipe.plan is not None
    base = lambda name: name.split("#shard")[0]  # noqa: E731
    order = [n for n, _ in model.named_parameters()]
    names = [base(n) for n, _ in pipe.named_parameters()]
    assert names == [n for n in order if n in set(names)], names
    assert len(list(pipe.parameters())) == len(list(pipe.named_parameters()))
    keys = [base(k) for k in pipe.state_dict()]
    model_keys = list(model.state_dict())
    assert keys == [k for k in model_keys if k in set(keys)], keys
    # a whole checkpoint of the model loads: each module takes its part
    other = model.state_dict()
    other = {k: v + 1 if v.is_floating_point() else v for k, v in other.items()}
    pipe.load_state_dict(other)
    for k, v in pipe.state_dict().items():
        if "#shard" not in k:
            assert torch.equal(v, other[k]), k
    pipe.load_state_dict(model.state_dict())
    msg = _raises(lambda: pipe.load_state_dict({"nope": torch.zeros(1)}))
    assert "missing" in msg and "nope" in msg
    # forward: eager's output where it is returned (under torchrun: the last stage's ranks)
    with torch.no_grad():
        want_out = model(x)
    pipe.eval()
    out = pipe(x)
    named = pipe(x=x)  # keywords bind to the model's forward's inputs (contract.bind_inputs)
    assert (named is None) == (out is None) and (out is None or torch.equal(named, out))
    if out is not None:  # a replica's output is its shard of the batch
        want_out = want_out.chunk(getattr(pipe, "replicas", 1))[getattr(pipe, "replica", 0)]
        assert torch.allclose(out, want_out, rtol=1e-5, atol=1e-6)
    pipe.train()
    out = pipe(x)  # under grad mode: locally differentiable, under torchrun refused by name
    if out is not None:
        assert out.requires_grad
        if isinstance(pipe, DistributedPipeline):
            assert "train_step" in _raises(lambda: out.sum().backward())
        else:
            out.sum().backward()
            model.zero_grad()
            model(x).sum().backward()
            got = dict(pipe.named_parameters())
            for name, p in model.named_parameters():
                if name in got:
                    assert torch.allclose(got[name].grad, p.grad, rtol=1e-4, atol=1e-6), name
            model.zero_grad()
        for p in pipe.parameters():
            p.grad = None
    # placement is the plan's; dtype is the user's
    for move in (lambda: pipe.to("cpu"), pipe.cpu, lambda: pipe.to(torch.device("cpu"))):
        assert "placement comes from the plan" in _raises(move)
    # train/eval switch the module (and its stages)
    pipe.eval()
    assert not pipe.training and not any(mod.training for mod in pipe.modules())
    pipe.train()
    assert pipe.training
    # train_step: eager's loss where the loss is computed, None elsewhere
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    loss = pipe.train_step(x, y, F.cross_entropy)
    want = eager_loss(model, x, y, m)
    if loss is not None:
        assert abs(float(loss) - want) < 1e-5, (float(loss), want)
    opt.step()
    # a checkpoint with the optimizer round-trips
    stepped = {k: v.clone() for k, v in pipe.state_dict().items()}
    pipe.save_checkpoint(str(tmp / "ckpt"), opt, extra={"step": 1})
    with torch.no_grad():
        for p in pipe.parameters():
            p.zero_()
    assert pipe.load_checkpoint(str(tmp / "ckpt"), opt) == {"step": 1}
    for k, v in pipe.state_dict().items():
        assert torch.equal(v, stepped[k]), k
    # dtype changes are allowed
    pipe.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in pipe.parameters())
    pipe.to(torch.float32)
    pipe.close()
    return None if loss is None else float(loss)
