"""One rule for batch-split stages (runtime/batch_shares.py), on the local runtime.

The torchrun runtime's members follow the same functions; tests/test_cross_distributed.py
runs them end to end.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx, nn

from crosscut.errors import CodegenError
from crosscut.frontend.tracer import trace
from crosscut.runtime import CompiledModule
from crosscut.runtime.batch_shares import (
    batch_of,
    check_output,
    input_kind,
    share_bounds,
    split_rows,
)


class SizeAcross(nn.Module):
    """Exports ``y.size(0)`` from the first stage; the second reshapes by it."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c(x)
        n = y.size(0)
        z = torch.relu(y)
        return self.fc(z.reshape(n, -1))


def _split_at(gm: fx.GraphModule, first_of_stage1: str) -> dict[str, int]:
    stage, out = 0, {}
    for n in gm.graph.nodes:
        stage = 1 if n.name == first_of_stage1 else stage
        out[n.name] = stage
    return out


def test_rule_functions() -> None:
    x = torch.zeros(5, 2)
    assert batch_of([3, x], "s") == 5
    assert batch_of([(torch.zeros(2),), x], "s") == 5  # a tensor argument first
    assert batch_of([3, (x, torch.zeros(2))], "s") == 5
    with pytest.raises(CodegenError, match="batch-major tensor input"):
        batch_of([3, torch.zeros(())], "s")
    assert share_bounds(5, 2) == [(0, 3), (3, 5)]
    assert share_bounds(2, 4) == [(0, 1), (1, 2)]  # no empty shares
    assert input_kind(x, 5) == "split"
    assert input_kind(torch.zeros(4, 2), 5) == "whole"
    assert input_kind((x[:1], 2), 5) == "whole"
    assert input_kind((x, {"b": x}, 3), 5) == "split"  # every tensor in it is batch-major
    assert input_kind((x, x[:1]), 5) == "whole"
    shares = split_rows((x, 3, {"b": x[:, :1]}), 2)
    assert [s[0].shape[0] for s in shares] == [3, 2] and [s[1] for s in shares] == [3, 3]
    assert torch.equal(torch.cat([s[2]["b"] for s in shares]), x[:, :1])
    assert input_kind((1, "a"), 5) == "const"
    check_output(torch.zeros(3, 1), 3, "0", "s")
    check_output((torch.zeros(3), {"aux": torch.zeros(3, 2)}), 3, "0", "s")  # a pytree
    bad_values = (
        torch.zeros(()),
        torch.zeros(2, 3),
        3,
        (),
        (torch.zeros(3), 3),  # a leaf that is not a tensor
        (torch.zeros(3), torch.zeros(2)),  # a leaf without the batch
    )
    for bad in bad_values:
        with pytest.raises(CodegenError, match="cannot be concatenated"):
            check_output(bad, 3, "0", "s")


def test_a_shape_exported_by_a_batch_split_stage_is_refused_at_compile_time() -> None:
    torch.manual_seed(0)
    model = SizeAcross()
    x = torch.randn(8, 3, 8, 8)
    gm = trace(model, x).gm
    assert gm is not None
    stage_of = _split_at(gm, "relu")
    groups = [(["cpu", "cpu"], "batch"), (["cpu"], "none")]
    # before: each share exported its own 4 rows as the batch size, and stage 1 crashed
    # (or, with a reshape that fits, computed wrong numbers)
    with pytest.raises(CodegenError, match=r"'size'.*non-tensor value"):
        CompiledModule(model, gm, stage_of, ["cpu", "cpu"], groups=groups)
    # the same cut as a plain pipeline is exact: both stages see the same micro-batch
    c = CompiledModule(model, trace(model, x).gm, stage_of, ["cpu", "cpu"])
    assert torch.allclose(c(x), model(x), atol=1e-6)


class PytreeWhole(nn.Module):
    """The batch-split stage reads a tuple holding a tensor (copied whole to each share)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = x.mean(0).chunk(2)  # a tuple-valued node, not batch-major, read by stage 1
        y = self.lin(x)
        return torch.cat([y[:, :2] * parts[0], y[:, 2:] + parts[1]], 1)


def test_whole_pytree_inputs_reach_every_share() -> None:
    torch.manual_seed(0)
    model = PytreeWhole()
    x = torch.randn(6, 4)
    gm = trace(model, x).gm
    assert gm is not None
    names = [n.name for n in gm.graph.nodes]
    assert names.index("chunk") < names.index("lin")
    stage_of = _split_at(gm, "lin")
    groups = [(["cpu"], "none"), (["cpu", "cpu", "cpu"], "batch")]
    c = CompiledModule(model, gm, stage_of, ["cpu", "cpu"], groups=groups)
    out = c(x)
    assert torch.allclose(out, model(x), atol=1e-6)
    out.sum().backward()
    model(x).sum().backward()
    got = dict(c.named_parameters())
    for k, p in model.named_parameters():
        assert torch.allclose(got[k].grad, p.grad, atol=1e-5), k


def test_a_tuple_of_batch_major_tensors_is_cut_into_the_shares() -> None:
    """Before, the tuple went whole to every share: share 0 concatenated the micro-batch's
    8 rows of one half with its own 4 rows of the other, and crashed."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "dist_scripts"))
    from chunk_group_check import ChunkAcross  # type: ignore[import-not-found]

    torch.manual_seed(0)
    model = ChunkAcross()
    x = torch.randn(8, 3, 8, 8)
    gm = trace(model, x).gm
    assert gm is not None
    stage_of = _split_at(gm, "getitem")
    assert stage_of["chunk"] == 0
    groups = [(["cpu"], "none"), (["cpu", "cpu"], "batch")]
    c = CompiledModule(model, gm, stage_of, ["cpu", "cpu"], groups=groups)
    out, ref = c(x), model(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    ref.sum().backward()
    got = dict(c.named_parameters())
    for k, p in model.named_parameters():
        torch.testing.assert_close(got[k].grad, p.grad, rtol=1e-4, atol=1e-6, msg=k)


class _TwoHeads(nn.Module):
    """Returns a named pair of batch-major tensors (logits and auxiliary logits)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.fc = nn.Linear(6, 4)
        self.aux = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.relu(self.c1(x)).mean((2, 3))
        return _Heads(self.fc(h), self.aux(h))


_Heads = collections.namedtuple("_Heads", ["logits", "aux"])


def test_a_batch_split_stage_joins_a_named_tuple_of_batch_major_tensors() -> None:
    """googlenet and inception return a named tuple in training: a batch-split stage (or
    local replicas, which are one) joins it leaf by leaf; outputs and gradients as eager."""
    model, eager = _TwoHeads(), _TwoHeads()
    x = torch.randn(8, 3, 8, 8)
    gm = trace(model, x).gm
    assert gm is not None
    stage_of = {n.name: 0 for n in gm.graph.nodes}
    c = CompiledModule(model, gm, stage_of, ["cpu"], groups=[(["cpu", "cpu"], "batch")])
    out, ref = c(x), eager(x)
    assert type(out) is _Heads
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(out.aux, ref.aux)
    (out.logits.sum() + out.aux.pow(2).sum()).backward()
    (ref.logits.sum() + ref.aux.pow(2).sum()).backward()
    for (k, p), q in zip(c.named_parameters(), eager.parameters()):
        assert p.grad is not None and q.grad is not None, k
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_a_torchrun_batch_group_joins_a_tuple_output(tmp_path: Path) -> None:
    """The same join on two gloo ranks, where each member sends its leaves to the leader."""
    import tests.test_distributed as td

    script = td.ROOT / "tests" / "dist_scripts" / "tuple_group_check.py"
    from tuple_group_check import batch, build, loss_fn  # type: ignore[import-not-found]

    td.ok(td.launch(2, ["--out", str(tmp_path)], timeout=180, script=script))
    ranks = [torch.load(tmp_path / f"tuple_rank{r}.pt", weights_only=False) for r in (0, 1)]
    model, (x, y) = build(), batch()
    want = model(x)
    lead = ranks[0]
    assert lead["infer_type"] == "Heads"  # the leader rebuilt the named tuple
    for got, ref in zip(lead["infer"], want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    loss = loss_fn(want, y)
    assert lead["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    loss.backward()
    for key, p in model.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(lead["grads"][key], p.grad, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_a_torchrun_batch_group_cuts_a_received_tuple(tmp_path: Path) -> None:
    """The same tuple over torchrun: the group's leader sends each member its rows of
    every tensor in the tuple; loss and every gradient as eager."""
    import tests.test_distributed as td

    script = td.ROOT / "tests" / "dist_scripts" / "chunk_group_check.py"
    from chunk_group_check import batch, build  # type: ignore[import-not-found]

    td.ok(td.launch(3, ["--out", str(tmp_path)], timeout=180, script=script))
    ranks = [torch.load(tmp_path / f"chunk_rank{r}.pt", weights_only=False) for r in range(3)]
    model, (x, y) = build(), batch()
    loss = nn.functional.cross_entropy(model(x), y)
    losses = [r["loss"] for r in ranks if r["loss"] is not None]
    assert losses and all(v == pytest.approx(float(loss.detach()), rel=1e-5) for v in losses)
    loss.backward()
    got: dict[str, torch.Tensor] = {}
    for r in ranks:
        got.update(r["grads"])
    for key, p in model.named_parameters():
        assert p.grad is not None and key in got, (key, sorted(got))
        torch.testing.assert_close(got[key], p.grad, rtol=1e-4, atol=1e-6, msg=key)
