"""One rank of the contract check (``tests/contract.py``) under torchrun.

argv: ``pipeline`` (rank 0 plans for world-size CPU stages), ``replicas`` (2
replicas of a pipeline over half the world: each stage under DDP, kept inside
the executor) or ``cross`` (a cross-shaped plan: 2 devices split by channel,
then 2 by batch), a directory and optionally a schedule (default ``1f1b``).
Prints ``OK <rank>`` and, on the rank that computes the loss, ``LOSS <value>``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contract import Small, batch, check_contract

import crosscut
import crosscut.distributed as cd
from crosscut.ir.schedule import virtual_stages


def replicas_still_reduce(pipe: cd.DistributedPipeline) -> None:
    """After a dtype change the next step is reduced all the same: both replicas of a
    stage hold the same gradients (each saw its own half of the batch)."""
    for p in pipe.parameters():
        p.grad = None
    pipe.train_step(*batch(), torch.nn.functional.cross_entropy)
    mine = [p.grad.clone() for p in pipe.parameters() if p.grad is not None]
    every: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (pipe.position, mine))
    peers = [g for pos, g in every if pos == pipe.position]  # type: ignore[misc]
    assert len(peers) == 2 and mine
    assert all(torch.equal(a, b) for a, b in zip(*peers, strict=True))


def main() -> None:
    cd.init(timeout_s=60)
    case, out = sys.argv[1], Path(sys.argv[2])
    schedule = sys.argv[3] if len(sys.argv) > 3 else "1f1b"
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Small()
    x, _ = batch()
    plan = None
    if case == "cross":
        from cross_check import widen  # type: ignore[import-not-found]

        from crosscut.ir.plan import Plan

        box: list[object] = [None]
        if rank == 0:
            base = crosscut.partition(
                model, ["cpu", "cpu"], x, microbatches=2, solver="dp", replicas=1, schedule=schedule
            )
            box[0] = widen(base, ((2, "channel"), (2, "batch"))).to_json()
        dist.broadcast_object_list(box, src=0)
        plan = Plan.from_json(str(box[0]))
    # replicas fixed as `crosscut run` fixes them: 2, or 1 for the pipeline case
    os.environ["CROSSCUT_REPLICAS"] = "2" if case == "replicas" else "1"
    pipe = crosscut.compile(model, None, x, microbatches=2, plan=plan, schedule=schedule)
    if case == "replicas":
        # DDP's reducer in the last backward; an interleaved rank (two stages) reduces after
        interleaved = virtual_stages(schedule) > 1  # 1f1b-vV, zb-vV, zbv
        assert pipe.replicas == 2 and (pipe._reducer is None) == interleaved
    loss = check_contract(pipe, model, 2, out)  # it ends with .to(float64) and back
    if case == "replicas":
        replicas_still_reduce(pipe)
    if loss is not None:
        print(f"LOSS {loss:.8f}", flush=True)
    print(f"OK {rank}", flush=True)


if __name__ == "__main__":
    main()
