"""A U-Net-like segmentation model for the distributed benchmarks (``--models unet``).

Why: torchvision's classifiers are chains with short residual skips; a U-Net
is the other common shape — every encoder level's activation is kept until
the decoder concatenates it, so a pipeline split anywhere in the middle ships
full-resolution skips between stages, and activations, not weights, dominate
memory and traffic. The issue's "small U-Net" figures (2 gloo ranks, batch 64
at 128×128) are taken on this model.

Shape: four encoder levels (two 3×3 conv + batch norm + ReLU each, 2×2 max
pool between), a bottleneck, four decoder levels (a 2×2 transposed conv up,
concatenation with the encoder's skip, two conv blocks), a 1×1 head to
:data:`CLASSES` per-pixel logits. ``base=16`` gives 1.9 M parameters and,
at 128×128, 0.76 G multiply-adds per image, 0.57× resnet50's (full-resolution
activations cost, not weights: like the issue's "small U-Net", whose DDP step
was 0.6× resnet50's). Any input whose side is a multiple of 16 works (32×32
for smoke tests, 128×128 for the figures). Targets are per-pixel class ids, so
``F.cross_entropy(model(x), targets(...))`` is the loss, as for the classifiers.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CLASSES", "UNet", "targets"]

CLASSES = 8  # per-pixel classes of the head; a small label set, as in most segmentation sets


def _block(cin: int, cout: int) -> nn.Sequential:
    """Two 3×3 conv + batch norm + ReLU: the unit of every U-Net level."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """Encoder/decoder with skip concatenations; submodules are named in forward order.

    The attribute order matters to ``benchmarks/pipelining_peer.py``, whose
    split candidates are depth-1 and depth-2 submodules in call order.
    """

    def __init__(self, base: int = 16, levels: int = 4, classes: int = CLASSES) -> None:
        super().__init__()
        widths = [base * 2**i for i in range(levels)]
        self.down = nn.ModuleList()
        cin = 3
        for w in widths:
            self.down.append(_block(cin, w))
            cin = w
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = _block(widths[-1], widths[-1] * 2)
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        cin = widths[-1] * 2
        for w in reversed(widths):
            self.up.append(nn.ConvTranspose2d(cin, w, 2, stride=2))
            self.dec.append(_block(2 * w, w))
            cin = w
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([up(x), skip], dim=1))
        out: torch.Tensor = self.head(x)
        return out


def targets(batch: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """Per-pixel class ids for a ``batch × size × size`` segmentation loss."""
    return torch.randint(0, CLASSES, (batch, size, size), generator=generator)
