"""The distributed executor: one pipeline stage per rank, torch.distributed P2P between them.

Layout (Mariana's worker groups × workers): ``R`` replicas of an ``S``-stage
pipeline, ``rank = replica * S + stage``. Each rank builds the same
:class:`~crosscut.codegen.split.StagedProgram` from the same plan, keeps only
its own stage module and runs its row of the GPipe or 1F1B schedule:

* ``F``: receive the stage's inputs (each from the stage that produces it —
  skip connections come straight from their producer, never relayed), run the
  stage, send every exported value to each stage that reads it; the last stage
  also computes ``loss_fn(output, targets) / M``.
* ``B``: receive the gradient of each exported value from each consumer, sum
  them, backpropagate through the stage's saved graph, send the gradient of
  each received input back to its producer.

After the schedule, each stage's gradients are averaged over its ``R``
replicas with one flattened all-reduce on a per-stage process group.

**Shapes are static, taken from the trace.** The graph is traced at the
micro-batch size, so every fx node carries its output's shape and dtype; both
ends of a transfer read them from the same graph, so no shapes travel at
run time and a receiver posts its buffer before the sender has finished. The
price: the global batch must be exactly ``R × M × micro-batch`` of the plan
(checked, with a remedy). Non-tensor values (``x.size(0)``) are constants of
that trace and are never sent.

**Tags** are computed from static data (edge index, micro-batch, tensor
leaf, direction), so messages match regardless of posting order. **Every
wait has a timeout** (``timeout_s``) and a failure becomes a
:class:`~crosscut.errors.DistributedError` naming the lost rank and the value,
micro-batch and action this rank was waiting for (see
:mod:`crosscut.runtime.p2p`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils import _pytree as pytree

from crosscut.codegen.split import ValueRef, build_stages, map_structure
from crosscut.codegen.transfers import INPUT
from crosscut.errors import DistributedError, InputError
from crosscut.runtime.groups import (
    allreduce_mean,
    broadcast_from_first,
    check_same_plan,
    check_world,
    make_stage_groups,
    plan_hash,
    stage_ranks,
)
from crosscut.runtime.local import gather, scatter
from crosscut.runtime.p2p import Edge, Messenger, PendingRecv, build_routes
from crosscut.schedule import Action, make_schedule, validate_schedule

__all__ = ["DistributedPipeline", "plan_hash"]


class DistributedPipeline(nn.Module):
    """This rank's stage of a pipelined, possibly replicated, model.

    ``parameters()`` are this stage's parameters only (build the optimizer
    from them on every rank). Call :meth:`train_step` with the same global
    batch on every rank (ranks whose stage reads no model input may pass
    ``None`` as inputs, and all but the last stage may pass ``None`` as
    targets).
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
        timeout_s: float = 300.0,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        grouped = [st.index for st in plan.stages if len(st.devices) > 1]
        if grouped:
            raise InputError(
                "the distributed runtime runs one device per stage; this plan has "
                f"cross-shaped stages {grouped}",
                value=[
                    (st.index, st.devices, st.split) for st in plan.stages if st.index in grouped
                ],
                remedy="run it with crosscut.compile on one machine, or re-partition without "
                "cross_shaped=True (worker groups across ranks: replicas=R)",
            )
        if not dist.is_available() or not dist.is_initialized():
            raise DistributedError(
                "a DistributedPipeline needs an initialised torch.distributed process group",
                remedy="call crosscut.distributed.init() first (launch with `crosscut run` "
                "or torchrun)",
            )
        self.plan = plan
        self.num_stages = int(plan.num_stages)
        self.replicas = int(replicas)
        self.microbatches = int(microbatches or plan.options.microbatches)
        self.schedule_name = schedule or plan.options.schedule
        self.timeout_s = float(timeout_s)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.plan_hash = plan_hash(plan)
        check_world(self.world_size, self.num_stages, self.replicas)
        self.stage_index = self.rank % self.num_stages
        self.replica = self.rank // self.num_stages
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        check_same_plan(
            self.rank,
            self.world_size,
            {
                "plan": self.plan_hash,
                "stages": self.num_stages,
                "replicas": self.replicas,
                "microbatches": self.microbatches,
                "schedule": self.schedule_name,
            },
        )
        self._msg = Messenger(
            self.rank,
            self.timeout_s,
            f"rank {self.rank} (stage {self.stage_index}, replica {self.replica})",
        )
        self._build(model, gm)
        self._groups = make_stage_groups(self.num_stages, self.replicas, self.timeout_s)
        self._ranks = stage_ranks(self.stage_index, self.num_stages, self.replicas)
        if self.replicas > 1:  # replicas start from replica 0's weights, as with DDP
            tensors = [t.data for t in [*self.stage.parameters(), *self.stage.buffers()]]
            broadcast_from_first(tensors, self._groups[self.stage_index], self._ranks, self._msg)

    # ---- start-up ---------------------------------------------------------------------
    def _build(self, model: nn.Module, gm: fx.GraphModule) -> None:
        s_count = self.num_stages
        program = build_stages(gm, dict(self.plan.assignment), ["cpu"] * s_count)
        me = program.stages[self.stage_index]
        self.stage = me.module.to(self.device)
        self._inputs = [list(st.inputs) for st in program.stages]
        self._outputs = list(me.outputs)
        self._mutated = set(me.mutated_inputs)
        self._param_keys = dict(me.param_keys)
        self._placeholders = list(program.placeholders)
        self._template = program.output_template
        self._output_sources = dict(program.output_sources)
        self.key_sources = dict(program.key_sources)
        self.original_keys = list(model.state_dict().keys())
        self._orphans = {
            k: v.detach().to("cpu", copy=True)
            for k, v in model.state_dict().items()
            if k not in self.key_sources
        }
        self.routes = build_routes(gm, self._inputs, self._output_sources)
        self.edges = self.routes.edges
        nodes = {n.name: n for n in gm.graph.nodes}
        self.micro_batch = (
            int(nodes[self._placeholders[0]].meta["val"].shape[0])
            if (self._placeholders and "val" in nodes[self._placeholders[0]].meta)
            else 0
        )
        self._schedules = {
            "train": make_schedule(self.schedule_name, s_count, self.microbatches),
            "infer": make_schedule("inference", s_count, self.microbatches),
        }
        validate_schedule(self._schedules["train"], s_count, self.microbatches, training=True)

    def use_schedule(self, name: str) -> None:
        """Switch the training schedule (every rank must switch alike, between steps)."""
        rows = make_schedule(name, self.num_stages, self.microbatches)
        validate_schedule(rows, self.num_stages, self.microbatches, training=True)
        self.schedule_name = name
        self._schedules["train"] = rows

    # ---- helpers --------------------------------------------------------------------
    def rank_of(self, stage: int) -> int:
        """The global rank running ``stage`` in this rank's replica."""
        return self.replica * self.num_stages + stage

    def _what(self, a: Action, e: Edge, grad: bool) -> str:
        kind = "the gradient" if grad else "the value"
        return f"{kind} of {e.value!r} for micro-batch {a.microbatch} (action {a})"

    def _post(self, a: Action) -> list[tuple[int, PendingRecv]]:
        """Post the receives action ``a`` needs: inputs for F, output gradients for B."""
        out: list[tuple[int, PendingRecv]] = []
        for i, e in enumerate(self.edges):
            if a.kind == "F" and e.dst == self.stage_index:
                idx = self.routes.tensor_leaves(e.value)
                peer = self.rank_of(e.src)
            elif a.kind == "B" and e.src == self.stage_index:
                idx = self.routes.grad_leaves(e.value)
                peer = self.rank_of(e.dst)
            else:
                continue
            if not idx:
                continue
            leaves = self.routes.meta[e.value][1]
            templates = [
                torch.empty(tuple(leaves[j].shape), dtype=leaves[j].dtype, device=self.device)
                for j in idx
            ]
            tags = [self.routes.tag(i, a.microbatch, j, a.kind == "B") for j in idx]
            pend = self._msg.post_recv(
                e.value, peer, tags, templates, self._what(a, e, a.kind == "B")
            )
            out.append((i, pend))
        return out

    def _assemble(self, value: str, tensors: list[torch.Tensor], grad: bool) -> Any:
        spec, leaves = self.routes.meta[value]
        it = iter(tensors)
        built = []
        for j, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                t = next(it)
                if grad and self.routes.grad_leaf[value][j]:
                    t.requires_grad_(True)
                built.append(t)
            else:
                built.append(leaf)
        return pytree.tree_unflatten(built, spec)

    def _send_value(self, a: Action, i: int, e: Edge, value: Any) -> None:
        leaves = pytree.tree_leaves(value)
        expected = self.routes.meta[e.value][1]
        for j, (t, ref) in enumerate(zip(leaves, expected)):
            if not isinstance(ref, torch.Tensor):
                continue
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(ref.shape):
                raise DistributedError(
                    f"stage {e.src} produced {e.value!r} with shape "
                    f"{tuple(getattr(t, 'shape', ()))} but the plan traced "
                    f"{tuple(ref.shape)}; shapes are fixed by the trace",
                    value={"value": e.value, "microbatch": a.microbatch},
                    remedy=f"pass a global batch of replicas × microbatches × {self.micro_batch} "
                    "samples, the size the plan was compiled for",
                )
            self._msg.send(
                t,
                self.rank_of(e.dst),
                self.routes.tag(i, a.microbatch, j, False),
                self._what(a, e, False),
            )

    def _split_inputs(self, inputs: Any, what: str) -> list[list[Any]] | None:
        """This replica's shard of the global batch, split into micro-batches."""
        if inputs is None:
            return None
        args = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
        need = self.replicas * self.microbatches * self.micro_batch
        for t in pytree.tree_leaves(args):
            if isinstance(t, torch.Tensor) and t.dim() > 0 and need and t.shape[0] != need:
                raise InputError(
                    f"the global batch of {what} must be replicas × microbatches × micro-batch "
                    f"= {self.replicas} × {self.microbatches} × {self.micro_batch} = {need}",
                    value=tuple(t.shape),
                    remedy="pass the batch size the plan was compiled for (shapes are static)",
                )
        if self.replicas > 1:
            args = pytree.tree_map(
                lambda t: (
                    t.chunk(self.replicas, 0)[self.replica]
                    if isinstance(t, torch.Tensor) and t.dim() > 0
                    else t
                ),
                args,
            )
        args = pytree.tree_map(
            lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t, args
        )
        return scatter(args, self.microbatches)

    # ---- execution ------------------------------------------------------------------
    def _run(
        self,
        kind: str,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    ) -> tuple[list[torch.Tensor], list[Any]]:
        s, last = self.stage_index, self.num_stages - 1
        reads_input = any(src == INPUT for _, src in self._inputs[s]) or (
            s == last and any(src == INPUT for src in self._output_sources.values())
        )
        mbs = self._split_inputs(inputs, "inputs")
        if reads_input and mbs is None:
            raise InputError(
                f"stage {s} reads the model's inputs, so rank {self.rank} needs them",
                remedy="pass the same global batch on every rank",
            )
        tgts = self._split_inputs(targets, "targets") if kind == "train" and s == last else None
        if kind == "train" and s == last and (tgts is None or loss_fn is None):
            raise InputError(
                "the last stage computes the loss: it needs targets and loss_fn",
                remedy="pass targets and loss_fn on every rank",
            )
        row = self._schedules[kind][s]
        training = kind == "train"
        saved: dict[int, tuple[dict[str, Any], dict[str, Any], torch.Tensor | None]] = {}
        posted: dict[Action, list[tuple[int, PendingRecv]]] = {}
        losses: list[torch.Tensor] = []
        results: list[Any] = []
        for pos, a in enumerate(row):
            for b in row[pos : pos + 2]:  # this action's and the next one's receives
                if b not in posted:
                    posted[b] = self._post(b)
            pend = posted.pop(a)
            if a.kind == "F":
                out, loss = self._forward(a, pend, mbs, tgts, loss_fn, saved, training)
                if loss is not None:
                    losses.append(loss)
                if s == last and not training:
                    results.append(out)
            else:
                self._backward(a, pend, saved)
            self._msg.drain()
        self._msg.flush()
        return losses, results

    def _forward(
        self,
        a: Action,
        pend: list[tuple[int, PendingRecv]],
        mbs: list[list[Any]] | None,
        tgts: list[list[Any]] | None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        saved: dict[int, tuple[dict[str, Any], dict[str, Any], torch.Tensor | None]],
        training: bool,
    ) -> tuple[Any, torch.Tensor | None]:
        s, m, last = self.stage_index, a.microbatch, self.num_stages - 1
        received: dict[str, Any] = {}
        for _i, p in pend:
            received[p.value] = self._assemble(p.value, self._msg.wait_recv(p), training)
        for e in self.edges:  # values with no tensor leaves were never posted
            if e.dst == s and e.value not in received:
                received[e.value] = self._assemble(e.value, [], training)

        def model_input(name: str) -> Any:
            assert mbs is not None
            return mbs[m][self._placeholders.index(name)]

        ins = []
        for v, src in self._inputs[s]:
            val = model_input(v) if src == INPUT else received[v]
            if v in self._mutated:  # in-place on a received leaf is illegal: mutate a copy
                val = pytree.tree_map(
                    lambda t: t.clone() if isinstance(t, torch.Tensor) else t, val
                )
            ins.append(val)
        outs = dict(zip(self._outputs, self.stage(*ins)))
        for i, e in enumerate(self.edges):
            if e.src == s:
                self._send_value(a, i, e, outs[e.value])
        out: Any = None
        loss: torch.Tensor | None = None
        if s == last:

            def fetch(leaf: Any) -> Any:
                if not isinstance(leaf, ValueRef):
                    return leaf
                name = leaf.name
                if name in outs:
                    return outs[name]
                if self._output_sources.get(name) == INPUT:
                    return model_input(name)
                return received[name]

            out = map_structure(fetch, self._template)
            if training:
                assert tgts is not None and loss_fn is not None
                loss = loss_fn(out, tgts[m][0]) * (1.0 / self.microbatches)
        if training:
            saved[m] = (received, outs, loss)
        return out, loss

    def _backward(
        self,
        a: Action,
        pend: list[tuple[int, PendingRecv]],
        saved: dict[int, tuple[dict[str, Any], dict[str, Any], torch.Tensor | None]],
    ) -> None:
        s, m = self.stage_index, a.microbatch
        received, outs, loss = saved.pop(m)
        sums: dict[str, list[torch.Tensor]] = {}
        for _i, p in pend:
            got = self._msg.wait_recv(p)
            if p.value in sums:
                sums[p.value] = [x + y for x, y in zip(sums[p.value], got)]
            else:
                sums[p.value] = got
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if loss is not None:
            roots.append(loss)
            grads.append(None)
        for value, gs in sums.items():
            flags = self.routes.grad_leaf[value]
            actual = [t for t, f in zip(pytree.tree_leaves(outs[value]), flags) if f]
            for t, g in zip(actual, gs):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    roots.append(t)
                    grads.append(g)
        if roots:
            torch.autograd.backward(roots, grads)
        for i, e in enumerate(self.edges):
            if e.dst != s:
                continue
            leaves = pytree.tree_leaves(received[e.value])
            for j, (t, f) in enumerate(zip(leaves, self.routes.grad_leaf[e.value])):
                if not f:
                    continue
                g = t.grad if t.grad is not None else torch.zeros_like(t)
                self._msg.send(
                    g, self.rank_of(e.src), self.routes.tag(i, m, j, True), self._what(a, e, True)
                )

    def _allreduce_grads(self) -> None:
        if self.replicas > 1:
            group = self._groups[self.stage_index]
            allreduce_mean(list(self.stage.parameters()), group, self._ranks, self._msg)

    def train_step(
        self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]
    ) -> torch.Tensor | None:
        """One pipelined forward+backward over the global batch; gradients land in ``.grad``.

        Returns the full-batch mean loss (averaged over micro-batches and
        replicas) on last-stage ranks and ``None`` on the others. ``loss_fn``
        must average over its batch (``reduction="mean"``); each micro-batch's
        loss is divided by ``M`` and the replicas' gradients are averaged, so
        the gradients equal those of the whole batch's mean loss. Call
        ``optimizer.zero_grad()`` before and ``optimizer.step()`` after.
        """
        losses, _ = self._run("train", inputs, targets, loss_fn)
        self._allreduce_grads()
        if self.stage_index != self.num_stages - 1:
            return None
        total = torch.stack([x.detach() for x in losses]).sum()
        if self.replicas > 1:
            group = self._groups[self.stage_index]
            work = dist.all_reduce(total, group=group, async_op=True)
            self._msg.wait_collective(work, self._ranks, "the loss all-reduce")
            total = total / self.replicas
        return total

    def forward(self, *inputs: Any) -> Any:
        """Inference through the pipeline (no gradients); the output on last-stage ranks, else None.

        Each replica computes its shard; the output is this replica's shard.
        """
        with torch.no_grad():
            _, results = self._run("infer", inputs, None, None)
        if self.stage_index != self.num_stages - 1:
            return None
        return gather(results, self.device)

    # ---- state under the original keys ------------------------------------------------
    def named_original_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(original state_dict key, tensor) for this stage's parameters and buffers."""
        out: list[tuple[str, torch.Tensor]] = []
        named: dict[str, torch.Tensor] = {
            **dict(self.stage.named_parameters(remove_duplicate=False)),
            **dict(self.stage.named_buffers(remove_duplicate=False)),
        }
        for local, keys in self._param_keys.items():
            for key in keys:
                out.append((key, named[local]))
        return out

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's part of the original model's state_dict, copied to CPU."""
        return {k: t.detach().to("cpu", copy=True) for k, t in self.named_original_tensors()}

    def local_grads(self) -> dict[str, torch.Tensor]:
        """This stage's parameter gradients under the original keys (CPU copies)."""
        return {
            k: t.grad.detach().to("cpu", copy=True)
            for k, t in self.named_original_tensors()
            if isinstance(t, nn.Parameter) and t.grad is not None
        }

    def save_checkpoint(self, directory: str, optimizer: Any = None, extra: Any = None) -> None:
        """Collective: every rank writes its stage's state (and optimizer state) atomically."""
        from crosscut.runtime.checkpoint import save_rank

        save_rank(self, directory, optimizer, extra)

    def load_checkpoint(self, directory: str, optimizer: Any = None) -> Any:
        """Collective: restore this stage (and optimizer) from a checkpoint; returns ``extra``."""
        from crosscut.runtime.checkpoint import load_rank

        return load_rank(self, directory, optimizer)

    def layout(self) -> dict[str, Any]:
        """Plain-data description of this rank: for logs and for checkpoint manifests."""
        return {
            "rank": self.rank,
            "stage": self.stage_index,
            "replica": self.replica,
            "stages": self.num_stages,
            "replicas": self.replicas,
            "world_size": self.world_size,
            "plan_hash": self.plan_hash,
            "edges": [(e.value, e.src, e.dst) for e in self.edges],
        }

    def orphans(self) -> dict[str, torch.Tensor]:
        """Original keys the traced graph never reads (kept so checkpoints are complete)."""
        return dict(self._orphans)
