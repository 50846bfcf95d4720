"""One rank of the torchrun check of a batch-split group returning a tuple.

Run by tests/test_batch_shares.py.

Two gloo ranks hold one stage split by batch. The model returns a named tuple
``(logits, features)`` of two batch-major tensors, as googlenet's logits and
auxiliary logits are: the group's leader joins both from the members'
shares, leaf by leaf. Each rank dumps its loss, its gradients and its
inference output; the test compares them with eager mode.
"""

from __future__ import annotations

import collections
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

Heads = collections.namedtuple("Heads", ["logits", "features"])


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.fc = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.relu(self.c1(x)).mean((2, 3))
        return Heads(self.fc(h), h)  # one node holding a named tuple, as googlenet's


def build() -> nn.Module:
    torch.manual_seed(0)
    return TwoHeads()


def loss_fn(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out[0], y) + out[1].pow(2).mean()


def main() -> int:
    out_dir = Path(sys.argv[sys.argv.index("--out") + 1])
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = cd.init(timeout_s=120)
    try:
        x, y = batch()
        from crosscut.api import partition

        box: list[Any] = [None]
        if ctx.rank == 0:  # one plan for both ranks (its timestamps are in its hash)
            plan = partition(build(), ["cpu"], x, microbatches=1, replicas=1, solver="dp")
            box[0] = widen(plan, ((2, "batch"),)).to_json()
        dist.broadcast_object_list(box, src=0)
        pipe = cd.compile_distributed(
            build(), x, Plan.from_json(str(box[0])), microbatches=1, timeout_s=120
        )
        loss = pipe.train_step(x, y, loss_fn)
        infer = pipe(x)
        dump: dict[str, Any] = {
            "loss": None if loss is None else float(loss),
            "grads": pipe.local_grads(),
            "infer": None if infer is None else tuple(infer),  # Heads is not importable
            "infer_type": type(infer).__name__,
        }
        torch.save(dump, out_dir / f"tuple_rank{ctx.rank}.pt")
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)
