"""One rank of the torchrun check that recomputation replays a leaf's Python draws
(tests/test_recompute_python_draws.py).

Compiles the same seeded model twice on the same plan, stages recomputing and not,
seeds Python's and NumPy's generators alike, runs three SGD steps on each and
writes, per rank, whether every loss, gradient and state tensor matched bit for
bit. argv: output directory.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from test_recompute_python_draws import Net  # type: ignore[import-not-found]

import crosscut
import crosscut.distributed as cd


def run(recompute: bool, plan: object, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Net("python").train()
    pipe = crosscut.compile(model, None, x, microbatches=2, plan=plan, recompute=recompute)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    random.seed(0)
    np.random.seed(0)
    out: list[torch.Tensor] = []
    for _ in range(3):
        opt.zero_grad()
        loss = pipe.train_step(x, y, lambda o, t: F.cross_entropy(o.mean((2, 3)), t))
        if loss is not None:
            out.append(loss.detach().clone())
        out += [p.grad.clone() for p in pipe.parameters() if p.grad is not None]
        opt.step()
    out += [v.clone() for v in pipe.state_dict().values()]
    pipe.close()
    return out


def main() -> None:
    cd.init(timeout_s=60)
    rank, outdir = dist.get_rank(), Path(sys.argv[1])
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)
    box: list[object] = [None]
    if rank == 0:
        torch.manual_seed(0)
        plan = crosscut.partition(Net("python"), ["cpu", "cpu"], x, microbatches=2, time_limit=5,
                                  require_all_devices=True, replicas=1)  # fmt: skip
        box[0] = plan.to_json()
    dist.broadcast_object_list(box, src=0)
    from crosscut.ir.plan import Plan

    plan = Plan.from_json(str(box[0]))
    plain, again = run(False, plan, x, y), run(True, plan, x, y)
    same = len(plain) == len(again) and all(torch.equal(a, b) for a, b in zip(plain, again))
    (outdir / f"rank{rank}.txt").write_text(f"{len(plain)} {'EQUAL' if same else 'DIFFER'}\n")


if __name__ == "__main__":
    main()
