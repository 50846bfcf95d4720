"""Under torchrun: values and gradients crossing a cut keep eager's layouts.

``layout_check.py OUT``: compiles :class:`CatAfterNorm` and
:class:`SplitThenNorm` under ``OUT/<name>.json`` (tests/test_grad_layout.py cuts
them where a gapped view crosses), runs one train step of each and saves this
rank's loss and gradients (original keys) to ``OUT/<name>_rank<r>.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed
import torch.nn.functional as F
from torch import nn

import crosscut.distributed as cd


class CatAfterNorm(nn.Module):
    """Two conv → batch-norm branches joined by a concatenation, read twice after it.

    The concatenation's backward hands each branch a channel slice of its
    gradient (a view with gaps), and CPU batch norm's backward sums such a view
    in another order than a contiguous copy of it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c3, self.c4 = nn.Conv2d(16, 4, 1), nn.Conv2d(16, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cat = torch.cat([self.b1(self.c1(x)), self.b2(self.c2(x))], 1)
        return (self.c3(cat) + self.c4(cat)).mean((2, 3))


class SplitThenNorm(nn.Module):
    """A convolution's output split in two channel halves (views with gaps), each
    normalised: a cut after the split sends the views forward."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.b1, self.b2 = nn.BatchNorm2d(8), nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.c1(x).chunk(2, 1)
        return self.c2(self.b1(a) + self.b2(b)).mean((2, 3))


MODELS = {"cat": CatAfterNorm, "split": SplitThenNorm}


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 4, generator=g)


def main() -> None:
    out = Path(sys.argv[1])
    cd.init(timeout_s=60)
    rank = torch.distributed.get_rank()
    for name, cls in MODELS.items():
        torch.manual_seed(0)
        model, (x, y) = cls(), data()
        pipe = cd.compile_distributed(model, x, out / f"{name}.json", timeout_s=60)
        loss = pipe.train_step(x, y, F.mse_loss)
        grads = {k: p.grad for k, p in pipe.named_parameters() if p.grad is not None}
        torch.save({"loss": loss, "grads": grads}, out / f"{name}_rank{rank}.pt")


if __name__ == "__main__":
    main()
