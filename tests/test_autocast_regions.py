"""``torch.autocast`` inside a forward, which torch.fx does not record (frontend/autocast_check.py).

Before, a convolution under ``with torch.autocast("cpu", dtype=torch.bfloat16)``
compiled silently and ran in fp32: outputs off by 1e-4 and weights by 6e-3
after one step, with no error. Now the trace refuses what the graph would drop
and names crosscut's own precision option.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import crosscut
from tests.test_mutation import assert_steps_like_eager

torch.set_num_threads(1)


class Region(nn.Module):
    def __init__(self, enabled: bool | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enabled = enabled
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.c1(x))
        if self.enabled is None:
            y = self.c2(y)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.enabled):
                y = self.c2(y)
        return self.fc(y.float().mean((2, 3)))


@pytest.mark.parametrize(
    ("enabled", "precision"), [(True, "fp32"), (True, "bf16"), (False, "bf16")]
)
def test_autocast_regions_the_graph_would_drop_are_refused(enabled: bool, precision: str) -> None:
    with pytest.raises(crosscut.TraceError, match=r"torch\.autocast") as info:
        crosscut.trace(Region(enabled), torch.randn(2, 3, 8, 8), precision=precision)
    assert f"enabled={enabled}" in str(info.value) and "precision=" in str(info.value)


def test_a_region_turning_autocast_off_in_fp32_trains_as_eager() -> None:
    x = torch.randn(4, 3, 8, 8)
    model = Region(False)
    ref = copy.deepcopy(model)
    c = crosscut.compile(model, ["cpu"] * 2, x, time_limit=2, replicas=1, microbatches=1)
    assert_steps_like_eager(c, ref, x)


def test_tracing_inside_the_callers_autocast_is_not_refused_and_the_watch_is_undone() -> None:
    """The watch covers the model's forward, not the caller's context; it patches
    ``autocast.__enter__`` while tracing and must put it back, after a refusal too."""
    original = torch.amp.autocast_mode.autocast.__enter__
    with torch.autocast("cpu", dtype=torch.bfloat16):
        crosscut.trace(Region(None), torch.randn(2, 3, 8, 8))
    with pytest.raises(crosscut.TraceError):
        crosscut.trace(Region(True), torch.randn(2, 3, 8, 8))
    assert torch.amp.autocast_mode.autocast.__enter__ is original
