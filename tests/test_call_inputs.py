"""How a compiled module is called and inspected, as the model is (issue 27, item 6).

Keyword arguments bind to the model's own ``forward`` signature (defaults
filled in, unknown or doubled names refused as a call's ``TypeError`` would
be, by name), and a non-persistent buffer that forward never reads is still
one of ``named_buffers()``/``buffers()``, out of ``state_dict()``, as on the
model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import crosscut
from crosscut.errors import InputError

torch.set_num_threads(1)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3)

    def forward(self, x: torch.Tensor, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * scale + shift


@pytest.mark.parametrize("m", [1, 2])
def test_keyword_arguments_and_defaults_bind_like_the_model(m: int) -> None:
    torch.manual_seed(0)
    model = Scaled()
    x = torch.randn(4, 3, 8, 8)
    c = crosscut.compile(
        model, ["cpu", "cpu"], x, microbatches=m, require_all_devices=True, replicas=1
    )
    calls = [
        ((x,), {"scale": 3.0}),
        ((x,), {"shift": 2.0, "scale": 0.5}),
        ((x, 3.0), {"shift": 1.0}),
        ((x, 3.0, 1.0), {}),
        ((x,), {}),
        ((), {"x": x, "scale": 2.0}),
    ]
    for args, kwargs in calls:
        assert torch.equal(c(*args, **kwargs), model(*args, **kwargs)), (args[1:], kwargs)
    with pytest.raises(InputError, match=r"'gain'.*scale"):
        c(x, gain=2.0)
    with pytest.raises(InputError, match="'scale' twice"):
        c(x, 2.0, scale=3.0)
    with pytest.raises(InputError, match="'x'"):
        c(scale=3.0)


class Unread(nn.Module):
    """A non-persistent buffer forward never reads, beside a persistent one it does."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)
        self.register_buffer("table", torch.arange(5.0), persistent=False)
        self.register_buffer("offset", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(x) + self.offset[:, None, None]


def test_an_unread_non_persistent_buffer_is_listed_like_the_model() -> None:
    model = Unread()
    c = crosscut.compile(model, ["cpu", "cpu"], torch.randn(2, 3, 8, 8), microbatches=1, replicas=1)
    names = [k for k, _ in c.named_buffers()]
    assert names == [k for k, _ in model.named_buffers()] == ["table", "offset"]
    assert [b.tolist() for b in c.buffers()] == [b.tolist() for b in model.buffers()]
    assert list(c.state_dict()) == list(model.state_dict())  # "table" not in it
