"""Local pipelined executor: one worker thread per stage (or device), autograd across devices.

Thread model (Mariana binds one CPU thread per GPU): every stage — a logical
device — has one persistent worker thread fed by a queue; under an interleaved
schedule (``"1f1b-v2"``) a device runs several stages, and its one thread runs
their actions in the order of its schedule row (``ir/schedule.py``). A call hands each
worker its row of the schedule; the worker runs its actions in order, waiting
for the values (forward) or gradients (backward) it needs from other workers.
On CUDA each worker has a compute stream and a copy stream; a producer records
an event after its forward, the consumer's copy stream waits on it, copies
``non_blocking`` and the compute stream waits on the copy. (These CUDA paths
are guarded by ``device.type == "cuda"`` and are not exercised on CPU.)
A cross-shaped stage is still one worker here: a batch-split stage drives its
other group devices from threads of its own (one per device, the worker
itself runs the leader's share), a channel-split stage issues every shard from
its worker (asynchronous on CUDA, so the devices overlap; sequential on CPU).
Every worker enters the caller's thread-local torch state for the call (grad
and inference mode, autocast, saved-tensor hooks:
:mod:`crosscut.runtime.thread_state`), so ``torch.autocast`` or ``no_grad``
around a compiled call acts on every stage as it does in eager mode.

Two modes:

* :meth:`LocalExecutor.forward` — F actions only, values moved with the
  differentiable ``Tensor.to``, so the whole batch builds ONE autograd graph
  spanning every device; ``loss.backward()`` then works as in eager mode and
  gradients accumulate over micro-batches and over values read by several
  stages.
* :meth:`LocalExecutor.train_step` — F and B actions of a GPipe or 1F1B
  schedule. Values cross stages as detached leaves; ``B(s, m)`` backpropagates
  stage ``s`` alone from the summed gradients its consumers sent back. The
  loss of micro-batch ``m`` is scaled by ``1/M`` (equal micro-batches) so the
  accumulated gradients and the returned loss equal the full-batch mean loss.

With one micro-batch on CPU nothing can overlap, so actions run inline on the
caller's thread (cheaper, and bit-exact against eager mode: autograd numbers
its nodes per thread, and one thread reproduces eager's accumulation order).
A batch-split stage's shares still run on their device threads then: its
forward outputs are the same on any thread, and its gradient reduce is one
fixed-order node (:func:`~crosscut.runtime.share_threads.replicate`), so
nothing depends on which thread built a share.

Micro-batches: tensor arguments are split along dim 0 into ``M`` equal parts;
a batch not divisible by ``M`` raises :class:`~crosscut.errors.InputError`
(equal parts keep the ``1/M`` loss scaling exact and BN statistics comparable).
Outputs are merged on the last stage's device by the rules of
:mod:`crosscut.runtime.output_merge` (concatenation along dim 0 unless the
caller's ``output_merge`` says otherwise; never a silent guess).

Failures never hang: every wait has a timeout, and the first exception in any
worker poisons the call, wakes all waiters and is re-raised to the caller as
:class:`~crosscut.errors.RuntimeError_` naming the stage and the action.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from crosscut.errors import InputError, RuntimeError_
from crosscut.ir.program import StagedProgram
from crosscut.ir.schedule import (
    DEFAULT_SCHEDULE,
    Action,
    Schedule,
    action_times,
    forward_only,
    make_schedule,
    placement,
    splits_backward,
    validate_schedule,
)
from crosscut.runtime.batch_split import BatchSplitStage
from crosscut.runtime.device_thread import DeviceThread
from crosscut.runtime.engine import (
    RunStage,
    StageEngine,
    consumers,
    incoming_grad,
    keep_incoming,
    sum_leaves,
)
from crosscut.runtime.microbatch import micro_rows, scatter
from crosscut.runtime.output_merge import OutputMerge
from crosscut.runtime.thread_state import ThreadState

__all__ = ["LocalExecutor"]

DEFAULT_TIMEOUT_S = 600.0


class _Abort(Exception):
    """Raised in a waiting worker when another worker failed (the poison pill)."""


@dataclass
class _Run:
    """State of one call: values per micro-batch, gradients, the first error."""

    timeout: float
    cond: threading.Condition = field(default_factory=threading.Condition)
    values: dict[tuple[int, str], tuple[Any, Any]] = field(default_factory=dict)
    # (micro-batch, value) -> reading stage -> per-leaf gradient it sends back
    grads: dict[tuple[int, str], dict[int, list[torch.Tensor | None]]] = field(default_factory=dict)
    error: tuple[str, BaseException] | None = None

    def put(self, key: tuple[int, str], value: Any, event: Any = None) -> None:
        with self.cond:
            self.values[key] = (value, event)
            self.cond.notify_all()

    def wait_for(self, ready: Callable[[], bool], what: str, stage: str) -> None:
        with self.cond:
            ok = self.cond.wait_for(lambda: ready() or self.error is not None, self.timeout)
            if self.error is not None:
                raise _Abort
            if not ok:
                raise RuntimeError_(
                    f"{stage} waited more than {self.timeout:.0f} s for {what}",
                    remedy="check the schedule and the stage assignment, or raise timeout",
                )

    def get(self, key: tuple[int, str], stage: str) -> tuple[Any, Any]:
        self.wait_for(
            lambda: key in self.values, f"value {key[1]!r} of micro-batch {key[0]}", stage
        )
        with self.cond:
            return self.values[key]

    def fail(self, where: str, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = (where, exc)
            self.cond.notify_all()


class LocalExecutor:
    """Runs a :class:`StagedProgram` on this process's devices, one thread per stage."""

    def __init__(
        self,
        program: StagedProgram,
        schedule: str = DEFAULT_SCHEDULE,
        microbatches: int = 1,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        output_merge: Any = None,
        runs: Sequence[RunStage | None] | None = None,
    ) -> None:
        """``output_merge``: rules merging micro-batch outputs (runtime/output_merge.py);
        ``runs[k]``: how stage ``k`` is called (default: its module; runtime/recomputing.py)."""
        if microbatches < 1:
            raise InputError(
                "microbatches must be >= 1", value=microbatches, remedy="pass 1 or more"
            )
        self.program = program
        self.microbatches = microbatches
        self.schedule_name = schedule
        self.timeout = timeout
        n = len(program.stages)
        self.train_schedule: Schedule = make_schedule(schedule, n, microbatches)
        self._rows = placement(schedule, n)  # stage -> worker (row, thread)
        validate_schedule(self.train_schedule, n, microbatches, schedule != "inference", self._rows)
        # one worker (thread) per row: per stage, or per device of an interleaved schedule
        self.forward_schedule: Schedule = forward_only(schedule, n, microbatches)
        self.output_device = program.stages[-1].device
        self.merge = OutputMerge(program.output_template, output_merge)
        self._workers: list[DeviceThread] | None = None
        self._lock = threading.Lock()
        # who reads each value from another stage (its gradient contributions), and what
        # each stage receives: one leaf per (value, reading stage), as under torchrun
        self._readers = consumers(program)
        self._reads: list[list[str]] = [
            [v for v, readers in self._readers.items() if st.index in readers]
            for st in program.stages
        ]
        self._engines = [
            StageEngine.for_stage(program, k, microbatches, run=runs[k] if runs else None)
            for k in range(len(program.stages))
        ]
        for engine in self._engines:
            engine.split = splits_backward(self.train_schedule)

    # ---- workers ------------------------------------------------------------------
    def _ensure_workers(self) -> list[DeviceThread]:
        if self._workers is None:
            self._workers = [
                DeviceThread(s.name, s.device)
                for s in self.program.stages[: len(self.train_schedule)]
            ]
        return self._workers

    def _worker(self, stage: int) -> DeviceThread:
        """The thread that runs ``stage``: its own, or its device's (interleaved: by the
        schedule's :func:`~crosscut.ir.schedule.placement`)."""
        workers = self._ensure_workers()
        return workers[self._rows[stage]]

    def close(self) -> None:
        """Stop the worker threads, and the stages' share threads (daemons: optional)."""
        if self._workers is not None:
            for w in self._workers:
                w.stop()
            self._workers = None
        for st in self.program.stages:  # a batch-split stage's share threads
            if isinstance(st.module, BatchSplitStage):
                st.module.close()

    def _execute_inline(self, run: _Run, rows: Schedule, do: Callable[[Action], None]) -> None:
        """Run every action on the caller's thread in simulated start-time order.

        Used when nothing can overlap (one micro-batch): no thread hand-offs,
        and autograd nodes are numbered on one thread as in eager mode, so the
        backward accumulates fan-out gradients in eager order (bit-exact).
        """
        times = action_times(rows, len(self.program.stages))
        for a in sorted(times, key=lambda a: (times[a][0], a.stage)):
            try:
                do(a)
            except Exception as exc:
                where = f"{self.program.stages[a.stage].name} at action {a}"
                raise RuntimeError_(
                    f"pipeline stage {where} failed: {type(exc).__name__}: {exc}",
                    remedy="the stage name and action locate the op; run the model eagerly",
                ) from exc

    def _execute(self, run: _Run, rows: Schedule, do: Callable[[Action], None]) -> None:
        if self.microbatches == 1 and not any(s.device.type == "cuda" for s in self.program.stages):
            self._execute_inline(run, rows, do)
            return
        workers = self._ensure_workers()
        # the caller's grad/inference/autocast state, entered by every worker (thread_state.py)
        state = ThreadState.capture(s.device.type for s in self.program.stages)

        def job(row: list[Action], worker: DeviceThread, first: int) -> Callable[[], None]:
            def body() -> None:
                action: Action | None = None
                try:
                    with state.applied():
                        for action in row:
                            if run.error is not None:
                                return
                            if worker.compute is not None:
                                with torch.cuda.stream(worker.compute):
                                    do(action)
                            else:
                                do(action)
                except _Abort:
                    return
                except BaseException as exc:
                    stage = action.stage if action is not None else first
                    run.fail(f"{self.program.stages[stage].name} at action {action}", exc)

            return body

        dones = [w.submit(job(row, w, k)) for k, (row, w) in enumerate(zip(rows, workers))]
        for d in dones:
            if not d.done.wait(self.timeout + 5):
                run.fail("caller", TimeoutError("a stage worker did not finish"))
                break
        if run.error is not None:
            where, exc = run.error
            raise RuntimeError_(
                f"pipeline stage {where} failed: {type(exc).__name__}: {exc}",
                remedy="the stage name and action locate the op; run the model eagerly to compare",
            ) from exc
        for w in workers:
            if w.compute is not None:
                torch.cuda.current_stream(self.output_device).wait_stream(w.compute)

    # ---- value movement -------------------------------------------------------------
    def _move(self, value: Any, event: Any, stage: int, detach: bool) -> Any:
        """Bring a value to ``stage``'s device; as a detached leaf when ``detach``."""
        dev = self.program.stages[stage].device
        worker = self._worker(stage)

        def one(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if worker.copy is not None and t.device != dev:
                with torch.cuda.stream(worker.copy):
                    if event is not None:
                        worker.copy.wait_event(event)
                    out = t.to(dev, non_blocking=True)
                worker.compute.wait_stream(worker.copy)
                out.record_stream(worker.compute)
            else:
                out = t.to(dev)
            if detach:
                req = t.requires_grad
                out = out.detach()
                if req:
                    keep_incoming(out.requires_grad_(True))
            return out

        return pytree.tree_map(one, value)

    def _event(self, stage: int) -> Any:
        worker = self._worker(stage)
        if worker.compute is None:
            return None
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(worker.compute)
        return ev

    def _model_input(self, run: _Run, m: int, stage: int) -> Callable[[str], Any]:
        """Micro-batch ``m``'s model inputs on ``stage``'s device (attached: not leaves)."""
        name = self.program.stages[stage].name
        return lambda v: self._move(*run.get((m, v), name), stage, False)

    def _start(self, args: Sequence[Any]) -> tuple[_Run, list[list[Any]]]:
        prog = self.program
        if len(args) != len(prog.placeholders):
            raise InputError(
                f"the model takes {len(prog.placeholders)} inputs {prog.placeholders}",
                value=len(args),
                remedy="call the compiled module with the same positional inputs as the model",
            )
        mbs = scatter(args, self.microbatches)
        run = _Run(self.timeout)
        for m, mb in enumerate(mbs):
            for name, v in zip(prog.placeholders, mb):
                run.put((m, name), v)
        return run, mbs

    # ---- forward (one autograd graph) ---------------------------------------------
    def forward(self, args: Sequence[Any]) -> Any:
        """Run all micro-batches forward; the result is differentiable end to end.

        The stage engine runs untrained actions: values move with the
        differentiable ``Tensor.to`` instead of as detached leaves, so the
        batch builds one autograd graph across every device.
        """
        run, mbs = self._start(args)
        results: dict[int, Any] = {}

        def do(a: Action) -> None:
            transport = _LocalTransport(self, run, a.stage)
            out, _ = self._engines[a.stage].forward(
                a, transport, self._model_input(run, a.microbatch, a.stage), training=False
            )
            if self._engines[a.stage].last:
                results[a.microbatch] = out

        with self._lock:
            self._execute(run, self.forward_schedule, do)
        sizes = [micro_rows(mb) for mb in mbs]
        ordered = [results[m] for m in range(self.microbatches)]
        return self.merge.merge(ordered, self.output_device, sizes)

    # ---- pipelined training step ------------------------------------------------------
    def train_step(
        self, args: Sequence[Any], targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]
    ) -> torch.Tensor:
        """Forward and backward every micro-batch by the schedule; returns the mean loss.

        Gradients are accumulated into ``.grad`` of the stage parameters (call
        ``optimizer.zero_grad()`` before and ``optimizer.step()`` after, as with
        eager training). ``loss_fn`` must average over the batch (the default
        ``reduction="mean"``) for the result to equal full-batch training. It is
        called on each micro-batch's outputs, unmerged: an output without a batch
        dimension is that micro-batch's value (``output_merge`` rules apply to
        :meth:`forward` only).
        """
        run, _ = self._start(args)
        tgts = scatter([targets], self.microbatches, micro_rows(args))  # the inputs' batch
        losses: list[torch.Tensor | None] = [None] * self.microbatches

        def do(a: Action) -> None:
            engine = self._engines[a.stage]
            transport = _LocalTransport(self, run, a.stage)
            if a.kind == "B":
                engine.backward(a, transport)
                return
            if a.kind == "W":
                engine.weight(a)
                return
            m = a.microbatch
            _, loss = engine.forward(
                a,
                transport,
                self._model_input(run, m, a.stage),
                training=True,
                target=tgts[m][0],
                loss_fn=loss_fn,
            )
            if loss is not None:
                losses[m] = loss.detach()

        try:
            with self._lock:
                self._execute(run, self.train_schedule, do)
        finally:
            for engine in self._engines:  # a failed step leaves no saved graphs behind
                engine.saved.clear()
        total = torch.zeros((), device=self.output_device)
        for loss_m in losses:
            assert loss_m is not None
            total = total + loss_m.to(self.output_device)
        return total


class _LocalTransport:
    """The stage engine's transport in one process: the call's shared value table.

    Values are published into ``_Run.values`` and moved to the reader's device
    (on CUDA through its copy stream, after the producer's event); gradients
    are collected per (micro-batch, value) from each reader and summed in
    reader-stage order, so the sum does not depend on which thread finished
    first.
    """

    def __init__(self, ex: LocalExecutor, run: _Run, stage: int) -> None:
        self.ex = ex
        self.run = run
        self.stage = stage
        self.name = ex.program.stages[stage].name

    def receive_values(self, a: Action, training: bool) -> dict[str, Any]:
        got = {}
        for v in self.ex._reads[self.stage]:
            value, event = self.run.get((a.microbatch, v), self.name)
            got[v] = self.ex._move(value, event, self.stage, training)
        return got

    def send_values(self, a: Action, outs: dict[str, Any]) -> None:
        event = self.ex._event(self.stage)
        for name, value in outs.items():
            self.run.put((a.microbatch, name), value, event)

    def receive_grads(self, a: Action) -> dict[str, list[torch.Tensor | None]]:
        sums: dict[str, list[torch.Tensor | None]] = {}
        for name in self.ex.program.stages[self.stage].outputs:
            readers = self.ex._readers.get(name, [])
            if not readers:
                continue
            key = (a.microbatch, name)

            def arrived(key: tuple[int, str] = key, need: int = len(readers)) -> bool:
                return len(self.run.grads.get(key, {})) >= need

            self.run.wait_for(arrived, f"gradient of {name!r} for micro-batch {key[0]}", self.name)
            with self.run.cond:
                contributions = self.run.grads.pop(key)
            sums[name] = sum_leaves([contributions[r] for r in readers])
        return sums

    def send_grads(self, a: Action, received: dict[str, Any]) -> None:
        for name, leaf in received.items():
            flat = [incoming_grad(t) for t in pytree.tree_leaves(leaf)]
            with self.run.cond:
                self.run.grads.setdefault((a.microbatch, name), {})[self.stage] = flat
                self.run.cond.notify_all()
