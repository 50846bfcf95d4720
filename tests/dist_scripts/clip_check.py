"""One rank of the torchrun check of ``crosscut.clip_grad_norm_`` (tests/test_grad_clip.py).

Rank 0 cuts a small CNN into the case's stages and groups; every rank trains two
clipped SGD steps and, beside it, eager training of the same model on the same
micro-batches with torch's own ``clip_grad_norm_``. Each rank writes, per step:
the total norm crosscut returned, eager's, and what torch's function returns over
this rank's parameters alone (the silent mistake the helper exists for); and at the
end the largest difference between the trained parameters (every rank's pieces
assembled) and eager's.
argv: case name, output directory.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import crosscut
import crosscut.distributed as cd
from crosscut.ir.plan import Plan
from crosscut.runtime.dist.state_files import assemble_parts

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.*
from tests.plan_factory import widen

# name -> (groups per stage, replicas, micro-batches, norm type, batch norm frozen)
CASES: dict[str, tuple[tuple[tuple[int, str], ...], int, int, float, bool]] = {
    "pipeline": (((1, "none"), (1, "none")), 1, 2, 2.0, False),
    "replicas": (((1, "none"), (1, "none")), 2, 1, float("inf"), False),
    "channel": (((2, "channel"),), 1, 2, 2.0, True),
    "batch": (((2, "batch"), (1, "none")), 1, 2, 1.0, True),
    # tests/test_channel_ties.py's Tied model: weights two modules share, cut into shards
    "tied": (((2, "channel"),), 1, 2, 2.0, False),
}
MAX_NORM = 0.05  # well under every step's norm: the factor is always applied


def build(case: str) -> nn.Module:
    torch.manual_seed(0)
    if case == "tied":
        from tests.test_channel_ties import Tied

        return Tied()
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def plan_for(case: str, x: torch.Tensor) -> Plan:
    groups, _replicas, mb, _norm, _frozen = CASES[case]
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        plan = crosscut.partition(
            build(case), ["cpu"] * len(groups), x, microbatches=mb, require_all_devices=True,
            solver="dp",
        )  # fmt: skip
        box[0] = widen(plan, groups).to_json()
    dist.broadcast_object_list(box, src=0)
    return Plan.from_json(str(box[0]))


def freeze_bn(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()


def main() -> None:
    name, out = sys.argv[1], Path(sys.argv[2])
    _groups, replicas, mb, norm_type, frozen = CASES[name]
    ctx = cd.init()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    plan = plan_for(name, x[: 8 // replicas])
    eager = build(name)
    pipe = cd.compile_distributed(copy.deepcopy(eager), x, plan, replicas=replicas, microbatches=mb)
    if frozen:
        freeze_bn(pipe)
        freeze_bn(eager)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.5)
    steps: list[dict[str, float]] = []
    for _ in range(2):
        opt.zero_grad()
        pipe.train_step(x, y, nn.functional.cross_entropy)
        alone = torch.nn.utils.get_total_norm(
            [p.grad for p in pipe.parameters() if p.grad is not None], norm_type
        )
        total = crosscut.clip_grad_norm_(pipe, MAX_NORM, norm_type)
        opt.step()
        eager_opt.zero_grad()
        for xs, ys in zip(x.chunk(mb * replicas), y.chunk(mb * replicas)):
            (nn.functional.cross_entropy(eager(xs), ys) / (mb * replicas)).backward()
        eager_total = torch.nn.utils.clip_grad_norm_(eager.parameters(), MAX_NORM, norm_type)
        eager_opt.step()
        steps.append({"total": total.item(), "eager": eager_total.item(), "alone": alone.item()})
    mine = {"layout": pipe.layout(), "state": pipe.local_state_dict()}
    mine["shards"] = pipe.local_shards()
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    trained = assemble_parts(parts)
    diff = max(
        (trained[k].double() - p.detach().double()).abs().max().item()
        for k, p in eager.named_parameters()
    )
    state = pipe.state_dict()  # shares storage with the rank's tensors, as nn.Module's
    aliases = all(state[k].data_ptr() == p.data_ptr() for k, p in pipe.named_parameters())
    report = {"steps": steps, "param_diff": diff, "shards": len(pipe.local_shards())}
    report["aliases"] = aliases
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(report))
    pipe.close()


if __name__ == "__main__":
    main()
