"""One rank of the torchrun check that recomputation writes every buffer once.

Compiles :class:`~test_recompute_state.Stateful` (a counter, an EMA read by the
output, ``F.batch_norm`` on a plain module's buffers, batch norms traced
through and as leaves) over the ranks with every stage recomputing, one
micro-batch, runs two SGD steps and saves this rank's state (original keys)
to ``OUT/rank<r>.pt``; tests/test_recompute_state.py compares it with eager.
argv: output directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from test_recompute_state import Stateful  # type: ignore[import-not-found]

import crosscut.distributed as cd


def main() -> None:
    cd.init(timeout_s=60)
    rank, outdir = dist.get_rank(), Path(sys.argv[1])
    torch.manual_seed(0)
    model = Stateful()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
    pipe = cd.compile_distributed(
        model, x, None, microbatches=1, replicas=1, recompute=True, timeout_s=60
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        pipe.train_step(x, y, F.cross_entropy)
        opt.step()
    torch.save(pipe.local_state_dict(), outdir / f"rank{rank}.pt")
    pipe.close()


if __name__ == "__main__":
    main()
