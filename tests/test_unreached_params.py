"""Parameters no loss reaches keep ``grad is None``, as in eager, on every local layout.

Why it matters: an optimizer skips a parameter whose gradient is ``None`` but applies
weight decay (and Adam's moments) to one whose gradient is a tensor of zeros. Before,
replicas (and any batch-split stage) handed such parameters zeros: autograd fills an
unused output's gradient with zeros for a custom ``Function`` unless told not to, and
``share_threads._Replicate`` sums its outputs' gradients. An auxiliary head whose output
no loss reads then moved by 4e-3 in one SGD step with weight decay, where eager left it.
Under torchrun a batch-split group had both faults (the last test here); the replicas keep
``None`` through DDP's reducer (``tests/test_overlap.py``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import crosscut
from crosscut.runtime import CompiledModule


class WithAux(nn.Module):
    """A body, and an auxiliary head whose output is returned but not in the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, stride=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 5),
        )
        self.aux = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.body(x)
        return y, self.aux(y)


X = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0))
Y = torch.arange(8) % 5


def _halves(gm: fx.GraphModule) -> dict[str, int]:
    nodes = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    return {name: 2 * i // len(nodes) for i, name in enumerate(nodes)}


def _compiled(layout: str, model: nn.Module) -> nn.Module:
    if layout in ("replicas", "pipeline-M2"):
        reps, m = (2, 1) if layout == "replicas" else (1, 2)
        kw = {"replicas": reps, "microbatches": m, "require_all_devices": True}
        return crosscut.compile(model, ["cpu", "cpu"], (X,), **kw)
    gm = fx.symbolic_trace(model)
    first, second = (["cpu", "cpu"], "batch"), (["cpu"], "none")
    groups = [first, second] if layout == "batch-split-first" else [second, first]
    return CompiledModule(model, gm, _halves(gm), ["cpu", "cpu"], "1f1b", 2, groups=groups)


@pytest.mark.parametrize(
    "layout", ["replicas", "pipeline-M2", "batch-split-first", "batch-split-second"]
)
def test_an_unread_head_keeps_no_gradient_and_weight_decay_leaves_it(layout: str) -> None:
    torch.manual_seed(0)
    eager = WithAux()
    compiled = _compiled(layout, copy.deepcopy(eager))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.1) for m in (compiled, eager)]
    for _ in range(2):
        for model, opt in zip((compiled, eager), opts):
            opt.zero_grad()
            F.cross_entropy(model(X)[0], Y).backward()
            if model is compiled:
                got = dict(compiled.named_parameters())
                assert got["aux.weight"].grad is None and got["aux.bias"].grad is None
                assert got["body.0.weight"].grad is not None
            opt.step()
    want = eager.state_dict()
    for name, value in compiled.state_dict().items():
        torch.testing.assert_close(value.cpu(), want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert torch.equal(compiled.state_dict()["aux.weight"].cpu(), want["aux.weight"])


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_a_torchrun_batch_group_keeps_no_gradient_and_accumulates_like_eager(
    tmp_path: Path,
) -> None:
    """2 gloo ranks, one stage split by batch. Before, the members' gradient all-reduce
    gave the unread head zeros (a member's share gets its gradients from the leader in
    fixed-shape messages, zeros for an output no loss reads), and a second step without
    ``zero_grad`` summed every member's accumulated gradient: 0.098 off eager."""
    from tests.test_recompute import run_two_ranks

    run_two_ranks("unreached_check.py", tmp_path)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for steps, got in report.items():
            assert got["with_grad"] == got["eager_with_grad"], (rank, steps, got)
            assert not any(k.startswith("aux.") for k in got["with_grad"]), (rank, steps, got)
            assert got["diff"] < 1e-6, (rank, steps, got)
