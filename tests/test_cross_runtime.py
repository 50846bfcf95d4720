"""Cross-shaped stages at run time: channel and batch splits against eager mode.

Stages run on groups of logical CPU devices. Channel splits are exact in train
mode (batch norm sees the whole batch on each channel shard; dropout runs whole
on the leader, drawing eager's random numbers). Batch splits normalise each
device's share with its own statistics, so models with batch norm are compared
with batch norm in eval mode, and dropout is switched off (each replica draws
its own mask). Outputs, gradients (shards concatenated) and the state after an
SGD step must match the fx-traced module run eagerly.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import fx, nn

from crosscut.errors import RuntimeError_
from crosscut.runtime import CompiledModule
from crosscut.runtime.batch_split import BatchSplitStage
from tests.test_transparency import build, chunks, no_randomness

torch.set_num_threads(1)
C = ["cpu"]
Groups = list[tuple[list[str], str]]


def _bn_eval(*mods: nn.Module) -> None:
    for mod in mods:
        for m in mod.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()


def grads_by_key(c: CompiledModule) -> dict[str, torch.Tensor]:
    """Every original parameter's gradient, shards concatenated."""
    out: dict[str, torch.Tensor] = {}
    for s, local, p in c.named_stage_parameters():
        for key in c.program.stages[s].param_keys.get(local, []):
            if p.grad is not None:
                out[key] = p.grad
    for key, (s, names, dim) in c.program.shard_sources.items():
        params = dict(c.stages[s].named_parameters())
        if dim is not None and all(n in params for n in names):
            out[key] = torch.cat([params[n].grad for n in names], dim)  # type: ignore[misc]
    return out


def compile_groups(
    name: str, k: int, groups: Groups, *, bn_eval: bool = False, **kw: Any
) -> tuple[CompiledModule, fx.GraphModule]:
    torch.manual_seed(0)
    model = build(name).train()
    if any(split == "batch" for _, split in groups):
        no_randomness(model)
    gm = fx.symbolic_trace(model)
    ref = copy.deepcopy(gm)
    c = CompiledModule(model, gm, chunks(gm, k), [g[0] for g, _ in groups], groups=groups, **kw)
    if bn_eval:
        _bn_eval(c, ref)
    return c, ref


def check_close(name: str, k: int, groups: Groups, *, bn_eval: bool = False) -> CompiledModule:
    c, ref = compile_groups(name, k, groups, bn_eval=bn_eval)
    sd, ref_sd = c.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    assert all(torch.equal(sd[key], ref_sd[key]) for key in ref_sd)  # bit-exact re-assembly
    x = torch.randn(4, 3, 64, 64)
    y = torch.randint(0, 1000, (4,))
    torch.manual_seed(1)
    out = c(x)
    torch.manual_seed(1)
    expected = ref(x)
    torch.testing.assert_close(out, expected)
    nn.functional.cross_entropy(out, y).backward()
    nn.functional.cross_entropy(expected, y).backward()
    got = grads_by_key(c)
    for key, p in ref.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(got[key], p.grad, msg=key)
    torch.optim.SGD(c.parameters(), lr=0.1).step()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    sd, ref_sd = c.state_dict(), ref.state_dict()
    for key, value in ref_sd.items():
        torch.testing.assert_close(sd[key], value, msg=key)
    return c


CASES = [
    ("alexnet", 2, [(C * 2, "channel"), (C * 2, "channel")], False),
    ("alexnet", 1, [(C * 4, "channel")], False),
    ("alexnet", 2, [(C * 2, "batch"), (C * 2, "batch")], False),
    ("alexnet", 1, [(C * 4, "batch")], False),
    ("vgg11", 2, [(C * 2, "channel"), (C * 2, "batch")], False),
    ("vgg11", 1, [(C * 4, "batch")], False),
    ("resnet18", 2, [(C * 2, "channel"), (C * 2, "channel")], False),
    ("resnet18", 1, [(C * 4, "batch")], True),
    ("googlenet", 1, [(C * 4, "channel")], False),
    ("googlenet", 2, [(C * 2, "batch"), (C * 2, "channel")], True),
]


@pytest.mark.parametrize(("name", "k", "groups", "bn_eval"), CASES)
def test_cross_shaped_matches_eager(name: str, k: int, groups: Groups, bn_eval: bool) -> None:
    c = check_close(name, k, groups, bn_eval=bn_eval)
    kinds = {col.kind for s in c.program.stages for col in s.collectives}
    if any(split == "channel" for _, split in groups):
        assert "all_gather" in kinds and c.program.shard_sources
    if any(split == "batch" for _, split in groups):
        assert "all_reduce" in kinds
    c.close()


def test_channel_shards_hold_only_their_slice() -> None:
    c, _ = compile_groups("alexnet", 1, [(C * 3, "channel")])  # 64 channels over 3: 22, 21, 21
    s, names, dim = c.program.shard_sources["features.0.weight"]
    params = dict(c.stages[s].named_parameters())
    assert dim == 0 and [params[n].shape[0] for n in names] == [22, 21, 21]
    assert sum(p.numel() for p in c.parameters()) == sum(
        p.numel() for p in build("alexnet").parameters()
    )
    c.close()


def test_uneven_shards_are_exact() -> None:
    check_close("alexnet", 2, [(C * 3, "channel"), (["cpu"], "none")]).close()


def test_load_state_dict_cuts_a_checkpoint_into_shards() -> None:
    c, _ref = compile_groups("resnet18", 2, [(C * 2, "channel"), (C * 2, "batch")])
    other = build("resnet18").state_dict()
    before = c.state_dict()
    assert not torch.equal(before["conv1.weight"], other["conv1.weight"])
    c.load_state_dict(other)
    sd = c.state_dict()
    assert all(torch.equal(sd[k], other[k]) for k in other)
    c.close()


def test_train_step_microbatches_matches_eager() -> None:
    c, ref = compile_groups(
        "alexnet", 2, [(C * 2, "channel"), (C * 2, "batch")], schedule="1f1b", microbatches=2
    )
    x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 1000, (4,))
    loss = c.train_step(x, y, nn.functional.cross_entropy)
    expected = nn.functional.cross_entropy(ref(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    got = grads_by_key(c)
    for key, p in ref.named_parameters():
        torch.testing.assert_close(got[key], p.grad, msg=key)
    c.close()


def test_exact_bn_refuses_batch_split_with_batch_norm() -> None:
    c, _ = compile_groups("resnet18", 1, [(C * 2, "batch")], bn_mode="exact")
    with pytest.raises(RuntimeError_, match="batch-split"):
        c(torch.randn(2, 3, 64, 64))
    c.eval()
    c(torch.randn(2, 3, 64, 64))  # eval mode uses running statistics: allowed
    c.close()


class _Boom(nn.Module):
    """Fails on a share holding a NaN (a leaf for the tracer, so the check is not traced)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.isnan(x).any():
            raise ValueError("NaN in this share")
        return x


class _Leaves(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, _Boom) or super().is_leaf_module(m, qualname)


def _small(dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        _Boom(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(8, 5),
    ).train()


def _compile_small(model: nn.Module, width: int, **kw: Any) -> CompiledModule:
    gm = fx.GraphModule(model, _Leaves().trace(model))
    return CompiledModule(model, gm, chunks(gm, 1), ["cpu"], groups=[(C * width, "batch")], **kw)


def _batch_stage(c: CompiledModule) -> BatchSplitStage:
    return next(m for m in c.modules() if isinstance(m, BatchSplitStage))


def test_batch_split_shares_run_on_one_thread_per_device() -> None:
    torch.manual_seed(0)
    c = _compile_small(_small(), 3)
    stage = _batch_stage(c)
    seen: list[int] = []
    stage.inner.get_submodule("0").register_forward_hook(
        lambda *_: seen.append(threading.get_ident())
    )
    x = torch.randn(6, 3, 8, 8)
    c(x)  # one micro-batch on CPU: the stage runs inline, the leader's share on this thread
    assert len(seen) == 3 and len(set(seen)) == 3 and seen.count(threading.get_ident()) == 1
    seen.clear()
    stage.parallel = False  # the sequential switch: every share on the stage's thread
    c(x)
    assert seen == [threading.get_ident()] * 3
    c.close()
    assert stage._threads is None


def test_failing_share_is_named_and_the_stage_recovers() -> None:
    torch.manual_seed(0)
    c = _compile_small(_small(), 3)
    x = torch.randn(6, 3, 8, 8)
    x[5, 0, 0, 0] = float("nan")  # rows 4:6 are share 2
    with pytest.raises(RuntimeError_, match=r"share 2 of 3 .*rows 4:6 on cpu.*NaN in this share"):
        c(x)
    with pytest.raises(RuntimeError_, match=r"share 2 of 3") as info:
        _batch_stage(c)(x)
    assert info.value.value == {"share": 2, "device": "cpu", "rows": [4, 6]}
    assert c(x[:4]).shape == (4, 5)  # the threads survived the failure
    c.close()


@pytest.mark.parametrize("how", ["forward", "train_step"])
def test_parallel_shares_equal_sequential_bit_for_bit(how: str) -> None:
    results = []
    for parallel in (True, False):
        torch.manual_seed(0)
        c = _compile_small(_small(), 3, schedule="1f1b", microbatches=2, bn_mode="step")
        _batch_stage(c).parallel = parallel
        x, y = torch.randn(12, 3, 8, 8), torch.randint(0, 5, (12,))
        for i in range(2):
            if how == "forward":
                out = c(x + i)
                nn.functional.cross_entropy(out, y).backward()
            else:
                out = c.train_step(x + i, y, nn.functional.cross_entropy)
        grads = [p.grad for p in c.parameters()]
        results.append((out.detach(), grads, c.state_dict()))
        c.close()
    (out_p, grads_p, sd_p), (out_s, grads_s, sd_s) = results
    assert torch.equal(out_p, out_s)
    assert all(torch.equal(a, b) for a, b in zip(grads_p, grads_s))  # type: ignore[arg-type]
    assert all(torch.equal(sd_p[k], sd_s[k]) for k in sd_s)  # step-mode BN commit included


def test_dropout_in_a_batch_split_stage_keeps_the_sequential_draws() -> None:
    outs = []
    for parallel in (True, False):
        torch.manual_seed(0)
        c = _compile_small(_small(dropout=0.5), 3)
        _batch_stage(c).parallel = parallel
        torch.manual_seed(1)
        outs.append(c(torch.ones(6, 3, 8, 8)))
        c.close()
    assert torch.equal(outs[0], outs[1])
