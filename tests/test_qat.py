"""Quantization-aware training (``torch.ao.quantization.prepare_qat``) trains as eager.

A QAT model's fake-quantize modules update their observers' min/max and their scale
in every training forward, through one fused kernel (``fused_moving_avg_obs_fake_quant``)
that moves no version counter, so the trace saw no state written: the default plan
split the batch over two replicas and the model trained 9e-4 off eager with no error.
And before its first forward a per-channel observer's scale is empty; the trace's
probe run resized it and could not copy it back: compiling a fresh QAT model failed
with "The size of tensor a (8) must match the size of tensor b (0)". The row probe
(``frontend/row_probe.py``) now records which buffers each leaf module wrote by value,
so the planner keeps such a model on one replica and one micro-batch (and refuses
them when asked), as it does for any state written from the batch.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import crosscut
from crosscut.errors import InputError
from tests.test_unreached_params import WithAux

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # eager-mode quantization is deprecated for torchao
    import torch.ao.quantization as tq

X = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
Y = torch.arange(8) % 5


class QNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = tq.QuantStub()
        self.body = WithAux().body  # a small CNN of convolutions, ReLUs and a linear head
        self.dequant = tq.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.body(self.quant(x)))


def _qat(warm: bool) -> nn.Module:
    torch.manual_seed(0)
    model = QNet().train()
    model.qconfig = tq.get_default_qat_qconfig("fbgemm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tq.prepare_qat(model, inplace=True)
    if warm:
        model(X)  # the observers take their shapes and first statistics
    return model


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "observed"])
def test_the_default_plan_trains_a_qat_model_as_eager(warm: bool) -> None:
    eager = _qat(warm)
    before = {k: v.clone() for k, v in eager.state_dict().items()}
    compiled = crosscut.compile(copy.deepcopy(eager), ["cpu", "cpu"], (X,))
    assert compiled.plan.replication.replicas == 1 and compiled.microbatches == 1
    for k, v in eager.state_dict().items():  # compiling left the caller's model alone
        assert v.shape == before[k].shape and torch.equal(v, before[k]), k
    for _ in range(2):
        for model in (compiled, eager):
            model.zero_grad()
            F.cross_entropy(model(X), Y).backward()
    got = dict(compiled.named_parameters())
    for name, p in eager.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, rtol=0, atol=0, msg=name)
    state = compiled.state_dict()
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("options", [{"microbatches": 2, "replicas": 1}, {"replicas": 2}])
def test_splitting_the_batch_of_a_qat_model_is_refused_by_name(options: dict[str, int]) -> None:
    with pytest.raises(InputError, match="activation_post_process") as err:
        crosscut.compile(_qat(warm=True), ["cpu", "cpu"], (X,), **options)
    assert "cannot be kept" in str(err.value)
