"""The peer a user would otherwise pick: torch.distributed.pipelining on the same job.

Same model, data, micro-batches and schedule as ``benchmarks/distributed.py``'s
crosscut pipeline (2 gloo ranks, one thread each): ``pipeline()`` splits the
model at ``SplitPoint.BEGINNING`` of chosen modules and one of torch's
schedules runs the pieces (``SCHEDULES``: ``1f1b``, the default, is
``Schedule1F1B`` on one piece per rank; ``interleaved1f1b``, ``interleavedzb``
and ``zbv`` put two pieces on each rank, so torch's bubble-closing schedules
are timed next to crosscut's own). Two splits:

* **parameter-balanced**: for ``P`` pieces, the ``k``-th cut at the first
  candidate module (after the previous cut) with ``k / P`` of the parameters
  before it — what the documentation's examples lead to;
* **best tried**: the cuts nearest ``k / P`` of the forward time (measured
  here, one eager pass) and a few single-cut moves away from them are each
  launched and timed, and the fastest kept — the best a patient user finds by
  hand. With one cut (2 pieces) this is the ``tries`` candidates nearest the
  middle of the forward.

Candidates are the model's submodules at depth 1 and 2 in forward order
(``layer3.0`` for resnet50). Run through ``benchmarks/distributed.py --peer``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "SCHEDULES",
    "PeerSchedule",
    "balanced_split",
    "balanced_splits",
    "candidates",
    "peer_step_time",
    "schedule_names",
    "tried_splits",
    "worker",
]

Candidate = tuple[str, float, float]


@dataclass(frozen=True)
class PeerSchedule:
    """One of torch's schedules as the peer runs it.

    ``per_rank`` pieces live on each rank; ``placement`` says which: ``"loop"``
    puts piece ``i`` on rank ``i % ranks`` (what torch's interleaved schedules
    assume), ``"v"`` puts pieces ``r`` and ``2 * ranks - 1 - r`` on rank ``r``
    (ZB-V: the first and the last piece share rank 0).
    """

    torch_name: str
    per_rank: int = 1
    placement: str = "loop"

    def pieces(self, ranks: int) -> int:
        """How many pieces the model is split into for ``ranks`` ranks."""
        return ranks * self.per_rank

    def rank_of(self, piece: int, ranks: int) -> int:
        """The rank that runs piece ``piece``."""
        if self.placement == "v" and piece >= ranks:
            return 2 * ranks - 1 - piece
        return piece % ranks


SCHEDULES: dict[str, PeerSchedule] = {
    "1f1b": PeerSchedule("Schedule1F1B"),
    "interleaved1f1b": PeerSchedule("ScheduleInterleaved1F1B", per_rank=2),
    "interleavedzb": PeerSchedule("ScheduleInterleavedZeroBubble", per_rank=2),
    "zbv": PeerSchedule("ScheduleZBVZeroBubble", per_rank=2, placement="v"),
}


def schedule_names(text: str) -> list[str]:
    """``"1f1b,zbv"`` as a list of known schedule names (an argparse type: bad names fail there)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown peer schedule {', '.join(unknown) or repr(text)}; "
            f"choose from {', '.join(SCHEDULES)}"
        )
    return names


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


def balanced_split(cands: list[Candidate]) -> str:
    """The first candidate with at least half of the parameters before it."""
    return next(n for n, p, _ in cands if p >= 0.5)


def balanced_splits(cands: list[Candidate], pieces: int) -> list[str]:
    """``pieces - 1`` cuts, the ``k``-th at the next candidate with ``k / pieces`` of the weights.

    With 2 pieces this is :func:`balanced_split`. A cut never goes so late
    that the later cuts run out of candidates: a model whose parameters sit in
    its last modules (resnet's ``layer4``) gets those cuts on the candidates
    just before and after, as a user sharing parameters out would. It raises
    ``ValueError`` only when there are fewer candidates than cuts.
    """
    if len(cands) < pieces - 1:
        raise ValueError(f"{len(cands)} candidate modules cannot make {pieces} pieces")
    cuts: list[int] = []
    for k in range(1, pieces):
        after = cuts[-1] + 1 if cuts else 0
        room = len(cands) - (pieces - 1 - k) - 1  # the last index that leaves one per later cut
        i = next((j for j in range(after, room + 1) if cands[j][1] >= k / pieces), room)
        cuts.append(i)
    return [cands[i][0] for i in cuts]


def tried_splits(cands: list[Candidate], pieces: int, tries: int) -> list[list[str]]:
    """Up to ``tries`` cut lists near equal forward-time shares, the likeliest first.

    The first puts cut ``k`` on the candidate nearest ``k / pieces`` of the
    forward time; each further one moves a single cut of it to another
    candidate, the moves whose new share lies nearest its target first, so the
    search stays at ``tries`` launches however many cuts there are. With one
    cut these are the ``tries`` candidates nearest the middle of the forward.
    """
    targets = [k / pieces for k in range(1, pieces)]
    base = [min(range(len(cands)), key=lambda j: abs(cands[j][2] - t)) for t in targets]
    for k in range(1, len(base)):  # two targets on one candidate: push the later one on
        base[k] = max(base[k], base[k - 1] + 1)
    for k in reversed(range(len(base))):  # ... and back, if that ran past the last one
        base[k] = min(base[k], len(cands) - len(base) + k)
    if not base or base[0] < 0:
        return []
    moves = sorted(
        (abs(c[2] - t), k, j) for k, t in enumerate(targets) for j, c in enumerate(cands)
    )
    out = [base]
    for _, k, j in moves:
        if len(out) >= tries:
            break
        cut = [*base[:k], j, *base[k + 1 :]]
        if all(a < b for a, b in itertools.pairwise(cut)) and cut not in out:
            out.append(cut)
    return [[cands[i][0] for i in cut] for cut in out[:tries]]


def _stage_step_args(
    here: list[int], pieces: int, x: torch.Tensor, y: torch.Tensor, losses: list[torch.Tensor]
) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    """This rank's ``schedule.step`` arguments: the batch on the first piece, targets on the last.

    Under ZB-V both pieces are on rank 0, which then passes both.
    """
    args = (x,) if 0 in here else ()
    kwargs: dict[str, Any] = {"target": y, "losses": losses} if pieces - 1 in here else {}
    return args, kwargs


def worker(ns: argparse.Namespace, build: Any, data: Any) -> int:
    """One rank of the peer: build, split at ``ns.split``, time ``ns.steps`` steps of the schedule.

    ``ns.split`` is a comma-separated list of cut modules (one per piece
    boundary); ``ns.peer_schedule`` one of :data:`SCHEDULES` (``1f1b`` where
    the caller's parser has no such option, as ``default_vs_peers.py``'s). A
    refusal from torch ends the rank with its one-line reason on stderr, which
    :func:`peer_step_time` reports instead of a time.
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        return _timed_steps(ns, build, data)
    except Exception as e:  # torch refused this schedule or split: one line for the launcher
        traceback.print_exc()  # the whole story for a reader of the rank's stderr
        print(f"{type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 1
    finally:
        dist.destroy_process_group()


def _timed_steps(ns: argparse.Namespace, build: Any, data: Any) -> int:
    """The body of :func:`worker`, inside an initialised process group."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    rank, ranks = dist.get_rank(), dist.get_world_size()
    name = getattr(ns, "peer_schedule", None) or "1f1b"
    kind = SCHEDULES[name if isinstance(name, str) else name[0]]
    cuts = [c for c in ns.split.split(",") if c]
    pieces = kind.pieces(ranks)
    if len(cuts) != pieces - 1:
        raise ValueError(f"{kind.torch_name} on {ranks} ranks takes {pieces - 1} cuts, got {cuts}")
    x, y = data(ns.batch, ns.size, ns.peer_worker)
    model = build(ns.peer_worker)
    mb = x[: ns.batch // ns.microbatches]
    split_spec = {c: pipelining.SplitPoint.BEGINNING for c in cuts}
    pipe = pipelining.pipeline(model, mb_args=(mb,), split_spec=split_spec)
    if pipe.num_stages != pieces:
        raise ValueError(f"pipeline() made {pipe.num_stages} pieces of {cuts}, not {pieces}")
    here = [i for i in range(pieces) if kind.rank_of(i, ranks) == rank]
    cpu = torch.device("cpu")
    stages: list[Any]  # PipelineStage or pipe's own _PipelineStage: torch's common base is private
    if kind.placement == "v":
        # pipe.build_stage's stages greet both neighbours with a gloo message at
        # start-up, and V puts two neighbours (1 and 2 of 4) on one rank: gloo
        # cannot send to its own rank. torch's hand-built PipelineStage around
        # the same pieces skips a same-rank neighbour, and runs the same schedule.
        stages = [pipelining.PipelineStage(pipe.get_stage_module(i), i, pieces, cpu) for i in here]
    else:
        stages = [pipe.build_stage(i, cpu) for i in here]
    cls = getattr(pipelining, kind.torch_name)
    target: Any = stages[0] if kind.per_rank == 1 else stages
    sched = cls(target, n_microbatches=ns.microbatches, loss_fn=F.cross_entropy)
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.SGD(params, lr=0.01)
    times, losses_out = [], []
    for i in range(ns.warmup + ns.steps):
        dist.barrier()
        t = time.perf_counter()
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        args, kwargs = _stage_step_args(here, pieces, x, y, losses)
        sched.step(*args, **kwargs)
        if losses:
            losses_out.append(float(torch.stack(losses).mean()))
        opt.step()
        dist.barrier()
        if i >= ns.warmup:
            times.append(time.perf_counter() - t)
    if pieces - 1 in here:  # the rank with the losses reports
        result = {"step_s": sum(times) / len(times), "first_loss": losses_out[0]}
        Path(ns.report).write_text(json.dumps(result))
    return 0


def peer_step_time(
    script: str,
    name: str,
    split: str,
    ns: argparse.Namespace,
    tmp: Path,
    schedule: str = "1f1b",
) -> dict[str, Any]:
    """Launch ``ns.ranks`` (2 if unset) peer ranks of ``script`` cutting at ``split``
    (comma-separated) under ``schedule``.

    Their step time, or the error. ``--peer-schedule`` is passed only when it
    is not ``1f1b``, so scripts whose parser lacks it still launch the default.
    """
    from crosscut.cli.launch import free_port

    report = tmp / f"peer-{name}-{schedule}-{split.replace(',', '+')}.json"
    report.unlink(missing_ok=True)
    port = free_port()
    procs = []
    ranks = getattr(ns, "ranks", 2)
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")  # fmt: skip
        cmd = [sys.executable, script, "--peer-worker", name, "--split", split,
               "--report", str(report), "--batch", str(ns.batch), "--size", str(ns.size),
               "--steps", str(ns.steps), "--warmup", str(ns.warmup),
               "--microbatches", str(ns.microbatches)]  # fmt: skip
        if schedule != "1f1b":
            cmd += ["--peer-schedule", schedule]
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
        errors.sort(key=lambda e: "Connection closed" in e or "Connection reset" in e)
        return {"error": errors[0][:300]}
    data: dict[str, Any] = json.loads(report.read_text())
    return data
