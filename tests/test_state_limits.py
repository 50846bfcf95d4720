"""State written in forward limits how the planner splits the batch (``state_limits.py``).

A write in forward happens once per stage call: with ``M`` micro-batches ``M``
times, and on a share of the batch (data-parallel replicas, a batch-split
group) only the leader's share writes it. Before, the planner chose data
parallelism or micro-batches for such models anyway: ``crosscut.compile``
then refused the planner's own plan (micro-batches), or trained an EMA of an
activation on half the batch without a word (replicas, groups). Checked here:
the classification, the planner's choices and its rows, the refusals of
options and of hand-made plans that break a rule, and that every default
plan equals eager.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import crosscut
from crosscut.errors import CodegenError, InputError
from crosscut.runtime.dist.plan_rules import check_state
from crosscut.state_limits import state_limits
from crosscut.verify import verify_plan
from tests.plan_factory import widen
from tests.test_fuzz_models import ModalCNN

torch.set_num_threads(1)


class Ema(nn.Module):
    """An EMA of an activation (read from the batch) updated in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c1(x).relu()
        with torch.no_grad():
            self.avg.mul_(0.9).add_(0.1 * y.mean((0, 2, 3)))
        return self.head(self.c2(y).relu().mean((2, 3)) + self.avg)


class Calls(nn.Module):
    """A call counter: written in forward, but from no value of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.head(self.c2(self.c1(x).relu()).relu().mean((2, 3)))


class PlainNorm(nn.Module):
    """``F.batch_norm`` on a plain module's buffers: not a batch norm's, so it is state."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.batch_norm(self.c(x), self.mean, self.var, None, None, self.training, 0.1)
        return self.head(y.relu().mean((2, 3)))


def _limits(model: nn.Module) -> tuple[str, str]:
    got = state_limits(crosscut.trace(model, torch.randn(4, 3, 8, 8)).gm)
    return got.micro, got.shares


def test_state_writes_are_classified_by_what_they_read() -> None:
    micro, shares = _limits(Ema())
    assert "'avg'" in micro and "'avg'" in shares and "from the batch" in shares
    micro, shares = _limits(Calls())
    assert "'calls'" in micro and shares == ""  # the leader's share counts once: eager's
    micro, shares = _limits(PlainNorm())
    assert "'mean'" in micro or "'var'" in micro
    assert shares  # its statistics come from the batch
    # batch norm's own statistics, as a leaf and as F.batch_norm on a BatchNorm2d's buffers
    # (a GraphModule keeps a plain Module there: the tracer's mark says it is a batch norm)
    spec = [(0, 0, "none", True, False), (1, 0, "none", False, False)]
    assert _limits(ModalCNN(spec, ["functional_bn", "none"], "logits")) == ("", "")
    assert _limits(torch.nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))) == ("", "")


@pytest.mark.parametrize("devices", [2, 3, 4])
def test_the_planner_keeps_the_batch_whole_for_a_write_from_the_batch(devices: int) -> None:
    """Every default plan: one replica, no batch-split group, one micro-batch; the rows say
    why; and the plan trains like eager (it chose data parallelism before)."""
    torch.manual_seed(0)
    model = Ema().double()
    x = torch.randn(16, 3, 16, 16, dtype=torch.float64)
    plan = crosscut.partition(model, ["cpu"] * devices, x, time_limit=3)
    assert plan.replication.replicas == 1 and plan.options.microbatches == 1
    assert all(len(s.devices) == 1 or s.split != "batch" for s in plan.stages)
    reasons = [a.reason for a in plan.strategy.alternatives if a.outcome == "excluded"]
    assert any("'avg'" in r and "one share" in r for r in reasons), reasons
    assert any("'avg'" in r and "once per micro-batch" in r for r in reasons), reasons
    report = verify_plan(model, x, plan, rtol=1e-8, atol=1e-9)
    assert report.ok, report.text()


def test_a_counter_keeps_replicas_but_not_microbatches() -> None:
    torch.manual_seed(0)
    model = Calls()
    x = torch.randn(16, 3, 16, 16)
    plan = crosscut.partition(model, ["cpu"] * 2, x, time_limit=3)
    assert plan.options.microbatches == 1
    c = crosscut.compile(model, ["cpu"] * 2, x, plan=plan)
    ref = copy.deepcopy(model)
    for _ in range(3):
        out = c(x)
        assert torch.allclose(out, ref(x), rtol=1e-5, atol=1e-6)
    assert int(c.state_dict()["calls"]) == 3 == int(ref.calls)


def test_options_that_break_a_rule_are_refused_by_the_planner() -> None:
    x = torch.randn(8, 3, 8, 8)
    with pytest.raises(InputError, match="replicas=2 cannot be kept: state 'avg'") as e:
        crosscut.partition(Ema(), ["cpu"] * 2, x, replicas=2)
    assert "replicas=1" in str(e.value)
    with pytest.raises(InputError, match="microbatches=2 cannot be kept: state 'calls'") as e:
        crosscut.partition(Calls(), ["cpu"] * 2, x, microbatches=2)
    assert "microbatches=1" in str(e.value)
    # planned from a traced graph (no model at hand): the same rule, from the graph
    graph = crosscut.trace(Calls(), x[:4])
    with pytest.raises(InputError, match="microbatches=2 cannot be kept"):
        crosscut.partition(graph, ["cpu"] * 2, microbatches=2)
    # cross_shaped asked for: the channel split stays, the batch split goes
    plan = crosscut.partition(Ema(), ["cpu"] * 2, x, cross_shaped=True, replicas=1)
    assert plan.options.splits == ["channel"]


class LastBatch(nn.Module):
    """Keeps the last batch's activations: a write from the batch that mixes no samples."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 2)
        self.register_buffer("last", torch.zeros(8, 4, 16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c1(x).relu()
        self.last.copy_(y.detach())
        return self.head(y.mean((2, 3)))


def test_a_hand_made_plan_that_splits_the_write_is_refused_when_compiled() -> None:
    """A plan the planner would not make (a saved plan edited by hand, an older version's):
    the local runtime and every torchrun rank refuse it by name. (An EMA's mean over the
    batch is refused before, by the plan's own rule: tests/test_batch_mixing.py.)"""
    torch.manual_seed(0)
    model = LastBatch()
    x = torch.randn(8, 3, 16, 16)
    one = crosscut.partition(model, ["cpu"], x, time_limit=3)
    grouped = widen(one, ((2, "batch"),))
    with pytest.raises(CodegenError, match="state 'last' is written in forward by node") as e:
        crosscut.compile(model, ["cpu"] * 2, x, plan=grouped)
    assert "one share" in str(e.value)
    gm = crosscut.trace(model, x).gm
    with pytest.raises(CodegenError, match="'last'"):
        check_state(model, gm, one, replicas=2, microbatches=1, bn_mode="micro")
    with pytest.raises(CodegenError, match="'last'"):
        check_state(model, gm, grouped, replicas=1, microbatches=1, bn_mode="micro")
    check_state(model, gm, one, replicas=1, microbatches=1, bn_mode="micro")  # one share: kept
    check_state(Calls(), crosscut.trace(Calls(), x).gm, one, 2, 1, "micro")  # a counter: kept


@pytest.mark.parametrize("modal", [["functional_bn"] * 4, ["branch", "functional_bn"] * 2])
@pytest.mark.parametrize("grouped", [0, 1])
def test_verify_splits_a_functional_batch_norm_of_a_grouped_stage(
    modal: list[str], grouped: int
) -> None:
    """``F.batch_norm`` on a BatchNorm2d's buffers in a batch-split stage: each share is
    normalised apart, the leader's updates the statistics. verify's reference knew only
    batch-norm modules and reported these plans different (0.03 on the outputs)."""
    torch.manual_seed(0)
    spec = [(0, 0, "none", True, False), (1, 0, "none", False, False)] * 2
    model = ModalCNN(spec, modal, "logits").double()
    x = torch.randn(8, 3, 8, 8, dtype=torch.float64)
    pipe = crosscut.partition(
        model, ["cpu"] * 2, x, replicas=1, microbatches=2, cross_shaped=False, time_limit=3
    )
    groups = ((1, "none"), (1, "none"))
    groups = tuple((2, "batch") if k == grouped else g for k, g in enumerate(groups))
    report = verify_plan(model, x, widen(pipe, groups), rtol=1e-8, atol=1e-9)
    assert report.ok, report.text()
