"""One rank of the default-strategy check (tests/test_strategy.py): ``compile`` with no options.

Every rank calls ``crosscut.compile(model, None, x)`` as a user would;
rank 0 plans the whole strategy for the job's ranks and every rank runs what
it chose. The script trains one SGD step and writes, per rank, the plan's
choice and the state after the step to ``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import crosscut
import crosscut.distributed as cd


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)


def main() -> None:
    cd.init(timeout_s=60)
    out = Path(sys.argv[1])
    x, y = batch()
    pipe = crosscut.compile(build(), None, x)  # None: the ranks own devices (as "torchrun")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    loss = pipe.train_step((x,), y, nn.functional.cross_entropy)
    opt.step()
    plan = pipe.plan
    record = {
        "replicas": plan.replication.replicas,
        "stages": plan.num_stages,
        "microbatches": plan.options.microbatches,
        "rows": [a.text() for a in plan.strategy.alternatives],
        "loss": None if loss is None else float(loss),
        "state": {k: v.detach().clone() for k, v in pipe.state_dict().items()},
    }
    torch.save(record, out / f"rank{torch.distributed.get_rank()}.pt")
    print(f"OK {torch.distributed.get_rank()}", flush=True)


if __name__ == "__main__":
    main()
