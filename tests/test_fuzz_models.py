"""Fuzzing compile with random small CNNs, and checkpoints moved between plans.

The random models are DAGs of conv/bn/relu/pool blocks joined by concat and
add, the shapes CNNs are made of; each is compiled over 2 or 3 CPU devices with
every device used, and must match eager (outputs, loss, and the parameters after
an SGD step with learning rate 1, i.e. the gradients).
"""

from __future__ import annotations

import copy

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import crosscut
from crosscut.verify import verify_plan


class Block(nn.Module):
    """conv → (bn) → relu → (pool): one op family of a CNN."""

    def __init__(self, cin: int, cout: int, bn: bool, pool: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.bn = nn.BatchNorm2d(cout) if bn else nn.Identity()
        self.pool = nn.MaxPool2d(3, 1, 1) if pool else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(self.bn(self.conv(x))))


class RandomCNN(nn.Module):
    """Block i reads block ``src[i]``'s output, plus a skip joined by add or concat."""

    def __init__(self, spec: list[tuple[int, int, str, bool, bool]], width: int) -> None:
        super().__init__()
        # an add needs equal channels: the input (3) never joins a block (width) by add
        self.spec = [
            (src, skip, "none" if join == "add" and skip == 0 else join, bn, pool)
            for src, skip, join, bn, pool in spec
        ]
        chans = [3]
        blocks = []
        for src, skip, join, bn, pool in self.spec:
            cin = chans[src] + (chans[skip] if join == "cat" else 0)
            blocks.append(Block(cin, width, bn, pool))
            chans.append(width)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(chans[-1], 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [x]
        for block, (src, skip, join, _bn, _pool) in zip(self.blocks, self.spec):
            inp = outs[src]
            if join == "cat":
                inp = torch.cat([inp, outs[skip]], dim=1)
            y = block(inp)
            if join == "add":
                y = y + outs[skip]
            outs.append(y)
        return self.head(outs[-1].mean(dim=(2, 3)))


@st.composite
def cnn_specs(draw: st.DrawFn) -> list[tuple[int, int, str, bool, bool]]:
    n = draw(st.integers(3, 7))
    spec = []
    for i in range(n):
        src = draw(st.integers(0, i))
        skip = draw(st.integers(0, i))
        join = draw(st.sampled_from(["none", "add", "cat"]))
        spec.append((src, skip, join, draw(st.booleans()), draw(st.booleans())))
    return spec


@settings(
    max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(cnn_specs(), st.integers(2, 3), st.sampled_from([1, 2]), st.sampled_from(["gpipe", "1f1b"]))
def test_random_cnns_compile_like_eager(
    spec: list[tuple[int, int, str, bool, bool]], devices: int, micro: int, schedule: str
) -> None:
    torch.manual_seed(0)
    model = RandomCNN(spec, width=4)
    x = torch.randn(4, 3, 8, 8)
    if len(crosscut.trace(model, x[: 4 // micro]).compute_nodes()) < devices:
        devices = 1
    plan = crosscut.partition(
        model,
        ["cpu"] * devices,
        x,
        microbatches=micro,
        schedule=schedule,
        require_all_devices=True,
        time_limit=5,
    )
    plan.validate()
    assert plan.num_stages == devices
    report = verify_plan(model, x, plan)
    assert report.ok, report.text()


def test_checkpoint_moves_between_plans() -> None:
    """Train under a 2-device plan, save, load into a 3-device plan: every tensor kept."""
    torch.manual_seed(0)
    spec = [
        (0, 0, "none", True, False),
        (1, 0, "cat", True, True),
        (2, 1, "add", False, False),
        (3, 2, "cat", True, False),
    ]
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    a = crosscut.compile(RandomCNN(spec, 4), ["cpu"] * 2, x, require_all_devices=True)
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    nn.functional.cross_entropy(a(x), y).backward()
    opt.step()
    saved = copy.deepcopy(a.state_dict())
    b = crosscut.compile(RandomCNN(spec, 4), ["cpu"] * 3, x, require_all_devices=True)
    assert b.plan.num_stages == 3 and b.plan.assignment != a.plan.assignment
    b.load_state_dict(saved)
    got = b.state_dict()
    assert list(got) == list(saved)
    assert all(torch.equal(got[k], saved[k]) for k in saved)
    eager = RandomCNN(spec, 4)
    eager.load_state_dict(saved)
    torch.testing.assert_close(b(x), eager(x), rtol=0, atol=0)


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.a(x)) + self.b(x)


def test_branch_early_in_fx_order_on_a_later_stage() -> None:
    """Regression: stage calls follow the pipeline, not the first node of each stage."""
    from crosscut.runtime import CompiledModule

    model = TwoBranches()
    x = torch.randn(2, 3, 8, 8)
    gm = crosscut.trace(model, x).gm
    stage_of = {"a": 1, "relu": 1, "b": 0, "add": 1}  # fx order: a, relu, b, add
    compiled = CompiledModule(model, gm, stage_of, [torch.device("cpu")] * 2)
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
