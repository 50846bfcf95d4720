"""Under torchrun: options are validated on every rank alike and honoured.

argv[1] names the case; each rank writes ``<argv[2]>/rank<r>.txt``: ``ERROR <class>:
<message>`` for a refused call, or ``PLAN <objective> <stages>`` for a compiled one
(files, not stdout: torchrun interleaves the ranks' output).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed
from torch import nn

import crosscut
import crosscut.distributed as cd
from crosscut.errors import CrosscutError

CASES = {
    "bogus-schedule": {"schedule": "bogus"},
    "zero-microbatches": {"microbatches": 0},
    "three-devices": {"devices": ["cpu", "cpu", "cpu"]},
    "latency": {"objective": "latency", "devices": "2xV100", "replicas": 1},
}


def main() -> None:
    cd.init(timeout_s=60)
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten())
    x = torch.randn(4, 3, 8, 8)
    options = dict(CASES[sys.argv[1]])
    devices = options.pop("devices", None)
    out = Path(sys.argv[2]) / f"rank{rank}.txt"
    try:
        pipe = crosscut.compile(model, devices, x, **options)  # type: ignore[arg-type]
    except CrosscutError as exc:
        out.write_text(f"ERROR {type(exc).__name__}: {exc}")
        return
    out.write_text(f"PLAN {pipe.plan.options.objective} {pipe.plan.num_stages}")


if __name__ == "__main__":
    main()
