"""The replicas' gradient all-reduce during a stage's last backward: DDP's own reducer.

Each stage module (under torchrun, with replicas, outside a cross-shaped
group) is wrapped in ``torch.nn.parallel.DistributedDataParallel`` over its
replica process group (the ranks holding the same stage in every replica),
the way ``torch.distributed.pipelining`` does it
(``PipelineStage.backward_maybe_with_nosync``): every backward of the step
but the stage's last accumulates into ``.grad`` with the reducer idle, and
right before the last one ``reducer.prepare_for_backward`` is called on that
backward's roots. DDP then does what it does in data-parallel training:
gradients in buckets (25 MB, the first 1 MB; reverse parameter order), each
bucket's all-reduce started asynchronously as its last gradient lands
(holding the sum over the step's micro-batches), waited for and copied back
into ``.grad`` at the end of that backward.

Details (``tests/test_overlap.py`` checks when buckets start, the unused
parameters, the gradients against eager training, the dtype rebuild and a
replica lost mid-reduction):

* **Forwards do not go through DDP.** The stage runs as the bare module; DDP
  only contributes its reducer (hooks on the parameters' gradient
  accumulators, which do nothing until armed). Under ``no_sync`` — what
  pipelining wraps its forwards in — DDP's forward would arm nothing either,
  but with ``find_unused_parameters`` it copies every output (its
  ``_DDPSink``), one more activation per micro-batch in flight.
* **The roots are the backward's own** (the loss, and each output a reader
  sent a gradient for), not every output of the stage: with
  ``find_unused_parameters=True`` DDP marks what those roots do not reach as
  unused, so a parameter that gets no gradient (an output no loss reads, a
  parameter only compared with) neither hangs the reduction nor is given one:
  it stays ``None``, as in eager training. Pipelining passes every output;
  with one that no loss reads, torch 2.14's reducer then starts no bucket at
  all and the step goes unreduced without an error (tried in one process).
  DDP prints once per process that it found nothing unused when every
  parameter is used; its graph traversal runs once per step here.
* **Averaging:** DDP divides each bucket by the group size (the replicas)
  and sums; every micro-batch loss is already divided by ``M`` (the engine),
  so the gradients are those of the global batch's mean loss, as eager.
* **No broadcast at start:** replicas are copied from replica 0 by the
  executor (parameters and buffers) before this wrapper exists, so DDP's
  own start-up broadcast is switched off where torch has the switch
  (``init_sync``; older torch broadcasts the same weights again), and it
  never touches buffers (``bn_mode`` handles batch norm).
* **A dtype change** (``.to(torch.float64)``, even there and back) gives the
  parameters new gradient accumulators that DDP never hooked: the next
  ``train_step`` wraps the stage again (:meth:`ReplicaReducer.current`).
* **Timeouts:** the group is made with ``timeout_s``; a replica lost during
  the reduction fails that backward with a :class:`~crosscut.errors.DistributedError`
  naming the group.

The reduction's tail (the bucket launched last) is waited for inside that
backward, before its input gradients go upstream: DDP's finalize runs at the
end of the autograd pass. ``overlap_allreduce=False`` keeps the executor's
one flattened all-reduce after the schedule instead.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.nn.parallel import DistributedDataParallel

from crosscut.runtime.dist.p2p import Messenger, describe_failure

__all__ = ["BUCKET_CAP_MB", "ReplicaReducer"]

BUCKET_CAP_MB: float | None = None  # DDP's default: 25 MB buckets, the first 1 MB (tests: smaller)


def _ddp_options() -> dict[str, Any]:
    """No start-up broadcast and no buffer sync, in the installed torch's words."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    out: dict[str, Any] = {}
    if "init_sync" in params:
        out["init_sync"] = False
    if "forward_sync_buffers" in params:  # newer torch's name for broadcast_buffers
        out["forward_sync_buffers"] = False
    else:
        out["broadcast_buffers"] = False
    return out


def _accumulators(stage: nn.Module) -> list[Any]:
    """The autograd nodes the parameters' gradients accumulate in (DDP hooks these)."""
    return [get_gradient_edge(p).node for p in stage.parameters() if p.requires_grad]


class ReplicaReducer:
    """``stage`` under DDP over ``group``: armed for one backward per step (module docstring).

    The wrapper stays inside the executor: the stage module keeps its own
    parameter names, and nothing here is an ``nn.Module`` attribute of it.
    """

    def __init__(
        self,
        stage: nn.Module,
        group: Any,
        ranks: list[int],
        msg: Messenger,
        bucket_cap_mb: float | None = None,
    ) -> None:
        self.group, self.ranks, self.msg = group, ranks, msg
        self.bucket_cap_mb = BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        options = _ddp_options()
        if self.bucket_cap_mb is not None:  # else DDP's own default
            options["bucket_cap_mb"] = self.bucket_cap_mb
        self.ddp = DistributedDataParallel(
            stage, process_group=group, find_unused_parameters=True, **options
        )
        self._hooked = _accumulators(stage)

    def current(self) -> ReplicaReducer:
        """This reducer, or a new one (collective) if a dtype change replaced its hooks.

        ``.to(dtype)`` (even there and back) gives each parameter new data
        and autograd a new gradient accumulator, so the hooks DDP put on the
        old ones would never fire and the step would go unreduced. Every
        replica changes alike, so the group's ranks rebuild at the same step.
        """
        stage: nn.Module = self.ddp.module
        now = _accumulators(stage)
        if len(now) == len(self._hooked) and all(a is b for a, b in zip(now, self._hooked)):
            return self
        return ReplicaReducer(stage, self.group, self.ranks, self.msg, self.bucket_cap_mb)

    @staticmethod
    def wanted(stage: nn.Module) -> bool:
        """DDP refuses a module without a trainable parameter: nothing to reduce there."""
        return any(p.requires_grad for p in stage.parameters())

    def backward(self, roots: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        """The step's last backward on this stage, its all-reduce running during it."""
        self.ddp.reducer.prepare_for_backward(roots)
        try:
            torch.autograd.backward(roots, grads)
        except RuntimeError as exc:
            if describe_failure(exc, self.msg.timeout_s).startswith("failed"):
                raise  # not the collective: the backward's own error
            others = [r for r in self.ranks if r != self.msg.rank]
            what = f"the replicas' gradient all-reduce (DDP, group ranks {self.ranks})"
            raise self.msg.lost(others[0] if len(others) == 1 else None, what, exc) from exc
