"""``bn_mode="step"``: running statistics updated once per step from the whole batch.

Two references, both eager on one device:

* **full batch** — plain training. The pipeline normalises each micro-batch
  (share) alone, so only batch norms whose input does not pass through an
  earlier batch norm can match it: resnet18's stem ``bn1``, and every batch
  norm of :class:`Calib`, which reads un-normalised paths only.
* **ghost** (:func:`ghost_step`) — the same chunks normalised alone, gradients
  accumulated over them (loss ``/ chunks``), then ONE running-statistics update
  per batch norm computed directly with ``torch.var_mean(cat(inputs))``. This is
  what ``"step"`` promises for every layer.

Every equality is also checked to fail under ``"micro"``, so the tests
discriminate.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torchvision
from torch import fx, nn

import crosscut
import crosscut.api
from crosscut.errors import InputError, RuntimeError_
from crosscut.runtime import CompiledModule
from crosscut.runtime.batchnorm import (
    StepBatchNorm,
    commit_batchnorm,
    install_step_batchnorm,
)
from tests.test_runtime_local import chunks

torch.set_num_threads(1)
BN = nn.modules.batchnorm._BatchNorm
LossFn = Callable[[Any, Any], torch.Tensor]
CE: LossFn = nn.functional.cross_entropy


def tracking_bns(model: nn.Module) -> dict[str, BN]:
    return {n: m for n, m in model.named_modules() if isinstance(m, BN) and m.track_running_stats}


def ghost_step(
    ref: nn.Module, parts: Sequence[torch.Tensor], targets: Sequence[Any] | None, loss_fn: LossFn
) -> None:
    """Eager training step that normalises each part alone and updates running stats once."""
    bns = tracking_bns(ref)
    before = {n: (m.running_mean.clone(), m.running_var.clone()) for n, m in bns.items()}  # type: ignore[union-attr]
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in bns}
    hooks = [
        m.register_forward_pre_hook(lambda _m, a, n=n: seen[n].append(a[0].detach()))
        for n, m in bns.items()
    ]
    outs = [ref(x) for x in parts]
    if targets is not None:  # one mean loss over the whole batch, as the compiled module sees it
        loss_fn(torch.cat(outs), torch.cat(list(targets))).backward()
    for h in hooks:
        h.remove()
    with torch.no_grad():
        for n, m in bns.items():
            assert len(seen[n]) == len(parts), "one call per forward in these models"
            xs = torch.cat(seen[n])
            var, mean = torch.var_mean(xs, dim=[0, *range(2, xs.dim())], correction=1)
            assert m.num_batches_tracked is not None
            m.num_batches_tracked.sub_(len(parts) - 1)  # the parts' forwards counted M
            f = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
            rm, rv = before[n]
            m.running_mean.copy_((1 - f) * rm + f * mean)  # type: ignore[union-attr]
            m.running_var.copy_((1 - f) * rv + f * var)  # type: ignore[union-attr]


def assert_state_close(c: CompiledModule, ref: nn.Module, what: str = "") -> None:
    sd = c.state_dict()
    ref_sd = ref.state_dict()
    assert list(sd) == list(ref_sd)
    for key, value in ref_sd.items():
        torch.testing.assert_close(sd[key], value, msg=f"{what} {key}")


def assert_eval_close(c: CompiledModule, ref: nn.Module, probe: torch.Tensor) -> None:
    """The user-visible result: eval outputs equal the reference's after one SGD step.

    Why only after the first step: with shares of 4 samples, resnet18's batch
    norms make the second step's gradients ill-conditioned. Eager against
    eager, scaling the loss by 1 + 2**-22 changes step 1's gradients by 3 %
    (step 0's by 1e-6), so after a second SGD step only bit-identical
    rounding could compare equal: it held on the earlier sessions' hosts and
    failed on an AVX2 one (2026-11-23). The running statistics of both steps and the parameters the
    second step starts from are still compared by the callers.
    """
    c.eval()
    ref.eval()
    torch.testing.assert_close(c(probe), ref(probe))
    c.train()
    ref.train()


def resnet(bn_mode: str, mb: int, schedule: str) -> tuple[CompiledModule, nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    ref = copy.deepcopy(model)
    gm = fx.symbolic_trace(model)
    c = CompiledModule(model, gm, chunks(gm, 2), ["cpu"] * 2, schedule, mb, bn_mode=bn_mode)
    return c, ref, model


def step(c: CompiledModule, x: torch.Tensor, y: torch.Tensor, how: str) -> None:
    if how == "train_step":
        c.train_step(x, y, CE)
    else:
        CE(c(x), y).backward()


@pytest.mark.parametrize(
    ("mb", "schedule", "how"),
    [(2, "gpipe", "train_step"), (4, "1f1b", "train_step"), (4, "gpipe", "forward")],
)
def test_step_running_stats_equal_ghost_eager_over_two_steps(
    mb: int, schedule: str, how: str
) -> None:
    c, ref, model = resnet("step", mb, schedule)
    opt_c = torch.optim.SGD(c.parameters(), lr=0.01)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.01)
    # micro-batches of 4: with 2 samples, layer4's 1x1 batch norm is so ill-conditioned that
    # rounding differences of 1e-7 grow to percents in one SGD step (eager against eager too)
    x, y = torch.randn(4 * mb, 3, 32, 32), torch.randint(0, 10, (4 * mb,))
    for i in range(2):
        xi, yi = x + i, y.roll(i)
        opt_c.zero_grad()
        opt_r.zero_grad()
        step(c, xi, yi, how)
        ghost_step(ref, xi.chunk(mb), yi.chunk(mb), CE)
        assert_state_close(c, ref, f"step {i}:")
        assert int(c.state_dict()["bn1.num_batches_tracked"]) == i + 1  # steps, not micro-batches
        if i == 0:
            opt_c.step()
            opt_r.step()
            assert_eval_close(c, ref, torch.randn(4 * mb, 3, 32, 32))
    assert type(model.bn1) is nn.BatchNorm2d  # the caller's model is untouched
    assert any(isinstance(m, StepBatchNorm) for m in c.modules())
    c.close()


@pytest.mark.parametrize("bn_mode", ["step", "micro"])
def test_stem_batch_norm_equals_full_batch_training_only_in_step_mode(bn_mode: str) -> None:
    c, ref, _ = resnet(bn_mode, 4, "1f1b")
    ghost = copy.deepcopy(ref)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    c.train_step(x, y, CE)
    CE(ref(x), y).backward()  # plain single-device training on the whole batch
    ghost_step(ghost, x.chunk(4), y.chunk(4), CE)
    sd, full_sd, ghost_sd = c.state_dict(), ref.state_dict(), ghost.state_dict()
    stem = ("bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked")
    deep = ("layer4.1.bn2.running_var", "layer2.0.downsample.1.running_mean")
    if bn_mode == "step":
        for key in stem:
            torch.testing.assert_close(sd[key], full_sd[key], msg=key)
        for key in deep:  # deeper inputs depend on per-micro-batch normalisation
            torch.testing.assert_close(sd[key], ghost_sd[key], msg=key)
            assert not torch.allclose(sd[key], full_sd[key], rtol=1e-4, atol=1e-5), key
    else:
        for key in (*stem, *deep):
            assert not torch.allclose(sd[key].double(), ghost_sd[key].double()), key
        assert int(sd["bn1.num_batches_tracked"]) == 4
    c.close()


def test_batch_split_stage_combines_the_shares() -> None:
    """One stage over two devices by batch, two micro-batches: four shares per step."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    ref = copy.deepcopy(model)
    gm = fx.symbolic_trace(model)
    groups = [(["cpu", "cpu"], "batch")]
    c = CompiledModule(model, gm, chunks(gm, 1), ["cpu"], "1f1b", 2, bn_mode="step", groups=groups)
    opt_c = torch.optim.SGD(c.parameters(), lr=0.01)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.01)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))  # shares of 4
    for i in range(2):
        opt_c.zero_grad()
        opt_r.zero_grad()
        c.train_step(x + i, y, CE)
        shares = [s for mb in (x + i).chunk(2) for s in mb.tensor_split(2)]
        ghost_step(ref, shares, [s for mb in y.chunk(2) for s in mb.tensor_split(2)], CE)
        assert_state_close(c, ref, f"step {i}:")
        if i == 0:
            opt_c.step()
            opt_r.step()
            assert_eval_close(c, ref, x)
    c.close()


def test_channel_split_shards_update_once_per_step() -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    ref = copy.deepcopy(model)
    gm = fx.symbolic_trace(model)
    groups = [(["cpu", "cpu"], "channel"), (["cpu", "cpu"], "channel")]
    c = CompiledModule(
        model, gm, chunks(gm, 2), ["cpu", "cpu"], "gpipe", 2, bn_mode="step", groups=groups
    )
    assert c.program.shard_sources
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    c.train_step(x, y, CE)
    ghost_step(ref, x.chunk(2), y.chunk(2), CE)
    sd = c.state_dict()
    for key, value in ref.state_dict().items():
        if "running" in key or "num_batches" in key:
            torch.testing.assert_close(sd[key], value, msg=key)
    c.close()


class Calib(nn.Module):
    """Every tracking batch norm reads an un-normalised path, so pipelining cannot change
    its input: momentum=None (cumulative average), affine=False, BatchNorm1d, and a shared
    module called at two sites (two updates per step, as in eager mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn_in = nn.BatchNorm2d(3, momentum=None)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.side = nn.Conv2d(3, 8, 3, padding=1)
        self.shared = nn.BatchNorm2d(8, affine=False)
        self.bn1d = nn.BatchNorm1d(3, momentum=None, affine=False)
        self.fc = nn.Linear(8 + 3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.conv(self.bn_in(x))
        b = self.shared(self.side(x)) + self.shared(self.conv(x))
        feat = torch.relu(a + b).mean((2, 3))
        return self.fc(torch.cat([feat, self.bn1d(x.mean((2, 3)))], 1))


def compile_calib(bn_mode: str, mb: int) -> tuple[CompiledModule, nn.Module]:
    torch.manual_seed(0)
    model = Calib().train()
    ref = copy.deepcopy(model)
    gm = fx.symbolic_trace(model)
    nodes = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    cut = nodes.index("shared_1") + 1  # a module's tensors live on one stage: both calls on 0
    stage_of = {
        name: 0 if i < cut else 1 + 2 * (i - cut) // (len(nodes) - cut)
        for i, name in enumerate(nodes)
    }
    c = CompiledModule(model, gm, stage_of, ["cpu"] * 3, "1f1b", mb, bn_mode=bn_mode)
    return c, ref


@pytest.mark.parametrize("bn_mode", ["step", "micro"])
def test_recalibration_with_momentum_none_equals_eager(bn_mode: str) -> None:
    """swa_utils.update_bn-style: training-mode forwards, no optimizer, then eval."""
    c, ref = compile_calib(bn_mode, 4)
    batches = [torch.randn(8, 3, 6, 6) * (i + 1) + i for i in range(3)]
    with torch.no_grad():
        for x in batches:
            c(x)
            ref(x)  # plain full-batch eager
    sd, ref_sd = c.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    c.eval()
    ref.eval()
    probe = torch.randn(8, 3, 6, 6)
    if bn_mode == "step":
        for key, value in ref_sd.items():
            torch.testing.assert_close(sd[key], value, msg=key)
        assert int(sd["shared.num_batches_tracked"]) == 6  # two call sites × three steps
        torch.testing.assert_close(c(probe), ref(probe))
    else:
        assert int(sd["bn_in.num_batches_tracked"]) == 12
        assert not torch.allclose(sd["bn_in.running_var"], ref_sd["bn_in.running_var"])
        assert not torch.allclose(c(probe), ref(probe))
    c.close()


def test_one_microbatch_step_mode_is_torchs_own_batch_norm() -> None:
    c, ref = compile_calib("step", 1)
    assert not any(isinstance(m, StepBatchNorm) for m in c.modules())
    x = torch.randn(4, 3, 6, 6)
    assert torch.equal(c(x), fx.symbolic_trace(ref)(x))
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in c.state_dict().items())


def test_untracked_batch_norm_is_left_alone() -> None:
    """track_running_stats=False: batch statistics in train and eval, nothing to commit."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False), nn.Flatten()
    )
    ref = copy.deepcopy(model)
    gm = fx.symbolic_trace(model)
    c = CompiledModule(model, gm, chunks(gm, 2), ["cpu"] * 2, "gpipe", 2, bn_mode="step")
    assert not any(isinstance(m, StepBatchNorm) for m in c.modules())
    x = torch.randn(4, 3, 5, 5)
    torch.testing.assert_close(c(x), torch.cat([ref(x[:2]), ref(x[2:])]))
    assert list(c.state_dict()) == list(ref.state_dict())
    assert not any("running" in key for key in ref.state_dict())
    c.close()


def test_failed_step_leaves_running_stats_alone() -> None:
    c, _ = compile_calib("step", 2)
    before = c.state_dict()

    def bad_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad loss")

    x = torch.randn(4, 3, 6, 6)
    with pytest.raises(RuntimeError_, match="bad loss"):
        c.train_step(x, torch.zeros(4, dtype=torch.long), bad_loss)
    after = c.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert commit_batchnorm(c.stages) == 0  # nothing left pending
    c.close()


def test_commit_reduce_sums_replicas() -> None:
    """Two 'replicas' see half the batch each; ``reduce`` makes both commit the whole batch."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None))
    a, b, whole = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    for m in (a, b, whole):
        assert install_step_batchnorm(m) == 1
    x = torch.randn(6, 3, 5, 5) + 3
    a(x[:2])
    b(x[2:])
    whole(x[:2])
    whole(x[2:])
    sent: list[torch.Tensor] = []
    assert commit_batchnorm(b, reduce=lambda t: sent.append(t.clone()) or t) == 1
    assert commit_batchnorm(a, reduce=lambda t: t + sent[0]) == 1
    assert commit_batchnorm(whole, reduce=lambda t: t) == 1
    eager = copy.deepcopy(base)
    eager(x)
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(a.state_dict()[key], value, msg=key)
        torch.testing.assert_close(whole.state_dict()[key], value, msg=key)


class OwnForward(nn.BatchNorm2d):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 1.0


def test_unknown_bn_mode_and_overridden_forward_are_refused() -> None:
    class Leaf(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return isinstance(m, OwnForward) or super().is_leaf_module(m, qualname)

    model = nn.Sequential(nn.Conv2d(3, 4, 3), OwnForward(4), nn.Flatten(), nn.Linear(36, 2))
    gm = fx.GraphModule(model, Leaf().trace(model))
    with pytest.raises(InputError, match="bn_mode must be known"):
        CompiledModule(model, gm, chunks(gm, 2), ["cpu"] * 2, "gpipe", 2, bn_mode="ghost")
    with pytest.raises(InputError, match=r"_BatchNorm\.forward.*OwnForward"):
        CompiledModule(model, gm, chunks(gm, 2), ["cpu"] * 2, "gpipe", 2, bn_mode="step")


def test_compile_passes_bn_mode_and_refuses_it_under_torchrun(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.randn(8, 3, 6, 6)
    c = crosscut.compile(Calib(), ["cpu", "cpu"], x, microbatches=2, bn_mode="step", replicas=1)
    assert c.bn_mode == "step"
    assert any(isinstance(m, StepBatchNorm) for m in c.modules())
    c.close()
    monkeypatch.setattr(crosscut.api, "_distributed_run", lambda: True)
    with pytest.raises(InputError, match="distributed runtime runs batch norm in bn_mode"):
        crosscut.compile(Calib(), None, x, microbatches=2, bn_mode="exact", replicas=1)
