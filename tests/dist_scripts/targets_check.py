"""One rank of the torchrun check that targets reach the loss as one structure
(tests/test_targets.py): every case of ``tests.test_targets.cases`` (a tuple, a
namedtuple, a dict, ``None``, a per-image list of dicts), on a 2-stage pipeline or on 2
replicas of one stage, each with 2 micro-batches of 2 samples. The loss rank(s) compare
the loss and gradients with eager on the same micro-batches.
argv: layout ("pipeline" or "replicas"), output directory.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import crosscut
import crosscut.distributed as cd
from crosscut.ir.plan import Plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.*
from tests.test_targets import _slice, cases, net


def main() -> None:
    layout, out_dir = sys.argv[1], Path(sys.argv[2])
    ctx = cd.init()
    replicas = 2 if layout == "replicas" else 1
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    box: list[Any] = [None]
    if ctx.rank == 0:
        devices = ["cpu"] if replicas > 1 else ["cpu", "cpu"]
        plan = crosscut.partition(
            net(), devices, x[: 8 // replicas], microbatches=2, require_all_devices=True,
            solver="dp",
        )  # fmt: skip
        box[0] = plan.to_json()
    dist.broadcast_object_list(box, src=0)
    report: dict[str, Any] = {}
    for name, (targets, loss_fn) in cases(8).items():
        eager = net()
        pipe = cd.compile_distributed(
            copy.deepcopy(eager), x, Plan.from_json(str(box[0])), replicas=replicas,
            microbatches=2,
        )  # fmt: skip
        loss = pipe.train_step(x, targets, loss_fn)
        want = 0.0
        for m in range(4):  # eager on the same four micro-batches of 2 samples
            part = loss_fn(eager(x[2 * m : 2 * m + 2]), _slice(targets, 2 * m, 2 * m + 2)) / 4
            part.backward()
            want += float(part.detach())
        grads = dict(pipe.local_grads())
        eager_grads = {k: p.grad for k, p in eager.named_parameters()}
        report[name] = {
            "loss_diff": abs(float(loss) - want) if loss is not None else None,
            "grad_diff": max(float((v - eager_grads[k]).abs().max()) for k, v in grads.items()),
        }
        pipe.close()
    (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
