"""One rank of the torchrun recomputation check (tests/test_recompute.py).

Compiles the same seeded model twice on the same plan — stages recomputing
and not — runs two SGD steps on each and writes, per rank, whether every
loss, gradient and state tensor matched bit for bit. argv: output directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from test_recompute import Block  # type: ignore[import-not-found]

import crosscut
import crosscut.distributed as cd


def run(recompute: bool, plan: object, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Block().train()
    pipe = crosscut.compile(model, None, x, microbatches=2, plan=plan, recompute=recompute)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    out: list[torch.Tensor] = []
    for step in range(2):
        torch.manual_seed(10 + step)
        opt.zero_grad()
        loss = pipe.train_step(x, y, F.cross_entropy)
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
    x, y = torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
    box: list[object] = [None]
    if rank == 0:
        torch.manual_seed(0)
        plan = crosscut.partition(Block(), ["cpu", "cpu"], x, microbatches=2, time_limit=5,
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
