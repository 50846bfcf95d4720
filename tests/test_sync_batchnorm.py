"""``nn.SyncBatchNorm``: the whole batch's statistics, or a named refusal.

A model converted with ``nn.SyncBatchNorm.convert_sync_batchnorm`` asks for batch
statistics over every process's samples. crosscut's local runtime has no process group,
so such a module fell back to plain batch norm over each replica's or micro-batch's
share, silently (resnet18 on two CPU replicas: outputs 2.16 off eager). These tests hold
the rule of ``runtime/batchnorm.check_sync_batchnorm``: a plan that keeps the whole batch
together (``bn_mode="exact"``) trains bit for bit like eager; one that splits it is
refused at compile time and at a later training call; frozen ones pass; under torchrun
every SyncBatchNorm is refused on every rank before anything runs.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import crosscut
from crosscut.errors import InputError


def _net(frozen: bool = False) -> nn.Module:
    torch.manual_seed(0)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(torchvision.models.resnet18(num_classes=5))
    if frozen:
        for m in net.modules():
            if isinstance(m, nn.SyncBatchNorm):
                m.eval()
    return net


X = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
Y = torch.arange(8) % 5


@pytest.mark.parametrize(
    "options",
    [{}, {"replicas": 2}, {"microbatches": 2, "replicas": 1}, {"bn_mode": "step"}],
    ids=["default", "replicas", "microbatches", "step"],
)
def test_a_plan_that_splits_the_batch_is_refused_by_name(options: dict[str, object]) -> None:
    with pytest.raises(InputError, match="SyncBatchNorm normalises with the whole batch") as err:
        crosscut.compile(_net(), ["cpu", "cpu"], (X,), **options)
    text = str(err.value)
    assert "layer1.0.bn1" in text and "'count': 20" in text and "bn_mode='exact'" in text


def test_exact_trains_bit_for_bit_like_eager() -> None:
    eager = _net()
    compiled = crosscut.compile(copy.deepcopy(eager), ["cpu", "cpu"], (X,), bn_mode="exact")
    assert compiled.plan.replication.replicas == 1 and compiled.microbatches == 1
    out = compiled(X)
    F.cross_entropy(out, Y).backward()
    want = eager(X)
    F.cross_entropy(want, Y).backward()
    assert torch.equal(out.detach().cpu(), want.detach())
    got = dict(compiled.named_parameters())
    for name, p in eager.named_parameters():
        assert got[name].grad is not None and torch.equal(got[name].grad.cpu(), p.grad), name
    buffers = dict(compiled.named_buffers())
    for name, b in eager.named_buffers():
        assert torch.equal(buffers[name].cpu(), b), name


def test_frozen_sync_batch_norms_pass_on_replicas() -> None:
    eager = _net(frozen=True)
    compiled = crosscut.compile(copy.deepcopy(eager), ["cpu", "cpu"], (X,), replicas=2)
    assert torch.allclose(compiled(X).detach().cpu(), eager(X).detach(), atol=1e-5)


def test_inference_passes_and_a_later_training_call_is_refused() -> None:
    eager = _net().eval()
    compiled = crosscut.compile(copy.deepcopy(eager), ["cpu", "cpu"], (X,), replicas=2)
    assert torch.allclose(compiled(X).cpu(), eager(X), atol=1e-5)
    compiled.train()
    with pytest.raises(InputError, match="SyncBatchNorm normalises with the whole batch"):
        compiled(X)


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_torchrun_refuses_sync_batch_norm_on_every_rank(tmp_path: Path) -> None:
    """2 gloo ranks: before this, torch's SyncBatchNorm raised its own ValueError on a CPU
    rank mid-step, and on GPUs its all-reduces would pair different stages' layers."""
    from tests.test_recompute import run_two_ranks

    run_two_ranks("sync_bn_check.py", tmp_path)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(report) == {"pipeline", "replicas", "eval"}, report
        for layout, got in report.items():
            assert got.startswith("InputError: nn.SyncBatchNorm cannot train"), (rank, layout, got)
            assert "2 processes" in got and "'1'" in got, (rank, layout, got)
