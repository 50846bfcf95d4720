"""Under torchrun: buffers written in forward and writes through views, on 2 ranks.

``mutation_check.py OUT MICROBATCHES``: compiles :class:`Writer` over the ranks,
runs 3 SGD train steps and saves this rank's state (original keys) to
``OUT/rank<r>.pt``; with ``MICROBATCHES > 1`` compile must refuse the buffer
update by name on every rank (writes the message to ``OUT/refused<r>.txt``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed
import torch.nn.functional as F
from torch import nn

import crosscut.distributed as cd
from crosscut.errors import CrosscutError


class Writer(nn.Module):
    """A call counter, an EMA under no_grad, and a write into a slice read on both sides."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("avg", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        y = self.c1(x)
        z = y * 2
        y[:, :4].add_(1)
        with torch.no_grad():
            self.avg.mul_(0.9).add_(0.1 * y.mean((0, 2, 3)))
        w = self.c2(torch.relu(y + z))
        return self.fc(w.mean((2, 3))) + self.calls.float() * 0.01


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)


def main() -> None:
    out, micro = Path(sys.argv[1]), int(sys.argv[2])
    cd.init(timeout_s=60)
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    x, y = data()
    try:
        pipe = cd.compile_distributed(
            Writer(), x, None, microbatches=micro, replicas=1, timeout_s=60
        )
    except CrosscutError as exc:
        if "'calls' is written in forward" in str(exc):  # a file per rank: torchrun
            out.mkdir(parents=True, exist_ok=True)  # interleaves the ranks' stdout
            (out / f"refused{rank}.txt").write_text(str(exc))
        return
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        pipe.train_step(x, y, F.cross_entropy)
        opt.step()
    out.mkdir(parents=True, exist_ok=True)
    torch.save(pipe.local_state_dict(), out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
