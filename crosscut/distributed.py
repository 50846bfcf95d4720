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
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Unpack

import torch
import torch.distributed as dist
from torch import nn

from crosscut.cpu_malloc import keep_freed_memory
from crosscut.errors import CrosscutError, DistributedError, InputError
from crosscut.ir.plan import Plan
from crosscut.ir.schedule import AUTO_SCHEDULE
from crosscut.options import CompileKeywords, PlanRequest, RunOptions, split_options
from crosscut.partitioner.validate import validate_plan
from crosscut.planning import as_tuple, micro_inputs
from crosscut.runtime.batchnorm import check_sync_batchnorm
from crosscut.runtime.dist.grad_clip import rank_clip_grad_norm_
from crosscut.runtime.dist.grad_scaler import PipelineGradScaler
from crosscut.runtime.dist.rank_executor import DistributedPipeline, check_bn_mode, plan_hash
from crosscut.runtime.dist.state_files import RankState, assemble_checkpoint
from crosscut.runtime.grad_norm import checked_norm_type, clip_pieces_
from crosscut.runtime.local.model_keys import ModelKeyedState

__all__ = [
    "DistContext",
    "DistributedKeywords",
    "DistributedPipeline",
    "PipelineGradScaler",
    "assemble_checkpoint",
    "clip_grad_norm_",
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
    else:
        keep_freed_memory()  # the allocator CPU profiles are taken with (cpu_malloc.py)
    if os.environ.get("MASTER_ADDR", "") in _LOOPBACK:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if not dist.is_initialized():
        try:
            dist.init_process_group(
                chosen, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
            )
            atexit.register(_leave_job)
            # gloo's mesh is joined pairwise: a rank whose side is done could leave (a bad
            # option refused at once) and close a pair that a slower rank was still
            # connecting, which then failed its init instead of refusing the option alike
            dist.barrier(device_ids=[dev.index or 0] if dev.type == "cuda" else None)
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
    model: nn.Module, inputs: tuple[torch.Tensor, ...], cluster: Any, request: PlanRequest
) -> Plan:
    """Rank 0 plans the whole strategy for the job's ranks; everyone gets its plan.

    ``inputs`` is the global batch and ``cluster`` one device per rank: the
    planner chooses what ``request`` leaves to it (replicas, micro-batches,
    schedule), every rank running a stage (``fill_devices``). A planning error
    on rank 0 is raised on every rank, so none waits for a plan that will not
    come.
    """
    from crosscut.planning import plan_request

    box: list[Any] = [None, None]
    if dist.get_rank() == 0:
        # one stage per rank; ranks are devices: no two stages on one group
        colocate = request.colocate and not request.cross_shaped
        request = replace(request, fill_devices=True, colocate=colocate)
        try:
            plan = plan_request(model, cluster, inputs, request)
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


class DistributedKeywords(CompileKeywords, total=False):
    """:func:`compile_distributed`'s keywords: ``compile``'s, and the old options dict."""

    partition_options: Mapping[str, Any]  # deprecated: the planning options as keywords


def compile_distributed(
    model: nn.Module,
    example_inputs: Any,
    plan: Plan | str | Path | None = None,
    *,
    devices: Any = None,
    device: torch.device | str | None = None,
    options: PlanRequest | None = None,
    run: RunOptions | None = None,
    **keywords: Unpack[DistributedKeywords],
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

    Options are :func:`crosscut.compile`'s (keywords, or ``options=`` and
    ``run=``): without a plan rank 0 partitions for ``devices`` (one per
    stage; ``None``: the ranks' own kind) with the planning options; a
    ``schedule`` or ``microbatches`` given overrides a given plan's. ``device``
    is this rank's (default: its CUDA device under NCCL, else the CPU).
    """
    kw: dict[str, Any] = dict(keywords)
    old = kw.pop("partition_options", None)
    if old:  # before issue 26 the planning options came as one dict: still honoured
        warnings.warn(
            "compile_distributed(partition_options={...}) is deprecated: pass the options "
            "as keywords or options=PlanRequest(...)",
            DeprecationWarning,
            stacklevel=2,
        )
        kw = {**dict(old), **kw}
    request, the_run = split_options(options, run, kw)
    check_bn_mode(the_run.bn_mode)
    t_out = float(
        the_run.timeout_s
        if the_run.timeout_s is not None
        else os.environ.get("CROSSCUT_TIMEOUT_S", DEFAULT_TIMEOUT_S)
    )
    if not dist.is_initialized():
        init(timeout_s=the_run.timeout_s or DEFAULT_TIMEOUT_S)
    # before the trace runs the model (runtime/batchnorm.py)
    check_sync_batchnorm([(model, False)], 1, dist.get_world_size(), frozen_too=True)
    env_reps = os.environ.get("CROSSCUT_REPLICAS")
    if request.replicas is None and env_reps:
        request = replace(request, replicas=int(env_reps))
    if plan is None and os.environ.get("CROSSCUT_PLAN"):
        plan = os.environ["CROSSCUT_PLAN"]
    dev = _rank_device(device)
    inputs = as_tuple(example_inputs)
    if plan is None:
        the_plan = _plan_for_the_job(model, inputs, devices, dev, request)
    else:
        the_plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    return _rank_pipeline(model, inputs, the_plan, request, the_run, dev, t_out)


def _rank_device(device: torch.device | str | None) -> torch.device:
    """This rank's device: as given, else its CUDA device under NCCL, else the CPU."""
    if device is not None:
        return torch.device(device)
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _plan_for_the_job(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    devices: Any,
    dev: torch.device,
    request: PlanRequest,
) -> Plan:
    """Rank 0's plan for the job's ranks, with the replicas (if fixed) dividing the world."""
    world = dist.get_world_size()
    if request.replicas is not None and world % request.replicas:
        raise DistributedError(
            f"replicas ({request.replicas}) must divide the world size ({world})",
            remedy="launch replicas × stages processes, or leave replicas to the planner",
        )
    return _plan_on_rank0(model, inputs, _plan_cluster(devices, world, dev), request)


def _rank_pipeline(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    the_plan: Plan,
    request: PlanRequest,
    run: RunOptions,
    dev: torch.device,
    timeout_s: float,
) -> DistributedPipeline:
    """Trace this rank's graph at the plan's micro-batch and build its pipeline."""
    from crosscut.codegen.modes import mode_differences
    from crosscut.planning import (
        check_plan_precision,
        other_mode_graph,
        trace,
    )

    reps = request.replicas if request.replicas is not None else the_plan.replication.replicas
    check_plan_precision(the_plan, run.precision)
    m = request.microbatches or the_plan.options.microbatches
    batch = int(inputs[0].shape[0])
    if batch % (reps * m):
        raise InputError(
            f"the global batch ({batch}) must split into replicas × microbatches = {reps} × {m}",
            value=batch,
            remedy=f"use a batch that is a multiple of {reps * m}",
        )
    micro = micro_inputs(inputs, reps * m)  # a 0-d input goes whole
    graph = trace(model, micro, mode=the_plan.model.mode, precision=the_plan.options.precision)
    validate_plan(the_plan, graph)
    other = other_mode_graph(model, graph)
    pipe = DistributedPipeline(
        model,
        graph.gm,
        the_plan,
        replicas=reps,
        # "auto": the plan's choice
        schedule=None if request.schedule == AUTO_SCHEDULE else request.schedule,
        microbatches=m,
        device=dev,
        run=replace(run, timeout_s=timeout_s),
    )
    if other is not None:  # one program per rank: the other mode is refused, never run wrong
        why = [str(other)] if isinstance(other, Exception) else mode_differences(graph.gm, other)
        pipe.mode_lock = (graph.mode == "train", why)
    return pipe


def clip_grad_norm_(
    module: nn.Module,
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` by the whole model's norm, on any plan.

    Pass the compiled module itself (not its ``parameters()``): under torchrun
    a rank holds one stage's parameters, and clipping them by their own norm
    scales every stage by a different factor. Call it on every rank, after
    ``train_step`` (a collective: two small all-reduces). The norm counts each
    parameter once, whatever the replicas and groups hold, computed as eager
    computes it (bit for bit unless a parameter is channel-sharded); returns
    it, as torch does. A local ``CompiledModule`` holds the whole model and a
    plain ``nn.Module`` is clipped by torch's own function.
    """
    if isinstance(module, RankState):
        return rank_clip_grad_norm_(module, max_norm, norm_type, error_if_nonfinite, foreach)
    if isinstance(module, ModelKeyedState):
        pieces, keys = module.grad_pieces()
        params = module.parameters()
        return clip_pieces_(params, pieces, keys, max_norm, norm_type, error_if_nonfinite, foreach)
    if isinstance(module, nn.Module):
        return torch.nn.utils.clip_grad_norm_(
            module.parameters(), max_norm, checked_norm_type(norm_type), error_if_nonfinite, foreach
        )
    raise InputError(
        "clip_grad_norm_ takes the compiled module (or a plain nn.Module)",
        value=type(module).__name__,
        remedy="pass the module crosscut.compile returned, not its parameters()",
    )
