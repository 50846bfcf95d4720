"""Model patterns from outside the test suite, each on pipelines it did not choose.

Each model is one habit of real CNN code that the trace, the planner or the
runtime could get wrong: a module called at two depths, a parameter shared by
two modules or read by ``F.conv2d`` twice, a ``detach`` skip, a value read at
three depths, two heads, a checkpointed block (both kinds), a custom autograd
Function, training-only state read in eval, rebound buffers, group and layer
norm through permutes, batch norm on every stage, weight standardization
(a weight read three times), weight clipping in forward, a mean teacher
updated over ``.parameters()``, batch norms frozen by ``.eval()`` in a training
model (a leaf one and one traced through), a parameter table cached in a dict
in eval; and since the twenty-ninth session a leaf registering tensor hooks, factories
sized by the batch one dimension at a time, a spatial transformer, a teacher under
``no_grad`` and a deformable convolution. Each runs on forced
pipelines: 2-4 CPU devices, 1-4 micro-batches, ``recompute`` auto/always/never,
1F1B, GPipe, zero-bubble and interleaved schedules; two SGD steps (lr 1, float64)
against eager on the same micro-batches, then (for models whose graph reads
``self.training``) an eval call.

With ``--groups`` each model runs instead on cross-shaped plans: a stage
channel-split over a group of 2-3 devices (the whole model, or the second of two
stages), 1-4 micro-batches, built by widening the planner's cut (as the torchrun
tests do), so every sharded weight, shared or not, meets the channel split.

A case is ``ok`` (within 1e-9; with ``--groups`` relative to the tensor's largest
entry, since channel-split sums round differently), ``refused`` (a crosscut error naming a rule:
state written in forward with several micro-batches) or ``BAD`` (a mismatch
or a crash). Refusals are listed; any ``BAD`` makes the exit status 1.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/held_out_patterns.py [--groups]``
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# the suite's own models for the habits it already tests one plan at a time
from tests.test_autograd_functions import Reverser  # noqa: E402
from tests.test_factory_sizes import Sized  # noqa: E402
from tests.test_forward_state import EvalCache, WithTeacher  # noqa: E402
from tests.test_modes import TrainCounter, _frozen_norms  # noqa: E402
from tests.test_tensor_hooks import Net as TensorHooked  # noqa: E402

__all__ = ["GROUP_PLANS", "MODELS", "PLANS", "main", "run_one"]


class TiedConv(nn.Module):
    """One module called at two depths."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.c = nn.Conv2d(8, 8, 3, padding=1)
        self.d = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.c(F.relu(self.a(x))))
        x = F.relu(self.c(F.relu(self.d(x))))
        return self.head(x.mean((2, 3)))


class TiedParam(nn.Module):
    """Two modules holding one Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.m = nn.Conv2d(8, 8, 1)
        self.c = nn.Conv2d(8, 8, 3, padding=1)
        self.c.weight = self.b.weight
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.b(torch.tanh(self.a(x))))
        x = torch.tanh(self.c(torch.tanh(self.m(x))))
        return self.head(x.mean((2, 3)))


class FunctionalShared(nn.Module):
    """A raw Parameter read by ``F.conv2d`` at two depths, and a layer scale."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, 3, 3) * 0.1)
        self.a = nn.Conv2d(3, 8, 1)
        self.mid = nn.Conv2d(8, 8, 1)
        self.gamma = nn.Parameter(torch.ones(1, 8, 1, 1) * 0.5)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        y = torch.tanh(self.mid(F.conv2d(x, self.w, padding=1)))
        z = F.conv2d(y, self.w, padding=1) * self.gamma + x
        return self.head(z.mean((2, 3)))


class DetachSkip(nn.Module):
    """A detached copy carried past two convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.c = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(x))
        d = x.detach() * 2
        y = torch.relu(self.c(torch.relu(self.b(x)))) + d
        return self.head(torch.cat([y, d], 1).mean((2, 3)))


class FanOut(nn.Module):
    """One value read at every later depth."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.ModuleList(nn.Conv2d(8, 8, 3, padding=1) for _ in range(4))
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = torch.sigmoid(self.a(x))
        y = r
        for i, m in enumerate(self.b):
            y = torch.tanh(m(y)) * r + (r if i % 2 else 0)
        return self.head(y.mean((2, 3)))


class TwoHeads(nn.Module):
    """An early head and a late head summed."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.h1 = nn.Linear(8, 5)
        self.h2 = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(x))
        e = self.h1(x.mean((2, 3)))
        return e + self.h2(torch.relu(self.b(x)).amax((2, 3)))


class Checkpointed(nn.Module):
    """A block under ``torch.utils.checkpoint``, reentrant or not."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.c = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = cp.checkpoint(self.b, torch.relu(self.a(x)), use_reentrant=self.reentrant)
        return self.head(torch.relu(self.c(x)).mean((2, 3)))


class Adversarial(nn.Module):
    """A gradient reversal layer (a custom autograd Function) before a second head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.rev = Reverser()
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.h1 = nn.Linear(8, 5)
        self.h2 = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(x))
        dom = self.h2(torch.relu(self.b(self.rev(x))).mean((2, 3)))
        return self.h1(x.mean((2, 3))) + dom


class Norms(nn.Module):
    """Group norm, then layer norm over channels through permutes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.gn(self.a(x)))
        x = self.ln(self.b(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.head(x.mean((2, 3)))


class BNStages(nn.Module):
    """Batch norm after every convolution."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for cin in (3, 8, 8):
            layers += [nn.Conv2d(cin, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()]
        self.f = nn.Sequential(*layers)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.f(x).mean((2, 3)))


class StdConv(nn.Conv2d):
    """Weight standardization: a Conv2d subclass whose forward reads its weight three
    times (mean, centre, std), traced through."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.std((1, 2, 3), keepdim=True) + 1e-5)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class WeightStandardized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = StdConv(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.b = StdConv(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.b(torch.relu(self.gn(self.a(x)))))
        return self.head(y.mean((2, 3)))


class Clipped(nn.Module):
    """WGAN weight clipping in forward, through the attribute's ``.data``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.b.weight.data.clamp_(-0.05, 0.05)
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))).mean((2, 3)))


class SpatialTransformer(nn.Module):
    """A spatial transformer: ``affine_grid`` sized by ``x.size()``, then ``grid_sample``."""

    def __init__(self) -> None:
        super().__init__()
        self.loc = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(8, 6),
        )  # fmt: skip
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        theta = self.loc(x).view(-1, 2, 3)
        grid = F.affine_grid(theta, x.size(), align_corners=False)  # the tutorial's form
        y = torch.relu(self.conv(F.grid_sample(x, grid, align_corners=False)))
        return self.head(y.mean((2, 3)))


class Distilled(nn.Module):
    """A frozen teacher run under ``torch.no_grad()`` beside the student it teaches."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 5, 1))
        self.student = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
            nn.Conv2d(8, 5, 1),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t = self.teacher(x)
        return (self.student(x) - t).mean((2, 3))


class Deformable(nn.Module):
    """torchvision's deformable convolution, its offsets from a convolution."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.ops import DeformConv2d

        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.offsets = nn.Conv2d(8, 18, 3, padding=1)
        self.deform = DeformConv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x))
        return self.head(torch.relu(self.deform(y, self.offsets(y))).mean((2, 3)))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "tied-conv": TiedConv,
    "tied-param": TiedParam,
    "functional-shared": FunctionalShared,
    "detach-skip": DetachSkip,
    "fan-out": FanOut,
    "two-heads": TwoHeads,
    "checkpoint": lambda: Checkpointed(False),
    "checkpoint-reentrant": lambda: Checkpointed(True),
    "grad-reverse": Adversarial,
    "train-state-inplace": lambda: TrainCounter(False),
    "train-state-rebound": lambda: TrainCounter(True),
    "norms": Norms,
    "bn-stages": BNStages,
    "weight-standardized": WeightStandardized,
    "weight-clip": Clipped,
    "mean-teacher": WithTeacher,
    "frozen-bn": _frozen_norms,
    "eval-cache": EvalCache,
    "tensor-hook": TensorHooked,
    "factory-sizes": Sized,
    "spatial-transformer": SpatialTransformer,
    "distilled": Distilled,
    "deformable": Deformable,
}
# (devices, micro-batches, recompute, schedule)
PLANS: list[tuple[int, int, str, str]] = [
    (2, 1, "auto", "auto"),
    (3, 1, "always", "1f1b"),
    (4, 1, "never", "auto"),
    (3, 2, "auto", "1f1b"),
    (4, 4, "always", "1f1b"),
    (3, 4, "always", "gpipe"),
    (2, 2, "never", "zb-h1"),
    (2, 2, "auto", "1f1b-v2"),
]


# channel-split layouts: (per stage: group width, split), micro-batches
GROUP_PLANS: list[tuple[tuple[tuple[int, str], ...], int]] = [
    (((2, "channel"),), 1),
    (((2, "channel"),), 2),
    (((1, "none"), (2, "channel")), 2),
    (((3, "channel"),), 4),
]


def _step(model: Any, x: torch.Tensor, mb: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Outputs over ``mb`` micro-batches in order, then one SGD step (lr 1) on their sum."""
    out = torch.cat([model(c) for c in x.chunk(mb)])
    out.pow(2).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= p.grad
                p.grad = None
    return out, model.state_dict()


def _off(got: torch.Tensor, want: torch.Tensor, relative: bool) -> float:
    """``|got - want|``'s largest entry; relative to ``want``'s largest (at least 1) for
    channel splits, whose sums over shards round differently from eager's (a convolution
    split by output channels sums its input gradient over the shards), while lr-1 SGD on
    a squared output grows the values to 1e6 and more by the second step."""
    diff = float((got.detach().double() - want.detach().double()).abs().max())
    if not relative or not want.numel():
        return diff
    return diff / max(1.0, float(want.detach().double().abs().max()))


def _compiled(model: nn.Module, x: torch.Tensor, plan: tuple[Any, ...]) -> tuple[Any, int]:
    """The compiled module for a pipeline plan or a channel-split layout, and its M."""
    import crosscut
    from tests.plan_factory import widen

    if len(plan) == 2:  # GROUP_PLANS
        groups, mb = plan
        cut = crosscut.partition(
            copy.deepcopy(model), ["cpu"] * len(groups), x, microbatches=mb,
            require_all_devices=True, solver="dp",
        )  # fmt: skip
        total = sum(width for width, _split in groups)
        return crosscut.compile(model, ["cpu"] * total, x, plan=widen(cut, groups)), mb
    devices, mb, recompute, schedule = plan
    c = crosscut.compile(
        model, ["cpu"] * devices, x, replicas=1, microbatches=mb,
        require_all_devices=True, recompute=recompute, schedule=schedule, time_limit=5,
    )  # fmt: skip
    return c, mb


def run_one(name: str, plan: tuple[Any, ...]) -> str:
    """``ok``, ``refused: ...`` or ``BAD: ...`` for one model on one forced plan."""
    from crosscut.errors import CrosscutError

    torch.manual_seed(0)
    model = MODELS[name]().double()
    x = torch.randn(8, 3, 8, 8, dtype=torch.float64)
    ref = copy.deepcopy(model)
    try:
        c, mb = _compiled(copy.deepcopy(model), x, plan)
    except CrosscutError as exc:
        return "refused: " + str(exc).split(";")[0][:110]
    try:
        for step in range(2):
            out, state = _step(c, x, 1)
            want, want_state = _step(ref, x, mb)
            pairs = [(out, want)] + [(state[k], v) for k, v in want_state.items()]
            worst = max(_off(a, b, relative=len(plan) == 2) for a, b in pairs)
            if worst > 1e-9:
                return f"BAD: step {step} off by {worst:.2e}"
        c.eval()
        ref.eval()
        with torch.no_grad():
            try:
                want = ref(x)
            except RuntimeError:  # eager refuses too (a tensor hook under no_grad)
                return "ok (eval under no_grad: eager raises, not compared)"
            worst = _off(c(x), want, relative=len(plan) == 2)
        return "ok" if worst <= 1e-9 else f"BAD: eval off by {worst:.2e}"
    except Exception as exc:  # a crash on a plan crosscut accepted is a finding
        return f"BAD: {type(exc).__name__}: {str(exc)[:110]}"
    finally:
        c.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--groups", action="store_true", help="channel-split plans instead")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # the eager reference's reentrant checkpoint warns that its input needs no gradient
    warnings.filterwarnings("ignore", message=".*requires_grad=True.*")
    tally = {"ok": 0, "refused": 0, "BAD": 0}
    for name in args.models:
        for plan in GROUP_PLANS if args.groups else PLANS:
            verdict = run_one(name, plan)
            tally[verdict.split(":")[0].split(" ")[0]] += 1
            where = (
                f"groups={plan[0]} mb={plan[1]}"
                if args.groups
                else f"devices={plan[0]} mb={plan[1]} recompute={plan[2]:6s} schedule={plan[3]:8s}"
            )
            print(f"{name:22s} {where} {verdict}", flush=True)
    print(f"{sum(tally.values())} cases: {tally['ok']} ok, {tally['refused']} refused, "
          f"{tally['BAD']} BAD")  # fmt: skip
    return 1 if tally["BAD"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
