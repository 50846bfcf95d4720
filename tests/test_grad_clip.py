"""``crosscut.clip_grad_norm_``: clipping by the whole model's norm on any plan.

Why: under torchrun a rank holds one stage, and torch's ``clip_grad_norm_`` over its
``parameters()`` clips each stage by that stage's own norm: training drifts from the
model's without an error. The helper computes the model's norm from every rank's
pieces, each parameter once, as eager computes it. Checked against eager training of
the same micro-batches with torch's function: locally on pipelines and a channel-split
group, and on torchrun (pipeline, replicas, a channel group, a batch group).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import crosscut
from crosscut.errors import InputError
from tests.plan_factory import widen

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "dist_scripts" / "clip_check.py"


class Net(nn.Module):
    """A small CNN with a tied weight (the head's two linears share one)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.b.weight = self.a.weight
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(torch.relu(self.b(torch.relu(self.a(h)))))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 3, 12, 12, generator=g), torch.randint(0, 4, (8,), generator=g)


def _train_both(
    compiled: nn.Module, eager: nn.Module, mb: int, norm_type: float, steps: int = 2
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _batch()
    opt = torch.optim.SGD(compiled.parameters(), lr=0.5)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.5)
    totals = []
    for _ in range(steps):
        opt.zero_grad()
        compiled.train_step(x, y, nn.functional.cross_entropy)  # type: ignore[operator]
        total = crosscut.clip_grad_norm_(compiled, 0.05, norm_type)
        opt.step()
        eager_opt.zero_grad()
        for xs, ys in zip(x.chunk(mb), y.chunk(mb)):
            (nn.functional.cross_entropy(eager(xs), ys) / mb).backward()
        eager_total = torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.05, norm_type)
        eager_opt.step()
        totals.append((total, eager_total))
    return totals


@pytest.mark.parametrize(
    ("devices", "mb", "norm_type"),
    [(2, 2, 2.0), (3, 1, float("inf")), (2, 4, 1.0)],
)
def test_local_pipeline_clips_like_eager_bit_for_bit(
    devices: int, mb: int, norm_type: float
) -> None:
    torch.manual_seed(0)
    eager = Net()
    x, _ = _batch()
    compiled = crosscut.compile(
        copy.deepcopy(eager), ["cpu"] * devices, x, microbatches=mb, time_limit=5,
        require_all_devices=True,
    )  # fmt: skip
    try:
        for total, eager_total in _train_both(compiled, eager, mb, norm_type):
            assert torch.equal(total, eager_total), (total, eager_total)
            assert total.item() > 0.05  # the factor was applied
        trained = compiled.state_dict()
        for key, value in eager.state_dict().items():
            assert torch.equal(trained[key], value), key
    finally:
        compiled.close()


def test_local_channel_shards_join_into_the_models_norm() -> None:
    """A channel-split stage's parameters are shards: their norms are joined, not summed."""
    torch.manual_seed(0)
    eager = Net()
    x, _ = _batch()
    plan = crosscut.partition(copy.deepcopy(eager), ["cpu"], x, microbatches=2, time_limit=5)
    wide = widen(plan, ((2, "channel"),))
    compiled = crosscut.compile(copy.deepcopy(eager), ["cpu", "cpu"], x, plan=wide)
    try:
        assert any("#shard" in n for n, _ in compiled.named_parameters())
        for total, eager_total in _train_both(compiled, eager, 2, 2.0):
            assert torch.allclose(total, eager_total, rtol=1e-6, atol=0), (total, eager_total)
        trained = compiled.state_dict()
        for key, value in eager.named_parameters():
            assert torch.allclose(trained[key], value, rtol=0, atol=1e-6), key
    finally:
        compiled.close()


def test_plain_module_is_clipped_by_torch() -> None:
    model = Net()
    twin = copy.deepcopy(model)
    x, y = _batch()
    for m in (model, twin):
        nn.functional.cross_entropy(m(x), y).backward()
    total = crosscut.clip_grad_norm_(model, 0.1)
    assert torch.equal(total, torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)


def test_bad_arguments_are_refused_by_rule() -> None:
    model = Net()
    with pytest.raises(InputError, match="compiled module"):
        crosscut.clip_grad_norm_(list(model.parameters()), 1.0)  # type: ignore[arg-type]
    x, _ = _batch()
    compiled = crosscut.compile(model, ["cpu"], x, time_limit=5)
    try:
        with pytest.raises(InputError, match="norm_type"):
            crosscut.clip_grad_norm_(compiled, 1.0, norm_type=-1)
        compiled.train_step(x, torch.zeros(8, dtype=torch.long), nn.functional.cross_entropy)
        first = next(iter(compiled.parameters()))
        assert first.grad is not None
        first.grad[0] = float("nan")
        with pytest.raises(RuntimeError, match="non-finite"):
            crosscut.clip_grad_norm_(compiled, 1.0, error_if_nonfinite=True)
    finally:
        compiled.close()


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
@pytest.mark.parametrize(
    ("case", "ranks"),
    [("pipeline", 2), ("replicas", 4), ("channel", 2), ("batch", 3), ("tied", 2)],
)
def test_torchrun_clips_by_the_whole_models_norm(case: str, ranks: int, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    done = subprocess.run(
        [*cmd, "--nproc-per-node", str(ranks), str(SCRIPT), case, str(tmp_path)],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]
    for step in range(2):
        totals = {rep["steps"][step]["total"] for rep in reports}
        assert len(totals) == 1, totals  # every rank scales by the same factor
        total, eager = reports[0]["steps"][step]["total"], reports[0]["steps"][step]["eager"]
        if case in ("channel", "tied"):  # shards' norms joined: rounds differently from the whole's
            assert abs(total - eager) <= 1e-6 * eager, (total, eager)
        else:
            assert total == eager, (total, eager)
        # what torch's own function gives over one rank's parameters is not the model's norm
        alone = [rep["steps"][step]["alone"] for rep in reports]
        assert min(alone) < 0.95 * eager, alone
    limit = {"pipeline": 0.0, "replicas": 0.0, "channel": 1e-7, "batch": 1e-9, "tied": 1e-6}[case]
    for rep in reports:
        assert rep["param_diff"] <= limit, (case, rep["param_diff"])
        assert rep["aliases"], "a rank's state_dict() values must share its tensors' storage"
    assert (reports[0]["shards"] > 0) == (case in ("channel", "tied"))
