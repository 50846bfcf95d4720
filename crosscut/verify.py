"""Check a plan numerically and measure it: ``crosscut verify`` and ``crosscut bench``.

``verify_plan`` replays a plan on CPU devices and compares the compiled module
with eager execution of the same model: the outputs of one forward, then one
training step as a user runs it — ``train_step`` against eager running the
same micro-batches' backwards in order, each loss times ``1/M`` (the contract
the runtimes keep bit for bit, README "What equals eager") — and every
parameter and buffer after one SGD step with learning rate 1, so the
parameter change *is* the gradient, compared under the original
``state_dict`` keys without knowing how codegen renamed anything.

The eager reference runs micro-batch by micro-batch, like the pipeline does, so
batch norm sees the same statistics on both sides (see the runtime's batch-norm
notes); dropout, stochastic depth and every other random drop are switched
off on both copies (:func:`_no_dropout`) because the two sides draw random
numbers in different orders. A batch norm in a batch-split stage (a
group of ``w`` devices) normalises each device's share of the micro-batch
apart, and only the leader's share updates the running statistics
(``runtime/batch_split.py``): the reference does the same for the batch norms
of those stages (:func:`_shared_batch_norms`), so a plan with device groups is
compared with what it computes, not flagged for normalising as data
parallelism does.
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from crosscut.errors import PlanError
from crosscut.ir.plan import Plan

__all__ = [
    "BenchReport",
    "VerifyReport",
    "bench_plan",
    "compare_states",
    "eager_reference",
    "loss_of",
    "verify_plan",
]


@dataclass
class VerifyReport:
    ok: bool
    max_output_diff: float
    loss_diff: float
    max_state_diff: float
    worst_key: str
    checked_keys: int
    devices: list[str] = field(default_factory=list)
    # batch norm running statistics and counters of a replicated plan: replica 0's (DDP)
    not_compared: list[str] = field(default_factory=list)

    def text(self) -> str:
        verdict = "OK" if self.ok else "MISMATCH"
        return (
            f"{verdict}: compiled vs eager on {self.devices}\n"
            f"  outputs   max |diff| {self.max_output_diff:.3e}\n"
            f"  loss      |diff|     {self.loss_diff:.3e}\n"
            f"  state after one SGD step (lr=1, so gradients): max |diff| "
            f"{self.max_state_diff:.3e} at {self.worst_key or '-'} over {self.checked_keys} tensors"
            + (
                f"\n  not compared: {len(self.not_compared)} batch-norm running statistics "
                "and counters (replicas keep replica 0's, as DistributedDataParallel does)"
                if self.not_compared
                else ""
            )
        )


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _tensors(v)]
    return []


def loss_of(out: Any) -> torch.Tensor:
    """A loss that depends on every output element: the sum of mean squares.

    Half-precision outputs are summed in float32; float64 ones stay float64, so
    a float64 check's gradients are not rounded to float32 at the head."""
    parts = [
        t.to(torch.promote_types(t.dtype, torch.float32)).pow(2).mean()
        for t in _tensors(out)
        if t.is_floating_point()
    ]
    if not parts:
        raise ValueError("the model returned no floating-point tensor to differentiate")
    return torch.stack(parts).sum()


#: the attributes that set how much a random-drop module (or a model's head) drops
_DROP_ATTRS = ("p", "drop_prob", "drop_rate")


def _no_dropout(model: nn.Module) -> None:
    """Switch off every op that drops at random, on one copy as on the other.

    Dropout modules, and any module whose class name says it drops (timm's
    ``DropPath`` and ``DropBlock2d``, torchvision's ``StochasticDepth``) get
    their rate set to 0; so does a float ``drop_rate`` on any module (timm's
    heads call ``F.dropout(x, self.drop_rate)``). Before, only ``nn.Dropout``
    was switched off, and every efficientnet plan — data parallelism included
    — "differed" from eager by whole units: its stochastic depth drew
    different rows on each side."""
    for m in model.modules():
        name = type(m).__name__.lower()
        drops = isinstance(m, nn.modules.dropout._DropoutNd) or any(
            word in name for word in ("drop", "stochasticdepth")
        )
        for attr in _DROP_ATTRS:
            if isinstance(getattr(m, attr, None), float) and (drops or attr == "drop_rate"):
                setattr(m, attr, 0.0)


def eager_reference(model: nn.Module, plan: Plan) -> nn.Module:
    """A copy of ``model`` whose eager forward computes what ``plan`` promises to.

    Random drops are off (:func:`_no_dropout`: the compiled side must switch
    them off too), and the batch norms of batch-split stages normalise the
    group's shares apart (:func:`_shared_batch_norms`). Run it micro-batch by
    micro-batch (and replica share by replica share) as the plan does; its
    outputs and state are then the compiled module's, to rounding."""
    ref = copy.deepcopy(model)
    _no_dropout(ref)
    _shared_batch_norms(ref, plan)
    return ref


def _shared_batch_norms(model: nn.Module, plan: Plan) -> None:
    """Make each batch norm of a batch-split stage normalise the group's shares apart.

    Share ``i`` holds the rows :func:`~crosscut.runtime.batch_shares.share_bounds`
    gives it (what the runtime scatters); every share runs the module's own
    forward, the leader's on the module's running statistics (updating them),
    the others' on copies, as the runtime's shares do. Eval mode is left alone.

    A batch norm belongs to the stage of its ``batch_norm`` node: the nearest
    batch-norm module around that node (timm's ``BatchNormAct2d`` is traced as
    ``F.batch_norm`` and an activation inside it; its ``num_batches_tracked``
    update may sit in another stage, and does not count). Before, the other
    shares ran ``F.batch_norm`` alone and skipped the activation such a module
    applies: every timm model with a grouped stage "differed" from eager.

    A functional batch norm outside any batch-norm module (``F.batch_norm`` on
    buffers the forward passes it) is found by the running mean its node reads:
    the model's forward then runs with ``F.batch_norm`` splitting the calls
    on that tensor (:func:`_functional_shares`)."""

    width: dict[str, int] = {}
    functional: dict[int, int] = {}  # id(running mean) -> shares
    by_name = {n.name: n for n in plan.nodes}
    for node in plan.nodes:
        stage = plan.assignment.get(node.name)
        if stage is None or plan.stages[stage].split != "batch" or "batch_norm" not in node.kind:
            continue
        w = len(plan.stages[stage].devices)
        path = _bn_module(model, node.module_path)
        if path is not None:
            width.setdefault(path, w)
            continue
        reads = [by_name.get(name) for name in node.inputs]
        stats = [r.target for r in reads if r is not None and r.op == "get_attr"]
        if stats and "running_mean" in stats[0]:
            functional[id(model.get_buffer(stats[0]))] = w
    for path, w in width.items():
        bn = model.get_submodule(path)
        if isinstance(bn, nn.modules.batchnorm._BatchNorm) and w > 1:
            bn.forward = functools.partial(_by_shares, bn, type(bn).forward, w)  # type: ignore[method-assign]
    if any(w > 1 for w in functional.values()):
        model.forward = functools.partial(_functional_shares, model.forward, functional)  # type: ignore[method-assign]


def _bn_module(model: nn.Module, module_path: str) -> str | None:
    """The path of the nearest batch-norm module around a node's module path, if any."""
    parts = module_path.split(".") if module_path else []
    for i in range(len(parts), 0, -1):  # the node's module, else the nearest around it
        path = ".".join(parts[:i])
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return path
    return None


def _by_shares(bn: nn.modules.batchnorm._BatchNorm, forward: Any, w: int, x: torch.Tensor) -> Any:
    """``bn`` on ``x`` as a batch-split group of ``w`` devices computes it (training)."""
    from crosscut.runtime.batch_shares import share_bounds

    if not bn.training:
        return forward(bn, x)
    outs = []
    for i, (a, b) in enumerate(share_bounds(int(x.shape[0]), w)):
        if i == 0:
            outs.append(forward(bn, x[a:b]))
            continue
        kept = dict(bn.named_buffers(recurse=False))
        for k, v in kept.items():  # the share runs on copies (autograd saved the originals)
            setattr(bn, k, v.clone())
        outs.append(forward(bn, x[a:b]))
        for k, v in kept.items():
            setattr(bn, k, v)
    return torch.cat(outs)


def _functional_shares(forward: Any, width: dict[int, int], *args: Any, **kwargs: Any) -> Any:
    """``forward`` with each training-mode ``F.batch_norm`` on a running mean of ``width``
    split into that many shares: the leader's on the statistics, the others' on copies."""
    from crosscut.runtime.batch_shares import share_bounds

    plain = F.batch_norm

    def by_shares(x: torch.Tensor, mean: Any, var: Any, *rest: Any, **kw: Any) -> Any:
        w = width.get(id(mean), 1)
        if w == 1 or not kw.get("training", rest[2] if len(rest) > 2 else False):
            return plain(x, mean, var, *rest, **kw)
        outs = []
        for i, (a, b) in enumerate(share_bounds(int(x.shape[0]), w)):
            stats = (mean, var) if i == 0 else (mean.clone(), var.clone())
            outs.append(plain(x[a:b], *stats, *rest, **kw))
        return torch.cat(outs)

    F.batch_norm = by_shares  # type: ignore[assignment]
    try:
        return forward(*args, **kwargs)
    finally:
        F.batch_norm = plain


def _load(plan: Plan | str | Path) -> Plan:
    return plan if isinstance(plan, Plan) else Plan.load(plan)


Inputs = torch.Tensor | tuple[torch.Tensor, ...]  # the model's one input, or its inputs


def _fresh(x: Inputs) -> Any:
    """A copy of the inputs, so that no run sees another's writes (nor the caller's data)."""
    if isinstance(x, tuple):
        return tuple(t.clone() for t in x)
    return x.clone()


def _chunks(x: Inputs, micro: int) -> list[tuple[torch.Tensor, ...]]:
    """``x`` cut into ``micro`` chunks along the batch, each as the model's arguments."""
    xs = x if isinstance(x, tuple) else (x,)
    return list(zip(*(t.chunk(micro) if t.dim() else [t] * micro for t in xs)))  # 0-d: whole


def _outputs(model: nn.Module, x: Inputs, micro: int) -> Any:
    """Eager forward per micro-batch (the pipeline's batch-norm statistics), no gradients."""
    with torch.no_grad():
        return _cat([model(*c) for c in _chunks(x, micro)])


def _eager_train(model: nn.Module, x: Inputs, micro: int) -> float:
    """What ``train_step`` promises: each micro-batch's loss times ``1/micro``, its
    backward run in order (gradients accumulating), then one SGD step with learning
    rate 1, so each parameter moves by exactly its gradient. Returns the mean loss."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    opt.zero_grad()
    total = torch.zeros(())  # summed as the runtimes sum the micro-batches' losses
    for c in _chunks(x, micro):
        loss = loss_of(model(*c)) * (1.0 / micro)
        torch.autograd.backward(loss)
        total = total + loss.detach()
    opt.step()
    return float(total)


def _compiled_train(compiled: Any, x: Inputs) -> float:
    """``train_step`` with :func:`loss_of` (targets unused), then the same SGD step."""
    opt = torch.optim.SGD(compiled.parameters(), lr=1.0)
    opt.zero_grad()
    targets = torch.zeros((x[0] if isinstance(x, tuple) else x).shape[0])
    loss = compiled.train_step(x, targets, lambda out, _targets: loss_of(out))
    opt.step()
    return float(loss.detach())


def _cat(outs: list[Any]) -> Any:
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outs)
    if isinstance(first, dict):
        return {k: _cat([o[k] for o in outs]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(_cat([o[i] for o in outs]) for i in range(len(first)))
    return first


def verify_plan(
    model: nn.Module,
    x: Inputs,
    plan: Plan | str | Path,
    *,
    devices: list[str] | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> VerifyReport:
    """Run ``plan`` on CPU devices and compare with eager (see the module docstring).

    ``x``: the model's input, or a tuple of its inputs (each with the batch as dim 0)."""
    from crosscut.api import compile as cc_compile

    the_plan = _load(plan)
    devs = devices or ["cpu"] * (len(the_plan.cluster.devices) * the_plan.replication.replicas)
    train = the_plan.model.mode == "train"
    ref = eager_reference(model, the_plan)
    work = copy.deepcopy(model)
    _no_dropout(work)
    try:
        compiled = cc_compile(work, devs, x, plan=the_plan)
    except PlanError as exc:
        if "fingerprint" not in str(exc):
            raise
        raise PlanError(
            "verify switches every random drop off on both sides, and with this model's "
            "drops off it traces to another graph than the plan was made for: a drop "
            "written as a Python branch on its rate (timm's drop_path) leaves the trace "
            "when the rate is 0",
            value=the_plan.model.name,
            remedy="partition the model with its drop rates at 0 (timm: drop_path_rate=0.0, "
            "drop_rate=0.0) and verify that plan; the cuts do not depend on the rates",
        ) from exc
    compiled.train(train)
    ref.train(train)
    # the replicas' shares of each micro-batch are normalised apart, as chunks are
    chunks = the_plan.options.microbatches * the_plan.replication.replicas
    # each run gets its own copy of the inputs: a model that writes into its input would
    # otherwise hand the next run a written one (eager writes the caller's tensor)
    ref_out = _outputs(ref, _fresh(x), chunks)
    with torch.no_grad():
        out = compiled(*_fresh(x)) if isinstance(x, tuple) else compiled(_fresh(x))
    if train:  # the training contract: train_step against eager's micro-batches in order
        ref_loss = _eager_train(ref, _fresh(x), chunks)
        loss = _compiled_train(compiled, _fresh(x))
    else:
        ref_loss, loss = float(loss_of(ref_out)), float(loss_of(out))
    out_diff = max(
        (
            float((a.detach().cpu().double() - b.detach().double()).abs().max())
            for a, b in zip(_tensors(out), _tensors(ref_out))
        ),
        default=0.0,
    )
    skip = _per_replica(ref) if the_plan.replication.replicas > 1 else set()
    ref_state = ref.state_dict()
    worst, worst_key, ok = compare_states(
        ref_state, compiled.state_dict(), skip=skip, rtol=rtol * 10, atol=atol * 10
    )
    ok = ok and out_diff <= atol + rtol * max(
        (float(t.detach().abs().max()) for t in _tensors(ref_out)), default=0.0
    )
    return VerifyReport(
        ok=ok,
        max_output_diff=out_diff,
        loss_diff=abs(loss - ref_loss),
        max_state_diff=worst,
        worst_key=worst_key,
        checked_keys=len(ref_state) - len(skip),
        devices=devs,
        not_compared=sorted(skip),
    )


def compare_states(
    want: dict[str, torch.Tensor],
    have: dict[str, torch.Tensor],
    *,
    skip: set[str] | frozenset[str] = frozenset(),
    rtol: float,
    atol: float,
) -> tuple[float, str, bool]:
    """``(largest |diff|, its key, all close)`` over the tensors of two state dicts with
    the same keys (a missing or extra key is not close).

    Compared in float64: a float32 cast rounds two float64 tensors that agree to
    1e-12 one float32 unit apart (2.4e-7 at 2.0), over a float64 check's
    tolerance; timm's rexnet_100 "differed" from eager that way in the group
    families sweep. Integer tensors (counters, ``num_batches_tracked``) must be
    equal: they were not compared at all before, so a counter stepped twice
    (a recomputation replaying it) would have passed."""
    worst, worst_key, ok = 0.0, "", set(want) == set(have)
    for key, ref in want.items():
        if key not in have or key in skip:
            continue
        got = have[key].detach().cpu().double()
        diff = float((got - ref.double()).abs().max()) if ref.numel() else 0.0
        if diff > worst:
            worst, worst_key = diff, key
        close = torch.allclose(got, ref.double(), rtol=rtol, atol=atol)
        ok = ok and (close if ref.is_floating_point() else torch.equal(got, ref.double()))
    return worst, worst_key, ok


def _per_replica(model: nn.Module) -> set[str]:
    """The state keys replicas keep apart: batch norm's running statistics, and counters
    (integer buffers). Replica 0's are kept, as under DDP; the reference runs the
    replicas' chunks one after another, so it would count a call once per replica."""
    out = {k for k, b in model.named_buffers() if not (b.is_floating_point() or b.is_complex())}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            for buf in ("running_mean", "running_var", "num_batches_tracked"):
                out.add(f"{name}.{buf}" if name else buf)
    return out


@dataclass
class BenchReport:
    measured_step_s: float
    eager_step_s: float
    predicted_step_s: float
    steps: int

    def text(self) -> str:
        pred = self.predicted_step_s
        ratio = self.measured_step_s / pred if pred > 0 else float("nan")
        vs_eager = self.measured_step_s / self.eager_step_s
        return (
            f"step time over {self.steps} steps (median): compiled "
            f"{self.measured_step_s * 1e3:.1f} ms, eager {self.eager_step_s * 1e3:.1f} ms "
            f"(ratio {vs_eager:.2f});"
            f" plan predicted {pred * 1e3:.1f} ms (measured/predicted {ratio:.2f}; meaningful only"
            " when the plan was priced for these devices)"
        )


def bench_plan(
    model: nn.Module, x: torch.Tensor, plan: Plan | str | Path, *, steps: int = 3
) -> BenchReport:
    """Median training-step time of the compiled plan and of eager, side by side."""
    from crosscut.api import compile as cc_compile

    the_plan = _load(plan)
    devs = ["cpu"] * (len(the_plan.cluster.devices) * the_plan.replication.replicas)
    eager = copy.deepcopy(model)
    compiled = cc_compile(copy.deepcopy(model), devs, x, plan=the_plan)

    def step(m: nn.Module) -> float:
        t0 = time.perf_counter()
        loss = loss_of(m(x))
        torch.autograd.backward(loss)
        return time.perf_counter() - t0

    step(eager)
    step(compiled)  # warm-up
    e = statistics.median(step(eager) for _ in range(steps))
    c = statistics.median(step(compiled) for _ in range(steps))
    return BenchReport(c, e, the_plan.predicted.step_time_s, steps)
