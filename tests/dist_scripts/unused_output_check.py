"""One rank of the unused-output check (tests/test_distributed.py): 2 stages, no replicas.

:class:`SideOutput` returns a second output that no loss reads, computed on
stage 0 from the stem, so it travels to the last stage (where outputs are
assembled) and no gradient comes back for it. In eager training its layer's
parameters get no gradient (``None``), and SGD with momentum and weight decay
leaves them alone; zeros sent back in its place would give them zero
gradients that weight decay then moves. Dumps this rank's gradients and the
state after one step under ``<out>/side_rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

import crosscut
import crosscut.distributed as cd
from crosscut.partitioner.annotate import annotate
from crosscut.partitioner.validate import validate_plan


class SideOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.side = nn.Linear(16, 4)
        self.body = nn.Sequential(*[nn.Conv2d(16, 16, 3, padding=1) for _ in range(4)])
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.relu(self.stem(x))
        s = self.side(y.mean((2, 3)))
        for conv in self.body:
            y = torch.relu(conv(y))
        return self.fc(y.mean((2, 3))), s


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)


def loss_fn(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out[0], target)  # the side output is never read


def plan_with_side_on_stage_0() -> crosscut.Plan:
    """Every node up to ``side`` and the first body conv on stage 0, the rest on stage 1."""
    x = batch()[0]
    plan = crosscut.partition(
        SideOutput(), ["cpu", "cpu"], x, microbatches=2, require_all_devices=True,
        time_limit=5, recompute="never", replicas=1
    )  # fmt: skip
    first = {"x", "stem", "relu", "mean", "side", "body_0", "relu_1"}
    plan.assignment = {n: 0 if n in first else 1 for n in plan.assignment}
    annotate(plan)
    validate_plan(plan)
    return plan


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--plan", required=True, help="plan_with_side_on_stage_0(), saved")
    ap.add_argument("--timeout", type=float, default=60.0)
    a = ap.parse_args()
    ctx = cd.init(timeout_s=a.timeout)
    pipe = cd.compile_distributed(
        SideOutput(), batch()[0], a.plan, microbatches=2,
        timeout_s=a.timeout, recompute=False,
    )  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    opt.zero_grad()
    pipe.train_step(*batch(), loss_fn)
    grads = pipe.local_grads()
    opt.step()
    state = {k: t.detach().clone() for k, t in pipe.named_original_tensors()}
    torch.save({"grads": grads, "state": state}, Path(a.out) / f"side_rank{ctx.rank}.pt")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
