"""Local pipelined executor: one worker thread per stage, autograd across devices.

Thread model (Mariana binds one CPU thread per GPU): every stage — a logical
device — has one persistent worker thread fed by a queue. A call hands each
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
fixed-order node (:func:`~crosscut.codegen.share_threads.replicate`), so
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

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from crosscut.codegen.batch_split import BatchSplitStage
from crosscut.codegen.split import StagedProgram, ValueRef, map_structure
from crosscut.codegen.transfers import INPUT
from crosscut.errors import InputError, RuntimeError_
from crosscut.runtime.microbatch import micro_rows, scatter
from crosscut.runtime.output_merge import OutputMerge, gather
from crosscut.runtime.thread_state import ThreadState
from crosscut.schedule import (
    Action,
    Schedule,
    inference,
    make_schedule,
    simulate,
    validate_schedule,
)

__all__ = ["LocalExecutor", "gather", "scatter"]

DEFAULT_TIMEOUT_S = 600.0


class _Abort(Exception):
    """Raised in a waiting worker when another worker failed (the poison pill)."""


@dataclass
class _Run:
    """State of one call: values per micro-batch, gradients, the first error."""

    timeout: float
    cond: threading.Condition = field(default_factory=threading.Condition)
    values: dict[tuple[int, str], tuple[Any, Any]] = field(default_factory=dict)
    grads: dict[tuple[int, str], list[list[torch.Tensor | None]]] = field(default_factory=dict)
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


class _Worker:
    """A persistent thread that runs jobs from a queue; ``None`` stops it."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device
        self.jobs: queue.Queue[tuple[Callable[[], None], threading.Event] | None] = queue.Queue()
        self.compute: Any = None
        self.copy: Any = None
        if device.type == "cuda":
            self.compute = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self.copy = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.thread = threading.Thread(target=self._loop, name=f"crosscut-{name}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                return
            fn, done = item
            try:
                fn()
            finally:
                done.set()

    def submit(self, fn: Callable[[], None]) -> threading.Event:
        done = threading.Event()
        self.jobs.put((fn, done))
        return done

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=5)


class LocalExecutor:
    """Runs a :class:`StagedProgram` on this process's devices, one thread per stage."""

    def __init__(
        self,
        program: StagedProgram,
        schedule: str = "gpipe",
        microbatches: int = 1,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        output_merge: Any = None,
    ) -> None:
        """``output_merge``: rules merging micro-batch outputs (runtime/output_merge.py)."""
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
        validate_schedule(self.train_schedule, n, microbatches, training=schedule != "inference")
        self.forward_schedule: Schedule = inference(n, microbatches)
        self.output_device = program.stages[-1].device
        self.merge = OutputMerge(program.output_template, output_merge)
        self._workers: list[_Worker] | None = None
        self._lock = threading.Lock()
        # consumers of each (stage, value): how many gradient contributions B waits for
        self._expected: dict[str, int] = {}
        for st in program.stages:
            for value, src in st.inputs:
                if src != INPUT:
                    self._expected[value] = self._expected.get(value, 0) + 1
        last = len(program.stages) - 1
        for value, src in program.output_sources.items():
            if src not in (INPUT, last):
                self._expected[value] = self._expected.get(value, 0) + 1

    # ---- workers ------------------------------------------------------------------
    def _ensure_workers(self) -> list[_Worker]:
        if self._workers is None:
            self._workers = [_Worker(s.name, s.device) for s in self.program.stages]
        return self._workers

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
        times = simulate(rows, len(rows))
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

        def job(row: list[Action], worker: _Worker) -> Callable[[], None]:
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
                    run.fail(f"{worker.name} at action {action}", exc)

            return body

        dones = [w.submit(job(row, w)) for row, w in zip(rows, workers)]
        for d in dones:
            if not d.wait(self.timeout + 5):
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
        worker = self._ensure_workers()[stage]

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
                    out.requires_grad_(True)
            return out

        return pytree.tree_map(one, value)

    def _event(self, stage: int) -> Any:
        worker = self._ensure_workers()[stage]
        if worker.compute is None:
            return None
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(worker.compute)
        return ev

    def _output(self, run: _Run, mb: int, stage: str, fetch: Callable[[str], Any]) -> Any:
        return map_structure(
            lambda leaf: fetch(leaf.name) if isinstance(leaf, ValueRef) else leaf,
            self.program.output_template,
        )

    # ---- forward (one autograd graph) ---------------------------------------------
    def forward(self, args: Sequence[Any]) -> Any:
        """Run all micro-batches forward; the result is differentiable end to end."""
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

        def do(a: Action) -> None:
            st = prog.stages[a.stage]
            ins = [
                self._move(*run.get((a.microbatch, v), st.name), a.stage, False)
                for v, _ in st.inputs
            ]
            outs = st.module(*ins)
            ev = self._event(a.stage)
            for name, val in zip(st.outputs, outs):
                run.put((a.microbatch, name), val, ev)

        with self._lock:
            self._execute(run, self.forward_schedule, do)
        results = []
        for m in range(self.microbatches):

            def fetch(name: str, m: int = m) -> Any:
                value, _ = run.values[(m, name)]
                return pytree.tree_map(
                    lambda t: t.to(self.output_device) if isinstance(t, torch.Tensor) else t, value
                )

            results.append(self._output(run, m, "output", fetch))
        sizes = [micro_rows(mb) for mb in mbs]
        return self.merge.merge(results, self.output_device, sizes)

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
        prog = self.program
        last = len(prog.stages) - 1
        mbs = scatter(args, self.microbatches)
        tgts = scatter([targets], self.microbatches)
        scale = 1.0 / self.microbatches
        run = _Run(self.timeout)
        for m, mb in enumerate(mbs):
            for name, v in zip(prog.placeholders, mb):
                run.put((m, name), v)
        saved: dict[tuple[int, int], tuple[dict[str, Any], dict[str, Any], Any]] = {}
        losses: list[torch.Tensor | None] = [None] * self.microbatches

        def forward(a: Action) -> None:
            st, m = prog.stages[a.stage], a.microbatch
            leaves: dict[str, Any] = {}
            ins = []
            for v, src in st.inputs:
                val, ev = run.get((m, v), st.name)
                moved = self._move(val, ev, a.stage, src != INPUT)
                if src != INPUT:
                    leaves[v] = moved
                if v in st.mutated_inputs:  # in-place on a leaf is illegal: mutate a copy
                    moved = pytree.tree_map(
                        lambda t: t.clone() if isinstance(t, torch.Tensor) else t, moved
                    )
                ins.append(moved)
            outs = dict(zip(st.outputs, st.module(*ins)))
            ev = self._event(a.stage)
            for name, val in outs.items():
                run.put((m, name), val, ev)
            loss = None
            if a.stage == last:

                def fetch(name: str) -> Any:
                    if name in outs:
                        return outs[name]
                    val, vev = run.get((m, name), st.name)
                    if prog.output_sources[name] == INPUT:
                        return self._move(val, vev, last, False)
                    leaves[f"out:{name}"] = self._move(val, vev, last, True)
                    return leaves[f"out:{name}"]

                out = self._output(run, m, st.name, fetch)
                loss = loss_fn(out, tgts[m][0])
                if scale != 1.0:
                    loss = loss * scale
                losses[m] = loss.detach()
            saved[(a.stage, m)] = (leaves, outs, loss)

        def backward(a: Action) -> None:
            st, m = prog.stages[a.stage], a.microbatch
            leaves, outs, loss = saved.pop((a.stage, m))
            roots: list[torch.Tensor] = []
            grads: list[torch.Tensor | None] = []
            if loss is not None:
                roots.append(loss)
                grads.append(None)
            for name, val in outs.items():
                need = self._expected.get(name, 0)
                if need == 0:
                    continue
                key = (m, name)

                def arrived(key: tuple[int, str] = key, need: int = need) -> bool:
                    return len(run.grads.get(key, [])) >= need

                run.wait_for(
                    arrived,
                    f"gradient of {name!r} for micro-batch {m}",
                    st.name,
                )
                with run.cond:
                    contributions = run.grads.pop(key)
                flat = [t for t in pytree.tree_leaves(val)]
                for i, t in enumerate(flat):
                    parts = [g for c in contributions if (g := c[i]) is not None]
                    if isinstance(t, torch.Tensor) and t.requires_grad and parts:
                        total: torch.Tensor = parts[0]
                        for p in parts[1:]:
                            total = total + p.to(total.device)
                        roots.append(t)
                        grads.append(total.to(t.device))
            if roots:
                torch.autograd.backward(roots, grads)
            for key_name, leaf in leaves.items():
                name = key_name.removeprefix("out:")
                flat = [
                    t.grad if isinstance(t, torch.Tensor) else None
                    for t in pytree.tree_leaves(leaf)
                ]
                with run.cond:
                    run.grads.setdefault((m, name), []).append(flat)
                    run.cond.notify_all()

        def do(a: Action) -> None:
            (forward if a.kind == "F" else backward)(a)

        with self._lock:
            self._execute(run, self.train_schedule, do)
        total = torch.zeros((), device=self.output_device)
        for loss_m in losses:
            assert loss_m is not None
            total = total + loss_m.to(self.output_device)
        return total
