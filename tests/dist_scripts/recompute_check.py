"""One rank of the torchrun recomputation check (tests/test_recompute.py).

Compiles the same seeded model twice on the same plan — stages recomputing
and not — runs two SGD steps on each and writes, per rank, whether every
loss, gradient and state tensor matched bit for bit. argv: output directory.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from test_recompute import Block  # type: ignore[import-not-found]

import crosscut
import crosscut.distributed as cd


def run(
    make: Callable[[], nn.Module],
    recompute: bool,
    plan: object,
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    reseed: Callable[[int], None],
    steps: int,
) -> list[torch.Tensor]:
    """Losses, gradients and final state of ``steps`` SGD steps of a compiled ``make()``;
    ``reseed(step)`` runs before each step."""
    torch.manual_seed(0)
    pipe = crosscut.compile(make().train(), None, batch[0], microbatches=2, plan=plan,
                            recompute=recompute)  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    out: list[torch.Tensor] = []
    for step in range(steps):
        reseed(step)
        opt.zero_grad()
        loss = pipe.train_step(batch[0], batch[1], loss_fn)
        if loss is not None:
            out.append(loss.detach().clone())
        out += [p.grad.clone() for p in pipe.parameters() if p.grad is not None]
        opt.step()
    out += [v.clone() for v in pipe.state_dict().values()]
    pipe.close()
    return out


def compare(
    make: Callable[[], nn.Module],
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    reseed: Callable[[int], None],
    steps: int = 2,
) -> None:
    """Plan ``make()`` on rank 0 for 2 pipeline stages, train it recomputing and not on
    every rank, and write ``<count> EQUAL|DIFFER`` to ``argv[1]/rank<r>.txt``."""
    cd.init(timeout_s=60)
    rank, outdir = dist.get_rank(), Path(sys.argv[1])
    box: list[object] = [None]
    if rank == 0:
        torch.manual_seed(0)
        plan = crosscut.partition(make(), ["cpu", "cpu"], batch[0], microbatches=2,
                                  time_limit=5, require_all_devices=True, replicas=1)  # fmt: skip
        box[0] = plan.to_json()
    dist.broadcast_object_list(box, src=0)
    from crosscut.ir.plan import Plan

    plan = Plan.from_json(str(box[0]))
    plain, again = (run(make, r, plan, batch, loss_fn, reseed, steps) for r in (False, True))
    same = len(plain) == len(again) and all(torch.equal(a, b) for a, b in zip(plain, again))
    (outdir / f"rank{rank}.txt").write_text(f"{len(plain)} {'EQUAL' if same else 'DIFFER'}\n")


def main() -> None:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
    compare(Block, (x, y), F.cross_entropy, lambda step: torch.manual_seed(10 + step))


if __name__ == "__main__":
    main()
