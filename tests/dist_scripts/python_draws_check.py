"""One rank of the torchrun check that recomputation replays a leaf's Python draws
(tests/test_recompute_python_draws.py): the same plan recomputing and not, Python's
and NumPy's generators seeded alike, three SGD steps, bit for bit (the comparison is
recompute_check.py's). argv: output directory.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from recompute_check import compare  # type: ignore[import-not-found]
from test_recompute_python_draws import Net  # type: ignore[import-not-found]


def _seed(step: int) -> None:
    if step == 0:  # once: the draws of later steps follow from the first
        random.seed(0)
        np.random.seed(0)


def main() -> None:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)
    compare(
        lambda: Net("python"),
        (x, y),
        lambda o, t: F.cross_entropy(o.mean((2, 3)), t),
        _seed,
        steps=3,
    )


if __name__ == "__main__":
    main()
