"""A leaf's draws from Python's ``random`` and NumPy, replayed under recomputation
(runtime/python_draws.py).

Before: a leaf doing stochastic depth with ``random.random()`` drew again when its
stage recomputed, so the recomputation could take the other branch; checkpoint
then raised "a different number of tensors was saved during the original forward
and recomputation" on a plan with recomputation, and the generator's stream moved
on by the extra draws (every later step's branches differed from the same plan
without recomputation).
"""

from __future__ import annotations

import copy
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import crosscut
import crosscut.runtime.python_draws as python_draws

torch.set_num_threads(1)


class PythonDrop(nn.Module):
    """Stochastic depth drawn from Python's or NumPy's generator; a leaf, since its
    forward branches on data before it draws."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source
        self.conv = nn.Conv2d(6, 6, 3, padding=1)
        self.draws: list[float] = []
        self.rng = random.Random(0)  # the leaf's own generator ("instance" sources)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().sum() == 0:  # data-dependent: fx cannot trace it, so a leaf
            return x
        r = {
            "python": random.random,
            "numpy": lambda: float(np.random.rand()),
            "instance": self.rng.random,
            "instance-uniform": lambda: self.rng.uniform(0.0, 1.0),  # Python code over random()
            "instance-randint": lambda: self.rng.randint(0, 1) - 0.25,  # over getrandbits()
        }[self.source]()
        self.draws.append(r)
        return x if r < 0.5 else x + self.conv(x)


class Net(nn.Module):
    def __init__(self, source: str) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU())
        self.drop = PythonDrop(source)
        self.b = nn.Sequential(nn.ReLU(), nn.Conv2d(6, 6, 3, padding=1), nn.ReLU())
        self.c = nn.Conv2d(6, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.drop(self.a(x))))


def _steps(model: nn.Module, x: torch.Tensor, recompute: str, steps: int = 4) -> list[object]:
    """Outputs and state of ``steps`` SGD steps (lr=0.01) of the compiled model, from
    one seed of Python's and NumPy's generators."""
    c = crosscut.compile(
        copy.deepcopy(model), ["cpu", "cpu"], x, replicas=1, microbatches=2,
        require_all_devices=True, recompute=recompute,
    )  # fmt: skip
    random.seed(0)
    np.random.seed(0)
    seen: list[object] = []
    try:
        for _ in range(steps):
            out = c(x.clone())
            out.pow(2).sum().backward()
            with torch.no_grad():
                for p in c.parameters():
                    if p.grad is not None:  # none where every draw skipped the block
                        p -= 1e-2 * p.grad
                        p.grad = None
            seen += [out, c.state_dict()]
    finally:
        c.close()
    return seen


@pytest.mark.parametrize(
    "source", ["python", "numpy", "instance", "instance-uniform", "instance-randint"]
)
def test_recomputation_replays_a_leafs_python_draws(source: str) -> None:
    """Module-level draws, and a generator object of the leaf's own (``random.Random``):
    before, the object's draws were not replayed (its recomputation took the other branch,
    or its stream moved on by the extra draws)."""
    torch.manual_seed(0)
    model = Net(source)
    x = torch.randn(4, 3, 8, 8)
    assert crosscut.trace(model, x).leaves.keys() == {"drop"}
    plain = _steps(model, x, "never")
    recomputed = _steps(model, x, "always")
    for a, b in zip(plain, recomputed):  # recomputation changes no number
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(torch.isfinite(v).all() for v in plain[-1].values())  # type: ignore[attr-defined]


def test_outside_a_replay_the_generators_are_untouched() -> None:
    originals = random.random, np.random.rand
    log: list[object] = []
    with python_draws.recording(log):
        first = [random.random(), float(np.random.rand())]
        other: list[float] = []
        t = threading.Thread(target=lambda: other.append(random.random()))
        t.start()
        t.join()
    assert log == first and len(other) == 1  # another thread's draw is its own
    with python_draws.replaying(log):
        assert [random.random(), float(np.random.rand())] == first
        extra = random.random()  # past the log: drawn anew
    assert extra not in first
    assert (random.random, np.random.rand) == originals
    assert "random" not in vars(random.Random)  # the class's inherited primitive is back


def test_a_generator_objects_draws_are_replayed_once_each() -> None:
    """``uniform`` draws through ``random()``: the log holds the outer draw alone, the
    replay hands it back without drawing, so the object's stream moves on once."""
    rng, twin = random.Random(5), random.Random(5)
    log: list[object] = []
    with python_draws.recording(log):
        first = [rng.uniform(2.0, 3.0), rng.randint(0, 99), random.uniform(0.0, 1.0)]
    assert len(log) == 3, log
    with python_draws.replaying(log):
        assert [rng.uniform(2.0, 3.0), rng.randint(0, 99), random.uniform(0.0, 1.0)] == first
    assert first[:2] == [twin.uniform(2.0, 3.0), twin.randint(0, 99)]
    assert rng.random() == twin.random()  # the replay drew nothing from the object


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_torchrun_recomputation_replays_python_draws(tmp_path: Path) -> None:
    """2 gloo ranks, 2 micro-batches, three steps: recomputing vs not, bit for bit."""
    from tests.test_recompute import run_two_ranks

    run_two_ranks("python_draws_check.py", tmp_path)
    for rank in (0, 1):
        count, verdict = (tmp_path / f"rank{rank}.txt").read_text().split()
        assert verdict == "EQUAL" and int(count) > 4, (rank, count, verdict)
