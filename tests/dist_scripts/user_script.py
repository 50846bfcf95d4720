"""What a user writes: init, compile, train_step — launched by `crosscut run`.

It prints the loss on the last stage so the test can compare it with eager.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

import crosscut
import crosscut.distributed as cd


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 5),
    )


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)


def main() -> None:
    cd.init(timeout_s=60)
    x, y = data()
    pipe = crosscut.compile(model(), None, x, plan=os.environ["CROSSCUT_PLAN"])
    loss = pipe.train_step((x,), y, nn.functional.cross_entropy)
    if loss is not None:
        print(f"LOSS {float(loss):.8f}", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
