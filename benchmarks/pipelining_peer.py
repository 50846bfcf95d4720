"""The peer a user would otherwise pick: torch.distributed.pipelining on the same job.

Same model, data, micro-batches and schedule as ``benchmarks/distributed.py``'s
crosscut pipeline (2 gloo ranks, one thread each): ``pipeline()`` splits the
model at one ``SplitPoint.BEGINNING`` and ``Schedule1F1B`` runs it. Two splits:

* **parameter-balanced**: the first candidate module at which half of the
  parameters lie before it — what the documentation's examples lead to;
* **best tried**: every candidate module boundary near the middle of the
  forward time (measured here, one eager pass) is launched and timed, and the
  fastest kept — the best a patient user finds by hand.

Candidates are the model's submodules at depth 1 and 2 in forward order
(``layer3.0`` for resnet50). Run through ``benchmarks/distributed.py --peer``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["balanced_split", "candidates", "peer_step_time", "worker"]


def candidates(model: nn.Module, x: torch.Tensor) -> list[tuple[str, float, float]]:
    """(module name, parameter share before it, forward-time share before it), in call order."""
    names = {m: n for n, m in model.named_modules() if n and n.count(".") <= 1}
    order: list[str] = []
    start: dict[str, float] = {}

    def pre(mod: nn.Module, _: Any) -> None:
        name = names[mod]
        if name not in start:
            order.append(name)
            start[name] = time.perf_counter()

    hooks = [m.register_forward_pre_hook(pre) for m in names]
    t0 = time.perf_counter()
    with torch.no_grad():
        model(x)
    total_t = time.perf_counter() - t0
    for h in hooks:
        h.remove()
    pos = {name: i for i, name in enumerate(order)}
    sizes = [0] * len(order)  # each parameter counts at the deepest called module holding it
    for key, p in model.named_parameters():
        owners = [n for n in order if key.startswith(n + ".")]
        if owners:
            sizes[pos[max(owners, key=len)]] += p.numel()
    total_p = sum(sizes) or 1
    out = []
    for i, name in enumerate(order):
        if i == 0 or any(o.startswith(name + ".") for o in order):
            continue  # the first module, or a container (its first child splits there)
        out.append((name, sum(sizes[:i]) / total_p, (start[name] - t0) / total_t))
    return out


def balanced_split(cands: list[tuple[str, float, float]]) -> str:
    """The first candidate with at least half of the parameters before it."""
    return next(n for n, p, _ in cands if p >= 0.5)


def worker(ns: argparse.Namespace, build: Any, data: Any) -> int:
    """One rank of the peer: build, split at ``ns.split``, time ``ns.steps`` 1F1B steps."""
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x, y = data(ns.batch, ns.size, ns.peer_worker)
    model = build(ns.peer_worker)
    mb = x[: ns.batch // ns.microbatches]
    pipe = pipeline(model, mb_args=(mb,), split_spec={ns.split: SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    sched = Schedule1F1B(stage, n_microbatches=ns.microbatches, loss_fn=F.cross_entropy)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.01)
    times, losses_out = [], []
    for i in range(ns.warmup + ns.steps):
        dist.barrier()
        t = time.perf_counter()
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
        else:
            losses: list[torch.Tensor] = []
            sched.step(target=y, losses=losses)
            losses_out.append(float(torch.stack(losses).mean()))
        opt.step()
        dist.barrier()
        if i >= ns.warmup:
            times.append(time.perf_counter() - t)
    if rank == 1:
        result = {"step_s": sum(times) / len(times), "first_loss": losses_out[0]}
        Path(ns.report).write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


def peer_step_time(
    script: str, name: str, split: str, ns: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    """Launch 2 peer ranks of ``script`` splitting at ``split``; their step time, or the error."""
    from crosscut.cli.launch import free_port

    report = tmp / f"peer-{name}-{split}.json"
    port = free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")  # fmt: skip
        cmd = [sys.executable, script, "--peer-worker", name, "--split", split,
               "--report", str(report), "--batch", str(ns.batch), "--size", str(ns.size),
               "--steps", str(ns.steps), "--warmup", str(ns.warmup),
               "--microbatches", str(ns.microbatches)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=ns.timeout)
        except subprocess.TimeoutExpired:  # a hung rank: end both, report, go on
            for q in procs:
                q.kill()
                q.wait()
            return {"error": f"timed out after {ns.timeout:g} s"}
        if p.returncode != 0:
            errors.append(err.strip().splitlines()[-1] if err.strip() else f"exit {p.returncode}")
    if errors:  # the crashed rank's own error, not its peer's "connection closed"
        errors.sort(key=lambda e: "Connection closed" in e)
        return {"error": errors[0][:200]}
    data: dict[str, Any] = json.loads(report.read_text())
    return data
