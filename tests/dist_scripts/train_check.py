"""One rank of a distributed training check: compile, train steps, dump results.

Why a script: torch.distributed needs one process per rank; the test launches
this file N times (or through torchrun) and compares the dumped gradients and
parameters with eager training in the test process. Options come from argv;
fault injection from environment variables:

* ``CROSSCUT_TEST_KILL_RANK=r``: rank r calls ``os._exit(1)`` after its first
  stage forward (a rank lost mid-step).
* ``CROSSCUT_TEST_HANG_RANK=r``: rank r stops answering after its first
  stage forward (sleeps, then exits).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

import crosscut.distributed as cd
from crosscut.errors import CrosscutError


def build(name: str) -> nn.Module:
    """The model every rank (and the eager reference) builds: seeded, 10 classes."""
    torch.manual_seed(0)
    kw: dict[str, Any] = {"num_classes": 10}
    if name == "googlenet":
        # no dropout: each rank draws its own random masks, so only a
        # deterministic model can be compared with eager bit for bit
        kw.update(aux_logits=False, init_weights=False, dropout=0.0)
    if name.startswith(("alexnet", "vgg", "squeezenet")):
        kw.update(dropout=0.0)  # the same reason: no random masks
    model: nn.Module = torchvision.models.get_model(name, weights=None, **kw)
    return model


def batch(n: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)


def make_plan(
    name: str, stages: int, replicas: int, mb: int, n: int, size: int, schedule: str
) -> Any:
    from crosscut.api import partition

    x, _ = batch(n, size)
    return partition(
        build(name),
        ["cpu"] * stages,
        x[: n // replicas],
        microbatches=mb,
        schedule=schedule,
        require_all_devices=True,
        time_limit=5,
    )


def kill_after_first_forward(pipe: cd.DistributedPipeline) -> None:
    original = pipe.stage.forward

    def dying(*args: Any) -> Any:
        out = original(*args)
        sys.stderr.write(f"rank {pipe.rank}: exiting on purpose after a forward\n")
        sys.stderr.flush()
        os._exit(1)
        return out

    pipe.stage.forward = dying  # type: ignore[method-assign]


def hang_after_first_forward(pipe: cd.DistributedPipeline, seconds: float) -> None:
    original = pipe.stage.forward

    def stuck(*args: Any) -> Any:
        out = original(*args)
        time.sleep(seconds)  # alive but silent: the peers must time out, not hang
        os._exit(1)
        return out

    pipe.stage.forward = stuck  # type: ignore[method-assign]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet18")
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--plan", default="")
    ap.add_argument("--save", default="")
    ap.add_argument("--load", default="")
    ap.add_argument("--bn-mode", default="micro")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ctx = cd.init(timeout_s=a.timeout)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    kill = os.environ.get("CROSSCUT_TEST_KILL_RANK")
    hang = os.environ.get("CROSSCUT_TEST_HANG_RANK")
    try:
        for name in a.models.split(","):
            x, y = batch(a.batch, a.size)
            plan: Any = a.plan or None
            t0 = time.perf_counter()
            pipe = cd.compile_distributed(
                build(name),
                x,
                plan,
                replicas=a.replicas,
                schedule=a.schedules.split(",")[0],
                microbatches=a.microbatches,
                timeout_s=a.timeout,
                bn_mode=a.bn_mode,
            )
            initial = {k: t.detach().clone() for k, t in pipe.named_original_tensors()}
            for schedule in a.schedules.split(","):
                pipe.use_schedule(schedule)
                with torch.no_grad():  # every schedule starts from the same weights
                    for k, t in pipe.named_original_tensors():
                        t.copy_(initial[k])
                opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
                if a.load:
                    pipe.load_checkpoint(a.load, opt)
                if kill is not None and ctx.rank == int(kill):
                    kill_after_first_forward(pipe)
                if hang is not None and ctx.rank == int(hang):
                    hang_after_first_forward(pipe, a.timeout + 3.0)
                losses, grads = [], {}
                t1 = time.perf_counter()
                for step in range(a.steps):
                    opt.zero_grad()
                    loss = pipe.train_step(x, y, nn.functional.cross_entropy)
                    losses.append(None if loss is None else float(loss))
                    grads = pipe.local_grads()
                    opt.step()
                    if a.save and step == 0:
                        pipe.save_checkpoint(a.save, opt, extra={"step": 1})
                t2 = time.perf_counter()
                torch.save(
                    {
                        "losses": losses,
                        "grads": grads,
                        "state": pipe.local_state_dict(),
                        "layout": pipe.layout(),
                        "compile_s": t1 - t0,
                        "train_s": t2 - t1,
                    },
                    out / f"{name}_{schedule}_rank{ctx.rank}.pt",
                )
    except CrosscutError as exc:
        sys.stderr.write(f"CROSSCUT-ERROR rank {ctx.rank}: {type(exc).__name__}: {exc}\n")
        return 3
    except Exception:
        traceback.print_exc()
        return 4
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)  # do not wait on a process group whose peers may be gone
