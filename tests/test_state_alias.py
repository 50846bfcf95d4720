"""``state_dict()`` values share storage with the compiled module, as ``nn.Module``'s do.

Why: an exponential moving average of the weights, the way timm's ``ModelEmaV2``/``V3``
keep it, is a deep copy of the trained module whose ``state_dict()`` values are updated
in place each step. Before, a compiled module's ``state_dict()`` returned CPU copies:
every such write was lost and the average never moved from the initial weights, without
an error. Now a whole tensor's value is the stage's tensor, detached (a channel-sharded
one is still a concatenated copy: README says to average through ``parameters()``).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import crosscut


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(8, 4),
    )  # fmt: skip


def _ema_update(ema: nn.Module, model: nn.Module, decay: float = 0.9) -> None:
    """timm's ModelEmaV2 update: in place, through the two state_dicts' values."""
    with torch.no_grad():
        for e, m in zip(ema.state_dict().values(), model.state_dict().values()):
            if e.is_floating_point():
                e.copy_(e * decay + (1.0 - decay) * m.to(e.device))
            else:
                e.copy_(m)


def test_an_ema_through_state_dict_tracks_training_as_on_the_model() -> None:
    eager = _net()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, 10, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
    compiled = crosscut.compile(
        copy.deepcopy(eager), ["cpu", "cpu"], x, microbatches=2, time_limit=5,
        require_all_devices=True,
    )  # fmt: skip
    ema, eager_ema = copy.deepcopy(compiled), copy.deepcopy(eager)
    try:
        opt = torch.optim.SGD(compiled.parameters(), lr=0.5)
        eager_opt = torch.optim.SGD(eager.parameters(), lr=0.5)
        for _ in range(3):
            opt.zero_grad()
            compiled.train_step(x, y, F.cross_entropy)
            opt.step()
            _ema_update(ema, compiled)
            eager_opt.zero_grad()
            for xs, ys in zip(x.chunk(2), y.chunk(2)):
                (F.cross_entropy(eager(xs), ys) / 2).backward()
            eager_opt.step()
            _ema_update(eager_ema, eager)
        averaged, want = ema.state_dict(), eager_ema.state_dict()
        initial = _net().state_dict()
        for key, value in want.items():
            assert torch.equal(averaged[key], value), key
        assert not torch.equal(averaged["0.weight"], initial["0.weight"])  # it moved
    finally:
        compiled.close()
        ema.close()


def test_state_dict_values_alias_the_stages_tensors() -> None:
    model = _net()
    x = torch.randn(4, 3, 10, 10)
    compiled = crosscut.compile(model, ["cpu", "cpu"], x, time_limit=5, require_all_devices=True)
    try:
        state = compiled.state_dict()
        params = dict(compiled.named_parameters())
        for key, param in params.items():
            assert state[key].data_ptr() == param.data_ptr(), key
            assert not state[key].requires_grad
        state["7.bias"].fill_(3.0)  # the head's bias, through the state dict
        assert torch.equal(params["7.bias"].detach(), torch.full((4,), 3.0))
    finally:
        compiled.close()
