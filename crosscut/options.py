"""The options, one frozen object each: how to plan (PlanRequest) and how to run (RunOptions).

``crosscut.partition``, ``crosscut.compile`` (locally and under torchrun) and
the CLI all build a :class:`PlanRequest` from what the caller gave; the
planner (:mod:`crosscut.strategy`) reads only it. An option the caller leaves
at ``None`` is the planner's to choose ("auto"); a value is a constraint:
``microbatches=8`` fixes M, ``replicas=2`` fixes the data-parallel replicas.
Device groups inside a stage are searched by default where they can be priced
honestly: ``cross_shaped=None`` ("auto") lets the one-replica layout (of one
node, or spanning nodes: there every device holds a stage or a share) give a
stage a batch-split group (data parallelism inside the stage), each share
priced at its own batch (the model is traced at that many samples: on a K20c
AlexNet costs 1.7x as much per sample at 4 samples as at 32, and a share
priced linearly would favour groups by a margin the devices do not give).
``cross_shaped=True`` also allows the splits ``splits`` names (channel
splits, each shard priced at its own size by the analytic roofline) and
groups on graphs given traced; ``False`` forbids groups.

Run options (batch-norm mode, output merge, all-reduce overlap, the run's
recomputation and precision, the torchrun timeout) are :class:`RunOptions`:
they do not change the plan, only how a compiled module executes it.

Every front door takes the same two objects, or their fields as keywords
(``compile(model, devices, x, microbatches=4)`` is
``compile(model, devices, x, options=PlanRequest(microbatches=4))``):
:func:`plan_options` and :func:`split_options` turn keywords into the objects,
and :class:`PlanKeywords` / :class:`CompileKeywords` type them for a checker.
A new option is a field here (and in the keywords' type, which
``tests/test_api.py`` holds to the fields).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypedDict

from crosscut.errors import InputError
from crosscut.ir.graph import MODES
from crosscut.ir.problem import OBJECTIVES, RECOMPUTE
from crosscut.ir.schedule import AUTO_SCHEDULE, SCHEDULE_CHOICES
from crosscut.partitioner.recompute_choice import check_recompute, recompute_request
from crosscut.precision import check_precision

__all__ = [
    "COSTS",
    "MODES",
    "OPTIMIZERS",
    "PLAN_FIELDS",
    "RUN_FIELDS",
    "CompileKeywords",
    "PlanKeywords",
    "PlanRequest",
    "RunOptions",
    "check_options",
    "cross_options",
    "plan_options",
    "split_options",
]

OPTIMIZERS = ("sgd", "momentum", "rmsprop", "adam", "adamw")
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
    (:mod:`crosscut.strategy`); a number is kept as given. ``schedule``:
    ``"auto"`` prices every pipeline schedule and keeps the quickest that fits
    (:mod:`crosscut.ir.schedule` lists them); a name fixes it.

    ``mode``: ``"train"`` or ``"infer"``; ``objective``: ``"throughput"`` (the
    slowest stage) or ``"latency"`` (one batch end to end); ``cost``:
    ``"analytic"`` (device presets) or ``"profiled"`` (measured here);
    ``optimizer`` sizes the optimizer state; ``time_limit`` (seconds) bounds
    the whole search, tracing included; ``solver``: ``"cpsat"`` or a
    baseline's name; ``require_all_devices`` gives every device a stage.

    ``cross_shaped=True`` lets a stage run on a group of devices split by
    ``splits`` (``"batch"``: data parallel inside the stage; ``"channel"``:
    conv/linear split by output channels) with group widths from ``widths``
    (default: 2, 4, 8, ... up to the device count, and the count itself).
    ``None`` (the default, "auto"): batch-split groups only, in the layout of
    one replica on one node, their shares priced at their own batch
    (:meth:`stage_groups`); ``False``: no groups.
    ``colocate=False`` forbids the last stage from sharing the previous stage's
    device group (needed for plans run under torchrun: one stage per rank).

    ``recompute`` (training only): ``"auto"`` lets stages keep only their inputs
    and recompute their activations in backward where that makes a plan fit
    the memory caps or run faster; ``"never"``; ``"always"``. The plan records
    it per stage and ``crosscut.compile`` runs it
    (:func:`crosscut.partitioner.partition.partition_graph` says how).

    ``precision`` (``"fp32"``, ``"bf16"``, ``"fp16"``): ops are priced and run
    under autocast with that dtype (:mod:`crosscut.precision`); bf16 is refused
    on devices without it.
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
    cross_shaped: bool | None = None
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
        cross_options(bool(self.cross_shaped), self.widths, self.splits, 2)
        if self.recompute not in RECOMPUTE:
            raise InputError(
                f"recompute must be one of {list(RECOMPUTE)}",
                value=self.recompute,
                remedy="'auto' (recompute where it makes a plan fit or faster), 'never', 'always'",
            )

    def stage_groups(self, replicas: int) -> tuple[bool, tuple[str, ...]]:
        """Whether a layout of ``replicas`` replicas may put stages on device groups, and
        how they may split: only where one replica holds the cluster (one node or
        several); as asked, or for "auto" (``None``) batch splits, if ``splits`` allows
        them. The strategy also leaves groups out where the caller wants a stage on
        every device (:func:`crosscut.layouts.layout_groups`)."""
        if self.cross_shaped is None:
            return replicas == 1 and "batch" in self.splits, ("batch",)
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


@dataclass(frozen=True)
class RunOptions:
    """How a compiled module runs its plan: options that do not change the plan.

    ``bn_mode`` (``"micro"``, ``"step"``, ``"exact"``): batch norm over
    micro-batches (:mod:`crosscut.runtime.local.compiled`). ``output_merge``:
    how micro-batch outputs become one (:mod:`crosscut.runtime.output_merge`).
    ``recompute``: ``"auto"`` runs the plan's per-stage choice; ``"always"``/
    ``True`` and ``"never"``/``False`` plan and run every stage that way; one
    bool per stage overrides the run only. ``precision``: ``None`` runs the
    plan's. Under torchrun only: ``overlap_allreduce`` (the replicas'
    all-reduce during the last backward, by DDP's reducer) and ``timeout_s``
    (every collective's deadline; ``None``: ``CROSSCUT_TIMEOUT_S`` or 300 s).
    """

    bn_mode: str = "micro"
    output_merge: Any = None
    recompute: str | bool | tuple[bool, ...] = "auto"
    precision: str | None = None
    overlap_allreduce: bool = True
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        check_recompute(self.recompute)
        if isinstance(self.recompute, list):  # one bool per stage, kept hashable
            object.__setattr__(self, "recompute", tuple(self.recompute))
        if self.precision is not None:
            check_precision(self.precision)


class _SharedKeywords(TypedDict, total=False):
    mode: str
    objective: str
    schedule: str
    microbatches: int | None
    replicas: int | None
    time_limit: float
    optimizer: str
    cost: str
    overlap_comm: bool
    seed: int
    solver: str
    require_all_devices: bool
    cross_shaped: bool | None
    widths: Sequence[int] | None
    splits: Sequence[str]
    colocate: bool


class PlanKeywords(_SharedKeywords, total=False):
    """``crosscut.partition``'s keywords: the fields of :class:`PlanRequest`."""

    recompute: str
    precision: str


class CompileKeywords(_SharedKeywords, total=False):
    """``crosscut.compile``'s keywords: :class:`PlanRequest`'s and :class:`RunOptions`' fields.

    ``recompute`` and ``precision`` are run options that also set the plan's.
    """

    recompute: str | bool | Sequence[bool]
    precision: str | None
    bn_mode: str
    output_merge: Any
    overlap_allreduce: bool
    timeout_s: float | None


_INTERNAL = ("fill_devices",)  # set by the torchrun path, not by a caller
PLAN_FIELDS = tuple(f.name for f in fields(PlanRequest) if f.name not in _INTERNAL)
RUN_FIELDS = tuple(f.name for f in fields(RunOptions))


def _refuse_unknown(keywords: Mapping[str, Any], known: Sequence[str], where: str) -> None:
    for name in keywords:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise InputError(
                f"{where} has no option {name!r}",
                value=name,
                remedy=f"{hint}options: {', '.join(sorted(known))}",
            )


def plan_options(options: PlanRequest | None, keywords: Mapping[str, Any]) -> PlanRequest:
    """``options`` (default: every field's default) with ``keywords`` put over it, checked."""
    _refuse_unknown(keywords, PLAN_FIELDS, "crosscut.partition")
    base = options if options is not None else PlanRequest()
    return dataclasses.replace(base, **keywords) if keywords else base


def split_options(
    options: PlanRequest | None, run: RunOptions | None, keywords: Mapping[str, Any]
) -> tuple[PlanRequest, RunOptions]:
    """``compile``'s keywords as one planning request and one set of run options.

    The run's ``recompute`` and ``precision`` also set the plan's
    (``recompute_request``: a list of flags is not priced); ``bn_mode="exact"``
    (the whole batch's statistics) fixes micro-batches and replicas at 1 and
    leaves out device groups (whose shares normalise apart) unless given.
    """
    _refuse_unknown(keywords, sorted({*PLAN_FIELDS, *RUN_FIELDS}), "crosscut.compile")
    base = options if options is not None else PlanRequest()
    run_kw = {k: v for k, v in keywords.items() if k in RUN_FIELDS}
    the_run = dataclasses.replace(run if run is not None else RunOptions(), **run_kw)
    plan_kw = {k: v for k, v in keywords.items() if k in PLAN_FIELDS}
    asked = keywords.get("recompute", base.recompute)
    if "recompute" not in keywords and run is not None and run.recompute != "auto":
        asked = run.recompute
    plan_kw["recompute"] = recompute_request(asked, the_run.bn_mode)
    plan_kw["precision"] = the_run.precision or base.precision
    if the_run.bn_mode == "exact":
        for name in ("microbatches", "replicas"):
            if plan_kw.get(name, getattr(base, name)) is None:
                plan_kw[name] = 1
        if plan_kw.get("cross_shaped", base.cross_shaped) is None:
            plan_kw["cross_shaped"] = False
    return dataclasses.replace(base, **plan_kw), the_run
