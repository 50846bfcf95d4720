"""Recomputation writes no state twice (issue 27, item 1; runtime/state_replay.py).

A recomputing stage runs its forward again in backward. Every buffer the
forward writes — a counter ``add_(1)``, an EMA ``mul_/add_`` under
``torch.no_grad()``, ``F.batch_norm(training=True)`` on a plain module's
buffers, a batch norm traced through with its own momentum (timm's
``BatchNormAct2d``), a leaf ``nn.BatchNorm2d`` — must move once per
micro-batch, and the recomputation must read the values the first pass read
(an EMA multiplied into the output changes the gradients otherwise). Checked
against eager bit for bit on three ``"cpu"`` stages (one micro-batch), against
the same plan without recomputation with two micro-batches, and under torchrun.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from timm.layers import BatchNormAct2d
from torch import nn

import crosscut

torch.set_num_threads(1)


class OwnNorm(nn.Module):
    """A plain module (no ``_BatchNorm``) normalising with its own buffers."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(c))
        self.register_buffer("var", torch.ones(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.mean, self.var, None, None, True, 0.2)


class FusedBN(nn.BatchNorm2d):
    """Traced through, with a literal momentum (``momentum=0`` on the module does not reach it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        y = F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.3
        )
        return torch.relu(y)


class Stateful(nn.Module):
    """Every kind of forward write on a few stages, the EMA read by the output."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.own = OwnNorm(4)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)
        self.fused = FusedBN(4)
        self.c3 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.c4 = nn.Conv2d(4, 4, 3, padding=1)
        self.act = BatchNormAct2d(4)
        self.fc = nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("avg", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        y = torch.relu(self.own(self.c1(x)))
        y = self.fused(self.c2(y))
        with torch.no_grad():
            self.avg.mul_(0.5).add_(0.5 * y.mean((0, 2, 3)))
        y = torch.relu(self.bn(self.c3(y))) * self.avg[None, :, None, None]
        y = self.act(self.c4(y))
        return self.fc(y.mean((2, 3)))


def _train(model: Any, x: torch.Tensor, y: torch.Tensor, steps: int) -> dict[str, Any]:
    """Losses, gradients and state after ``steps`` SGD steps, then an eval forward."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {}
    for step in range(steps):
        opt.zero_grad()
        if isinstance(model, nn.Module) and not hasattr(model, "train_step"):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        else:
            loss = model.train_step(x, y, F.cross_entropy)
        out[f"loss{step}"] = loss.detach().clone()
        for name, p in model.named_parameters():
            out[f"grad{step}:{name}"] = p.grad.clone()
        opt.step()
    out.update({"state:" + k: v.clone() for k, v in model.state_dict().items()})
    model.eval()
    with torch.no_grad():
        out["eval"] = model(x).clone()
    model.train()
    return out


def _differ(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    assert want.keys() == got.keys()
    return [k for k in want if not torch.equal(want[k], got[k])]


@pytest.mark.parametrize("recompute", ["always", True])
def test_recomputation_writes_every_buffer_once_like_eager(recompute: Any) -> None:
    """Three stages, one micro-batch: bit for bit eager after two steps and in eval."""
    torch.manual_seed(0)
    model = Stateful()
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 3, (4,))
    c = crosscut.compile(
        copy.deepcopy(model),
        ["cpu"] * 3,
        x,
        recompute=recompute,
        require_all_devices=True,
        microbatches=1,
        replicas=1,
    )
    assert all(c._recompute) and len(c._recompute) == 3
    want, got = _train(copy.deepcopy(model), x, y, 2), _train(c, x, y, 2)
    assert not _differ(want, got), _differ(want, got)
    assert int(got["state:calls"]) == 2 and int(got["state:fused.num_batches_tracked"]) == 2


def test_recomputation_with_microbatches_matches_the_plan_without_it() -> None:
    """Two micro-batches, batch norms only (counters are refused with M > 1): the same plan
    recomputing and not gives the same bits, each statistic moved once per micro-batch."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), FusedBN(4), nn.Conv2d(4, 4, 3, padding=1),
        BatchNormAct2d(4), nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
    )  # fmt: skip
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 3, (8,))
    plan = crosscut.partition(
        model, ["cpu"] * 3, x, microbatches=2, require_all_devices=True, replicas=1
    )
    runs = []
    for flag in (False, True):
        c = crosscut.compile(copy.deepcopy(model), ["cpu"] * 3, x, plan=plan, recompute=flag)
        runs.append(_train(c, x, y, 2))
    assert not _differ(*runs), _differ(*runs)
    assert int(runs[1]["state:1.num_batches_tracked"]) == 4  # 2 steps x 2 micro-batches
    assert int(runs[1]["state:3.num_batches_tracked"]) == 4


def test_a_retained_graph_recomputes_from_the_same_state_twice() -> None:
    """A second backward over a retained graph replays the first pass's state again."""
    torch.manual_seed(0)
    model = Stateful()
    x = torch.randn(4, 3, 8, 8)
    c = crosscut.compile(copy.deepcopy(model), ["cpu"] * 3, x, recompute=True,
                         require_all_devices=True, microbatches=1, replicas=1)  # fmt: skip
    ref = copy.deepcopy(model)
    out, want = c(x), ref(x)
    assert torch.equal(out, want)
    for _ in range(2):
        out.square().sum().backward(retain_graph=True)
        want.square().sum().backward(retain_graph=True)
    got = dict(c.named_parameters())
    for name, p in ref.named_parameters():
        assert torch.equal(got[name].grad, p.grad), name
    sd = c.state_dict()
    for key, v in ref.state_dict().items():
        assert torch.equal(sd[key], v), key


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_torchrun_recomputation_writes_every_buffer_once(tmp_path: Path) -> None:
    """2 gloo ranks, one micro-batch, the stateful model: recomputing vs eager, bit for bit."""
    from tests.test_recompute import run_two_ranks

    run_two_ranks("recompute_state_check.py", tmp_path)
    got: dict[str, torch.Tensor] = {}
    for rank in (0, 1):
        got.update(torch.load(tmp_path / f"rank{rank}.pt"))
    torch.manual_seed(0)
    model = Stateful()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
    want = _train(model, x, y, 2)
    state = {k.removeprefix("state:"): v for k, v in want.items() if k.startswith("state:")}
    assert set(got) == set(state)
    assert [k for k in state if not torch.equal(state[k], got[k])] == []


# ---- stages writing their received inputs in place (issue 27, item 4) ------------------


class DropPathBlock(nn.Module):
    """Stochastic depth as timm writes it: a mask divided in place, ``x += shortcut``."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c2(torch.relu(self.c1(x)))
        mask = y.new_empty(y.shape[0], 1, 1, 1).bernoulli_(0.7)
        mask.div_(0.7)
        y = y * mask
        y += x
        return torch.relu(y)


class DropPathNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.b1, self.b2 = DropPathBlock(), DropPathBlock()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.b2(self.b1(self.stem(x))).mean((2, 3)))


def _written_input_cuts(gm: Any) -> list[dict[str, int]]:
    """Three-stage placements cutting just before in-place writes (so a stage receives the
    value it writes), each write in turn."""
    from crosscut.frontend.alias import inplace_target

    names = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    modules = dict(gm.named_modules())
    writes = [
        names.index(n.name)
        for n in gm.graph.nodes
        if n.name in names and inplace_target(n, modules) is not None
    ]
    plans = []
    for a, b in itertools.pairwise(writes):
        if 0 < a < b:
            plans.append({n: (0 if i < a else 1 if i < b else 2) for i, n in enumerate(names)})
    return plans


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_stages_writing_received_values_recompute_like_they_run(precision: str) -> None:
    """Every cut that hands a stage a value it writes in place (the mask's ``div_``,
    ``y += x``), two micro-batches: recomputing changes no bit and backward runs (it failed
    with "modified by an inplace operation")."""
    from crosscut.runtime import CompiledModule

    torch.manual_seed(0)
    model = DropPathNet().train()
    x, y = torch.randn(8, 3, 6, 6), torch.randint(0, 3, (8,))
    gm = crosscut.trace(model, x[:4]).gm
    plans = _written_input_cuts(gm)
    assert len(plans) >= 3
    for stage_of in plans:
        runs = []
        for flag in (False, True):
            c = CompiledModule(copy.deepcopy(model), gm, stage_of, ["cpu"] * 3, "1f1b", 2,
                               recompute=flag, precision=precision)  # fmt: skip
            assert any(st.mutated_inputs for st in c.program.stages)
            torch.manual_seed(1)
            runs.append(_train(c, x, y, 2))
        assert not _differ(*runs), (stage_of, _differ(*runs))


class ParamWriter(nn.Module):
    """Weight clipping in forward: a parameter written under ``no_grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.c1.weight.clamp_(-0.2, 0.2)
        return self.c2(torch.relu(self.c1(x)))


def test_a_parameter_written_in_forward_is_not_recomputed_but_refused_by_name() -> None:
    """A parameter write cannot be replayed (autograd saved the parameter): compile names
    it, with the stage and the node (the graph records the write); without recomputation
    it runs as eager. (The first call's refusal, runtime/state_replay.py, stays behind it
    for writes no trace finds.)"""
    from crosscut.errors import CodegenError

    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(CodegenError, match=r"parameter 'c1\.weight'") as e:
        crosscut.compile(ParamWriter(), ["cpu", "cpu"], x, recompute=True,
                         require_all_devices=True, microbatches=1, replicas=1)  # fmt: skip
    assert "recompute='auto' or 'never'" in str(e.value) and "clamp_" in str(e.value)
    model = ParamWriter()
    c = crosscut.compile(
        copy.deepcopy(model), ["cpu", "cpu"], x, recompute=False, microbatches=1, replicas=1
    )
    assert torch.equal(c(x), model(x))


def test_the_distributed_runtime_refuses_a_recomputed_parameter_write_at_build(
    tmp_path: Path,
) -> None:
    """The distributed runtime applies the local rule (codegen/state_writes.py) when it
    builds a rank: a recomputation the caller asked for is refused by name there (it used
    to fail at the first training call), and one the plan chose under "auto" is turned
    off, so the step is eager's. One gloo rank in this process: the rule reads no peer."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import crosscut.distributed as cd
    from crosscut.errors import CodegenError

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        torch.manual_seed(0)
        x, y = torch.randn(2, 3, 8, 8), torch.randn(2, 4, 4, 4)
        with pytest.raises(CodegenError, match=r"stage 0 recomputes.*'c1\.weight'"):
            cd.compile_distributed(ParamWriter(), x, None, replicas=1, recompute=True)
        model = ParamWriter()
        plan = crosscut.partition(model, ["cpu"], x, recompute="always", microbatches=1)
        assert plan.stages[0].recompute  # the plan asks for it; "auto" takes the plan's
        pipe = cd.compile_distributed(copy.deepcopy(model), x, plan, recompute="auto")
        got = pipe.train_step(x, y, F.mse_loss)
        pipe.close()
        want = F.mse_loss(model(x), y)
        want.backward()
        assert torch.equal(got, want.detach())
    finally:
        dist.destroy_process_group()


def test_timm_stochastic_depth_in_bf16_on_three_stages_recomputes() -> None:
    """The issue's case: timm's resnet with drop_path_rate, bf16, 3 stages, a cut handing a
    stage the ``x`` of ``x += shortcut``: backward ran into "modified by an inplace
    operation"; now recomputing equals not recomputing, bit for bit."""
    timm = pytest.importorskip("timm")
    from crosscut.runtime import CompiledModule

    torch.manual_seed(0)
    model = timm.create_model("resnet10t", num_classes=3, drop_path_rate=0.2).train()
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 3, (4,))
    gm = crosscut.trace(model, x[:2], precision="bf16").gm
    stage_of = _written_input_cuts(gm)[0]
    runs = []
    for flag in (False, True):
        c = CompiledModule(copy.deepcopy(model), gm, stage_of, ["cpu"] * 3, "1f1b", 2,
                           recompute=flag, precision="bf16")  # fmt: skip
        torch.manual_seed(1)
        runs.append(_train(c, x, y, 1))
    assert not _differ(*runs), _differ(*runs)
