"""One rank of the torchrun check that ``nn.SyncBatchNorm`` is refused by name before any
rank runs it (tests/test_sync_batchnorm.py): on 2 gloo ranks, as a 2-stage pipeline and
as 2 replicas, and also when the model is compiled in eval mode (a later ``.train()``
would start its collectives). Each rank writes what ``compile_distributed`` raised.
argv: output directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

import crosscut.distributed as cd
from crosscut.errors import CrosscutError


def model(train: bool) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.SyncBatchNorm(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 4),
    )
    return net.train(train)


def main() -> None:
    out_dir = Path(sys.argv[1])
    ctx = cd.init()
    x = torch.randn(8, 3, 8, 8)
    report = {}
    for layout, replicas, train in (
        ("pipeline", 1, True),
        ("replicas", 2, True),
        ("eval", 1, False),
    ):
        try:
            pipe = cd.compile_distributed(model(train), (x,), replicas=replicas, microbatches=1)
            pipe.close()
            report[layout] = "compiled"
        except CrosscutError as exc:
            report[layout] = f"{type(exc).__name__}: {exc}"
    (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
