"""Buffers written in forward, no_grad blocks, and the caller's model (issue 13, item 3).

A buffer counter or an EMA updated in forward must update on every call as in
eager (it is a graph node since the trace proxies buffers); ``torch.no_grad()``
blocks, which fx does not record, must not join the autograd graph; ``trace``,
``partition`` and ``compile`` must leave the caller's model bit for bit as it
was; and with several micro-batches, where the update would run once per
micro-batch, compile refuses by name (batch norm's own statistics excepted).
Locally on 1-3 stages and under torchrun on 2 gloo ranks.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import crosscut
from crosscut.errors import CrosscutError
from tests.test_mutation import assert_steps_like_eager, compiled_step, eager_step

torch.set_num_threads(1)


def assert_steps_equal(
    c: Any, ref: nn.Module, x: torch.Tensor, steps: int
) -> dict[str, torch.Tensor]:
    """``steps`` SGD steps of ``c`` and eager ``ref``, bit for bit; closes ``c``."""
    try:
        for _ in range(steps):
            out, sd = compiled_step(c, x)
            expected, ref_sd = eager_step(ref, x, 1)
            assert torch.equal(out, expected)
            assert all(torch.equal(sd[key], ref_sd[key]) for key in ref_sd)
    finally:
        c.close()
    return sd


# ---- models --------------------------------------------------------------------------


class Counter(nn.Module):
    """A buffer counter and an EMA buffer updated in forward, beside a batch norm."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        y = torch.relu(self.bn(self.c1(x)))
        m = y.mean((0, 2, 3)).detach()
        self.avg.mul_(0.9).add_(0.1 * m)
        return self.fc(y.mean((2, 3))) + self.calls.float() * 0.01


class NoGradUpdates(nn.Module):
    """An EMA under ``torch.no_grad()`` read after the update, and a frozen teacher branch.

    fx does not record ``no_grad``: traced naively, the buffer joins each call's
    autograd graph (the second backward fails) and the teacher gets gradients.
    """

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.teacher = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("avg", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        with torch.no_grad():
            self.avg.mul_(0.9).add_(0.1 * y.mean(0))
            t = self.teacher(x)
        return self.b(y) - self.avg + t


class FusedBN(nn.BatchNorm2d):
    """A batch norm traced through (like timm's BatchNormAct2d): its counter is a graph node."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        y = F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.1
        )
        return torch.relu(y)


class FusedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = FusedBN(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(self.c(x)).mean((2, 3)))


# ---- buffers written in forward --------------------------------------------------------


def state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_trace_partition_compile_leave_the_callers_model_unchanged(mode: str) -> None:
    torch.manual_seed(0)
    for factory in (Counter, FusedNet):
        model = factory().train(mode == "train")
        before = state(model)
        x = torch.randn(4, 3, 8, 8)
        crosscut.trace(model, x, mode=mode)
        crosscut.partition(model, ["cpu", "cpu"], x, mode=mode, microbatches=1, replicas=1)
        crosscut.compile(
            model,
            ["cpu", "cpu"],
            x,
            mode=mode,
            require_all_devices=True,
            microbatches=1,
            replicas=1,
        )
        after = model.state_dict()
        assert list(after) == list(before)
        assert all(torch.equal(before[k], after[k]) for k in before), [
            k for k in before if not torch.equal(before[k], after[k])
        ]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_buffer_counter_and_ema_update_on_every_call_like_eager(k: int) -> None:
    torch.manual_seed(0)
    model = Counter()
    x = torch.randn(4, 3, 8, 8)
    c = crosscut.compile(
        model, ["cpu"] * k, x, microbatches=1, require_all_devices=True, replicas=1
    )
    ref = copy.deepcopy(model)
    for _ in range(3):
        out, sd = compiled_step(c, x)
        expected, ref_sd = eager_step(ref, x, 1)
        assert torch.equal(out, expected)
    assert int(sd["calls"]) == 3 == int(ref_sd["calls"])
    assert all(torch.equal(sd[key], ref_sd[key]) for key in ref_sd)
    assert int(model.state_dict()["calls"]) == 0  # the caller's model untouched


def test_buffer_written_in_forward_with_microbatches_is_refused_by_name() -> None:
    model = Counter()
    with pytest.raises(CrosscutError, match="'calls' is written in forward by node 'add_'") as e:
        crosscut.compile(model, ["cpu", "cpu"], torch.randn(4, 3, 8, 8), microbatches=2, replicas=1)
    assert "microbatches=1" in str(e.value)


def test_batch_norm_counter_traced_through_keeps_bn_mode_with_microbatches() -> None:
    """num_batches_tracked written as a graph node is batch norm's own: bn_mode governs it."""
    torch.manual_seed(0)
    model = FusedNet()
    x = torch.randn(4, 3, 8, 8)
    c = crosscut.compile(
        model, ["cpu", "cpu"], x, microbatches=2, require_all_devices=True, replicas=1
    )
    ref = copy.deepcopy(model)
    out, sd = compiled_step(c, x)
    expected, ref_sd = eager_step(ref, x, 2)
    torch.testing.assert_close(out, expected)
    assert int(sd["bn.num_batches_tracked"]) == 2 == int(ref_sd["bn.num_batches_tracked"])
    for key in ref_sd:
        torch.testing.assert_close(sd[key], ref_sd[key])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_no_grad_blocks_in_forward_run_without_autograd_like_eager(k: int) -> None:
    torch.manual_seed(0)
    model = NoGradUpdates()
    x = torch.randn(4, 8)
    c = crosscut.compile(
        model, ["cpu"] * k, x, microbatches=1, require_all_devices=True, replicas=1
    )
    ref = copy.deepcopy(model)
    for _ in range(3):  # the second backward failed when the EMA joined the graph
        out, sd = compiled_step(c, x)
        expected, ref_sd = eager_step(ref, x, 1)
        assert torch.equal(out, expected)
        assert all(torch.equal(sd[key], ref_sd[key]) for key in ref_sd)
    assert dict(c.named_parameters())["teacher.weight"].grad is None
    assert ref.teacher.weight.grad is None


# ---- under torchrun ----------------------------------------------------------------------


def _torchrun(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return subprocess.run(
        [*cmd, str(script), *args], env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_torchrun_buffers_written_in_forward_and_view_writes_train_like_eager(
    tmp_path: Path,
) -> None:
    """2 gloo ranks, 1 micro-batch: 3 SGD steps give eager's parameters and buffers;
    with 2 micro-batches every rank refuses the buffer update by name."""
    script = Path(__file__).parent / "dist_scripts" / "mutation_check.py"
    done = _torchrun(script, str(tmp_path), "1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    got: dict[str, torch.Tensor] = {}
    for r in range(2):
        got.update(torch.load(tmp_path / f"rank{r}.pt"))
    sys.path.insert(0, str(script.parent))
    from mutation_check import Writer, data  # type: ignore[import-not-found]

    torch.manual_seed(0)
    x, y = data()
    model = Writer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    want = model.state_dict()
    assert set(got) == set(want)
    assert int(got["calls"]) == 3
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=key)

    refused = _torchrun(script, str(tmp_path / "m2"), "2")
    assert refused.returncode == 0, refused.stdout[-2000:] + refused.stderr[-2000:]
    for r in range(2):
        assert "microbatches=1" in (tmp_path / "m2" / f"refused{r}.txt").read_text()


@pytest.mark.parametrize("bn_mode", ["step", "exact"])
def test_traced_through_batch_norm_under_step_or_exact_with_microbatches_is_refused(
    bn_mode: str,
) -> None:
    """bn_mode='step'/'exact' reach leaf batch norms only: a graph that updates a batch
    norm's statistics itself (its forward traced through) is refused by name."""
    x = torch.randn(4, 3, 8, 8)
    with pytest.raises(CrosscutError, match=r"'bn\.(running_mean|num_batches_tracked)'") as e:
        crosscut.compile(FusedNet(), ["cpu", "cpu"], x, microbatches=2, bn_mode=bn_mode, replicas=1)
    assert "bn_mode='micro'" in str(e.value)
    leaf = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(3))
    leaf(x)  # materialise the lazy layer
    crosscut.compile(
        leaf, ["cpu", "cpu"], x, microbatches=2, bn_mode="step", replicas=1
    )  # leaf: fine
    crosscut.compile(FusedNet(), ["cpu", "cpu"], x, microbatches=1, bn_mode=bn_mode, replicas=1)


# ---- state the graph cannot hold: refused by name (issue 27, item 5) --------------------


class PythonCounter(nn.Module):
    """A Python attribute counter read by the output: the graph would freeze its value."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        return self.c(x) * (1 + 0.01 * self.step)


class Reassigned(nn.Module):
    """Buffers rebound in forward, not written in place: ``self.calls += 1`` and
    ``self.avg = ...`` rebind (the tracer reads buffers as graph values), the old value
    read after the rebinding, the new one read later."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.d = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = torch.relu(self.c(x))
        old = self.avg
        self.avg = 0.9 * self.avg + 0.1 * y.mean((0, 2, 3)).detach()
        y = torch.relu(self.d(y)) * old.view(1, -1, 1, 1) + self.avg.view(1, -1, 1, 1)
        return self.fc(y.mean((2, 3))) * self.calls


class Relaid(nn.Module):
    """A buffer rebound to another dtype: an in-place write cannot follow."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 0.5
        return self.c(x) * self.calls


class Aliased(nn.Module):
    """A buffer bound to another buffer: two names for one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)
        self.register_buffer("u", torch.zeros(4))
        self.register_buffer("v", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.u = self.v
        return self.c(x) * self.u.view(1, -1, 1, 1)


class Reset(nn.Module):
    """A buffer rebound to a fresh constant tensor, which the graph does not compute."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)
        self.register_buffer("u", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.u = torch.ones(4)
        return self.c(x) * self.u.view(1, -1, 1, 1)


class Holder(nn.Module):
    """Wraps a module so the write happens in a submodule (a path, not the root)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).relu()


class LazyCache(nn.Module):
    """A value cached on the module on the first call (a new attribute)."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_scale = x.shape[-1] / 8
        return self.c(x) * self.last_scale


class FeatureList(nn.Module):
    """Features kept for a loss outside (deep supervision, distillation) in a list."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.d = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3)
        self.feats: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.c(x))
        self.feats.append(y)
        return self.d(y)


class FeatureDict(FeatureList):
    """Statistics of an activation kept by name, next to a parameter-only entry."""

    def __init__(self) -> None:
        super().__init__()
        self.stats: dict[str, Any] = {"kept": 1}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.c(x))
        self.stats["norm"] = self.d.weight.norm()  # parameters only: a cache, not refused
        self.stats["mean"] = (y.mean(), 0)
        return self.d(y)


class PythonDepth(nn.Module):
    """Stochastic depth decided by Python's (or NumPy's) generator, as some code writes it."""

    def __init__(self, numpy: bool = False) -> None:
        super().__init__()
        self.c, self.d = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.numpy = numpy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import random

        import numpy as np

        y = torch.relu(self.c(x))
        keep = np.random.rand() if self.numpy else random.random()
        return y + self.d(y) if self.training and keep > 0.5 else y


_MODULE_LEVEL = torch.Generator().manual_seed(7)


class OwnGenerator(nn.Module):
    """A random mask drawn from a generator of the model's own (or a module-level one)."""

    def __init__(self, module_level: bool = False) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        if not module_level:
            self.g = torch.Generator().manual_seed(123)
        self.module_level = module_level

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c(x)
        g = _MODULE_LEVEL if self.module_level else self.g
        return y * (torch.rand(y.shape, generator=g) > 0.5)


class EvalCache(nn.Module):
    """An attention-bias-like table cached per device in eval (as timm's LeViT and
    EfficientViT do): parameters only, so the graph computes it and the cache is put back."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)
        self.table = nn.Parameter(torch.randn(4, 1, 1))
        self.cache: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            bias = self.table * 2
        else:
            key = str(x.device)  # traced: the name of a Proxy, as in timm
            if key not in self.cache:
                self.cache[key] = self.table * 2
            bias = self.cache[key]
        return self.c(x) + bias


def test_a_parameter_cache_in_a_dict_is_put_back_and_computed_by_the_graph() -> None:
    """Before, compile left a traced or fake tensor in the caller's cache, which its
    next eager eval call would have read."""
    torch.manual_seed(0)
    model, x = EvalCache(), torch.randn(4, 3, 8, 8)
    ref = copy.deepcopy(model)
    c = crosscut.compile(model, ["cpu", "cpu"], x, microbatches=1, replicas=1)
    assert model.cache == {}
    c.eval(), ref.eval()
    with torch.no_grad():
        assert torch.equal(c(x), ref(x))
    c.train(), ref.train()
    assert_steps_equal(c, ref, x, 1)


@pytest.mark.parametrize(
    ("k", "recompute"), [(1, "auto"), (2, "auto"), (3, "always"), (4, "never")]
)
def test_rebound_buffers_are_kept_across_calls_like_eager(k: int, recompute: str) -> None:
    """``self.calls += 1`` and ``self.avg = 0.9 * self.avg + ...`` are kept as in-place
    writes at the graph's end: every call counts and averages as eager does, on every
    cut, and the caller's model keeps its tensors (before: refused by name)."""
    torch.manual_seed(0)
    model = Reassigned()
    tensors = dict(model._buffers)
    x = torch.randn(4, 3, 8, 8)
    c = crosscut.compile(
        model, ["cpu"] * k, x, microbatches=1, require_all_devices=True, replicas=1,
        recompute=recompute,
    )  # fmt: skip
    assert dict(model._buffers) == tensors and int(model.calls) == 0
    sd = assert_steps_equal(c, copy.deepcopy(model), x, 3)
    assert int(sd["calls"]) == 3 and float(sd["avg"].abs().sum()) > 0
    with pytest.raises(CrosscutError, match="'calls' is written in forward by node 'copy_'"):
        crosscut.compile(model, ["cpu", "cpu"], x, microbatches=2, replicas=1)


@pytest.mark.parametrize(
    ("factory", "name", "remedy"),
    [
        (PythonCounter, "'step'", "register_buffer"),
        (lambda: Holder(PythonCounter()), "'inner.step'", "register_buffer"),
        (LazyCache, "'last_scale'", "register_buffer"),
        (Relaid, "'calls' to a value of another shape or dtype", "int64"),
        (lambda: Holder(Relaid()), "'inner.calls'", ".to(self.<buffer>.dtype)"),
        (Aliased, "'u' to another parameter or buffer \\('v'\\)", "copy_"),
        (Reset, "'u' .* the traced graph does not compute", "in place"),
        (FeatureList, "stores a value computed from its inputs in 'feats'", "forward hook"),
        (lambda: Holder(PythonDepth()), "draws from random.random\\(\\)", "torch.rand"),
        (lambda: PythonDepth(numpy=True), "draws from numpy.random.rand\\(\\)", "bernoulli"),
        (lambda: Holder(FeatureDict()), "in 'inner.stats' \\(a Python dict", "extra output"),
        (lambda: Holder(OwnGenerator()), "Generator of its own \\('inner.g'\\)", "manual_seed"),
        (lambda: OwnGenerator(True), "Generator of its own \\('one outside", "manual_seed"),
    ],
)
def test_python_state_written_in_forward_is_refused_by_name(
    factory: Any, name: str, remedy: str
) -> None:
    """A Python attribute or a rebound buffer changed in forward cannot be a graph node:
    compile refuses it naming the attribute, and leaves the caller's model as it was."""
    import random

    model, draw = factory(), random.random
    before = dict(vars(model.inner if isinstance(model, Holder) else model))
    gen = before.get("g")
    gen_state = None if gen is None else gen.get_state()
    with pytest.raises(CrosscutError, match=name) as e:
        crosscut.compile(model, ["cpu", "cpu"], torch.randn(4, 3, 8, 8), microbatches=1, replicas=1)
    assert remedy in str(e.value) and "likely a crosscut bug" not in str(e.value)
    after = vars(model.inner if isinstance(model, Holder) else model)
    assert {k: v for k, v in after.items() if not k.startswith("_")} == {
        k: v for k, v in before.items() if not k.startswith("_")
    }
    assert dict(after["_buffers"]) == dict(before["_buffers"])
    assert random.random is draw  # Python's draws are watched only while tracing
    if gen is not None:  # no draw from it was left behind
        assert torch.equal(gen.get_state(), gen_state)
    kept = {"feats": [], "stats": {"kept": 1}}  # contents put back, not only the objects
    assert {k: after[k] for k in kept if k in after} == {
        k: v for k, v in kept.items() if k in after
    }


class OwnNorm(nn.Module):
    """``F.batch_norm(training=True)`` on a plain module's own buffers (no ``_BatchNorm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.d = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.batch_norm(self.c(x), self.mean, self.var, None, None, True, 0.1)
        return self.d(torch.relu(y))


@pytest.mark.parametrize("bn_mode", ["micro", "step", "exact"])
def test_functional_batch_norm_on_plain_buffers_with_microbatches_is_refused(
    bn_mode: str,
) -> None:
    """Not a batch norm module, so no bn_mode reaches it: with M > 1 it would move once per
    micro-batch; refused naming the buffer and the node. With M = 1 it is eager's."""
    x = torch.randn(4, 3, 8, 8)
    with pytest.raises(CrosscutError, match=r"'(mean|var)' is written in forward by node "
                       r"'batch_norm'") as e:  # fmt: skip
        crosscut.compile(OwnNorm(), ["cpu", "cpu"], x, microbatches=2, bn_mode=bn_mode, replicas=1)
    assert "microbatches=1" in str(e.value)
    torch.manual_seed(0)
    model = OwnNorm()
    c = crosscut.compile(
        model, ["cpu", "cpu"], x, require_all_devices=True, microbatches=1, replicas=1
    )
    ref = copy.deepcopy(model)
    for _ in range(2):
        out, sd = compiled_step(c, x)
        expected, ref_sd = eager_step(ref, x, 1)
        assert torch.equal(out, expected)
        assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)


# ---- writes the trace cannot see, and parameter writes under recomputation ---------------


class MeanTeacher(nn.Module):
    """A teacher updated as an EMA of the student in forward, through ``.parameters()``:
    the real tensors, which fx neither proxies nor records."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                for t, s in zip(self.teacher.parameters(), self.student.parameters()):
                    t.mul_(0.9).add_(0.1 * s)
        return self.student(x) + self.teacher(x)


class WithTeacher(nn.Module):
    """The same update one level down: that submodule becomes a leaf, which runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 3, 3, padding=1)
        self.pair = MeanTeacher()
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.pair(torch.relu(self.stem(x)))))


class Clipped(nn.Module):
    """WGAN-style weight clipping in forward, on the tensor from ``.parameters()`` (hidden
    from the trace) or through the attribute's ``.data`` (traced)."""

    def __init__(self, hidden: bool) -> None:
        super().__init__()
        self.hidden = hidden
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.c = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.b(torch.relu(self.a(x))))
        with torch.no_grad():
            w = next(iter(self.c.parameters())) if self.hidden else self.c.weight.data
            w.clamp_(-0.1, 0.1)
        return self.c(y)


@pytest.mark.parametrize(
    ("factory", "key"), [(MeanTeacher, "teacher.0.weight"), (lambda: Clipped(True), "c.weight")]
)
def test_writes_the_trace_cannot_see_are_refused_before_they_write(factory: Any, key: str) -> None:
    """Before: the trace ran the write once on the caller's model and recorded nothing
    (a mean teacher: every compiled step after the first differed by up to 39)."""
    model = factory()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CrosscutError, match=f"writes {key!r} in place") as e:
        crosscut.compile(model, ["cpu", "cpu"], torch.randn(4, 3, 8, 8))
    assert "outside forward" in str(e.value) and "likely a crosscut bug" not in str(e.value)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_submodule_writing_hidden_tensors_is_a_leaf_that_runs_its_write(k: int) -> None:
    torch.manual_seed(0)
    model = WithTeacher()
    assert "teacher" in crosscut.trace(model, torch.randn(2, 3, 8, 8)).leaves["pair"]
    x = torch.randn(4, 3, 8, 8)
    c = crosscut.compile(
        copy.deepcopy(model), ["cpu"] * k, x, microbatches=1, require_all_devices=True,
        replicas=1,
    )  # fmt: skip
    assert_steps_equal(c, copy.deepcopy(model), x, 3)


def test_a_recomputing_stage_that_writes_a_parameter_is_refused_at_compile_time() -> None:
    """Before: compile accepted it and the first training call failed in the stage."""
    x = torch.randn(4, 3, 8, 8)
    with pytest.raises(CrosscutError, match=r"stage \d recomputes .* parameter 'c.weight'"):
        crosscut.compile(
            Clipped(False), ["cpu"] * 3, x, microbatches=1, require_all_devices=True,
            replicas=1, recompute="always",
        )  # fmt: skip


def test_auto_recomputation_stays_off_on_a_stage_that_writes_a_parameter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The planner's flags say recompute everywhere (as under memory pressure); the stage
    clipping ``c.weight`` runs without, the others recompute, and steps equal eager's."""
    import crosscut.api

    monkeypatch.setattr(crosscut.api, "recompute_flags_for", lambda r, plan: [True] * 3)
    torch.manual_seed(0)
    model = Clipped(False)
    x = torch.randn(4, 3, 8, 8)
    c = crosscut.compile(
        copy.deepcopy(model), ["cpu"] * 3, x, microbatches=1, require_all_devices=True,
        replicas=1,
    )  # fmt: skip
    writer = c.plan.assignment["clamp_"]
    assert c._recompute == [k != writer for k in range(3)]
    assert_steps_equal(c, copy.deepcopy(model), x, 2)


def test_a_leaf_writing_its_parameters_follows_the_rules_for_state_written_in_forward() -> None:
    """The leaf's writes are found by running it (version counters of its parameters), so
    micro-batches and recomputation refuse it by name at compile time (before: autograd's
    in-place error, or the stage's, at the first training call)."""
    x = torch.randn(4, 3, 8, 8)
    with pytest.raises(CrosscutError, match=r"'pair\.teacher\.0\.weight' is written in forward"):
        crosscut.compile(WithTeacher(), ["cpu", "cpu"], x, microbatches=2, replicas=1)
    with pytest.raises(CrosscutError, match=r"recomputes .* parameter 'pair.teacher.0.weight'"):
        crosscut.compile(
            WithTeacher(), ["cpu"] * 3, x, microbatches=1, replicas=1, recompute="always",
            require_all_devices=True,
        )  # fmt: skip
    c = crosscut.compile(WithTeacher(), ["cpu", "cpu"], x)  # the planner keeps one micro-batch
    assert c.plan.options.microbatches == 1
    c.close()


def test_a_leaf_drawing_from_its_own_generator_is_left_unmoved_by_compile() -> None:
    """Before, a model's own torch.Generator used in the graph was copied into the stages:
    compile advanced the model's generator (propagation draws), a compiled call never did,
    and no call equalled eager's (now refused by name, above). A submodule that runs whole
    (a hook makes it a leaf) draws from the generator itself: compile gives its state
    back, and with one micro-batch the compiled calls draw eager's numbers (from the
    stage's copy of the submodule, as its parameters are)."""
    x = torch.randn(4, 3, 8, 8)
    torch.manual_seed(0)
    model = Holder(OwnGenerator())
    model.inner.register_forward_hook(lambda _m, _i, o: None)  # a leaf: called by its stage
    ref = copy.deepcopy(model)
    before = model.inner.g.get_state()
    c = crosscut.compile(model, ["cpu", "cpu"], x, microbatches=1, replicas=1)
    assert torch.equal(model.inner.g.get_state(), before)
    for _ in range(2):
        assert torch.equal(c(x), ref(x))


class RetainsGrad(nn.Module):
    """``y.retain_grad()`` in forward, as gradient-inspection code leaves it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.h = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        y.retain_grad()
        return self.h(self.b(y).mean((2, 3)))


def test_retain_grad_in_forward_compiles_and_trains_as_eager() -> None:
    """Before, compile refused it as "the model rejected the example inputs" (shapes are
    propagated without gradients, and retain_grad refuses a tensor that needs none),
    with a remedy about input shapes. It changes no value: propagation skips it, and
    the stages run it on tensors that need gradients, as eager does."""
    x = torch.randn(4, 3, 8, 8)
    torch.manual_seed(0)
    model = RetainsGrad()
    ref = copy.deepcopy(model)
    c = crosscut.compile(
        model, ["cpu", "cpu"], x, time_limit=2, require_all_devices=True, microbatches=2
    )
    assert_steps_like_eager(c, ref, x)
