"""Batch norm whose running statistics are updated once per step (``bn_mode="step"``).

A pipeline normalises every micro-batch as it arrives: statistics of the whole
batch would need a barrier at every batch norm (all micro-batches through the
layers before it, then a second pass), which is exactly what pipelining
avoids. So in training each micro-batch — and, in a batch-split stage, each
device's share of it — is normalised with its own batch statistics, as with
``bn_mode="micro"``. What *can* be made exact is the running statistics:

* :func:`install_step_batchnorm` turns every ``_BatchNorm`` of a stage into a
  :class:`StepBatchNorm` (the class is swapped in place, so parameters,
  buffers and ``state_dict`` keys stay the original ones). In training its
  forward calls ``F.batch_norm`` without running buffers (so nothing is
  updated mid-step) and records the call's detached ``(count, mean, biased
  variance)``.
* :func:`commit_batchnorm` is the commit point, called once after every
  micro-batch of a step went forward. For each call site it combines the
  records exactly — law of total variance, ``M2 = Σ nᵢ (varᵢ + (meanᵢ − mean)²)``
  in float64 — and updates ``running_mean``, ``running_var`` (with torch's
  unbiased ``N/(N−1)`` correction over the whole batch) and
  ``num_batches_tracked`` ONCE, with the module's momentum (or, for
  ``momentum=None``, the cumulative average ``1/num_batches_tracked``).

The result equals single-device training that normalises the same chunks: the
running statistics are those of the whole batch's batch-norm inputs. Where
those inputs do not depend on how an earlier batch norm normalised (the first
batch norm of a network, or every one when the earlier ones are frozen in
eval mode) they equal plain full-batch eager training; deeper layers see
activations computed from per-micro-batch normalisation, so they cannot.

Call sites: a module called several times per forward (a shared batch norm)
gets one update per call, as in eager mode. A forward pre-hook on every
``fx.GraphModule`` of the stage sets a thread-local token (one per stage
forward, per device share); the ``j``-th call of a module under one token is
call site ``j``. Records are appended under a lock, since the local executor
runs stages on one thread per device and a batch-split stage its shares on one
thread per group device; a share's records carry its ``(call, share)`` key
(:func:`~crosscut.runtime.share_threads.share_order`) and the commit sorts by
it, so the sums run in the sequential order whatever the threads' timing.

Costs: one extra reduction over each batch-norm input (``var_mean``, no
autograd) per call, and ``2C + 1`` numbers per call until the commit.

``nn.SyncBatchNorm`` promises the whole batch's statistics, which no mode here
gives a share of the batch: :func:`check_sync_batchnorm` refuses it wherever a
plan would silently normalise it over a part (``bn_mode="exact"`` keeps the
batch whole, and then it is torch's own batch norm).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from crosscut.errors import InputError
from crosscut.runtime.share_threads import share_order

__all__ = [
    "StepBatchNorm",
    "check_sync_batchnorm",
    "commit_batchnorm",
    "discard_batchnorm",
    "install_step_batchnorm",
]

Site = tuple[int, int]  # (owner graph's position in install order, call index in its forward)
Token = tuple[int, int]  # (owner graph's position, serial number of this forward)

_LOCK = threading.Lock()
_context = threading.local()
_serial = itertools.count()
_NO_OWNER: Site = (-1, 0)  # calls outside any hooked graph: all one site
_CLASSES: dict[type[nn.Module], type[StepBatchNorm]] = {}
_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # graphs that already set tokens


@dataclass(frozen=True)
class _Stats:
    """One call's batch statistics: per-channel count, mean and biased variance."""

    count: int
    mean: torch.Tensor
    var: torch.Tensor
    event: Any = None  # CUDA event recorded after the reduction (the worker's stream)
    order: tuple[int, ...] = ()  # (call, share) in a batch-split stage: the commit's sum order


class StepBatchNorm(_BatchNorm):
    """Training forward normalises with batch statistics and records them; no buffer changes.

    Never constructed: :func:`install_step_batchnorm` swaps an existing
    module's class to a subclass of this and of its own class, so
    ``isinstance(m, nn.BatchNorm2d)`` and the module's ``repr`` keep working.
    """

    _crosscut_calls: dict[Token, int]
    _crosscut_pending: dict[Site, list[_Stats]]

    def _tracks(self) -> bool:
        return bool(
            self.training
            and self.track_running_stats
            and self.running_mean is not None
            and self.running_var is not None
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self._tracks():  # eval (running statistics) or nothing to track: as torch
            return super().forward(input)
        self._check_input_dim(input)  # type: ignore[no-untyped-call]
        out = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        self._record(input)
        return out

    def _record(self, input: torch.Tensor) -> None:
        with torch.no_grad():
            x = input.detach()
            if x.dtype in (torch.float16, torch.bfloat16):
                x = x.float()
            var, mean = torch.var_mean(x, dim=[0, *range(2, x.dim())], correction=0)
        event = None
        if x.is_cuda:  # the worker's stream on this device (not the current device's)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(x.device))
        count = x.numel() // max(int(x.shape[1]), 1)
        stats = _Stats(count, mean, var, event, share_order())
        token: Token | None = getattr(_context, "token", None)
        with _LOCK:
            if token is None:
                site = _NO_OWNER
            else:
                j = self._crosscut_calls.get(token, 0)
                self._crosscut_calls[token] = j + 1
                site = (token[0], j)
            self._crosscut_pending.setdefault(site, []).append(stats)


def _step_class(base: type[nn.Module]) -> type[StepBatchNorm]:
    """``Step<Base>``: StepBatchNorm's forward over ``base`` (one class per base, cached)."""
    with _LOCK:
        cls = _CLASSES.get(base)
        if cls is None:
            cls = type(f"Step{base.__name__}", (StepBatchNorm, base), {"__module__": __name__})
            _CLASSES[base] = cls
        return cls


def _enter(owner: int) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        _context.token = (owner, next(_serial))

    return hook


def install_step_batchnorm(module: nn.Module) -> int:
    """Make every tracking batch norm in ``module`` a :class:`StepBatchNorm`; returns how many.

    ``module`` is a stage (or a container of stages, in pipeline order): its
    graph modules get the pre-hooks that tell call sites apart. Idempotent.
    Batch norms with ``track_running_stats=False`` are left alone (nothing to
    update). A subclass with its own ``forward`` (``SyncBatchNorm``, custom
    ones) is refused: replacing its forward would silently change what it does.
    """
    count = 0
    for name, m in module.named_modules():
        if isinstance(m, StepBatchNorm):
            continue
        if not isinstance(m, _BatchNorm) or not m.track_running_stats:
            continue
        if type(m).forward is not _BatchNorm.forward:
            raise InputError(
                "bn_mode='step' needs batch norm modules that use torch's _BatchNorm.forward",
                value={"module": name, "type": type(m).__name__},
                remedy="use bn_mode='micro', or replace the module by nn.BatchNorm1d/2d/3d",
            )
        m.__class__ = _step_class(type(m))
        assert isinstance(m, StepBatchNorm)
        m._crosscut_calls = {}
        m._crosscut_pending = {}
        count += 1
    owners = [module, *(g for g in module.modules() if isinstance(g, fx.GraphModule))]
    for i, g in enumerate(dict.fromkeys(owners)):
        if g not in _HOOKED:
            g.register_forward_pre_hook(_enter(i))
            _HOOKED.add(g)
    return count


def _step_modules(module: nn.Module) -> Iterator[StepBatchNorm]:
    return (m for m in module.modules() if isinstance(m, StepBatchNorm))


def discard_batchnorm(module: nn.Module) -> None:
    """Drop the statistics recorded since the last commit (after a failed step)."""
    with _LOCK:
        for m in _step_modules(module):
            m._crosscut_calls = {}
            m._crosscut_pending = {}


def _combine(
    records: list[_Stats], device: torch.device
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(N, mean, M2) of the union of the records, in float64 on ``device``."""
    _sync(records, device)
    n = float(sum(r.count for r in records))
    counts = torch.tensor([float(r.count) for r in records], dtype=torch.float64, device=device)
    means = torch.stack([r.mean.to(device, torch.float64) for r in records])
    vars_ = torch.stack([r.var.to(device, torch.float64) for r in records])
    w = counts[:, None]
    mean = (w * means).sum(0) / n
    m2 = (w * (vars_ + (means - mean) ** 2)).sum(0)
    return n, mean, m2


def _sync(records: list[_Stats], device: torch.device) -> None:
    """Order the commit after the reductions that ran on the workers' streams.

    A record was computed on whatever stream was current on its device in the
    worker thread; the commit runs on the caller's current streams. A copy
    between devices runs on the source device's current stream, so both that
    stream and the destination's wait for the record's event, and the record's
    memory is marked as used by the source stream (the allocator must not hand
    it back to the worker before the copy ran).
    """
    for r in records:
        if r.event is None:
            continue
        here = torch.cuda.current_stream(r.mean.device)
        here.wait_event(r.event)
        if device.type == "cuda" and device != r.mean.device:
            torch.cuda.current_stream(device).wait_event(r.event)
        r.mean.record_stream(here)
        r.var.record_stream(here)


def _update(m: StepBatchNorm, n: float, mean: torch.Tensor, m2: torch.Tensor) -> None:
    """One running-statistics update, as ``_BatchNorm.forward`` + the kernel would do it."""
    rm, rv, nbt = m.running_mean, m.running_var, m.num_batches_tracked
    assert rm is not None and rv is not None
    factor = 0.0 if m.momentum is None else float(m.momentum)
    if nbt is not None:
        nbt.add_(1)
        if m.momentum is None:  # cumulative moving average
            factor = 1.0 / float(nbt)
    var = m2 / (n - 1)  # n > 1: F.batch_norm refuses a call with one value per channel
    rm.copy_(((1.0 - factor) * rm.double() + factor * mean).to(rm.dtype))
    rv.copy_(((1.0 - factor) * rv.double() + factor * var).to(rv.dtype))


def commit_batchnorm(
    module: nn.Module, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> int:
    """Apply the step's recorded statistics to the running buffers; returns the updates made.

    Call once per training step, after the last micro-batch's forward (a no-op
    when nothing was recorded, e.g. in eval mode). ``reduce`` is for replicas
    in several processes: it receives one float64 tensor holding, per call
    site, ``[N, Σx (C), Σx² (C)]`` and must return its sum over the replicas
    (e.g. ``dist.all_reduce`` in place, then return it), so every replica
    commits the statistics of the global batch; all replicas must have run the
    same schedule.
    """
    with _LOCK:
        work: list[tuple[StepBatchNorm, list[list[_Stats]]]] = []
        for m in _step_modules(module):
            if m._crosscut_pending:
                sites = [m._crosscut_pending[s] for s in sorted(m._crosscut_pending)]
                # shares record from concurrent threads: restore their sequential order
                work.append((m, [sorted(r, key=lambda r: r.order) for r in sites]))
            m._crosscut_calls = {}
            m._crosscut_pending = {}
    combined: list[tuple[StepBatchNorm, float, torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for m, sites in work:
            assert m.running_mean is not None
            for records in sites:
                combined.append((m, *_combine(records, m.running_mean.device)))
        if reduce is not None and combined:
            combined = _reduced(combined, reduce)
        for m, n, mean, m2 in combined:
            _update(m, n, mean, m2)
    return len(combined)


def _reduced(
    combined: list[tuple[StepBatchNorm, float, torch.Tensor, torch.Tensor]],
    reduce: Callable[[torch.Tensor], torch.Tensor],
) -> list[tuple[StepBatchNorm, float, torch.Tensor, torch.Tensor]]:
    """Sum ``[N, Σx, Σx²]`` of every site over the replicas in one flat tensor."""
    device = combined[0][2].device
    packed = torch.cat(
        [
            torch.cat([mean.new_tensor([n]), n * mean, m2 + n * mean * mean]).to(device)
            for _, n, mean, m2 in combined
        ]
    )
    total = reduce(packed)
    out = []
    at = 0
    for m, _, mean, _ in combined:
        c = mean.numel()
        part = total[at : at + 1 + 2 * c].to(mean.device)
        at += 1 + 2 * c
        n = float(part[0])
        mu = part[1 : 1 + c] / n
        out.append((m, n, mu, part[1 + c :] - n * mu * mu))
    return out


_SYNC_REMEDY = (
    "build the model with nn.BatchNorm2d (drop convert_sync_batchnorm: each replica and "
    "micro-batch normalises its own share, as DistributedDataParallel does without "
    "SyncBatchNorm), or compile locally with bn_mode='exact' (one replica, one "
    "micro-batch: the whole batch's statistics)"
)


def check_sync_batchnorm(
    stages: Sequence[tuple[nn.Module, bool]],
    microbatches: int,
    world_size: int | None = None,
    names: dict[str, str] | None = None,
    frozen_too: bool = False,
) -> None:
    """Refuse a training ``nn.SyncBatchNorm`` whose statistics would silently not be the
    whole batch's. ``stages``: each stage's module and whether it splits its batch over
    devices (replicas run as such splits); ``world_size``: processes in the job (default:
    ``torch.distributed``'s world where a process group exists, else 1); ``names``: the
    model's own path of each module by its graph node's name, for the message.

    Why: SyncBatchNorm promises statistics over every process's batch, and does it with
    its own collectives over ``torch.distributed``'s world. In crosscut's local runtime
    no process group exists, so it falls back to plain batch norm over each micro-batch
    or device share: measured, resnet18 with SyncBatchNorm on two replicas was 2.16 off
    eager in its outputs, with no error. Under torchrun its collectives would run over
    every rank of the job, which hold different stages (on CPUs torch refuses them; on
    GPUs they would pair one stage's layer with another's). Frozen ones (``.eval()``)
    use their running statistics and pass, unless ``frozen_too`` (torchrun's ranks: a
    later ``.train()`` would start their collectives, and no step checks again).
    """
    known = names or {}
    found = [
        (known.get(name.rsplit(".", 1)[-1], name), split)
        for module, split in stages
        for name, m in module.named_modules()
        if isinstance(m, nn.SyncBatchNorm) and (m.training or frozen_too)
    ]
    if not found:
        return
    if world_size is None:
        ready = torch.distributed.is_available() and torch.distributed.is_initialized()
        world_size = torch.distributed.get_world_size() if ready else 1
    if world_size > 1:
        names_ = sorted({name for name, _ in found})
        raise InputError(
            f"nn.SyncBatchNorm cannot train in a crosscut job of {world_size} processes: "
            "its own all-reduces would span ranks that hold different stages",
            value={"modules": names_[:8], "count": len(names_)},
            remedy=_SYNC_REMEDY.replace(", or compile locally", "; or run locally"),
        )
    split = sorted({name for name, s in found if s or microbatches > 1})
    if split:
        how = f"{microbatches} micro-batches" if microbatches > 1 else "replicas or a batch split"
        raise InputError(
            "nn.SyncBatchNorm normalises with the whole batch's statistics, and this plan "
            f"gives each one part of the batch ({how})",
            value={"modules": split[:8], "count": len(split), "microbatches": microbatches},
            remedy=_SYNC_REMEDY,
        )
