"""One rank of the torchrun check of a batch-split group that receives a tuple.

Run by tests/test_batch_shares.py.

Three gloo ranks: stage 0 on rank 0 ends with ``x.chunk(2, dim=1)``, whose
tuple of batch-major halves crosses the cut to stage 1, a group of ranks 1
and 2 split by batch. The leader must cut every tensor of the tuple into the
members' rows (before, it sent the whole tuple and each share crashed
concatenating a whole half with its own rows). Each rank dumps its loss and
gradients; the test compares them with eager mode.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import crosscut.distributed as cd
from crosscut.ir.plan import Plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cross_check import widen
from merge_check import batch  # the same 8 images and labels


class ChunkAcross(nn.Module):
    """Stage 0 ends with ``x.chunk(2, dim=1)``: a tuple of batch-major halves crosses the
    cut, as in every shufflenet_v2 block's channel split."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        halves = self.c(x).chunk(2, dim=1)
        y = torch.cat([halves[0], torch.relu(self.b(halves[1]))], 1)
        return self.fc(y.mean((2, 3)))


def build() -> nn.Module:
    torch.manual_seed(0)
    return ChunkAcross()


def cut_after_chunk(plan: Plan) -> Plan:
    """``plan`` re-cut so that stage 0 ends with the ``chunk`` node, then re-priced."""
    from crosscut.partitioner.annotate import annotate

    order = [n.name for n in plan.nodes if n.name in plan.assignment]
    last = order.index("chunk")
    plan.assignment = {name: int(i > last) for i, name in enumerate(order)}
    return annotate(plan)


def main() -> int:
    out_dir = Path(sys.argv[sys.argv.index("--out") + 1])
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = cd.init(timeout_s=120)
    try:
        x, y = batch()
        from crosscut.api import partition

        box: list[Any] = [None]
        if ctx.rank == 0:  # one plan for every rank (its timestamps are in its hash)
            plan = partition(build(), ["cpu"] * 2, x, microbatches=1, replicas=1,
                             cross_shaped=False, solver="dp")  # fmt: skip
            box[0] = widen(cut_after_chunk(plan), ((1, "none"), (2, "batch"))).to_json()
        dist.broadcast_object_list(box, src=0)
        pipe = cd.compile_distributed(
            build(), x, Plan.from_json(str(box[0])), microbatches=1, timeout_s=120
        )
        loss = pipe.train_step(x, y, nn.functional.cross_entropy)
        dump = {"loss": None if loss is None else float(loss), "grads": pipe.local_grads()}
        torch.save(dump, out_dir / f"chunk_rank{ctx.rank}.pt")
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)
