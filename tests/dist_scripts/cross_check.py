"""One rank of a cross-shaped distributed training check: grouped plans, one step, dumps.

Why a script: every member of a device group is a process. The test launches
this file once per rank; rank 0 partitions the model into ``len(groups)``
stages and widens them into the device groups of the chosen case (the same
plan file a user would get from ``partition(..., cross_shaped=True)``, but
with the groups fixed so the test knows what runs), broadcasts it, and every
rank trains one step per schedule and dumps its losses, gradients and state
(whole tensors and channel shards) for the test to assemble and compare with
eager training. ``CROSSCUT_TEST_KILL_RANK=r`` makes rank ``r`` exit after its
first stage forward.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torchvision
from torch import nn

import crosscut.distributed as cd
from crosscut.errors import CrosscutError
from crosscut.ir.plan import Plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.*
from tests.plan_factory import widen


@dataclass(frozen=True)
class Case:
    model: str
    groups: tuple[tuple[int, str], ...]  # per stage: (group width, split)
    schedules: tuple[str, ...]
    size: int = 32
    microbatches: int = 2
    batch: int = 8
    bn_eval: bool = False  # batch splits normalise each share alone: compare in eval mode
    replicas: int = 1
    checkpoint: bool = False  # save, clobber, load and dump the checkpoint directory


CASES = {
    "alexnet_channel": Case("alexnet", ((4, "channel"),), ("gpipe",), size=64),
    "alexnet_batch": Case("alexnet", ((2, "batch"), (2, "batch")), ("1f1b",), size=64),
    # vgg11: one schedule each, to keep the run short
    "vgg11_channel": Case("vgg11", ((2, "channel"), (2, "channel")), ("1f1b",)),
    "vgg11_batch": Case("vgg11", ((3, "batch"), (1, "none")), ("gpipe",)),
    "resnet18_channel": Case("resnet18", ((1, "none"), (3, "channel")), ("gpipe", "1f1b")),
    "resnet18_batch": Case("resnet18", ((4, "batch"),), ("gpipe",), bn_eval=True),
    "googlenet_channel": Case("googlenet", ((4, "channel"),), ("gpipe",)),
    "googlenet_mixed": Case(
        "googlenet",
        ((2, "batch"), (2, "channel")),
        ("gpipe", "1f1b"),
        bn_eval=True,
        checkpoint=True,
    ),
    "resnet18_replicas": Case(
        "resnet18", ((2, "channel"),), ("1f1b",), bn_eval=True, replicas=2, checkpoint=True
    ),
}


def build(name: str) -> nn.Module:
    """Seeded, 10 classes, no dropout (every rank would draw its own masks)."""
    torch.manual_seed(0)
    kw: dict[str, Any] = {"num_classes": 10}
    if name == "googlenet":
        kw.update(aux_logits=False, init_weights=False, dropout=0.0)
    if name in ("alexnet", "vgg11"):
        kw.update(dropout=0.0)
    model: nn.Module = torchvision.models.get_model(name, weights=None, **kw)
    if name == "vgg11":
        # the classifier reads a 1x1 pool (512 inputs, not 512x7x7): 120M parameters less
        # on the ranks and in the test process, so that four ranks of this case and the
        # other test worker fit in 24 GB together (a rank was OOM-killed at 4.5 GB); the
        # channel and batch splits of its Linear layers are the same
        model.avgpool = nn.AdaptiveAvgPool2d(1)  # type: ignore[assignment]
        model.classifier[0] = nn.Linear(512, 4096)  # type: ignore[index]
    return model


def digest(t: torch.Tensor) -> str:
    """The exact bytes of a tensor, hashed (to compare copies without shipping them)."""
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def bn_eval(*mods: nn.Module) -> None:
    for mod in mods:
        for m in mod.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()


def batch(n: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)


def make_plan(case: Case) -> Plan:
    """Rank 0 cuts the model into stages; every rank gets the same widened plan."""
    from crosscut.api import partition

    box: list[Any] = [None]
    if dist.get_rank() == 0:
        x, _ = batch(case.batch, case.size)
        plan = partition(
            build(case.model),
            ["cpu"] * len(case.groups),
            x[: case.batch // case.replicas],
            microbatches=case.microbatches,
            schedule=case.schedules[0],
            require_all_devices=True,
            solver="dp",  # the chain DP: deterministic and quick; the cut is not under test
        )
        box[0] = widen(plan, case.groups).to_json()
    dist.broadcast_object_list(box, src=0)
    return Plan.from_json(str(box[0]))


def kill_after_first_forward(pipe: cd.DistributedPipeline) -> None:
    original = pipe.stage.forward

    def dying(*args: Any) -> Any:
        out = original(*args)
        sys.stderr.write(f"rank {pipe.rank}: exiting on purpose after a forward\n")
        sys.stderr.flush()
        os._exit(1)
        return out

    pipe.stage.forward = dying  # type: ignore[method-assign]


def checkpoint_round_trip(pipe: cd.DistributedPipeline, opt: Any, directory: Path) -> None:
    """Save, clobber every tensor, load: this rank's whole tensors and shards come back."""
    pipe.save_checkpoint(str(directory), opt, extra={"step": 1})
    before = [t.detach().clone() for t in [*pipe.parameters(), *pipe.buffers()]]
    with torch.no_grad():
        for t in [*pipe.parameters(), *pipe.buffers()]:
            t.zero_()
    assert pipe.load_checkpoint(str(directory), opt) == {"step": 1}
    after = [*pipe.parameters(), *pipe.buffers()]
    assert all(torch.equal(a, b) for a, b in zip(after, before)), "load_checkpoint lost state"


def run_case(name: str, case: Case, out: Path, rank: int, timeout: float) -> None:
    x, y = batch(case.batch, case.size)
    plan = make_plan(case)
    t0 = time.perf_counter()
    pipe = cd.compile_distributed(
        build(case.model),
        x,
        plan,
        replicas=case.replicas,
        schedule=case.schedules[0],
        microbatches=case.microbatches,
        timeout_s=timeout,
    )
    if case.bn_eval:
        bn_eval(pipe)
    kill = os.environ.get("CROSSCUT_TEST_KILL_RANK")
    if kill is not None and rank == int(kill):
        kill_after_first_forward(pipe)
    start = [t.detach().clone() for t in [*pipe.parameters(), *pipe.buffers()]]
    for schedule in case.schedules:
        pipe.use_schedule(schedule)
        with torch.no_grad():  # every schedule starts from the same weights
            for t, t0_ in zip([*pipe.parameters(), *pipe.buffers()], start):
                t.copy_(t0_)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        opt.zero_grad()
        t1 = time.perf_counter()
        loss = pipe.train_step(x, y, nn.functional.cross_entropy)
        grads, shard_grads = pipe.local_grads(), pipe.local_shard_grads()
        opt.step()
        train_s = time.perf_counter() - t1
        pipe.eval()  # inference through the groups (no tokens, no gradients)
        infer = pipe(x)
        pipe.train()
        if case.bn_eval:
            bn_eval(pipe)
        if case.checkpoint and schedule == case.schedules[-1]:
            checkpoint_round_trip(pipe, opt, out / f"{name}_ckpt")
        layout = pipe.layout()
        dump: dict[str, Any] = {
            "loss": None if loss is None else float(loss),
            "infer": infer,
            "layout": layout,
            "compile_s": t1 - t0,
            "train_s": train_s,
            # every rank's tensors, by digest: members of a batch group and replicas
            # must hold exactly what their group leader / replica 0 holds
            "digests": {k: digest(t) for k, t in pipe.named_original_tensors()},
            "shard_digests": {k: digest(t) for k, _m, _d, t in pipe.named_shards()},
        }
        if layout["replica"] == 0 and (layout["split"] != "batch" or layout["member"] == 0):
            dump.update(  # the pieces the test assembles: group leaders' and shards
                grads=grads,
                shard_grads=shard_grads,
                state=pipe.local_state_dict(),
                shards=pipe.local_shards(),
            )
        torch.save(dump, out / f"{name}_{schedule}_rank{rank}.pt")
    del pipe


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="alexnet_channel")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    ctx = cd.init(timeout_s=a.timeout)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        for name in a.cases.split(","):
            run_case(name, CASES[name], out, ctx.rank, a.timeout)
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
