"""Public entry points for multi-process runs: ``init``, ``compile_distributed``, checkpoints.

A user script launched by ``crosscut run --plan plan.json script.py`` (or
torchrun) calls :func:`init` once, then :func:`compile_distributed` with the
model, a global example batch and the plan, and trains with
``pipeline.train_step(x, y, loss_fn)`` on every rank. ``crosscut run`` puts
the plan path in ``CROSSCUT_PLAN`` and the replica count in
``CROSSCUT_REPLICAS``; :func:`compile_distributed` reads them when its own
arguments are not given.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from crosscut.errors import CrosscutError, DistributedError, InputError
from crosscut.ir.plan import Plan
from crosscut.ir.schedule import AUTO_SCHEDULE
from crosscut.partitioner.validate import validate_plan
from crosscut.planning import as_tuple
from crosscut.runtime.dist.grad_scaler import PipelineGradScaler
from crosscut.runtime.dist.rank_executor import DistributedPipeline, check_bn_mode, plan_hash
from crosscut.runtime.dist.state_files import assemble_checkpoint

__all__ = [
    "DistContext",
    "DistributedPipeline",
    "PipelineGradScaler",
    "assemble_checkpoint",
    "compile_distributed",
    "init",
    "plan_hash",
]

DEFAULT_TIMEOUT_S = 300.0
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class DistContext:
    """What :func:`init` found: this process's place in the job and its device."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def _env_int(name: str) -> int:
    raw = os.environ.get(name)
    if raw is None:
        raise DistributedError(
            f"environment variable {name} is not set: this process was not started by a "
            "distributed launcher",
            remedy="launch with `crosscut run --plan plan.json script.py` or torchrun "
            "(or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT yourself)",
        )
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"{name} must be an integer", value=raw) from None


def _leave_job() -> None:
    """At exit, release the process group this module created (if the script did not).

    A script that ends without ``destroy_process_group`` leaves its gloo pairs to
    the interpreter's teardown, where a peer that already exited can make the
    process abort (exit -6) after its work is done. Errors here change nothing.
    """
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # the job is over either way
        pass


def init(
    *, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, device: str | None = None
) -> DistContext:
    """Join the job described by torchrun's environment variables (idempotent).

    Backend: ``nccl`` when CUDA is available (and ``device`` is not ``"cpu"``),
    else ``gloo``; the device is ``cuda:LOCAL_RANK`` or ``cpu``. On a loopback
    rendezvous gloo is pinned to the loopback interface so that hosts whose
    name resolves to an unreachable address still work.
    """
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    want_cuda = torch.cuda.is_available() and device != "cpu"
    chosen = backend or ("nccl" if want_cuda else "gloo")
    dev = (
        torch.device(device)
        if device
        else (torch.device("cuda", local) if chosen == "nccl" else torch.device("cpu"))
    )
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if os.environ.get("MASTER_ADDR", "") in _LOOPBACK:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if not dist.is_initialized():
        try:
            dist.init_process_group(
                chosen, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
            )
            atexit.register(_leave_job)
        except (RuntimeError, ValueError) as exc:
            raise DistributedError(
                f"rank {rank} could not join the process group ({chosen}): "
                f"{str(exc).splitlines()[0][:300]}",
                value={
                    "MASTER_ADDR": os.environ.get("MASTER_ADDR"),
                    "MASTER_PORT": os.environ.get("MASTER_PORT"),
                    "world_size": world,
                },
                remedy="check that every rank started and the rendezvous address is reachable",
            ) from exc
    return DistContext(rank, world, local, dist.get_backend(), dev)


def _plan_on_rank0(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    cluster: Any,
    microbatches: int | None,
    replicas: int | None,
    schedule: str,
    options: Mapping[str, Any],
) -> Plan:
    """Rank 0 plans the whole strategy for the job's ranks; everyone gets its plan.

    ``inputs`` is the global batch and ``cluster`` one device per rank: the
    planner chooses the replicas (``None``), the pipeline and the
    micro-batches (``None``), every rank running a stage
    (``fill_devices``). ``options`` are :func:`crosscut.partition`'s
    (objective, time limit, costs, cross-shaped search): what the caller gave
    ``compile``, honoured here. A planning error on rank 0 is raised on every
    rank, so none waits for a plan that will not come.
    """
    from crosscut.options import PlanRequest
    from crosscut.planning import plan_request

    box: list[Any] = [None, None]
    if dist.get_rank() == 0:
        extra = {**dict(options), "microbatches": microbatches, "schedule": schedule}
        extra.update(replicas=replicas, fill_devices=True)  # one stage per rank
        if extra.get("cross_shaped"):
            extra["colocate"] = False  # ranks are devices: no two stages on one group
        try:
            plan = plan_request(model, cluster, inputs, PlanRequest(**extra))
            box[0] = plan.to_json()
        except CrosscutError as exc:
            box[1] = exc
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise box[1]
    return Plan.from_json(str(box[0]))


def _plan_cluster(devices: Any, ranks: int, device: torch.device) -> Any:
    """The cluster rank 0 plans for: ``devices`` if given (one per rank), else the ranks'."""
    from crosscut.cost_models.cluster import Cluster

    if devices is None:  # one logical device per rank, of the ranks' kind
        if device.type == "cpu":
            return ["cpu"] * ranks
        # GPUs on other ranks (other nodes) are not visible here: price this rank's own
        # GPU for every rank instead of naming cuda:i devices rank 0 may not have
        from crosscut.cost_models.detect import cuda_spec

        base = cuda_spec(device)
        specs = [base.renamed(f"gpu{i}", f"cuda:{i}") for i in range(ranks)]
        return Cluster.from_specs(specs, "pcie")
    cluster = Cluster.from_any(devices)
    if cluster.nodes > 1:  # e.g. devices="torchrun" on a job of several nodes
        raise InputError(
            "under torchrun, compile plans the job's ranks on one node; a cluster of several "
            "nodes is planned as replicas × pipeline by partition()",
            value=cluster.name,
            remedy="`crosscut partition MODEL --devices ... -o plan.json` (or "
            "crosscut.partition(model, cluster, global_batch)), then `crosscut run --plan "
            "plan.json` on every node; or pass devices=None",
        )
    if len(cluster.devices) != ranks:
        raise InputError(
            f"under torchrun, devices must list one device per rank: {ranks} ranks, "
            f"{len(cluster.devices)} devices given",
            value=[d.name for d in cluster.devices],
            remedy=f"pass {ranks} devices (or a spec such as '{ranks}xV100' to plan for that "
            "hardware), or None to plan for the ranks' own devices",
        )
    return cluster


def compile_distributed(
    model: nn.Module,
    example_inputs: Any,
    plan: Plan | str | Path | None = None,
    *,
    replicas: int | None = None,
    schedule: str | None = None,
    microbatches: int | None = None,
    timeout_s: float | None = None,
    device: torch.device | str | None = None,
    bn_mode: str = "micro",
    output_merge: Any = None,
    devices: Any = None,
    partition_options: Mapping[str, Any] | None = None,
    recompute: str | bool | Sequence[bool] = "auto",
    precision: str | None = None,
    overlap_allreduce: bool = True,
) -> DistributedPipeline:
    """This rank's :class:`DistributedPipeline` of ``model`` under ``plan``.

    ``example_inputs`` is a GLOBAL batch (all replicas); the graph is traced at
    ``batch / (replicas × microbatches)``, the micro-batch the plan was made
    for. ``plan`` is a Plan, a path, ``None`` to read ``CROSSCUT_PLAN``, or —
    when that is unset too — made by rank 0 for the job's ranks (one CPU or GPU
    device each) and broadcast: the planner chooses ``replicas`` (data
    parallelism on every rank is always priced), the pipeline and
    ``microbatches`` for the shortest predicted step, keeping any of them given
    (``replicas`` or ``CROSSCUT_REPLICAS``; a given plan brings its own).
    Every rank must build ``model`` identically (same seed) or load a
    checkpoint; replicas are synchronised from replica 0.
    ``bn_mode``: ``"micro"`` or ``"step"``; ``recompute``: as for :func:`crosscut.compile`.
    ``overlap_allreduce``: the replicas' gradient all-reduce runs during each
    stage's last backward, by DDP's reducer (:mod:`crosscut.runtime.dist.overlap`);
    ``False`` runs it after the backward.
    ``output_merge``: as for :func:`crosscut.compile` (the last stage merges
    its replica's micro-batch outputs in ``forward``). Without a plan, rank 0
    partitions for ``devices`` (one per stage; ``None``: the ranks' own kind)
    with ``partition_options`` (:func:`crosscut.partition`'s keywords).
    """
    from crosscut.codegen.modes import mode_differences
    from crosscut.planning import (
        check_plan_precision,
        other_mode_graph,
        recompute_flags_for,
        trace,
    )

    check_bn_mode(bn_mode)
    if not dist.is_initialized():
        init(timeout_s=timeout_s or DEFAULT_TIMEOUT_S)
    env_reps = os.environ.get("CROSSCUT_REPLICAS")
    fixed = replicas if replicas is not None else (int(env_reps) if env_reps else None)
    t_out = float(
        timeout_s
        if timeout_s is not None
        else os.environ.get("CROSSCUT_TIMEOUT_S", DEFAULT_TIMEOUT_S)
    )
    if device is None:
        dev = (
            torch.device("cuda", torch.cuda.current_device())
            if (dist.get_backend() == "nccl")
            else torch.device("cpu")
        )
    else:
        dev = torch.device(device)
    if plan is None and os.environ.get("CROSSCUT_PLAN"):
        plan = os.environ["CROSSCUT_PLAN"]
    inputs = as_tuple(example_inputs)
    world = dist.get_world_size()
    if plan is None:
        if fixed is not None and world % fixed:
            raise DistributedError(
                f"replicas ({fixed}) must divide the world size ({world})",
                remedy="launch replicas × stages processes, or leave replicas to the planner",
            )
        cluster = _plan_cluster(devices, world, dev)
        options = {**(partition_options or {})}
        if precision is not None:
            options["precision"] = precision
        the_plan = _plan_on_rank0(
            model, inputs, cluster, microbatches, fixed, schedule or AUTO_SCHEDULE, options
        )
        reps = the_plan.replication.replicas
    else:
        the_plan = plan if isinstance(plan, Plan) else Plan.load(plan)
        reps = fixed if fixed is not None else the_plan.replication.replicas
    check_plan_precision(the_plan, precision)
    m = microbatches or the_plan.options.microbatches
    batch = int(inputs[0].shape[0])
    if batch % (reps * m):
        raise InputError(
            f"the global batch ({batch}) must split into replicas × microbatches = {reps} × {m}",
            value=batch,
            remedy=f"use a batch that is a multiple of {reps * m}",
        )
    micro = tuple(t[: batch // (reps * m)] for t in inputs)
    graph = trace(model, micro, mode=the_plan.model.mode, precision=the_plan.options.precision)
    validate_plan(the_plan, graph)
    other = other_mode_graph(model, graph)
    pipe = DistributedPipeline(
        model,
        graph.gm,
        the_plan,
        replicas=reps,
        schedule=None if schedule == AUTO_SCHEDULE else schedule,  # "auto": the plan's choice
        microbatches=m,
        timeout_s=t_out,
        device=dev,
        bn_mode=bn_mode,
        output_merge=output_merge,
        recompute=recompute_flags_for(recompute, the_plan),
        overlap_allreduce=overlap_allreduce,
    )
    if other is not None:  # one program per rank: the other mode is refused, never run wrong
        why = [str(other)] if isinstance(other, Exception) else mode_differences(graph.gm, other)
        pipe.mode_lock = (graph.mode == "train", why)
    return pipe
