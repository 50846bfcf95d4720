"""Activation recomputation (runtime/recomputing.py): same numbers, fewer saved activations.

Every case compiles one model twice on the same plan — stages recomputing and
not — and checks outputs, gradients and buffers bit for bit (recomputation
must not change a number), plus against eager where eager is the reference
(one micro-batch: eager's own dropout draws).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import crosscut
from crosscut.errors import InputError
from crosscut.runtime import CompiledModule

SKIP = ("placeholder", "output", "get_attr")


class Block(nn.Module):
    """Conv, batch norm, dropout and a skip connection that crosses the cut."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.3)
        self.c3 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.c1(x)))
        z = self.drop(torch.relu(self.bn2(self.c2(y))))
        z = torch.relu(self.c3(z)) + y
        return self.fc(F.dropout(z.mean((2, 3)), 0.2, self.training))


def _stage_of(gm: fx.GraphModule, k: int) -> dict[str, int]:
    comp = [n.name for n in gm.graph.nodes if n.op not in SKIP]
    return {name: i * k // len(comp) for i, name in enumerate(comp)}


Groups = list[tuple[list[str], str]] | None


def _compile(model: nn.Module, m: int, groups: Groups, recompute: Any) -> CompiledModule:
    gm = fx.symbolic_trace(model)
    k = 2 if groups is None else len(groups)
    devices = ["cpu"] * k
    return CompiledModule(
        model, gm, _stage_of(gm, k), devices, "1f1b", m, groups=groups, recompute=recompute
    )


def _step(c: CompiledModule, x: torch.Tensor, y: torch.Tensor, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    loss = c.train_step(x, y, F.cross_entropy)
    out = {"loss": loss.detach().clone()}
    for name, p in c.named_parameters():
        assert p.grad is not None, name
        out["grad:" + name] = p.grad.clone()
    out.update({"state:" + k: v.clone() for k, v in c.state_dict().items()})
    c.zero_grad()
    with torch.no_grad():
        torch.manual_seed(seed + 1)
        out["forward"] = c(x).clone()  # in train mode: batch statistics again
    return out


CASES = {
    "pipeline": None,
    "batch-split": [(["cpu"], "none"), (["cpu", "cpu"], "batch")],
    "channel-split": [(["cpu", "cpu"], "channel"), (["cpu"], "none")],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("m", [1, 2])
def test_recomputation_changes_no_number(case: str, m: int) -> None:
    torch.manual_seed(0)
    model = Block().train()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
    plain = _compile(copy.deepcopy(model), m, CASES[case], False)
    again = _compile(copy.deepcopy(model), m, CASES[case], True)
    calls = [0]
    # a pre-hook: checkpoint stops a recomputation once it has what backward needs
    again.stages[0].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    for seed in (11, 12):  # two steps: the second starts from updated running statistics
        want, got = _step(plain, x, y, seed), _step(again, x, y, seed)
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key], got[key]), (case, m, key)
    # each training forward of stage 0 ran twice (the recomputation), inference once
    assert calls[0] == 2 * (2 * m) + 2 * m, calls


def test_one_microbatch_recomputation_equals_eager() -> None:
    """M = 1 runs inline with eager's own dropout draws: recomputation must keep them."""
    torch.manual_seed(0)
    model = Block().train()
    eager = copy.deepcopy(model)
    c = _compile(copy.deepcopy(model), 1, None, True)
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 4, (4,))
    torch.manual_seed(5)
    loss = c.train_step(x, y, F.cross_entropy)
    torch.manual_seed(5)
    want = F.cross_entropy(eager(x), y)
    want.backward()
    assert torch.equal(loss, want.detach())
    got = dict(c.named_parameters())
    for name, p in eager.named_parameters():
        assert p.grad is not None and torch.equal(got[name].grad, p.grad), name
    state = c.state_dict()
    for key, v in eager.state_dict().items():
        assert torch.equal(state[key], v), key  # running statistics updated once, as eager


def test_recomputation_saves_fewer_activations() -> None:
    """What autograd keeps alive after the forward of a step: the stages' inputs only."""
    torch.manual_seed(0)
    model = Block().train()
    x = torch.randn(8, 3, 6, 6)
    sizes, grads = {}, {}
    for flag in (False, True):
        c = _compile(copy.deepcopy(model), 1, None, flag)
        saved = [0]

        def pack(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved[0] += t.numel() * t.element_size()
            return t

        torch.manual_seed(7)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = c(x)
        sizes[flag] = saved[0]
        out.square().sum().backward()  # the differentiable forward recomputes too
        grads[flag] = {k: p.grad for k, p in c.named_parameters()}
    assert sizes[True] < sizes[False] / 2, sizes
    for k, g in grads[False].items():
        assert torch.equal(g, grads[True][k]), k


def test_refusals_name_the_rule() -> None:
    model = Block()
    gm = fx.symbolic_trace(model)
    with pytest.raises(InputError, match="bn_mode"):
        CompiledModule(model, gm, _stage_of(gm, 2), ["cpu"] * 2, bn_mode="step", recompute=True)
    with pytest.raises(InputError, match="one bool per stage"):
        CompiledModule(model, gm, _stage_of(gm, 2), ["cpu"] * 2, recompute=[True])
    with pytest.raises(InputError, match="recompute must be"):
        crosscut.compile(
            model, ["cpu"] * 2, torch.randn(2, 3, 6, 6), recompute="yes", microbatches=1, replicas=1
        )
    # through the front door: every stage recomputes
    c = crosscut.compile(
        model, ["cpu"] * 2, torch.randn(4, 3, 6, 6), recompute=True, microbatches=1, replicas=1
    )
    assert c._recompute == [True] * len(c.program.stages)


def run_two_ranks(script: str, out: Path, *args: str) -> None:
    """``tests/dist_scripts/<script> [args] <out>`` on 2 gloo ranks (torchrun), which must
    succeed."""
    path = Path(__file__).parent / "dist_scripts" / script
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*cmd, str(path), *args, str(out)],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_torchrun_recomputation_changes_no_number(tmp_path: Path) -> None:
    """2 gloo ranks, 2 micro-batches, dropout and batch norm: recomputing vs not, bit for bit."""
    run_two_ranks("recompute_check.py", tmp_path)
    for rank in (0, 1):
        count, verdict = (tmp_path / f"rank{rank}.txt").read_text().split()
        assert verdict == "EQUAL" and int(count) > 4, (rank, count, verdict)
