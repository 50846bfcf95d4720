"""One rank of the torchrun check that a 0-d tensor input goes whole to every piece
(tests/test_call_inputs.py): ``Gated(x, gate)`` on a 2-stage pipeline and on 2 replicas,
each with 2 micro-batches; each rank compares its loss and gradients with eager.
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
from tests.test_call_inputs import Gated


def run(layout: str, rank: int) -> dict[str, Any]:
    replicas = 2 if layout == "replicas" else 1
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
    gate = torch.tensor(0.5)
    box: list[Any] = [None]
    if rank == 0:
        devices = ["cpu"] if replicas > 1 else ["cpu", "cpu"]
        plan = crosscut.partition(
            Gated(), devices, (x[: 8 // replicas], gate), microbatches=2,
            require_all_devices=True, solver="dp",
        )  # fmt: skip
        box[0] = plan.to_json()
    dist.broadcast_object_list(box, src=0)
    torch.manual_seed(0)
    eager = Gated()
    pipe = cd.compile_distributed(
        copy.deepcopy(eager), (x, gate), Plan.from_json(str(box[0])), replicas=replicas,
        microbatches=2,
    )  # fmt: skip
    loss = pipe.train_step((x, gate), y, F.cross_entropy)
    want = 0.0
    for xs, ys in zip(x.chunk(4), y.chunk(4)):  # eager on the same four micro-batches
        part = F.cross_entropy(eager(xs, gate), ys) / 4
        part.backward()
        want += float(part.detach())
    grads = pipe.local_grads()
    eager_grads = {k: p.grad for k, p in eager.named_parameters()}
    pipe.close()
    return {
        "loss_diff": abs(float(loss) - want) if loss is not None else None,
        "grad_diff": max(float((v - eager_grads[k]).abs().max()) for k, v in grads.items()),
        "grads": len(grads),
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    ctx = cd.init()
    report = {layout: run(layout, ctx.rank) for layout in ("pipeline", "replicas")}
    (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
