"""One rank of the torchrun check that a parameter no loss reaches keeps ``grad is None``
in a batch-split group (tests/test_unreached_params.py): two gloo ranks hold one stage
split by batch; the model's auxiliary head returns an output the loss does not read;
and that gradients accumulate over steps as eager's do.
Each rank writes which parameters hold a gradient, and the largest difference of its
gradients from eager's, after one step and after two without ``zero_grad``.
argv: output directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import crosscut.distributed as cd
from crosscut.api import partition
from crosscut.ir.plan import Plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.*
from cross_check import widen

from tests.test_unreached_params import WithAux, X, Y


def build() -> WithAux:
    torch.manual_seed(0)
    return WithAux()


def check(plan: str, steps: int) -> dict[str, Any]:
    """``steps`` train steps without ``zero_grad`` (gradients accumulate), against eager."""
    pipe = cd.compile_distributed(build(), X, Plan.from_json(plan), microbatches=1)
    eager = build()
    for _ in range(steps):
        pipe.train_step(X, Y, lambda out, y: F.cross_entropy(out[0], y))
        F.cross_entropy(eager(X)[0], Y).backward()
    want = dict(eager.named_parameters())
    held = {k: p.grad for k, p in pipe.named_parameters()}
    pipe.close()
    return {
        "with_grad": sorted(k for k, g in held.items() if g is not None),
        "eager_with_grad": sorted(k for k, p in want.items() if p.grad is not None),
        "diff": max(
            float((g - want[k].grad).abs().max())
            for k, g in held.items()
            if g is not None and want[k].grad is not None
        ),
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    ctx = cd.init(timeout_s=120)
    box: list[Any] = [None]
    if ctx.rank == 0:
        plan = partition(build(), ["cpu"], X, microbatches=1, replicas=1, solver="dp")
        box[0] = widen(plan, ((2, "batch"),)).to_json()
    dist.broadcast_object_list(box, src=0)
    report = {f"steps{n}": check(str(box[0]), n) for n in (1, 2)}
    (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
