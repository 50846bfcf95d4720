"""One rank of the torchrun check that a tuple of targets reaches the loss whole
(tests/test_targets.py): a 2-stage pipeline, 2 micro-batches of 2 samples, a loss that
unpacks ``y, w = t``; the loss rank compares its loss and gradients with eager.
argv: output directory.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import crosscut
import crosscut.distributed as cd
from crosscut.ir.plan import Plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.*
from tests.test_targets import net


def loss_fn(out: torch.Tensor, t: Any) -> torch.Tensor:
    y, w = t
    return (F.cross_entropy(out, y, reduction="none") * w).mean()


def main() -> None:
    out_dir = Path(sys.argv[1])
    ctx = cd.init()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 8, 8, generator=g)
    y, w = torch.randint(0, 4, (4,), generator=g), torch.rand(4, generator=g)
    box: list[Any] = [None]
    if ctx.rank == 0:
        plan = crosscut.partition(
            net(), ["cpu", "cpu"], x, microbatches=2, require_all_devices=True, solver="dp"
        )
        box[0] = plan.to_json()
    dist.broadcast_object_list(box, src=0)
    eager = net()
    pipe = cd.compile_distributed(copy.deepcopy(eager), x, Plan.from_json(str(box[0])))
    loss = pipe.train_step(x, (y, w), loss_fn)
    want = 0.0
    for m in (0, 2):  # eager on the same two micro-batches
        part = loss_fn(eager(x[m : m + 2]), (y[m : m + 2], w[m : m + 2])) / 2
        part.backward()
        want += float(part.detach())
    grads = dict(pipe.local_grads())
    eager_grads = {k: p.grad for k, p in eager.named_parameters()}
    report: dict[str, Any] = {
        "loss_diff": abs(float(loss) - want) if loss is not None else None,
        "grads_equal": all(torch.equal(v, eager_grads[k]) for k, v in grads.items()),
    }
    (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps(report))
    pipe.close()


if __name__ == "__main__":
    main()
