"""Random ops draw the same numbers whatever the plan (``crosscut/runtime/rng.py``).

With several micro-batches each random op draws from a seed of (the call's
seed, the micro-batch, the op's traced name): two plans of one model, run
after ``torch.manual_seed(s)``, give identical outputs and losses, run after
run, whatever the threads do. With one micro-batch on CPU and the random ops
in program order, the stages run inline and draw eager's own numbers.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import fx, nn

from crosscut.runtime import CompiledModule

torch.set_num_threads(1)
SKIP = ("placeholder", "output", "get_attr")


class Noisy(nn.Module):
    """Every kind of random op: a Dropout module, F.dropout, rand_like, bernoulli_."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.drop(self.a(x))
        v = F.dropout(self.b(x), 0.3, self.training)
        noise = torch.rand_like(x)
        keep = torch.empty_like(x).bernoulli_(0.8)
        w = self.c(x * keep) + noise
        return self.head(torch.relu(u + v + w))


def random_plans(gm: fx.GraphModule, count: int, seed: int) -> list[dict[str, int]]:
    """Edge-respecting stage assignments: cuts at random points of the node order."""
    names = [n.name for n in gm.graph.nodes if n.op not in SKIP]
    rng = random.Random(seed)
    plans = [dict.fromkeys(names, 0)]
    while len(plans) < count:
        k = rng.randint(2, 4)
        cuts = sorted(rng.sample(range(1, len(names)), k - 1))
        plans.append({n: sum(i >= c for c in cuts) for i, n in enumerate(names)})
    return plans


def compiled(model: nn.Module, gm: fx.GraphModule, plan: dict[str, int], m: int) -> CompiledModule:
    k = max(plan.values()) + 1
    return CompiledModule(copy.deepcopy(model), gm, plan, ["cpu"] * k, "1f1b", m)


@pytest.mark.parametrize("m", [2, 4])
def test_every_plan_draws_the_same_numbers(m: int) -> None:
    torch.manual_seed(0)
    model = Noisy().train()
    gm = fx.symbolic_trace(model)
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    outs, losses, grads = [], [], []
    for plan in random_plans(gm, 6, seed=m):
        c = compiled(model, gm, plan, m)
        torch.manual_seed(7)
        outs.append(c(x))
        torch.manual_seed(8)
        losses.append(c.train_step(x, y, F.cross_entropy))
        grads.append({k: p.grad.clone() for k, p in c.named_parameters()})
        c.close()
    for out, loss, g in zip(outs[1:], losses[1:], grads[1:]):
        assert torch.equal(out, outs[0])
        assert torch.equal(loss, losses[0])
        assert all(torch.equal(g[k], grads[0][k]) for k in g)


def test_draws_differ_between_micro_batches_and_calls() -> None:
    """Seeds mix the micro-batch and the call: no mask is reused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8)).train()
    gm = fx.symbolic_trace(model)
    names = [n.name for n in gm.graph.nodes if n.op not in SKIP]
    c = CompiledModule(model, gm, dict(zip(names, [0, 0, 1])), ["cpu", "cpu"], "gpipe", 2)
    row = torch.randn(1, 8)
    x = row.repeat(4, 1)  # micro-batches 0 and 1 see the same rows
    first = c(x)
    assert not torch.equal(first[:2], first[2:])
    assert not torch.equal(first, c(x))
    torch.manual_seed(3)
    a = c(x)
    torch.manual_seed(3)
    assert torch.equal(a, c(x))  # the caller's seed decides
    c.close()


def test_one_micro_batch_in_program_order_draws_eagers_numbers() -> None:
    torch.manual_seed(0)
    model = Noisy().train()
    gm = fx.symbolic_trace(model)
    x = torch.randn(4, 8)
    for plan in random_plans(gm, 4, seed=5):
        c = compiled(model, gm, plan, 1)
        torch.manual_seed(11)
        got = c(x)
        torch.manual_seed(11)
        assert torch.equal(got, model(x))
        c.close()


def test_stochastic_depth_and_dropout_in_a_torchvision_model() -> None:
    """efficientnet_b0: StochasticDepth (bernoulli_) in every block, dropout in the head."""
    torch.manual_seed(0)
    model = torchvision.models.efficientnet_b0(num_classes=10).train()
    gm = fx.symbolic_trace(model)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    losses = []
    for plan in random_plans(gm, 3, seed=1):
        c = compiled(model, gm, plan, 2)
        torch.manual_seed(5)
        losses.append(c.train_step(x, y, F.cross_entropy))
        c.close()
    assert losses[1] == losses[0] and losses[2] == losses[0]


def test_batch_split_shares_draw_their_own_seeds_on_their_threads() -> None:
    """A stage split by batch over two devices: shares on two threads, repeatable draws."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.ReLU()).train()
    gm = fx.symbolic_trace(model)
    names = [n.name for n in gm.graph.nodes if n.op not in SKIP]
    groups = [(["cpu", "cpu"], "batch"), (["cpu"], "none")]
    c = CompiledModule(
        model, gm, dict(zip(names, [0, 0, 1, 1])), ["cpu", "cpu"], "1f1b", 2, groups=groups
    )
    x = torch.randn(1, 8).repeat(8, 1)  # every share sees the same rows
    runs = []
    for _ in range(3):
        torch.manual_seed(4)
        runs.append(c(x))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    shares = runs[0].split(2)  # 2 micro-batches x 2 shares: four different masks
    assert all(not torch.equal(shares[i], shares[j]) for i in range(4) for j in range(i))
    c.close()


def test_a_wrapped_random_op_still_counts_as_random_for_share_threads() -> None:
    """Batch-split shares run one after another when the stage draws (share_threads.py).

    The stage graphs' random ops are wrapped by runtime/rng.py; the check used to
    miss the wrappers, so shares drew concurrently from the caller's generator
    with one micro-batch (masks by thread timing).
    """
    from crosscut.runtime.rng import seed_random_ops
    from crosscut.runtime.share_threads import draws_random

    class Drop(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.dropout(x, 0.5, True) + x.bernoulli()

    gm = fx.symbolic_trace(Drop())
    assert draws_random(gm)
    assert seed_random_ops(gm) == 2
    assert draws_random(gm)
