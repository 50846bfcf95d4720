"""Under torchrun: options are validated on every rank alike and honoured.

argv[1] names the case; each rank prints ``ERROR <rank> <class>: <message>`` for a
refused call, or ``PLAN <rank> <objective> <stages>`` for a compiled one.
"""

from __future__ import annotations

import sys

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
    "latency": {"objective": "latency", "devices": "2xV100"},
}


def main() -> None:
    cd.init(timeout_s=60)
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten())
    x = torch.randn(4, 3, 8, 8)
    options = dict(CASES[sys.argv[1]])
    devices = options.pop("devices", None)
    try:
        pipe = crosscut.compile(model, devices, x, **options)  # type: ignore[arg-type]
    except CrosscutError as exc:
        print(f"ERROR {rank} {type(exc).__name__}: {exc}", flush=True)
        return
    print(f"PLAN {rank} {pipe.plan.options.objective} {pipe.plan.num_stages}", flush=True)


if __name__ == "__main__":
    main()
