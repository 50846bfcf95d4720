"""The distributed executor: one rank per pipeline stage (or per device of its group).

Layout (Mariana's worker groups × workers): ``R`` replicas of an ``S``-stage
pipeline, ``rank = replica × S + stage`` — or, for a cross-shaped plan,
``rank = replica × W + offset[stage] + member`` with ``W`` the plan's devices
(:class:`~crosscut.runtime.dist.world.RankLayout`); under an interleaved
schedule a rank runs ``V`` stages (:mod:`crosscut.runtime.dist.rank_stages`).
Each rank builds the same :class:`~crosscut.ir.program.StagedProgram` from the
same plan, keeps only its own stage modules and runs its row of the schedule:

* ``F``: receive the stage's inputs (each from the stage that produces it —
  skip connections come straight from their producer, never relayed), run the
  stage, send every exported value to each stage that reads it; the last stage
  also computes ``loss_fn(output, targets) / M``.
* ``B``: receive the gradient of each exported value from each consumer, sum
  them, backpropagate through the stage's saved graph, send the gradient of
  each received input back to its producer (``W``: the weight gradients later).

What each action posts, sends and rebuilds is :mod:`crosscut.runtime.dist.stage_io`;
which plans ranks accept, :mod:`crosscut.runtime.dist.plan_rules`; the
once-per-step batch-norm commit, :mod:`crosscut.runtime.dist.bn_commit`.

Each rank's gradients are averaged over its ``R`` replicas on a per-position
process group: by DDP's reducer during the stage's last backward of the step
(:mod:`crosscut.runtime.dist.overlap`), or, with ``overlap_allreduce=False``, on
cross-shaped stages and interleaved ranks, by one flattened all-reduce after
the schedule.

**Cross-shaped stages** (a stage on a device group split by channel or by
batch) get one rank per device of the group. Member 0, the leader, is the
stage for the rest of the pipeline (routes and tags between stages do not
change); the other members run the same schedule row and talk only to their
group (:mod:`crosscut.runtime.dist.group_members` cuts each member's share,
:mod:`crosscut.runtime.dist.group_comm` carries the messages). After the
schedule a batch-split group sums its members' parameter gradients and copies
the leader's buffers to the others; a channel-split member owns its shards.

**Shapes and tags are static** (the same micro-batch trace on both ends; the
global batch must be exactly ``R × M × micro-batch``). **Every wait has a
timeout** (``timeout_s``): a :class:`~crosscut.errors.DistributedError` names
the lost rank and what this rank waited for (:mod:`crosscut.runtime.dist.p2p`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from crosscut.codegen.split import build_stages
from crosscut.ir.program import INPUT, StagedProgram
from crosscut.ir.schedule import (
    forward_only,
    make_schedule,
    placement,
    splits_backward,
    validate_schedule,
    virtual_stages,
)
from crosscut.options import RunOptions
from crosscut.precision import autocast
from crosscut.runtime.batch_split import BatchSplitStage
from crosscut.runtime.batchnorm import install_step_batchnorm
from crosscut.runtime.contract import bind_inputs, inference_only, signature_of
from crosscut.runtime.dist.bn_commit import StepCommit
from crosscut.runtime.dist.group_comm import GroupLink
from crosscut.runtime.dist.group_members import build_member
from crosscut.runtime.dist.group_role import GroupRole
from crosscut.runtime.dist.overlap import ReplicaReducer
from crosscut.runtime.dist.p2p import Messenger, build_routes
from crosscut.runtime.dist.plan_rules import (
    check_bn_mode,
    check_mode,
    check_one_stage_per_device,
    check_recompute,
    check_state,
    group_widths,
    recompute_for,
)
from crosscut.runtime.dist.rank_stages import (
    RankStages,
    check_same_cut,
    stages_module,
)
from crosscut.runtime.dist.stage_io import StageIO
from crosscut.runtime.dist.state_files import RankState
from crosscut.runtime.dist.wire_dtypes import WireDtypes
from crosscut.runtime.dist.world import (
    RankLayout,
    allreduce_mean,
    broadcast_from_first,
    check_initialised,
    check_same_plan,
    check_world,
    make_device_groups,
    make_position_groups,
    plan_hash,
)
from crosscut.runtime.engine import RunStage, StageEngine
from crosscut.runtime.module_flags import KeepsModuleFlags
from crosscut.runtime.output_merge import OutputMerge, check_outputs
from crosscut.runtime.recomputing import recompute_flags, recomputing, written_inputs
from crosscut.runtime.rng import RandomScope
from crosscut.runtime.thread_state import ThreadState

__all__ = [
    "DistributedPipeline",
    "check_bn_mode",
    "check_one_stage_per_device",
    "group_widths",
    "plan_hash",
]


class DistributedPipeline(RankState, KeepsModuleFlags):  # type: ignore[misc]
    """This rank's stage of a pipelined, possibly replicated, model.

    ``parameters()`` are this rank's parameters only (build the optimizer
    from them on every rank); state under the original keys comes from
    :class:`~crosscut.runtime.dist.state_files.RankState`. Call
    :meth:`train_step` with the same global batch on every rank (ranks whose
    stage reads no model input may pass ``None`` as inputs, and all but the
    last stage may pass ``None`` as targets).
    """

    def __init__(
        self,
        model: nn.Module,
        gm: fx.GraphModule,
        plan: Any,
        *,
        replicas: int = 1,
        schedule: str | None = None,
        microbatches: int | None = None,
        device: torch.device | str | None = None,
        run: RunOptions | None = None,
    ) -> None:
        super().__init__()
        run = run if run is not None else RunOptions()
        bn_mode = run.bn_mode
        check_bn_mode(bn_mode)
        check_one_stage_per_device(plan)
        check_initialised()
        self.mode_lock: tuple[bool, list[str]] | None = None  # plan_rules.check_mode
        self.bn_mode = bn_mode
        self.plan = plan
        self.num_stages = int(plan.num_stages)
        self.replicas = int(replicas)
        self.microbatches = int(microbatches or plan.options.microbatches)
        self.schedule_name = schedule or plan.options.schedule
        self.virtual = virtual_stages(str(plan.options.schedule))  # stages per rank
        check_same_cut(self.schedule_name, str(plan.options.schedule))
        self.timeout_s = float(run.timeout_s if run.timeout_s is not None else 300.0)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._take_role()
        self._msg = Messenger(self.rank, self.timeout_s, self._whoami())
        program = self._build(model, gm)
        # the last stage's merge of micro-batch outputs in forward (runtime/output_merge.py)
        rules = check_outputs(gm, run.output_merge, self.microbatches)
        check_state(model, gm, self.plan, self.replicas, self.microbatches, bn_mode)  # plan_rules
        self._merge = OutputMerge(self._template, rules)
        # the dtypes values cross ranks in under the caller's autocast (runtime/dist/wire_dtypes.py)
        self._wire = WireDtypes(gm, self.device, any(w > 1 for w in self.rank_layout.widths))
        self._make_groups()
        self._group: GroupRole | None = None
        # one micro-batch's forward/backward (runtime/engine.py); recomputing: recomputing.py
        self._here = self._stages_here(
            program, recompute_for(model, gm, plan, run.recompute), bn_mode
        )
        self._io = self._here.ios[self.stage_index]
        if self.width > 1:
            self._join_group(gm, program)
        self.stage = self.stage.to(self.device)
        # plan-independent draws (runtime/rng.py), hooked on each stage module this rank runs
        mods = [self.stage] if self.virtual == 1 else list(self._stage_modules.values())
        self._rng = RandomScope(mods)
        self.keep_module_flags(mods, model.training)  # a frozen batch norm: module_flags.py
        self.train(model.training)  # the model's mode, whatever mode the graph was traced in
        if bn_mode == "step":
            install_step_batchnorm(self.stage)
        if self._group is not None:
            self._group.start_identical(self.stage)
        self._start_replicas(run.overlap_allreduce)

    # ---- start-up ---------------------------------------------------------------------
    def _stages_here(self, program: StagedProgram, recompute: Any, bn_mode: str) -> RankStages:
        """The stages this rank runs, each with its messages and engine; a lone stage is
        called through _call_stage (a group leader's members join there)."""
        flags = recompute_flags(recompute, self.num_stages, bn_mode)
        for k in self.my_stages:
            check_recompute(flags[k], k, self.width, self.split)
        mods = {k: self.stage for k in self.my_stages} if self.virtual == 1 else self._stage_modules

        def replay(k: int) -> RunStage:
            return recomputing(mods[k], lambda: self._rng, written_inputs(program.stages[k]))

        def plain(k: int) -> RunStage:
            return self._call_stage if self.virtual == 1 else StageEngine.plain(mods[k])

        io = StageIO(self.routes, self._msg, self.stage_index, self.rank_of, self.device,
                     self.micro_batch, self.replica, self.replicas, self.microbatches)  # fmt: skip
        return RankStages.build(program, io, self.my_stages, flags, plain, replay)

    def _take_role(self) -> None:
        """This rank's place in the layout; every rank checks that all run the same plan."""
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.plan_hash = plan_hash(self.plan)
        widths = group_widths(self.plan)
        # ranks are workers: an interleaved plan's W first stages' devices (plan_rules.py)
        self.workers = len(widths) // self.virtual
        widths = widths[: self.workers]
        check_world(self.world_size, widths, self.replicas)
        self.rank_layout = RankLayout(tuple(widths), self.replicas)
        self.replica, self.stage_index, self.member = self.rank_layout.role(self.rank)
        # the stages this rank runs: its own, or under an interleaved schedule its V (one
        # placement for every schedule of the plan's cut: rank_stages.check_same_cut)
        self._placement = placement(str(self.plan.options.schedule), self.num_stages)
        self.my_stages = [k for k, w in enumerate(self._placement) if w == self.stage_index]
        self.position = self.rank % self.rank_layout.per_replica
        self.width = widths[self.stage_index]
        self.split = self.plan.stages[self.stage_index].split if self.width > 1 else "none"
        mine = {"plan": self.plan_hash, "stages": self.num_stages, "group_widths": widths}
        mine |= {"replicas": self.replicas, "microbatches": self.microbatches}
        check_same_plan(self.rank, self.world_size, {**mine, "schedule": self.schedule_name})

    def _whoami(self) -> str:
        """This rank as its errors name it: stage, replica and place in its group."""
        stages = f"stage{'s' if self.virtual > 1 else ''} {', '.join(map(str, self.my_stages))}"
        me = f"rank {self.rank} ({stages}, replica {self.replica}"
        if self.width > 1:
            me += f", member {self.member} of its {self.width}-device {self.split}-split group"
        return me + ")"

    def _make_groups(self) -> None:
        """Every rank creates every process group, in the same order (new_group is collective)."""
        self._position_groups = make_position_groups(self.rank_layout, self.timeout_s)
        self._device_groups = make_device_groups(self.rank_layout, self.timeout_s)
        self._bn = StepCommit.for_rank(
            self.bn_mode,
            self._msg,
            layout=self.rank_layout,
            rank=self.rank,
            split=self.split,
            device_groups=self._device_groups,
            position_groups=self._position_groups,
        )

    def _join_group(self, gm: fx.GraphModule, program: StagedProgram) -> None:
        """A width-split stage: this member's share, and its role in its group."""
        link = GroupLink(
            self._msg,
            self._device_groups[(self.replica, self.stage_index)],
            self.rank_layout.group_ranks(self.replica, self.stage_index),
            self.stage_index,
            self.member,
            self.device,
        )
        self._group = GroupRole(link, self.split)
        self._keep_member(build_member(gm, program.stages[self.stage_index], link))

    def _start_replicas(self, overlap_allreduce: bool) -> None:
        """Replicas start from replica 0's weights, as with DDP; DDP's reducer when wanted."""
        self._reducer: ReplicaReducer | None = None
        if self.replicas > 1:
            tensors = [t.data for t in [*self.stage.parameters(), *self.stage.buffers()]]
            ranks = self.rank_layout.position_ranks(self.position)
            group = self._position_groups[self.position]
            broadcast_from_first(tensors, group, ranks, self._msg)
            # DDP's reducer during the stage's last backward (runtime/dist/overlap.py); a
            # cross-shaped group sums its shares first, an interleaved rank (several stages,
            # several last backwards) all of them: after the schedule
            alone = self._group is None and self.virtual == 1
            if overlap_allreduce and alone and ReplicaReducer.wanted(self.stage):
                self._reducer = ReplicaReducer(self.stage, group, ranks, self._msg)

    def _build(self, model: nn.Module, gm: fx.GraphModule) -> StagedProgram:
        s_count = self.num_stages
        # only this rank's stage is width-split (it is the only one kept); members share a
        # placeholder device: each keeps its own shards and talks to the others by message
        groups: list[tuple[list[str], str]] = [(["cpu"], "none")] * s_count
        groups[self.stage_index] = (["cpu"] * self.width, self.split)
        program = build_stages(
            gm,
            dict(self.plan.assignment),
            ["cpu"] * s_count,
            groups=groups if self.width > 1 else None,
            batch_stage=BatchSplitStage,
        )
        self._stage_modules = {k: program.stages[k].module for k in self.my_stages}
        self.stage, self._param_keys = stages_module(program, self.my_stages)
        self._inputs = [list(st.inputs) for st in program.stages]
        self._shard_sources = {
            k: v for k, v in program.shard_sources.items() if v[0] == self.stage_index
        }
        self._placeholders = list(program.placeholders)
        self._signature = signature_of(gm)
        self._template = program.output_template
        self._output_sources = dict(program.output_sources)
        self.key_sources = dict(program.key_sources)
        self.original_keys = list(model.state_dict().keys())
        self._orphans = {
            k: v.detach().to("cpu", copy=True)
            for k, v in model.state_dict().items()
            if k not in self.key_sources and k not in program.shard_sources
        }
        self.routes = build_routes(gm, self._inputs, self._output_sources, program.aliases)
        self.edges = self.routes.edges
        nodes = {n.name: n for n in gm.graph.nodes}
        self.micro_batch = (
            int(nodes[self._placeholders[0]].meta["val"].shape[0])
            if (self._placeholders and "val" in nodes[self._placeholders[0]].meta)
            else 0
        )
        # one row per rank (worker): its stage's, or its stages' interleaved
        train = make_schedule(self.schedule_name, s_count, self.microbatches)
        validate_schedule(train, s_count, self.microbatches, True, self._placement)
        infer = forward_only(self.schedule_name, s_count, self.microbatches)
        self._schedules = {"train": train, "infer": infer}
        return program

    def _keep_member(self, member: nn.Module) -> None:
        """Hold only this member's share of the width-split stage (module docstring)."""
        held = {
            *dict(member.named_parameters(remove_duplicate=False)),
            *dict(member.named_buffers(remove_duplicate=False)),
        }
        self._param_keys = {k: v for k, v in self._param_keys.items() if k in held}
        self.stage = member

    def use_schedule(self, name: str) -> None:
        """Switch the training schedule (every rank must switch alike, between steps)."""
        check_same_cut(name, str(self.plan.options.schedule))
        rows = make_schedule(name, self.num_stages, self.microbatches)
        validate_schedule(rows, self.num_stages, self.microbatches, True, self._placement)
        self.schedule_name = name
        self._schedules["train"] = rows

    # ---- helpers --------------------------------------------------------------------
    def rank_of(self, stage: int) -> int:
        """The global rank running ``stage`` (its group's leader) in this rank's replica."""
        return self.rank_layout.rank(self.replica, self._placement[stage])

    # ---- execution ------------------------------------------------------------------
    def _run(
        self,
        kind: str,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    ) -> tuple[list[torch.Tensor], list[Any]]:
        check_mode(self.mode_lock, self.training)
        # this thread runs the schedule: the caller's autocast holds; the messages follow it
        self._here.set_dtypes(self._wire.for_state(ThreadState.capture([self.device.type])))
        if self._group is not None and self.member > 0:
            self._group.follow(self.stage, self._schedules[kind][self.stage_index], kind == "train")
            return [], []
        s, last = self.stage_index, self.num_stages - 1  # s: this rank's row (worker)
        has_last = last in self.my_stages
        reads_input = any(src == INPUT for k in self.my_stages for _, src in self._inputs[k]) or (
            has_last and any(src == INPUT for src in self._output_sources.values())
        )
        training = kind == "train"  # the loss needs targets and loss_fn on the last's rank
        needs = (reads_input, training and has_last)
        mbs, tgts = self._here.batches(inputs, targets, needs, self.rank, loss_fn is not None)
        losses: list[torch.Tensor] = []
        results: list[Any] = []
        where = self._placeholders.index

        def model_input(m: int) -> Callable[[str], Any]:
            return lambda name: mbs[m][where(name)] if mbs is not None else None

        row = self._schedules[kind][s]
        # the last backward reduces the replicas' gradients as it runs; a split backward
        # reduces them after the schedule (its weight gradients come in many W calls)
        self._here.set_split(splits_backward(self._schedules[kind]))
        last_b = max((i for i, a in enumerate(row) if a.kind == "B"), default=-1)
        try:
            for i, a in enumerate(self._here.start(row)):
                engine, io = self._here.engines[a.stage], self._here.ios[a.stage]
                if a.kind == "W":
                    engine.weight(a)
                elif a.kind == "B":
                    armed = self._reducer if i == last_b and not engine.split else None
                    engine.backward(a, io, armed.backward if armed is not None else None)
                else:
                    m = a.microbatch
                    out, loss = engine.forward(
                        a,
                        io,
                        model_input(m),
                        training=training,
                        target=tgts[m][0] if tgts is not None else None,
                        loss_fn=loss_fn,
                    )
                    if loss is not None:
                        losses.append(loss)
                    if a.stage == last and not training:
                        results.append(out)
                self._msg.drain()
        finally:
            self._here.clear()
        self._msg.flush()
        return losses, results

    def _call_stage(
        self, ins: list[Any], m: int, training: bool
    ) -> tuple[list[Any], torch.Tensor | None]:
        """Run this rank's stage; a group leader's members join through the token chain."""
        if self._group is not None:
            results, token = self._group.lead(self.stage, ins, m, training)
            return list(results), token
        return list(self.stage(*ins)), None

    def _allreduce_grads(self) -> None:
        """Sum a batch group's shares' gradients, then average the replicas'."""
        if self._group is not None:
            self._group.reduce_grads(self.stage)
        split = splits_backward(self._schedules["train"])
        if self.replicas > 1 and (self._reducer is None or split):  # else in the last backward
            ranks = self.rank_layout.position_ranks(self.position)
            # the same parameters on every replica (one stage graph); those backward never
            # reached keep grad None, as in eager training and under DDP
            params = [p for p in self.stage.parameters() if p.grad is not None]
            allreduce_mean(params, self._position_groups[self.position], ranks, self._msg)

    def _autocast(self) -> AbstractContextManager[Any]:
        """The plan's precision (crosscut/precision.py) on this rank's device type."""
        return autocast(getattr(self.plan.options, "precision", "fp32"), self.device.type)

    def train_step(
        self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]
    ) -> torch.Tensor | None:
        """One pipelined forward+backward over the global batch; gradients land in ``.grad``.

        Returns the full-batch mean loss (averaged over micro-batches and replicas) on
        last-stage ranks (a cross-shaped last stage's leader) and ``None`` on the others.
        ``loss_fn`` must average over its batch (``reduction="mean"``); each micro-batch's
        loss is divided by ``M`` and the replicas' gradients averaged: the gradients of the
        whole batch's mean loss, accumulated into ``.grad`` as eager's ``backward()``.
        """
        self._rng.start(enabled=True)
        if self._reducer is not None:  # rebuilt after a dtype change (runtime/dist/overlap.py)
            self._reducer = self._reducer.current()
        fresh = self._group.fresh_grads(self.stage) if self._group is not None else nullcontext()
        with fresh, self._autocast():  # a batch group sums this step's gradients only
            losses, _ = self._bn.run(
                self.stage, lambda: self._run("train", inputs, targets, loss_fn)
            )
            self._allreduce_grads()
        if self._group is not None:
            self._group.sync_buffers(self.stage)
        if self.num_stages - 1 not in self.my_stages or self.member > 0:
            return None
        total = torch.stack([x.detach() for x in losses]).sum()
        if self.replicas > 1:
            group = self._position_groups[self.position]
            ranks = self.rank_layout.position_ranks(self.position)
            work = dist.all_reduce(total, group=group, async_op=True)
            self._msg.wait_collective(work, ranks, "the loss all-reduce")
            total = total / self.replicas
        return total

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Inference through the pipeline; the output on last-stage ranks, else None.

        Under grad mode the output requires grad as eager's would, but its
        backward is refused by name: train with :meth:`train_step`
        (:func:`~crosscut.runtime.contract.inference_only`).

        Each replica computes its shard; the output is this replica's shard, its
        micro-batches merged by the ``output_merge`` rules (a ``"sum"`` is this
        replica's sum). Keywords bind to the model's forward as on the model.
        """
        inputs = bind_inputs(self._signature, inputs, kwargs)
        with torch.no_grad(), self._autocast():
            self._rng.start(enabled=True)
            _, results = self._bn.run(self.stage, lambda: self._run("infer", inputs, None, None))
        if self._group is not None:
            self._group.sync_buffers(self.stage)
        if self.num_stages - 1 not in self.my_stages or self.member > 0:
            return None
        merged = self._merge.merge(results, self.device, [self.micro_batch] * len(results))
        return inference_only(merged)  # a backward through it is refused by name (contract.py)

    # ---- description (state under the original keys: checkpoint.RankState) -----------
    def layout(self) -> dict[str, Any]:
        """Plain-data description of this rank: for logs and for checkpoint manifests."""
        plain = ("rank", "replica", "member", "width", "split", "position", "replicas")
        return {n: getattr(self, n) for n in (*plain, "world_size", "plan_hash")} | {
            "stage": self.stage_index,
            "stages_here": list(self.my_stages),
            "group_widths": list(self.rank_layout.widths),
            "stages": self.num_stages,
            "edges": [(e.value, e.src, e.dst) for e in self.edges],
        }
