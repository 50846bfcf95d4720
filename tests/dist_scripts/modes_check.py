"""Under torchrun: a model whose forward reads ``self.training`` trains in the mode it was
compiled for and refuses the other by name on every rank (ranks hold one program).

Prints ``LOSS <x>`` on the last stage, then ``REFUSED <rank>`` on each rank that refused
eval mode with crosscut's error, then ``PARAMS <rank> <names>``.
"""

from __future__ import annotations

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
    pipe = crosscut.compile(Branchy(), None, x, require_all_devices=True)
    loss = pipe.train_step((x,), y, F.cross_entropy)
    if loss is not None:
        print(f"LOSS {float(loss):.6f}", flush=True)
    pipe.eval()
    try:
        pipe(x)
    except CrosscutError as exc:
        if "reads self.training" in str(exc):
            print(f"REFUSED {torch.distributed.get_rank()}", flush=True)
    pipe.train()
    pipe.train_step((x,), y, F.cross_entropy)  # the compiled mode still runs after the refusal
    names = [n for n, _ in pipe.named_parameters()]
    print(f"PARAMS {torch.distributed.get_rank()} {','.join(names)}", flush=True)


if __name__ == "__main__":
    main()
