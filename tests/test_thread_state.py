"""The caller's thread-local torch state reaches every thread a compiled call runs on.

Autocast, grad mode, inference mode and saved-tensor hooks are per thread in
torch. With one micro-batch on CPU a compiled module runs inline on the
caller's thread; with several, each stage runs on a worker thread, and a
batch-split stage runs its shares on threads of its own. Every one of them
must see the caller's state (``crosscut/runtime/thread_state.py``), so the
same call gives eager's dtypes and values whatever ``microbatches`` is, and
``torch.amp.GradScaler`` sees every stage's gradients.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import fx, nn

from crosscut.runtime import CompiledModule
from crosscut.runtime.thread_state import ThreadState
from tests.test_runtime_local import chunks, compiled_grads, grads

torch.set_num_threads(1)
BF16 = torch.bfloat16


class Net(nn.Module):
    """Conv, batch-free norm, a skip over a stage, linear: autocast casts every matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.c3 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.c1(x))
        b = torch.relu(self.norm(self.c2(a)))
        c = self.c3(b) + a
        return self.fc(c.mean((2, 3)))


def compiled(
    model: nn.Module, k: int, mb: int, groups: list[tuple[list[str], str]] | None = None
) -> CompiledModule:
    gm = fx.symbolic_trace(model)
    devices = [g[0] for g, _ in groups] if groups else ["cpu"] * k
    return CompiledModule(model, gm, chunks(gm, k), devices, "gpipe", mb, groups=groups)


def per_micro_batch(model: nn.Module, x: torch.Tensor, mb: int) -> torch.Tensor:
    """Eager on the same micro-batches (the kernels see the same batch sizes)."""
    return torch.cat([model(xc) for xc in x.chunk(mb)])


def test_capture_is_entered_on_another_thread() -> None:
    def pack(t: torch.Tensor) -> torch.Tensor:
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    seen: dict[str, Any] = {}
    with (
        torch.autocast("cpu", dtype=BF16, cache_enabled=False),
        torch.no_grad(),
        torch.autograd.graph.saved_tensors_hooks(pack, unpack),
    ):
        state = ThreadState.capture()

    def other() -> None:
        seen["fresh"] = (torch.is_autocast_enabled("cpu"), torch.is_grad_enabled())
        with state.applied():
            seen["in"] = (
                torch.is_autocast_enabled("cpu"),
                torch.get_autocast_dtype("cpu"),
                torch.is_autocast_cache_enabled(),
                torch.is_grad_enabled(),
                torch._C._autograd._top_saved_tensors_default_hooks(False),
            )
        seen["after"] = (torch.is_autocast_enabled("cpu"), torch.is_grad_enabled())

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["fresh"] == (False, True)  # a new thread starts with torch's defaults
    assert seen["in"] == (True, BF16, False, False, (pack, unpack))
    assert seen["after"] == (False, True)  # and gets them back
    assert state.autocasting and not state.grad and not state.inference


@pytest.mark.parametrize(("k", "mb"), [(2, 1), (3, 1), (2, 2), (3, 4)])
def test_autocast_dtypes_values_and_grads_match_eager(k: int, mb: int) -> None:
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    c = compiled(model, k, mb)
    x = torch.randn(8, 3, 8, 8)
    with torch.autocast("cpu", dtype=BF16):
        out = c(x)
        whole = ref(x)
        same_chunks = per_micro_batch(copy.deepcopy(ref), x, mb)
    assert out.dtype == whole.dtype == BF16
    if mb == 1:  # inline on the caller's thread: the very ops of eager mode
        assert torch.equal(out, whole)
    torch.testing.assert_close(out, same_chunks)
    torch.testing.assert_close(out, whole, rtol=2e-2, atol=2e-2)
    out.float().pow(2).mean().backward()
    whole.float().pow(2).mean().backward()
    got = compiled_grads(c)
    want = grads(ref)
    assert set(got) == set(want)
    for key, g in want.items():
        assert got[key].dtype == g.dtype == torch.float32
        torch.testing.assert_close(got[key], g, rtol=5e-2, atol=5e-3, msg=key)


@pytest.mark.parametrize("mb", [1, 2])
def test_autocast_reaches_the_share_threads_of_a_batch_split_stage(mb: int) -> None:
    """The last stage runs on a 2-device batch group: share 1 on a thread of its own.

    A share left in float32 would make the concatenated output float32."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    c = compiled(model, 2, mb, groups=[(["cpu"], "none"), (["cpu", "cpu"], "batch")])
    assert c.program.stages[1].split == "batch"
    x = torch.randn(8, 3, 8, 8)
    with torch.autocast("cpu", dtype=BF16):
        out = c(x)
        whole = ref(x)
    assert out.dtype == BF16
    torch.testing.assert_close(out, whole, rtol=2e-2, atol=2e-2)
    with torch.autocast("cpu", dtype=BF16, enabled=False):  # and off again: float32, exact
        torch.testing.assert_close(c(x), ref(x))


@pytest.mark.parametrize("mb", [1, 4])
def test_no_grad_and_inference_mode_keep_no_graph(mb: int) -> None:
    torch.manual_seed(0)
    c = compiled(Net(), 3, mb)
    x = torch.randn(8, 3, 8, 8)
    packed: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(threading.get_ident())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.no_grad():
            out = c(x)
        assert not out.requires_grad and out.grad_fn is None
        assert packed == []  # nothing saved for a backward: no graph anywhere
        with torch.inference_mode():
            inf = c(x)
        assert inf.is_inference() and not inf.requires_grad
        assert packed == []
        live = c(x)  # grad mode on: saved tensors, through the caller's hooks
    assert live.requires_grad and packed
    if mb > 1:  # ... packed on the stage workers, which entered the caller's hooks
        assert any(ident != threading.get_ident() for ident in packed)
    torch.testing.assert_close(out, inf)
    torch.testing.assert_close(out, live.detach())


def _scaler_steps(
    model: nn.Module,
    step: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int = 3,
    init_scale: float = 2.0**12,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scales = []
    for _ in range(steps):
        opt.zero_grad()
        step(scaler, x, y)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _eager_step(model: nn.Module) -> Any:
    def step(scaler: torch.amp.GradScaler, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
            assert out.dtype == torch.float16
            loss = nn.functional.cross_entropy(out.float(), y)
        scaler.scale(loss).backward()

    return step


@pytest.mark.parametrize("path", ["forward", "train_step"])
def test_grad_scaler_with_float16_autocast_matches_eager(path: str) -> None:
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    c = compiled(model, 3, 2)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))
    if path == "forward":
        step = _eager_step(c)
    else:

        def step(scaler: torch.amp.GradScaler, x: torch.Tensor, y: torch.Tensor) -> None:
            def loss_fn(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
                assert out.dtype == torch.float16  # on the last stage's worker thread
                return scaler.scale(nn.functional.cross_entropy(out.float(), t))

            with torch.autocast("cpu", dtype=torch.float16):
                c.train_step(x, y, loss_fn)

    scales, state = _scaler_steps(c, step, x, y)
    want_scales, want = _scaler_steps(ref, _eager_step(ref), x, y)
    assert scales == want_scales == [2.0**13, 2.0**14, 2.0**15]
    for key, v in want.items():
        torch.testing.assert_close(state[key], v, rtol=2e-2, atol=2e-3, msg=key)


def test_grad_scaler_skips_the_step_when_only_the_first_stage_overflows() -> None:
    """The inf/NaN check spans every stage: an inf in stage 0 alone skips the step."""
    torch.manual_seed(0)
    c = compiled(Net(), 3, 2)
    before = {k: v.clone() for k, v in c.state_dict().items()}
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = torch.optim.SGD(c.parameters(), lr=0.1)
    _eager_step(c)(scaler, x, y)
    first = next(p for s, _, p in c.named_stage_parameters() if s == 0)
    last = next(p for s, _, p in c.named_stage_parameters() if s == 2)
    assert first.grad is not None and last.grad is not None
    assert any(first is p for p in c.parameters())
    first.grad.view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**7  # backed off
    after = c.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # no stage stepped


def test_wire_dtypes_follow_autocast_and_leave_the_model_untouched() -> None:
    """Under torchrun the receivers post buffers in the dtypes autocast gives each value
    (runtime/dist/wire_dtypes.py), derived on fake tensors: batch norm's counters stay put."""
    from crosscut.api import trace
    from crosscut.errors import DistributedError
    from crosscut.runtime.dist.wire_dtypes import WireDtypes

    class WithNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.bn = nn.BatchNorm2d(4)
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.bn(self.conv(x)).mean((2, 3))
            return self.fc(h), nn.functional.mse_loss(h, h.flip(0), reduction="none")

    model = WithNorm().train()
    graph = trace(model, torch.randn(2, 3, 8, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wire = WireDtypes(graph.gm, torch.device("cpu"), cross_shaped=False)
    assert wire.for_state(ThreadState.capture()) == {}  # autocast off: the traced dtypes
    with torch.autocast("cpu", dtype=BF16):
        state = ThreadState.capture()
        real = model(torch.randn(2, 3, 8, 8))
    dtypes = wire.for_state(state)
    assert dtypes["conv"] == [BF16] and dtypes["fc"] == [real[0].dtype] == [BF16]
    assert dtypes["mse_loss"] == [real[1].dtype] == [torch.float32]  # autocast's fp32 list
    model.load_state_dict(before)  # the real call above counted a batch; fakes do not:
    wire._cache.clear()
    wire.for_state(state)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(DistributedError, match="cross-shaped"):
        WireDtypes(graph.gm, torch.device("cpu"), cross_shaped=True).for_state(state)
