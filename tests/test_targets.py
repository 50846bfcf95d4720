"""What ``train_step`` accepts as targets, cut into micro-batches as eager would see them.

Why: a loss reads its targets the way the user's training loop builds them. Before, a
loss of the outputs alone (``targets=None``) and torchvision-style detection targets
(a list of one dict per image) were refused with "every tensor argument needs the same
batch size ... got: []" (under torchrun, until the thirty-first session, "needs a
batch-first tensor" and "the global batch of targets must be ..."); under torchrun a
tuple of targets ``(labels, weights)`` reached the loss as its first tensor alone,
so ``y, w = t`` unpacked two rows of the labels when a micro-batch held two samples.
Now each micro-batch's loss gets its slice of the whole structure, on every runtime:
tensors cut on dim 0, a per-sample list of dicts cut by samples (never its boxes),
``None`` as is. Checked against eager on the same micro-batches.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import crosscut

SCRIPT = Path(__file__).resolve().parent / "dist_scripts" / "targets_check.py"


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(8, 4),
    )  # fmt: skip


def _per_image(out: torch.Tensor, t: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """A detection-style loss: every image has two boxes; the loss reads both and the label."""
    labels = torch.stack([d["labels"][0] for d in t])
    boxes = torch.stack([d["boxes"] for d in t])  # (images, 2, 4)
    return F.cross_entropy(out, labels) + (out[:, :1] * boxes.mean((1, 2))[:, None]).mean()


class Pair(NamedTuple):
    y: torch.Tensor
    w: torch.Tensor


def _weighted(out: torch.Tensor, t: Pair) -> torch.Tensor:
    """Reads the targets by field name: they must arrive as the namedtuple they were."""
    return (F.cross_entropy(out, t.y, reduction="none") * t.w).mean()


def cases(batch: int) -> dict[str, tuple[Any, Callable[[Any, Any], torch.Tensor]]]:
    g = torch.Generator().manual_seed(2)
    y, w = torch.randint(0, 4, (batch,), generator=g), torch.rand(batch, generator=g)
    images = [
        {"boxes": torch.rand(2, 4, generator=g), "labels": torch.randint(0, 4, (2,), generator=g)}
        for _ in range(batch)
    ]
    return {
        "none": (None, lambda o, t: o.pow(2).mean()),
        "tuple": ((y, w), lambda o, t: (F.cross_entropy(o, t[0], reduction="none") * t[1]).mean()),
        "unpacked": (
            (y, w),
            lambda o, t: (lambda yy, ww: (o.sum(1) * ww).mean() + yy.float().mean())(*t),
        ),
        "dict": ({"y": y}, lambda o, t: F.cross_entropy(o, t["y"])),
        "namedtuple": (Pair(y, w), _weighted),
        "per-image": (images, _per_image),
    }


def _slice(t: Any, lo: int, hi: int) -> Any:
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        return t[lo:hi]
    if isinstance(t, dict):
        return {k: _slice(v, lo, hi) for k, v in t.items()}
    if isinstance(t, list):  # the per-image list: cut by images
        return t[lo:hi]
    parts = [_slice(v, lo, hi) for v in t]
    return type(t)(*parts) if hasattr(t, "_fields") else tuple(parts)


@pytest.mark.parametrize("mb", [2, 4])
@pytest.mark.parametrize("case", ["none", "tuple", "unpacked", "dict", "namedtuple", "per-image"])
def test_local_train_step_cuts_targets_as_eager_sees_them(case: str, mb: int) -> None:
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    targets, loss_fn = cases(8)[case]
    eager = net()
    compiled = crosscut.compile(
        copy.deepcopy(eager), ["cpu", "cpu"], x, microbatches=mb, time_limit=5,
        require_all_devices=True,
    )  # fmt: skip
    try:
        loss = compiled.train_step(x, targets, loss_fn)
        want = 0.0
        k = 8 // mb
        for m in range(mb):
            part = loss_fn(eager(x[m * k : (m + 1) * k]), _slice(targets, m * k, (m + 1) * k)) / mb
            part.backward()
            want += float(part)
        assert abs(float(loss) - want) < 1e-6, (float(loss), want)
        for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
            assert p.grad is not None and q.grad is not None
            assert torch.equal(p.grad, q.grad), name
    finally:
        compiled.close()


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
@pytest.mark.parametrize("layout", ["pipeline", "replicas"])
def test_torchrun_train_step_hands_targets_over_as_locally(layout: str, tmp_path: Path) -> None:
    """2 gloo ranks, 2 micro-batches of 2 samples per replica, every case of :func:`cases`.
    Before: a tuple ``(y, w)`` reached the loss as ``y`` alone (``y, w = t`` unpacked its
    rows), and ``None`` or a per-image list of dicts was refused on the loss's rank."""
    from tests.test_recompute import run_two_ranks

    run_two_ranks(SCRIPT.name, tmp_path, layout)
    losses = [1] if layout == "pipeline" else [0, 1]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(report) == set(cases(8)), report
        for case, got in report.items():
            assert got["grad_diff"] < 1e-6, (rank, case, got)
            if rank in losses:
                assert got["loss_diff"] < 1e-6, (rank, case, got)
            else:
                assert got["loss_diff"] is None, (rank, case, got)
