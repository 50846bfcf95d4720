"""Planning options: one frozen object, checked once, read by every front door.

``crosscut.partition``, ``crosscut.compile`` (locally and under torchrun) and
the CLI all build a :class:`PlanRequest` from what the caller gave; the
planner (:mod:`crosscut.strategy`) reads only it. An option the caller leaves
at ``None`` is the planner's to choose ("auto"); a value is a constraint:
``microbatches=8`` fixes M, ``replicas=2`` fixes the data-parallel replicas.
Device groups inside a stage (``cross_shaped=True``) are asked for, not
searched by default: a group's share of a micro-batch is priced at the whole
micro-batch's per-sample rate (``partitioner/group_costs.py``), while a
smaller batch runs less efficiently (on a K20c AlexNet's step costs 1.7x as
much per sample at 4 samples as at 32), so the planner would favour groups
by a margin the devices do not give.

Run options (batch-norm mode, output merge, all-reduce overlap) are not here:
they do not change the plan, only how a compiled module executes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from crosscut.errors import InputError
from crosscut.ir.graph import MODES
from crosscut.ir.problem import OBJECTIVES, RECOMPUTE
from crosscut.ir.schedule import AUTO_SCHEDULE, SCHEDULE_CHOICES
from crosscut.precision import check_precision

__all__ = ["COSTS", "MODES", "OPTIMIZERS", "PlanRequest", "check_options", "cross_options"]

OPTIMIZERS = ("sgd", "momentum", "adam")
COSTS = ("analytic", "profiled")


def _positive_or_auto(label: str, value: Any, example: str) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise InputError(
            f"{label} must be a positive integer",
            value=value,
            remedy=f"{example} (None: the planner's choice)",
        )


def check_options(
    *,
    mode: str,
    objective: str,
    schedule: str,
    microbatches: int | None,
    time_limit: float,
    optimizer: str = "sgd",
    cost: str = "analytic",
    replicas: int | None = None,
) -> None:
    for label, value, allowed in (
        ("mode", mode, MODES),
        ("objective", objective, OBJECTIVES),
        ("schedule", schedule, SCHEDULE_CHOICES),
        ("optimizer", optimizer, OPTIMIZERS),
        ("cost", cost, COSTS),
    ):
        if value not in allowed:
            raise InputError(f"{label} must be one of {list(allowed)}", value=value)
    _positive_or_auto(
        "microbatches",
        microbatches,
        "use 1 for no pipelining, e.g. 4 or 8",
    )
    _positive_or_auto("replicas", replicas, "e.g. replicas=2 (two data-parallel copies)")
    if not isinstance(time_limit, (int, float)) or not time_limit > 0:
        raise InputError(
            "time_limit must be a positive number of seconds",
            value=time_limit,
            remedy="e.g. time_limit=10",
        )


@dataclass(frozen=True)
class PlanRequest:
    """Every partitioning option, normalised and checked once, at construction.

    The front door's request: :func:`crosscut.partition` builds one from its
    keywords, ``crosscut.compile`` builds one before it decides between the
    local and the torchrun path (so every rank checks the same options the
    same way), and the planner consumes it without checking again.

    ``microbatches=None`` and ``replicas=None`` leave them to the planner,
    which prices every (replicas × stages × micro-batches) strategy that fits
    and keeps the one with the shortest predicted step
    (:mod:`crosscut.strategy`); a number is kept as given.
    """

    mode: str = "train"
    objective: str = "throughput"
    schedule: str = AUTO_SCHEDULE
    microbatches: int | None = None
    time_limit: float = 10.0
    optimizer: str = "sgd"
    cost: str = "analytic"
    overlap_comm: bool = False
    seed: int = 0
    solver: str = "cpsat"
    require_all_devices: bool = False
    cross_shaped: bool = False
    widths: tuple[int, ...] | None = None
    splits: tuple[str, ...] = ("batch", "channel")
    colocate: bool = True
    recompute: str = "auto"
    precision: str = "fp32"
    replicas: int | None = None
    # every device runs a stage of some replica (torchrun: one rank per device), with the
    # replicas still searched; require_all_devices on one node also fixes one replica
    fill_devices: bool = False

    def __post_init__(self) -> None:
        check_precision(self.precision)
        check_options(
            mode=self.mode,
            objective=self.objective,
            schedule=self.schedule,
            microbatches=self.microbatches,
            time_limit=self.time_limit,
            optimizer=self.optimizer,
            cost=self.cost,
            replicas=self.replicas,
        )
        # widths and splits normalised to tuples, their rules checked (device count: later)
        if self.widths is not None:
            object.__setattr__(self, "widths", tuple(self.widths))
        object.__setattr__(self, "splits", tuple(self.splits))
        cross_options(self.cross_shaped, self.widths, self.splits, 2)
        if self.recompute not in RECOMPUTE:
            raise InputError(
                f"recompute must be one of {list(RECOMPUTE)}",
                value=self.recompute,
                remedy="'auto' (recompute where it makes a plan fit or faster), 'never', 'always'",
            )

    def stage_groups(self, replicas: int) -> tuple[bool, tuple[str, ...]]:
        """Whether a layout of ``replicas`` replicas may put stages on device groups, and
        how they may split: as asked, and only where one replica holds the cluster."""
        return self.cross_shaped and replicas == 1, self.splits

    def partition_options(self) -> dict[str, Any]:
        """The keywords of :func:`crosscut.partition` this request stands for."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def cross_options(
    cross_shaped: bool, widths: Sequence[int] | None, splits: Sequence[str], devices: int
) -> tuple[list[int], list[str]]:
    """PlanOptions.widths/splits for the cross-shaped switch, checked up front."""
    if not cross_shaped:
        return [1], []
    bad = [x for x in splits if x not in ("batch", "channel")]
    if bad or not splits:
        raise InputError(
            "splits must name 'batch' and/or 'channel'",
            value=list(splits),
            remedy="e.g. splits=('batch', 'channel')",
        )
    if widths is None:  # 1, 2, 4, ... up to the device count, and the count itself
        widths = sorted({1, devices, *(1 << i for i in range(1, devices.bit_length()))})
    if any(not isinstance(w, int) or w < 1 for w in widths):
        raise InputError("widths must be positive integers", value=list(widths), remedy="(1, 2, 4)")
    return sorted({1, *widths}), sorted(set(splits))
