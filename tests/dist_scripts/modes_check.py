"""Under torchrun: a model whose forward reads ``self.training`` trains in the mode it was
compiled for and refuses the other by name on every rank (ranks hold one program).

Each rank writes ``<dir>/rank<r>.json`` (argv[1]): its loss (on the last stage),
whether it refused eval mode with crosscut's error, and its parameter names. Files, not
stdout: torchrun interleaves the ranks' output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed
import torch.nn.functional as F
from torch import nn

import crosscut
import crosscut.distributed as cd
from crosscut.errors import CrosscutError


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.bn
        y = F.batch_norm(
            self.c1(x), bn.running_mean, bn.running_var, bn.weight, bn.bias, self.training
        )
        if self.training:
            y = y * 2
        return self.fc(self.c2(F.relu(y)).mean((2, 3)))


def main() -> None:
    cd.init(timeout_s=60)
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    pipe = crosscut.compile(
        Branchy(), None, x, require_all_devices=True, microbatches=1, replicas=1
    )
    loss = pipe.train_step((x,), y, F.cross_entropy)
    pipe.eval()
    refused = False
    try:
        pipe(x)
    except CrosscutError as exc:
        refused = "reads self.training" in str(exc)
    pipe.train()
    pipe.train_step((x,), y, F.cross_entropy)  # the compiled mode still runs after the refusal
    record = {
        "loss": None if loss is None else float(loss),
        "refused": refused,
        "params": [n for n, _ in pipe.named_parameters()],
    }
    rank = torch.distributed.get_rank()
    (Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
