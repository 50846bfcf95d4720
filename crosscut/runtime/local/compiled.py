"""``CompiledModule``: the split model behind the original ``nn.Module`` surface.

It looks like the model it came from — ``forward``, ``parameters()``,
``train()/eval()``, and a ``state_dict()`` with exactly the original keys — so
training loops, optimizers and checkpoints do not change. Placement is fixed
by the plan: ``.to()``, ``.cuda()`` and ``.cpu()`` are refused (recompile
for another placement).

Batch norm over micro-batches (``bn_mode``). A pipeline normalises each
micro-batch when it arrives; normalising with the whole batch's statistics
would need a barrier at every batch norm (every micro-batch through the layers
before it first), which is what pipelining avoids. The modes differ in what
they promise about that and about the running statistics:

* ``"micro"`` (default): each micro-batch is normalised with its own
  statistics — the same as training with batch size ``B/M`` — and running
  statistics are updated ``M`` times per step (so ``num_batches_tracked``
  counts micro-batches, the effective momentum is ``1 - (1 - m)^M``, and each
  update uses the ``n/(n-1)`` correction of one micro-batch).
* ``"step"``: normalisation as ``"micro"`` (and, in a batch-split stage, each
  device's share with its own statistics), but the running mean/var and
  ``num_batches_tracked`` are updated ONCE per step, at the end of
  :meth:`CompiledModule.forward` / :meth:`CompiledModule.train_step`, from the
  whole batch's statistics combined exactly from the per-micro-batch (per
  share) means and variances (``crosscut/runtime/batchnorm.py``). The running
  statistics are then those of single-device training that normalises the
  same chunks ("ghost" batch norm with whole-batch running statistics). They
  equal plain full-batch training wherever a batch norm's input does not
  depend on an earlier batch norm's normalisation (a network's first batch
  norm; every one whose predecessors are frozen in eval mode) — deeper layers
  see activations normalised per micro-batch, so no running update can make
  them match. Cost: one extra ``var_mean`` over each batch-norm input. With
  one micro-batch and no batch-split stage it is ``"exact"`` (torch's own
  batch norm, nothing swapped).
* ``"exact"``: batch statistics must equal single-device training. That holds
  with one micro-batch (bit-exact); with ``M > 1``, or a batch-split stage
  holding batch norm, a training-mode forward raises
  :class:`~crosscut.errors.RuntimeError_` rather than silently computing
  something else. Eval-mode calls are allowed.

Eval mode is the same in every mode (running statistics), so inference is
exact for any ``M`` — except for batch norms built with
``track_running_stats=False``, which always normalise with batch statistics,
hence per micro-batch.

Cross-shaped stages (``groups``): a channel-split stage holds each conv/linear
weight as shards on its group's devices; ``state_dict()`` concatenates them
back into the original full tensors under the original keys, and
``load_state_dict()`` cuts a full checkpoint into the same shards. A
batch-split stage normalises each device's share of the micro-batch with its
own batch-norm statistics (like micro-batches): ``bn_mode="exact"`` refuses
training-mode calls when such a stage contains batch norm, and ``"step"``
combines the shares' statistics into the step's single update.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, Unpack

import torch
from torch import fx, nn

from crosscut.codegen.modes import other_program, share_state
from crosscut.codegen.source import program_source
from crosscut.codegen.split import build_stages
from crosscut.codegen.state_writes import (
    check_recomputed_writes,
    check_state_writes,
    split_nodes,
)
from crosscut.cpu_malloc import keep_freed_memory
from crosscut.errors import CrosscutError, InputError, RuntimeError_
from crosscut.ir.program import StagedProgram
from crosscut.ir.schedule import DEFAULT_SCHEDULE
from crosscut.precision import autocast, check_precision
from crosscut.runtime.batch_split import BatchSplitStage
from crosscut.runtime.batchnorm import (
    check_sync_batchnorm,
    commit_batchnorm,
    discard_batchnorm,
    install_step_batchnorm,
)
from crosscut.runtime.contract import (
    bind_inputs,
    dtype_of_to,
    load_file,
    refuse_placement,
    save_file,
    signature_of,
)
from crosscut.runtime.local.model_keys import ModelKeyedState
from crosscut.runtime.local.thread_executor import LocalExecutor
from crosscut.runtime.module_flags import KeepsModuleFlags
from crosscut.runtime.output_merge import check_outputs
from crosscut.runtime.recomputing import recompute_flags, recomputing, written_inputs
from crosscut.runtime.rng import RandomScope, in_program_order

__all__ = ["BN_MODES", "CompiledModule", "LocalKeywords", "LocalOptions"]

BN_MODES = ("micro", "step", "exact")


class LocalKeywords(TypedDict, total=False):
    """:class:`CompiledModule`'s keywords: the fields of :class:`LocalOptions`."""

    bn_mode: str
    example_inputs: Sequence[Any] | None
    timeout: float
    groups: Sequence[tuple[Sequence[torch.device | str], str]] | None
    output_merge: Any
    other_gm: fx.GraphModule | CrosscutError | None
    gm_training: bool
    recompute: bool | Sequence[bool]
    precision: str


@dataclass(frozen=True)
class LocalOptions:
    """How a :class:`CompiledModule` runs, beyond its program and devices.

    ``bn_mode``: batch norm over micro-batches (module docstring);
    ``example_inputs``: inputs to check the stages' signatures with;
    ``timeout``: seconds a stage thread may wait; ``groups``: one
    ``(devices, split)`` per stage that runs on a device group;
    ``output_merge``: how micro-batch outputs merge; ``other_gm``: the other
    train/eval mode's graph (or why it cannot be run), ``gm_training`` the
    mode ``gm`` was traced in; ``recompute``: one bool, or one per stage;
    ``precision``: the autocast dtype every call runs under.
    """

    bn_mode: str = "micro"
    example_inputs: Sequence[Any] | None = None
    timeout: float = 600.0
    groups: Sequence[tuple[Sequence[torch.device | str], str]] | None = None
    output_merge: Any = None
    other_gm: fx.GraphModule | CrosscutError | None = None
    gm_training: bool = True
    recompute: bool | Sequence[bool] = False
    precision: str = "fp32"


class CompiledModule(ModelKeyedState, KeepsModuleFlags):  # type: ignore[misc]
    """A model split into stages on devices, run by a pipelined local executor."""

    def __init__(
        self,
        model: nn.Module,
        gm: fx.GraphModule,
        stage_of: Mapping[str, int],
        stage_devices: Sequence[torch.device | str],
        schedule: str = DEFAULT_SCHEDULE,
        microbatches: int = 1,
        plan: Any = None,
        **keywords: Unpack[LocalKeywords],
    ) -> None:
        super().__init__()
        o = LocalOptions(**keywords)
        # every call runs under autocast with this dtype; stage threads inherit it
        self._precision = check_precision(o.precision)
        if o.bn_mode not in BN_MODES:
            raise InputError(
                "bn_mode must be known", value=o.bn_mode, remedy=f"use one of {BN_MODES}"
            )
        self.plan = plan
        self.bn_mode = o.bn_mode
        program = build_stages(
            gm,
            stage_of,
            stage_devices,
            example_inputs=o.example_inputs,
            groups=o.groups,
            batch_stage=BatchSplitStage,
        )
        self._program = program
        self.stages = nn.ModuleList([s.module for s in program.stages])
        # how micro-batch outputs merge; an output that cannot is refused here (output_merge.py)
        self._output_merge = check_outputs(gm, o.output_merge, microbatches)
        self._signature = signature_of(gm)
        # written M times, or from a share of the batch? (codegen/state_writes.py)
        check_state_writes(model, gm, microbatches, o.bn_mode, split_nodes(stage_of, o.groups))
        self._schedule = schedule
        self._timeout = o.timeout
        self._microbatches = microbatches
        # stages that keep only their inputs and recompute in backward (runtime/recomputing.py)
        self._recompute = recompute_flags(o.recompute, len(program.stages), o.bn_mode)
        check_recomputed_writes(model, gm, stage_of, self._recompute)  # codegen/state_writes.py
        self._executor = self._new_executor(program)
        # the other train/eval mode's program, when the traced graph differs (codegen/modes.py);
        # its stage modules are not children: they share every state tensor with ``stages``
        self._gm_training = o.gm_training
        self._build_other(model, gm, o.other_gm, stage_of, stage_devices, o.groups, o.output_merge)
        # random ops draw per (call, micro-batch, op) seeds: the same on every plan
        # (runtime/rng.py); one micro-batch inline in program order keeps eager's draws
        modules = [st.module for p in (program, self._other) if p is not None for st in p.stages]
        self._rng = RandomScope(modules)
        inline = microbatches == 1 and all(torch.device(d).type == "cpu" for d in stage_devices)
        if any(torch.device(d).type == "cpu" for d in stage_devices):
            keep_freed_memory()  # the allocator CPU profiles are taken with (cpu_malloc.py)
        self._eager_draws = inline and in_program_order(gm, dict(stage_of))
        self._keep_model_keys(model)
        self._module_names = {  # the model's module paths, for messages
            n.name: str(n.target) for n in gm.graph.nodes if n.op == "call_module"
        }
        self._sync_bn = any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
        self._check_sync_bn(model.training)  # at compile time, what training would refuse
        self._install_batchnorm()
        # each module's own flag (a batch norm frozen by .eval()): runtime/module_flags.py;
        # they are the flags of the model's mode, which need not be the traced graph's
        self.keep_module_flags([st.module for st in program.stages], model.training)
        self.train(model.training)

    def _build_other(
        self,
        model: nn.Module,
        gm: fx.GraphModule,
        other_gm: fx.GraphModule | CrosscutError | None,
        stage_of: Mapping[str, int],
        stage_devices: Sequence[torch.device | str],
        groups: Sequence[tuple[Sequence[torch.device | str], str]] | None,
        output_merge: Any,
    ) -> None:
        """The other train/eval mode's program and executor, or why there is none."""
        self._other: StagedProgram | None = None
        self._other_map: list[int] = []
        self._other_executor: LocalExecutor | None = None
        self._other_error = other_gm if isinstance(other_gm, CrosscutError) else None
        if isinstance(other_gm, fx.GraphModule):
            check_outputs(other_gm, output_merge, self._microbatches, strict_paths=False)
            split = split_nodes(stage_of, groups)
            check_state_writes(model, other_gm, self._microbatches, self.bn_mode, split)
            self._other, self._other_map = other_program(
                self._program, gm, other_gm, stage_of, stage_devices, groups, BatchSplitStage
            )
            self._other_executor = self._new_executor(self._other)

    def _keep_model_keys(self, model: nn.Module) -> None:
        """The model's state keys in order, and CPU copies of the tensors no stage holds."""
        original = model.state_dict(keep_vars=True)
        self._keys = list(original)
        self._param_names = [k for k, _ in model.named_parameters(remove_duplicate=False)]
        self._unique_params = [k for k, _ in model.named_parameters()]
        self._buffer_names = [k for k, _ in model.named_buffers(remove_duplicate=False)]
        self._unique_buffers = [k for k, _ in model.named_buffers()]
        # tensors no traced graph reads (unused submodules): kept on CPU so state_dict(),
        # load_state_dict() and parameters() still cover every original key, in order
        held = self._held_keys()
        self._orphans: dict[str, torch.Tensor] = {}
        for k, v in original.items():
            if k not in held:
                copy_ = v.detach().to("cpu", copy=True)
                is_param = isinstance(v, nn.Parameter)
                self._orphans[k] = nn.Parameter(copy_, v.requires_grad) if is_param else copy_
        for k, b in model.named_buffers():  # non-persistent ones: out of state_dict, still
            if k not in held and k not in self._orphans:  # named_buffers()'s, as on the model
                self._orphans[k] = b.detach().to("cpu", copy=True)

    def _install_batchnorm(self) -> None:
        """Which stages hold batch norm, and the once-per-step batch norm of ``bn_mode="step"``."""
        training_stages = self._training_modules()
        self._has_bn = any(
            isinstance(m, nn.modules.batchnorm._BatchNorm)
            for st in training_stages
            for m in st.modules()
        )
        self._batch_split_bn = any(
            s.split == "batch"
            and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in s.module.modules())
            for s in self._training_program().stages
        )
        # "step" with one micro-batch and no batch-split stage is already exact: keep
        # torch's own batch norm there (bit-exact against eager mode)
        self._step_bn = self.bn_mode == "step" and (self._microbatches > 1 or self._batch_split_bn)
        if self._step_bn:
            install_step_batchnorm(nn.ModuleList(training_stages))

    def _held_keys(self) -> set[str]:
        programs = [self._program] + ([self._other] if self._other is not None else [])
        return {k for p in programs for k in (*p.key_sources, *p.shard_sources)}

    def _training_program(self) -> StagedProgram:
        if self._other is not None and not self._gm_training:
            return self._other
        return self._program

    def _training_modules(self) -> list[nn.Module]:
        return [s.module for s in self._training_program().stages]

    def _active(self, strict: bool = True) -> tuple[StagedProgram, LocalExecutor]:
        """The program of the current train/eval flag, and its executor.

        ``strict``: raise when that mode is refused; otherwise fall back to the plan's.
        """
        if self.training == self._gm_training or (self._other_error and not strict):
            return self._program, self._executor
        if self._other_error is not None:
            raise RuntimeError_(
                f"this module was compiled in {'train' if self._gm_training else 'eval'} mode "
                f"and the model cannot be traced in the other: {self._other_error}",
                value={"training": self.training},
                remedy=f"call .{'train' if self._gm_training else 'eval'}(), or compile in the "
                "mode you need with inputs the model accepts in it",
            )
        if self._other is not None and self._other_executor is not None:
            return self._other, self._other_executor
        return self._program, self._executor

    def train(self, mode: bool = True) -> CompiledModule:
        """Switch train/eval like the model: leaf flags, and the program that runs. In the
        mode it was compiled in, each module runs in the mode it had then: the graph was
        traced so (a frozen batch norm stays frozen, as an override of the model's
        ``train`` would keep it); the other mode sets every module, as ``model.train``."""
        super().train(mode)  # the compile-time flags in that mode: runtime/module_flags.py
        if self._other is not None:
            for st in self._other.stages:
                st.module.train(mode)
        return self

    # ---- introspection ------------------------------------------------------------
    @property
    def program(self) -> StagedProgram:
        """The staged program (stages, transfers, key map) this module runs in its mode."""
        return self._active(strict=False)[0]

    @property
    def microbatches(self) -> int:
        return self._microbatches

    @property
    def code(self) -> str:
        """Readable Python source of every stage with device/input/output headers."""
        return program_source(self._active(strict=False)[0])

    # ---- execution ----------------------------------------------------------------
    def _check_sync_bn(self, training: bool) -> None:
        if training and self._sync_bn:  # one given part of the batch (runtime/batchnorm.py)
            stages = [(s.module, s.split == "batch") for s in self._training_program().stages]
            check_sync_batchnorm(stages, self._microbatches, names=self._module_names)

    def _check_bn(self) -> None:
        self._check_sync_bn(self.training)
        if self.bn_mode == "exact" and self.training and self._batch_split_bn:
            raise RuntimeError_(
                "bn_mode='exact' cannot match single-device batch statistics in a batch-split "
                "stage (each device normalises its share of the micro-batch)",
                value=[s.name for s in self._program.stages if s.split == "batch"],
                remedy="split that stage by channel, use bn_mode='step' (running statistics "
                "of the whole batch) or 'micro', or call eval()",
            )
        if self.bn_mode == "exact" and self.training and self._has_bn and self.microbatches > 1:
            raise RuntimeError_(
                "bn_mode='exact' cannot match single-device batch statistics with "
                f"{self.microbatches} micro-batches in training mode",
                value={"microbatches": self.microbatches},
                remedy="compile with microbatches=1, use bn_mode='step' (running statistics "
                "of the whole batch) or 'micro', or call eval()",
            )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Same inputs and outputs as the original model (outputs on the last device)."""
        args = bind_inputs(self._signature, args, kwargs)  # keywords as the model takes them
        self._check_bn()
        executor = self._active()[1]
        self._rng.start(enabled=not self._eager_draws)
        with self._autocast():
            return self._committed(lambda: executor.forward(args))

    def train_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
    ) -> torch.Tensor:
        """One pipelined forward+backward by the compiled schedule; returns the mean loss.

        ``inputs`` is one tensor or a tuple of the model's inputs. Gradients
        accumulate into ``.grad``; step the optimizer afterwards.
        """
        self._check_bn()
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        executor = self._active()[1]
        self._rng.start(enabled=not self._eager_draws)
        with self._autocast():
            loss: torch.Tensor = self._committed(
                lambda: executor.train_step(args, targets, loss_fn)
            )
        return loss

    def _autocast(self) -> AbstractContextManager[Any]:
        """The plan's precision (crosscut/precision.py) on the stages' device type."""
        return autocast(self._precision, self._program.stages[0].device.type)

    def _committed(self, call: Callable[[], Any]) -> Any:
        """Run one step; with ``bn_mode="step"`` its batch-norm statistics are committed
        after every micro-batch went forward, or dropped if the step failed."""
        if not self._step_bn or not self.training:
            return call()
        stages = nn.ModuleList(self._training_modules())
        try:
            out = call()
        except BaseException:
            discard_batchnorm(stages)
            raise
        commit_batchnorm(stages)
        return out

    # ---- placement is the plan's business; dtype is the user's ------------------------
    def _devices(self) -> list[str]:
        return [str(s.device) for s in self._program.stages]

    def to(self, *args: Any, **kwargs: Any) -> CompiledModule:  # type: ignore[override]
        """A dtype change (``.to(torch.float64)``); device moves are refused (contract.py)."""
        dtype = dtype_of_to(args, kwargs, self._devices())
        if dtype is not None:
            self._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
        return self

    def cuda(self, device: Any = None) -> CompiledModule:
        raise refuse_placement(".cuda()", self._devices())

    def cpu(self) -> CompiledModule:
        raise refuse_placement(".cpu()", self._devices())

    def _apply(self, fn: Any, recurse: bool = True) -> CompiledModule:
        """Convert every program's tensors and the orphans, keeping one tensor per key."""
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        if self._other is not None:
            for st in self._other.stages:
                st.module._apply(fn, recurse)  # type: ignore[no-untyped-call]
            share_state(self._program, self._other, self._other_map)
        with torch.no_grad():
            for key, t in self._orphans.items():
                if isinstance(t, nn.Parameter):
                    t.data = fn(t.data)
                else:
                    self._orphans[key] = fn(t)
        return self

    # ---- checkpoints ----------------------------------------------------------------
    def save_checkpoint(self, path: str | Path, optimizer: Any = None, extra: Any = None) -> None:
        """One file: the model's state_dict, the optimizer's, ``extra``; written atomically.

        Parameters follow the model's order, so the file loads under any plan of
        the model (and ``state`` into the model itself).
        """
        state = {k: v.to("cpu", copy=True) for k, v in self.state_dict().items()}
        save_file(state, path, optimizer, extra)

    def load_checkpoint(self, path: str | Path, optimizer: Any = None) -> Any:
        """Restore :meth:`save_checkpoint`'s file (and the optimizer); returns ``extra``."""
        state, extra = load_file(path, optimizer)
        self.load_state_dict(state)
        return extra

    # ---- copies -------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Everything but the executors' threads and locks (rebuilt on unpickling)."""
        state = self.__dict__.copy()
        state["_executor"] = None
        state["_other_executor"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._executor = self._new_executor(self._program)
        if self._other is not None:
            self._other_executor = self._new_executor(self._other)

    def _new_executor(self, program: StagedProgram) -> LocalExecutor:
        return LocalExecutor(
            program,
            self._schedule,
            self._microbatches,
            timeout=self._timeout,
            output_merge=self._output_merge,
            runs=[
                recomputing(st.module, lambda: getattr(self, "_rng", None), written_inputs(st))
                if again
                else None
                for st, again in zip(program.stages, self._recompute)
            ],
        )

    def named_stage_parameters(self) -> Iterator[tuple[int, str, nn.Parameter]]:
        """(stage, local name, parameter) for every stage parameter."""
        for s, mod in enumerate(self.stages):
            for name, p in mod.named_parameters():
                yield s, name, p

    def close(self) -> None:
        """Stop the worker threads."""
        self._executor.close()
