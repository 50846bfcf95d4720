"""One rank of the contract check (``tests/contract.py``) under torchrun.

argv: ``pipeline`` (rank 0 plans for world-size CPU stages) or ``cross`` (a
cross-shaped plan: 2 devices split by channel, then 2 by batch), and a directory.
Prints ``OK <rank>`` and, on the rank that computes the loss, ``LOSS <value>``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contract import Small, batch, check_contract

import crosscut
import crosscut.distributed as cd


def main() -> None:
    cd.init(timeout_s=60)
    case, out = sys.argv[1], Path(sys.argv[2])
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Small()
    x, _ = batch()
    plan = None
    if case == "cross":
        from cross_check import widen  # type: ignore[import-not-found]

        from crosscut.partitioner.plan import Plan

        box: list[object] = [None]
        if rank == 0:
            base = crosscut.partition(model, ["cpu", "cpu"], x, microbatches=2, solver="dp")
            box[0] = widen(base, ((2, "channel"), (2, "batch"))).to_json()
        dist.broadcast_object_list(box, src=0)
        plan = Plan.from_json(str(box[0]))
    pipe = crosscut.compile(model, None, x, microbatches=2, plan=plan)
    loss = check_contract(pipe, model, 2, out)
    if loss is not None:
        print(f"LOSS {loss:.8f}", flush=True)
    print(f"OK {rank}", flush=True)


if __name__ == "__main__":
    main()
