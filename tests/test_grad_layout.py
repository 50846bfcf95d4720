"""Values and gradients crossing a cut keep the layouts eager gives them.

A concatenation's backward hands each input a channel slice of its gradient,
a view with gaps; batch norm's CPU backward sums such a view in another order
than a contiguous copy. A stage that sent its received leaf's ``.grad`` (a
contiguous clone) made every gradient before the cut differ from eager in the
last bits (timm nasnet on 3 stages: 685 of 1,018). Both runtimes now send the
gradient as autograd handed it over and rebuild its strides (runtime/engine.py);
under torchrun a value sent forward gets the strides the trace recorded (a
channel half of ``chunk`` read by batch norm, whose forward is layout-sensitive too).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import crosscut
from crosscut.runtime import CompiledModule
from crosscut.runtime.engine import with_strides

sys.path.insert(0, str(Path(__file__).parent / "dist_scripts"))
from layout_check import MODELS, CatAfterNorm, data  # type: ignore[import-not-found]

# the cuts: both branches (convolution, batch norm) on stage 0, the join and its readers on 1;
# the split on stage 0, the batch norms reading its halves on 1
CUT = {"c1": 0, "b1": 0, "c2": 0, "b2": 0, "cat": 1, "c3": 1, "c4": 1, "add": 1, "mean": 1}
CUTS = {
    "cat": CUT,
    "split": {"c1": 0, "chunk": 0, "getitem": 0, "getitem_1": 0, "b1": 1, "b2": 1, "add": 1,
              "c2": 1, "mean": 1},
}  # fmt: skip


def test_the_kernels_this_guards_against_are_layout_sensitive() -> None:
    """Why the fix exists: if batch norm's forward and backward ever stop depending on the
    layout, this fails and the strides on the wire can go."""
    torch.manual_seed(0)
    bn, x = torch.nn.BatchNorm2d(8), torch.randn(4, 8, 6, 6, requires_grad=True)
    view = torch.randn(4, 16, 6, 6).narrow(1, 8, 8)
    grads = []
    for g in (view, view.contiguous()):
        x.grad = None
        bn(x).backward(g)
        grads.append(x.grad.clone())
    assert not torch.equal(*grads)
    with torch.no_grad():
        assert not torch.equal(bn(view), bn(view.contiguous()))


def test_with_strides_rebuilds_a_gapped_view() -> None:
    view = torch.randn(4, 16, 6, 6).narrow(1, 8, 8)
    flat = view.contiguous()
    back = with_strides(flat, flat.device, view.stride())
    assert back.stride() == view.stride() and torch.equal(back, view)
    assert with_strides(view, view.device, view.stride()) is view


@pytest.mark.parametrize("micro", [1, 2])
def test_a_cut_through_a_concatenation_trains_like_eager(micro: int) -> None:
    torch.manual_seed(0)
    model, (x, y) = CatAfterNorm(), data()
    gm = crosscut.trace(model, x[: 4 // micro]).gm
    assert {n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")} == set(CUT)
    c = CompiledModule(copy.deepcopy(model), gm, CUT, [torch.device("cpu")] * 2, "1f1b", micro)
    ref = copy.deepcopy(model)
    got = c.train_step(x, y, F.mse_loss)
    loss = torch.zeros(())
    for xm, ym in zip(x.chunk(micro), y.chunk(micro)):  # eager on the same micro-batches
        part = F.mse_loss(ref(xm), ym) / micro
        part.backward()
        loss = loss + part.detach()
    params = dict(c.named_parameters())
    differ = [k for k, p in ref.named_parameters() if not torch.equal(params[k].grad, p.grad)]
    if micro == 1:  # one micro-batch: eager's numbers, bit for bit
        assert float(got) == float(loss)
        assert not differ, differ
    else:
        for k, p in ref.named_parameters():
            torch.testing.assert_close(params[k].grad, p.grad, rtol=1e-5, atol=1e-6, msg=k)
    c.close()


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_cuts_through_views_on_two_gloo_ranks_are_bit_exact(tmp_path: Path) -> None:
    """A concatenation's input gradients (going back) and a split's halves (going forward)
    cross the cut: loss and every gradient equal eager's."""
    import tests.test_distributed as td

    for name, cls in MODELS.items():
        torch.manual_seed(0)
        model, (x, _) = cls(), data()
        plan = crosscut.partition(model, ["cpu"] * 2, x, microbatches=1, replicas=1, time_limit=5)
        assert set(plan.assignment) == set(CUTS[name]), sorted(plan.assignment)
        plan.assignment = dict(CUTS[name])
        plan.save(tmp_path / f"{name}.json")
    script = td.ROOT / "tests" / "dist_scripts" / "layout_check.py"
    td.ok(td.launch(2, [str(tmp_path)], timeout=240, script=script))
    for name, cls in MODELS.items():
        torch.manual_seed(0)
        model, (x, y) = cls(), data()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        got: dict[str, torch.Tensor] = {}
        losses = []
        for r in (0, 1):
            d = torch.load(tmp_path / f"{name}_rank{r}.pt", weights_only=False)
            got.update(d["grads"])
            losses += [float(d["loss"])] if d["loss"] is not None else []
        assert losses == [float(loss.detach())], name
        assert set(got) == {k for k, _ in model.named_parameters()}
        differ = [k for k, p in model.named_parameters() if not torch.equal(got[k], p.grad)]
        assert not differ, (name, differ)
