"""Outputs of several micro-batches merge by explicit rules, or the compile refuses.

A model's outputs are concatenated on the batch dimension by default; an
output without a batch dimension (a sum, a mean loss, a count, a Python
number) needs a rule (``output_merge=``) or ``crosscut.compile`` refuses it by
path. Every case is compared with eager mode on the whole batch, with one and
several micro-batches, outputs and gradients through the merged outputs.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import pytest
import torch
from torch import fx, nn

import crosscut
from crosscut.errors import InputError, RuntimeError_
from crosscut.runtime import CompiledModule
from crosscut.runtime.output_merge import OutputMerge, check_outputs, normalize_merge
from tests.test_runtime_local import chunks, compiled_grads, grads

torch.set_num_threads(1)


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.c2 = nn.Conv2d(6, 6, 3, padding=1)
        self.fc = nn.Linear(6, 4)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.c2(torch.relu(self.c1(x))))


class Energy(Body):
    """The issue's model: logits and the sum of their squares."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.fc(self.features(x).mean((2, 3)))
        return logits, logits.pow(2).sum()


class Stats(NamedTuple):
    energy: torch.Tensor
    mean: torch.Tensor
    peak: torch.Tensor


class Nested(Body):
    """A namedtuple and a dict, nested; a feature map, a per-sample loss, Python numbers."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        feat = self.features(x)
        logits = self.fc(feat.mean((2, 3)))
        per_sample = nn.functional.cross_entropy(logits, y, reduction="none")
        return {
            "logits": logits,
            "aux": (feat, per_sample),
            "stats": Stats(logits.pow(2).sum(), per_sample.mean(), logits.abs().amax()),
            "count": x.size(0),
            "half": x.shape[0] * 0.5,
            "tag": "nested",
        }


NESTED_RULES = {
    "stats.energy": "sum",
    "stats.mean": "mean",
    "stats.peak": lambda vs: torch.stack(vs).amax(),
    "count": "sum",
    "half": "sum",
}


def compile_(model: nn.Module, x: Any, mb: int, k: int = 3, **kw: Any) -> Any:
    return crosscut.compile(
        model,
        ["cpu"] * k,
        x,
        microbatches=mb,
        schedule="gpipe",
        require_all_devices=True,
        time_limit=5,
        **kw,
    )


def test_the_issue_model_is_refused_without_a_rule_and_exact_with_sum() -> None:
    torch.manual_seed(0)
    model = Energy()
    x = torch.randn(8, 3, 8, 8)
    with pytest.raises(InputError, match=r"output '1': a tensor of shape \[\]") as err:
        compile_(model, x, 2)
    assert "output_merge={'1': 'sum'}" in str(err.value)
    ref = copy.deepcopy(model)
    for mb in (1, 2, 4):
        c = compile_(model, x, mb, output_merge={1: "sum"})
        logits, energy = c(x)
        want_logits, want_energy = ref(x)
        torch.testing.assert_close(logits, want_logits)
        torch.testing.assert_close(energy, want_energy)
    assert compile_(model, x, 1)(x)[1].shape == ()  # one micro-batch: nothing to merge


@pytest.mark.parametrize("mb", [1, 2, 4])
def test_nested_outputs_match_eager(mb: int) -> None:
    torch.manual_seed(0)
    model = Nested()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 4, (8,))
    c = compile_(model, (x, y), mb, output_merge=NESTED_RULES)
    got, want = c(x, y), ref(x, y)
    assert list(got) == list(want) and isinstance(got["stats"], Stats)
    assert got["count"] == 8 and got["half"] == 4.0 and got["tag"] == "nested"
    for key in ("logits", "aux", "stats"):
        torch.testing.assert_close(got[key], want[key])


@pytest.mark.parametrize(("mb", "path"), [(2, "stats.energy"), (4, "stats.energy"), (4, "mean")])
def test_gradients_through_merged_outputs_match_eager(mb: int, path: str) -> None:
    """The forward path builds one autograd graph over the micro-batches and the merge."""
    torch.manual_seed(0)
    model = Nested()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 4, (8,))
    c = compile_(model, (x, y), mb, output_merge=NESTED_RULES)
    got, want = c(x, y), ref(x, y)
    if path == "mean":
        (got["stats"].mean + got["logits"].pow(2).mean()).backward()
        (want["stats"].mean + want["logits"].pow(2).mean()).backward()
    else:
        got["stats"].energy.backward()
        want["stats"].energy.backward()
    g, w = compiled_grads(c), grads(ref)
    assert set(g) == set(w)
    for key in w:
        torch.testing.assert_close(g[key], w[key], msg=key)


def test_python_number_outputs_need_a_rule() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 4, (8,))
    rules = {k: v for k, v in NESTED_RULES.items() if k != "count"}
    with pytest.raises(InputError, match="output 'count': a Python int"):
        compile_(Nested(), (x, y), 2, output_merge=rules)


def test_a_whole_output_rule_and_a_per_sample_vector() -> None:
    class MeanLoss(Body):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = self.fc(self.features(x).mean((2, 3)))
            return nn.functional.cross_entropy(logits, y)

    class PerSample(Body):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = self.fc(self.features(x).mean((2, 3)))
            return nn.functional.cross_entropy(logits, y, reduction="none")

    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 4, (8,))
    for model, rule in ((MeanLoss(), "mean"), (PerSample(), None)):
        ref = copy.deepcopy(model)
        c = compile_(model, (x, y), 4, k=2, output_merge=rule)
        out, want = c(x, y), ref(x, y)
        torch.testing.assert_close(out, want)
        out.sum().backward()
        want.sum().backward()
        for key, g in grads(ref).items():
            torch.testing.assert_close(compiled_grads(c)[key], g, msg=key)
    with pytest.raises(InputError, match="the whole output: a tensor of shape"):
        compile_(MeanLoss(), (x, y), 2, k=2)


def test_same_rule_checks_every_micro_batch() -> None:
    class Constant(Body):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.fc(self.features(x).mean((2, 3)))
            return logits, self.fc.weight.norm() + 0 * logits.sum()

    torch.manual_seed(0)
    model = Constant()
    x = torch.randn(8, 3, 8, 8)
    c = compile_(model, x, 2, k=2, output_merge={1: "same"})
    torch.testing.assert_close(c(x)[1], model(x)[1])
    with pytest.raises(RuntimeError_, match="rule 'same' but micro-batch 1"):
        compile_(Energy(), x, 2, k=2, output_merge={1: "same"})(x)


def test_train_step_calls_loss_fn_per_micro_batch_with_its_own_values() -> None:
    """No merge in train_step: a non-batch output is that micro-batch's value."""
    torch.manual_seed(0)
    model = Energy()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 4, (8,))
    c = compile_(model, x, 2, output_merge={1: "sum"})
    seen: list[float] = []

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor], t: torch.Tensor) -> torch.Tensor:
        seen.append(float(out[1].detach()))
        return nn.functional.cross_entropy(out[0], t) + 1e-3 * out[1]

    loss = c.train_step(x, y, loss_fn)
    want = [float(ref(xc)[1].detach()) for xc in x.chunk(2)]
    assert seen == pytest.approx(want, rel=1e-5)
    total = sum(loss_fn(ref(xc), yc) / 2 for xc, yc in zip(x.chunk(2), y.chunk(2)))
    assert float(loss) == pytest.approx(float(total.detach()), rel=1e-5)


def test_bad_rules_are_refused_before_tracing() -> None:
    x = torch.randn(8, 3, 8, 8)
    for bad, match in (
        ("median", "must be one of"),
        ({1: 3}, "must be one of"),
        ([("1", "sum")], "a rule or a mapping"),
        ({1.5: "sum"}, "paths are strings"),
        ({"": "sum", "1": "mean"}, "must not overlap"),
        ({"a": "sum", "a.b": "sum"}, "must not overlap"),
    ):
        with pytest.raises(InputError, match=match):
            compile_(Energy(), x, 2, output_merge=bad)
    with pytest.raises(InputError, match="paths the model's output does not have"):
        compile_(Energy(), x, 2, output_merge={1: "sum", "logits": "sum"})
    with pytest.raises(InputError, match="'cat' on output '1'"):
        compile_(Energy(), x, 2, output_merge={1: "cat"})


def test_without_traced_shapes_the_rule_is_checked_at_run_time() -> None:
    """A module built from a bare symbolic trace has no shapes: a non-batch output without
    a rule fails at the call by path, never merged by a guess."""
    torch.manual_seed(0)
    model = Energy()
    gm = fx.symbolic_trace(model)
    assert all("val" not in n.meta for n in gm.graph.nodes)
    x = torch.randn(8, 3, 8, 8)
    c = CompiledModule(model, gm, chunks(gm, 2), ["cpu"] * 2, "gpipe", 2)
    with pytest.raises(RuntimeError_, match="output '1' has no batch dimension"):
        c(x)
    good = CompiledModule(
        model, gm, chunks(gm, 2), ["cpu"] * 2, "gpipe", 2, output_merge={1: "sum"}
    )
    torch.testing.assert_close(good(x)[1], model(x)[1])


def test_merge_unit_rules() -> None:
    dev = torch.device("cpu")
    merge = OutputMerge(spec={"a": "mean", "b.0": "sum"})
    outs = [
        {"a": torch.tensor(1.0), "b": (2, torch.ones(1, 2))},
        {"a": torch.tensor(3.0), "b": (5, torch.ones(2, 2))},
    ]
    got = merge.merge(outs, dev, [1, 2])
    assert float(got["a"]) == 2.0 and got["b"][0] == 7 and got["b"][1].shape == (3, 2)
    with pytest.raises(RuntimeError_, match=r"1 rows for a micro-batch of 2"):
        merge.merge(outs, dev, [2, 2])
    assert normalize_merge(None) == {} and normalize_merge("sum") == {"": "sum"}
    gm = fx.symbolic_trace(Energy())
    assert check_outputs(gm, {1: "sum"}, 4) == {"1": "sum"}  # no shapes: nothing to refuse


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_merge_and_autocast_under_torchrun(tmp_path: Any) -> None:
    """Two gloo ranks: the refusal on every rank, the merged sum on the last, bfloat16
    autocast through the stages and the messages between them (forward and train_step),
    and a gradient scaler whose inf check spans both ranks."""
    import tests.test_distributed as td

    script = td.ROOT / "tests" / "dist_scripts" / "merge_check.py"
    from merge_check import batch, build, loss_fn  # type: ignore[import-not-found]  # td's path

    td.ok(td.launch(2, ["--out", str(tmp_path)], timeout=180, script=script))
    ranks = [torch.load(tmp_path / f"merge_rank{r}.pt", weights_only=False) for r in (0, 1)]
    for seen in ranks:
        assert "output '1': a tensor of shape []" in seen["refused"]
    assert ranks[0]["plain"] is None and ranks[0]["loss"] is None  # stage 0 returns nothing
    model, (x, y) = build(), batch()
    want = model(x)
    torch.testing.assert_close(ranks[1]["plain"], want)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = model(x)
        got = ranks[1]["autocast"]
        assert got[0].dtype == got[1].dtype == eager[0].dtype == torch.bfloat16
        torch.testing.assert_close(got, eager, rtol=2e-2, atol=2e-2)
        total = sum(loss_fn(model(xc), yc) / 2 for xc, yc in zip(x.chunk(2), y.chunk(2)))
    assert ranks[1]["loss"] == pytest.approx(float(total.detach()), rel=1e-2)
    # precision="bf16" runs exactly what the caller's autocast ran
    for a, b in zip(ranks[1]["bf16"], ranks[1]["autocast"], strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    assert ranks[1]["bf16_loss"] == ranks[1]["loss"] and ranks[0]["bf16"] is None
    total.backward()
    grads = {**ranks[0]["grads"], **ranks[1]["grads"]}
    assert set(grads) == {k for k, _ in model.named_parameters()}
    for key, p in model.named_parameters():
        assert grads[key].dtype == torch.float32
        torch.testing.assert_close(grads[key], p.grad, rtol=5e-2, atol=5e-3, msg=key)
    # PipelineGradScaler: rank 0's inf skips rank 1's step too; then both step, same scale
    for seen in ranks:
        assert seen["unchanged1"] and not seen["unchanged2"]
        assert seen["scale1"] == seen["scale2"] == 2.0**7
    state = {**ranks[0]["state"], **ranks[1]["state"]}
    with torch.no_grad():
        for key, p in model.named_parameters():  # one SGD step (lr 0.1) on the same gradients
            torch.testing.assert_close(state[key], p - 0.1 * p.grad, rtol=5e-2, atol=5e-3)
