"""A backward split into B (input gradients) and W (weight gradients) equals one backward.

``crosscut/split_backward.py`` restarts autograd at the nodes where the two
parts meet; these tests hold its results to one ``torch.autograd.backward``
bit for bit, on graphs built to hit each rule (weights through a view, a
weight used twice, an output of parameters only, no input to differentiate,
recomputation), then on compiled pipelines of model families under the
``zb-h1`` schedule against ``1f1b``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.utils.checkpoint import checkpoint

import crosscut
from crosscut.split_backward import backward_input, backward_weight


class LayerScale(nn.Module):
    """Conv, batch norm, a per-channel scale through a view, a skip: weight nodes of
    every shape (a conv, a batch norm, a mul whose weight edge goes through a view)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.gamma = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x)) * self.gamma.view(1, -1, 1, 1)
        return x + torch.relu(y)


class Tied(nn.Module):
    """One weight used by two convolutions: B and W cannot be split (it falls back)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, 3, 3) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(F.conv2d(x, self.w, padding=1))
        return F.conv2d(y, self.w, padding=1)


class WithBias(nn.Module):
    """An output of parameters only (a learned bias map), beside one of the input."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)
        self.bias_map = nn.Parameter(torch.randn(1, 4, 6, 6))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv(x), self.bias_map * 2.0


class UsesAndSends(nn.Module):
    """A stage that reads a tensor needing no gradient (the model's input) besides the one
    it receives, and both uses and sends on what it computes from it (the fuzz's zb-v2
    stage): the side convolution gets gradient through the cat and as a stage output.
    B skipped the output's gradient (it reaches no received leaf) and W restarted only the
    cat: the side weights' gradients were 0.2-1.2x eager's."""

    def __init__(self) -> None:
        super().__init__()
        self.side = nn.Conv2d(4, 4, 3, padding=1)
        self.conv = nn.Conv2d(8, 4, 3, padding=1)
        self.register_buffer("image", torch.randn(2, 4, 6, 6))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.relu(self.side(self.image))
        return y, self.conv(torch.cat([x, y], 1))


def _grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor | None]:
    return [x.grad, *(p.grad for p in module.parameters())]


def _run(
    module: nn.Module, split: bool, steps: int, wrap: Callable[..., object] | None = None
) -> list[torch.Tensor | None]:
    torch.manual_seed(1)
    xs = [torch.randn(2, 4, 6, 6) for _ in range(steps)]
    leaves = []
    pending = []
    for x in xs:  # accumulate over micro-batches, B of all before any W (as a pipeline may)
        leaf = x.requires_grad_()
        out = wrap(module, leaf) if wrap else module(leaf)
        outs = list(out) if isinstance(out, tuple) else [out]
        roots = [o for o in outs if isinstance(o, torch.Tensor)]
        grads: list[torch.Tensor | None] = [torch.ones_like(r) for r in roots]
        if split:
            pending.append(backward_input(roots, grads, [leaf]))
        else:
            torch.autograd.backward(roots, grads)
        leaves.append(leaf)
    for p in pending:
        backward_weight(p)
    return [*(leaf.grad for leaf in leaves), *(p.grad for p in module.parameters())]


@pytest.mark.parametrize("make", [LayerScale, Tied, WithBias, UsesAndSends])
@pytest.mark.parametrize("recompute", [False, True])
def test_a_split_backward_equals_one_backward_bit_for_bit(
    make: Callable[[], nn.Module], recompute: bool
) -> None:
    torch.manual_seed(0)
    module = make()
    wrap = (lambda m, x: checkpoint(m, x, use_reentrant=False)) if recompute else None
    one = _run(copy.deepcopy(module), split=False, steps=3, wrap=wrap)
    two = _run(copy.deepcopy(module), split=True, steps=3, wrap=wrap)
    assert len(one) == len(two)
    for i, (a, b) in enumerate(zip(one, two)):
        assert (a is None) == (b is None), i
        if a is not None and b is not None:
            assert torch.equal(a, b), i
            assert a.stride() == b.stride(), i


def test_b_computes_no_weight_gradient_and_w_no_input_gradient() -> None:
    """The split is real: after B the weights have no gradient, and W leaves the
    inputs' gradients as B left them."""
    torch.manual_seed(0)
    module = LayerScale()
    x = torch.randn(2, 4, 6, 6, requires_grad=True)
    out = module(x)
    pending = backward_input([out], [torch.ones_like(out)], [x])
    assert x.grad is not None
    assert all(p.grad is None for p in module.parameters())
    after_b = x.grad.clone()
    backward_weight(pending)
    assert all(p.grad is not None for p in module.parameters())
    assert torch.equal(x.grad, after_b)


def test_without_an_input_to_differentiate_w_runs_the_whole_backward() -> None:
    """A first stage: nothing goes upstream, so B is empty and W does it all."""
    torch.manual_seed(0)
    module = LayerScale()
    ref = copy.deepcopy(module)
    x = torch.randn(2, 4, 6, 6)
    out = module(x)
    pending = backward_input([out.sum()], [None], [])
    assert all(p.grad is None for p in module.parameters())
    backward_weight(pending)
    ref(x).sum().backward()
    for a, b in zip(module.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)


def _family(name: str) -> nn.Module:
    kwargs = {"aux_logits": False, "init_weights": True} if name == "googlenet" else {}
    model: nn.Module = getattr(torchvision.models, name)(num_classes=10, **kwargs)
    for mod in model.modules():
        if isinstance(mod, nn.Dropout):
            mod.p = 0.0
    return model


@pytest.mark.parametrize(
    ("name", "stages", "micro"),
    [("resnet18", 3, 4), ("mobilenet_v3_small", 3, 2), ("googlenet", 2, 4), ("densenet121", 4, 4)],
)
def test_zb_h1_pipelines_train_bit_for_bit_like_1f1b(name: str, stages: int, micro: int) -> None:
    """Compiled model families: loss and every gradient of a zb-h1 step equal 1F1B's."""
    torch.manual_seed(0)
    model = _family(name)
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))
    got = {}
    for schedule in ("1f1b", "zb-h1"):
        torch.manual_seed(1)
        pipe = crosscut.compile(
            copy.deepcopy(model),
            ["cpu"] * stages,
            x,
            microbatches=micro,
            replicas=1,
            require_all_devices=True,
            schedule=schedule,
            time_limit=5,
        )
        assert pipe.plan.options.schedule == schedule and pipe.plan.num_stages == stages
        loss = pipe.train_step(x, y, F.cross_entropy)
        got[schedule] = (float(loss), {n: p.grad for n, p in pipe.named_parameters()})
        pipe.close()
    (la, ga), (lb, gb) = got["1f1b"], got["zb-h1"]
    assert la == lb
    assert ga.keys() == gb.keys()
    differ = [n for n in ga if not torch.equal(ga[n], gb[n])]
    assert not differ, differ


def test_a_weight_used_twice_falls_back_to_one_backward_in_b() -> None:
    """Restarting both convolutions of a tied weight would reorder its accumulation: B
    runs the whole backward and W has nothing left (correct, only not earlier)."""
    torch.manual_seed(0)
    module = Tied()
    x = torch.randn(2, 4, 6, 6, requires_grad=True)
    out = module(x)
    pending = backward_input([out], [torch.ones_like(out)], [x])
    assert module.w.grad is not None and x.grad is not None
    assert pending.items == [] and pending.whole is None


def test_a_split_backward_shows_b_and_w_apart() -> None:
    """Under a zero-bubble schedule the timeline draws every W in its own shade and the
    key says what B and W are."""
    from crosscut.partitioner.simulate import simulate
    from crosscut.viz import plan_to_html

    model = torchvision.models.resnet18(weights=None)
    plan = crosscut.partition(
        model,
        "3xV100",
        torch.randn(12, 3, 64, 64),
        replicas=1,
        microbatches=3,
        require_all_devices=True,
        schedule="zb-h1",
    )
    sim = simulate(plan)
    page = plan_to_html(plan, simulation=sim)
    timeline = page[page.index('<svg class="timeline"') :]
    timeline = timeline[: timeline.index("</svg>")]
    n_w = sum(e.kind == "W" for e in sim.events)
    assert n_w == 3 * 3
    assert timeline.count('class="ev ev-W"') == n_w
    assert timeline.count('class="ev ev-B"') == n_w
    assert "darkest W = the weight gradients" in page


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2"])
def test_local_replicas_and_recomputation_under_zero_bubble_equal_1f1b(schedule: str) -> None:
    """2 replicas x 2 stages (each stage position a batch-split group of 2 devices), and
    every stage recomputing: a zero-bubble step's gradients are 1F1B's, bit for bit."""
    torch.manual_seed(0)
    model = _family("resnet18")
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    for kw in ({"replicas": 2}, {"replicas": 1, "recompute": "always"}):
        got = []
        for name in ("1f1b", schedule):
            torch.manual_seed(1)
            pipe = crosscut.compile(
                copy.deepcopy(model),
                ["cpu"] * (4 if kw["replicas"] == 2 else 2),
                x,
                microbatches=2,
                require_all_devices=True,
                schedule=name,
                time_limit=5,
                **kw,
            )
            assert pipe.plan.num_stages == 2
            loss = pipe.train_step(x, y, F.cross_entropy)
            got.append((float(loss), {n: p.grad for n, p in pipe.named_parameters()}))
            pipe.close()
        (la, ga), (lb, gb) = got
        assert la == lb, kw
        assert [n for n in ga if not torch.equal(ga[n], gb[n])] == [], kw


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2"])
def test_a_stage_that_uses_and_sends_what_it_computes_from_the_input_trains_like_1f1b(
    schedule: str,
) -> None:
    """The seeded fuzz's pipeline (float32, one micro-batch): stage 1 convolves the model's
    input and both concatenates and sends on the result. Under zero bubble its weight
    gradients were 0.10 and 0.25 off 1F1B's; now bit for bit."""
    from crosscut.runtime.local.compiled import CompiledModule
    from tests.test_fuzz_models import RandomCNN

    spec = [(0, 0, "none", False, False), (0, 0, "none", False, False),
            (1, 2, "cat", False, False), (2, 3, "add", False, False)]  # fmt: skip
    stages = [
        ["blocks_0_conv", "blocks_0_bn", "relu", "blocks_0_pool"],
        ["blocks_1_conv", "blocks_1_bn", "relu_1", "blocks_1_pool", "cat", "blocks_2_conv"],
        ["blocks_2_bn", "relu_2", "blocks_2_pool", "blocks_3_conv", "blocks_3_bn", "relu_3",
         "blocks_3_pool"],
        ["add", "mean", "head"],
    ]  # fmt: skip
    stage_of = {name: k for k, names in enumerate(stages) for name in names}
    torch.manual_seed(0)
    model = RandomCNN(spec, width=4)
    x = torch.randn(4, 3, 8, 8)
    gm = crosscut.trace(model, x).gm
    grads = []
    for name in ("1f1b", schedule):
        c = CompiledModule(copy.deepcopy(model), gm, stage_of, ["cpu"] * 4, name, 1)
        c.train_step(x, None, lambda out, _t: out.pow(2).sum())
        grads.append({k: p.grad for k, p in c.named_parameters()})
        c.close()
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0]), [
        k for k in grads[0] if not torch.equal(grads[0][k], grads[1][k])
    ]
