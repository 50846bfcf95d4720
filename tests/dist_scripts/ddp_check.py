"""One rank of the replicas' all-reduce check (tests/test_overlap.py): 2 replicas × 2 stages.

For 1 and 2 micro-batches per replica, with ``overlap_allreduce`` on (DDP's
reducer during each stage's last backward) and off (one all-reduce after the
schedule), and for the GPipe and 1F1B schedules, one SGD step of
:class:`TwoHeads` from the same weights; each run dumps this rank's loss,
gradients and stepped state under ``<out>/<tag>_rank<r>.pt``, and with the
reducer on, the order in which this rank ran its backwards and DDP launched
its buckets (a comm hook), with how many of the stage's gradients had landed
at each launch. Buckets are made small (``BUCKET_CAP_MB``) so a stage has
several.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import crosscut.distributed as cd
import crosscut.runtime.dist.overlap as overlap
from crosscut.errors import CrosscutError


class TwoHeads(nn.Module):
    """A small CNN whose last stage holds a head no loss reads, and a parameter that is
    only compared with (neither gets a gradient, in eager training or here)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(3, 32, 3, padding=1)
        self.gate = nn.Parameter(torch.ones(()))
        self.body = nn.Sequential(*[nn.Conv2d(32, 32, 3, padding=1) for _ in range(5)])
        self.fc = nn.Linear(32, 10)
        self.aux = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.relu(self.c1(x)) * (self.gate > 0).to(x.dtype)
        for conv in self.body:
            y = torch.relu(conv(y))
        y = y.mean((2, 3))
        return self.fc(y), self.aux(y)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)


def loss_fn(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out[0], target)  # the aux head is never read


def record(pipe: cd.DistributedPipeline, log: list[Any]) -> None:
    """Log each backward (armed or not) and each bucket DDP launches on this rank."""
    red = pipe._reducer
    assert red is not None, "overlap_allreduce=True but no DDP reducer on this rank"
    landed = [0]
    for p in pipe.stage.parameters():
        p.register_post_accumulate_grad_hook(lambda _: landed.__setitem__(0, landed[0] + 1))

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations
        log.append(("bucket", bucket.index(), landed[0]))
        return default_hooks.allreduce_hook(state, bucket)

    red.ddp.register_comm_hook(red.group, hook)  # the state: the group to reduce over
    backward = pipe._here.engines[pipe.stage_index].backward

    def logged(a: Any, io: Any, autograd: Any = None) -> None:
        landed[0] = 0
        log.append(("B", a.microbatch, autograd is not None))
        backward(a, io, autograd)
        log.append(("end", a.microbatch, landed[0]))

    pipe._here.engines[pipe.stage_index].backward = logged  # type: ignore[method-assign]


def step(pipe: cd.DistributedPipeline, schedule: str, initial: dict[str, Any]) -> dict[str, Any]:
    """One SGD step under ``schedule`` from the ``initial`` weights: what the test compares."""
    pipe.use_schedule(schedule)
    with torch.no_grad():
        for k, t in pipe.named_original_tensors():
            t.copy_(initial[k])
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    opt.zero_grad()
    x, y = batch()
    loss = pipe.train_step(x, y, loss_fn)
    grads = pipe.local_grads()
    opt.step()
    named = pipe.named_original_tensors()
    return {
        "losses": [None if loss is None else float(loss)],
        "grads": grads,
        "state": {k: t.detach().clone() for k, t in named},
        "keys": [k for k, _ in named],
        "layout": pipe.layout(),
    }


def lose_a_replica(rank: int, die: int, timeout: float) -> int:
    """Rank ``die`` exits as its armed backward starts: its replica peer's reduction fails."""
    pipe = cd.compile_distributed(
        TwoHeads(),
        batch()[0],
        replicas=2,
        microbatches=2,
        schedule="1f1b",  # DDP's reducer runs in the last backward (not after a split one)
        timeout_s=timeout,
        recompute=False,
        require_all_devices=True,
    )
    if rank == die:
        backward = pipe._here.engines[pipe.stage_index].backward

        def dying(a: Any, io: Any, autograd: Any = None) -> None:
            if autograd is not None:
                print(f"rank {rank}: exiting on purpose before the reduction", flush=True)
                os._exit(1)
            backward(a, io, autograd)

        pipe._here.engines[pipe.stage_index].backward = dying  # type: ignore[method-assign]
    pipe.train_step(*batch(), loss_fn)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--die-rank", type=int, default=-1, help="exits as its DDP backward starts")
    a = ap.parse_args()
    ctx = cd.init(timeout_s=a.timeout)
    out = Path(a.out)
    overlap.BUCKET_CAP_MB = 0.01  # 10 kB: several buckets per stage
    try:
        if a.die_rank >= 0:
            return lose_a_replica(ctx.rank, a.die_rank, a.timeout)
        for mb in (1, 2):
            for on in (True, False):
                pipe = cd.compile_distributed(
                    TwoHeads(),
                    batch()[0],
                    replicas=2,
                    microbatches=mb,
                    schedule="gpipe",
                    timeout_s=a.timeout,
                    overlap_allreduce=on,
                    recompute=False,
                    # the pre-issue-26 form, kept working (a DeprecationWarning)
                    partition_options={"require_all_devices": True},
                )
                assert (pipe._reducer is not None) == on
                log: list[Any] = []
                if on:
                    record(pipe, log)
                initial = {k: t.detach().clone() for k, t in pipe.named_original_tensors()}
                for schedule in ("gpipe", "1f1b"):
                    log.clear()
                    got = step(pipe, schedule, initial)
                    got["log"] = list(log)
                    tag = f"mb{mb}_{'ddp' if on else 'after'}_{schedule}"
                    torch.save(got, out / f"{tag}_rank{ctx.rank}.pt")
    except CrosscutError as exc:
        print(f"rank {ctx.rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 3
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
