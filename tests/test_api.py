"""The public API end to end: compile, partition, plan replay, and bad input."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

import crosscut
from crosscut.cost_models.cluster import Cluster
from crosscut.cost_models.devices import preset
from crosscut.errors import DeviceError, InfeasiblePlanError, InputError, PlanError
from crosscut.partitioner.validate import validate_plan
from crosscut.verify import compare_states, loss_of, verify_plan

X = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(0))
CAP = 1_300_000_000


@pytest.fixture(scope="module")
def resnet18() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None)


@pytest.fixture(scope="module")
def plan_2dev(resnet18: nn.Module) -> crosscut.Plan:
    return crosscut.partition(
        resnet18,
        ["cpu", "cpu"],
        X,
        microbatches=2,
        require_all_devices=True,
        time_limit=5,
        replicas=1,
    )


def test_compile_trains_like_eager(resnet18: nn.Module) -> None:
    eager = copy.deepcopy(resnet18)
    compiled = crosscut.compile(
        copy.deepcopy(resnet18),
        ["cpu"] * 2,
        X,
        require_all_devices=True,
        microbatches=1,
        replicas=1,
    )
    assert compiled.plan.num_stages == 2
    # state_dict equals the original bit for bit right after compile
    sd, ref = compiled.state_dict(), eager.state_dict()
    assert list(sd) == list(ref)
    assert all(torch.equal(sd[k], ref[k]) for k in ref)
    y = torch.randint(0, 1000, (8,))
    for m in (eager, compiled):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        loss = nn.functional.cross_entropy(m(X), y)
        loss.backward()
        opt.step()
    sd, ref = compiled.state_dict(), eager.state_dict()
    assert all(torch.equal(sd[k], ref[k]) for k in ref)  # one micro-batch: bit-exact


def test_replay_saved_plan(resnet18: nn.Module, plan_2dev: crosscut.Plan, tmp_path: Path) -> None:
    path = plan_2dev.save(tmp_path / "plan.json")
    compiled = crosscut.compile(copy.deepcopy(resnet18), ["cpu", "cpu"], X, plan=path)
    assert compiled.plan.assignment == plan_2dev.assignment
    report = verify_plan(resnet18, X, path)
    assert report.ok, report.text()
    assert report.checked_keys == len(resnet18.state_dict())


def test_require_all_devices_is_honoured_or_refused() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(4, 4)
    spread = crosscut.compile(
        copy.deepcopy(net), ["cpu"] * 2, x, require_all_devices=True, microbatches=1, replicas=1
    )
    assert spread.plan.num_stages == 2
    with pytest.raises(crosscut.PartitionError, match="at least one node per device"):
        crosscut.compile(
            nn.Sequential(nn.Linear(4, 4)),
            ["cpu"] * 3,
            x,
            require_all_devices=True,
            microbatches=1,
            replicas=1,
        )


def test_plan_for_another_model_is_refused(plan_2dev: crosscut.Plan) -> None:
    other = torchvision.models.resnet34(weights=None)
    with pytest.raises(PlanError, match="fingerprint"):
        crosscut.compile(other, ["cpu", "cpu"], X, plan=plan_2dev)


def test_plan_for_other_devices_is_refused(resnet18: nn.Module, plan_2dev: crosscut.Plan) -> None:
    with pytest.raises(PlanError, match="made for 2 devices but 3 were given"):
        crosscut.compile(copy.deepcopy(resnet18), ["cpu"] * 3, X, plan=plan_2dev)


def test_plan_for_another_batch_is_refused(resnet18: nn.Module, plan_2dev: crosscut.Plan) -> None:
    with pytest.raises(PlanError, match="fingerprint"):
        crosscut.compile(copy.deepcopy(resnet18), ["cpu", "cpu"], X[:4], plan=plan_2dev)


def test_same_inputs_same_plan_json(resnet18: nn.Module) -> None:
    # a limit long enough that time never ends the strategy search early
    a = crosscut.partition(resnet18, "4xV100", X, microbatches=2, time_limit=60, replicas=1)
    b = crosscut.partition(resnet18, "4xV100", X, microbatches=2, time_limit=60, replicas=1)
    for p in (a, b):
        assert all(row.outcome != "not tried" for row in p.strategy.alternatives)
        p.solver.wall_time_s = p.strategy.wall_time_s = 0.0  # measured, not deterministic
    assert a.to_json() == b.to_json()


def test_plan_fits_memory_one_device_cannot_hold() -> None:
    """vgg11's training state (~1.6 GB with momentum) on 1.3 GB devices: spread to fit.

    (Its first classifier layer alone needs 1.23 GB, so smaller caps need cross-shaped splits.)
    """
    torch.manual_seed(0)
    model = torchvision.models.vgg11(weights=None)
    small = [dataclasses.replace(preset("V100"), name=f"gpu{i}", mem_cap=CAP) for i in range(4)]
    cluster = Cluster.from_specs(small, "nvlink")
    plan = crosscut.partition(
        model,
        cluster,
        torch.randn(2, 3, 64, 64),
        optimizer="momentum",
        time_limit=5,
        microbatches=1,
        replicas=1,
    )
    total = sum(n.resident_bytes for n in plan.nodes)
    assert total > CAP  # one device cannot hold it
    assert plan.num_stages >= 2
    for dev, peak in plan.predicted.device_peak_bytes.items():
        assert peak <= CAP, dev
    validate_plan(plan)


def test_infeasible_memory_names_the_numbers() -> None:
    model = torchvision.models.vgg11(weights=None)
    tiny = [
        dataclasses.replace(preset("V100"), name=f"gpu{i}", mem_cap=50_000_000) for i in range(2)
    ]
    with pytest.raises(InfeasiblePlanError) as info:
        crosscut.partition(
            model,
            Cluster.from_specs(tiny, "nvlink"),
            torch.randn(2, 3, 64, 64),
            microbatches=1,
            replicas=1,
        )
    msg = str(info.value)
    assert "50" in msg and "remedy" in msg


def test_latency_objective_on_branches() -> None:
    """googlenet at batch 1 on 2 devices: the makespan is at most the one-device time."""
    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False)
    x = torch.randn(1, 3, 224, 224)
    one = crosscut.partition(
        model,
        "1xV100",
        x,
        mode="infer",
        objective="latency",
        time_limit=5,
        microbatches=1,
        replicas=1,
    )
    two = crosscut.partition(
        model,
        "2xV100",
        x,
        mode="infer",
        objective="latency",
        time_limit=5,
        microbatches=1,
        replicas=1,
    )
    assert two.predicted.makespan_s <= one.predicted.makespan_s * (1 + 1e-6)
    if two.num_stages == 1:
        assert any("does not pay" in n for n in two.solver.notes)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"microbatches": 3}, InputError, "microbatches must divide the batch"),
        ({"microbatches": 0}, InputError, "positive integer"),
        ({"time_limit": 0}, InputError, "time_limit must be a positive"),
        ({"time_limit": -1.0}, InputError, "time_limit must be a positive"),
        ({"objective": "fast"}, InputError, "objective must be one of"),
        ({"schedule": "zigzag"}, InputError, "schedule must be one of"),
        ({"mode": "eval"}, InputError, "mode must be one of"),
    ],
)
def test_bad_options(
    resnet18: nn.Module, kwargs: dict[str, object], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        crosscut.compile(copy.deepcopy(resnet18), ["cpu", "cpu"], X, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("devices", "match"),
    [
        ([], "empty|at least one"),
        ("4xFoo", "preset|known"),
        (["tpu:0"], "tpu"),
        (["cuda:7"], "cuda"),
    ],
)
def test_bad_devices(resnet18: nn.Module, devices: object, match: str) -> None:
    with pytest.raises(DeviceError, match=match):
        crosscut.compile(copy.deepcopy(resnet18), devices, X, microbatches=1, replicas=1)


def test_not_a_module() -> None:
    with pytest.raises(InputError, match=r"nn\.Module"):
        crosscut.compile(torchvision.models.resnet18, ["cpu"], X, microbatches=1, replicas=1)  # type: ignore[arg-type]


def test_bad_example_inputs(resnet18: nn.Module) -> None:
    with pytest.raises(InputError, match="Tensor"):
        crosscut.compile(copy.deepcopy(resnet18), ["cpu"], [[1, 2, 3]], microbatches=1, replicas=1)
    with pytest.raises(InputError):  # one channel into a 3-channel conv
        crosscut.compile(
            copy.deepcopy(resnet18), ["cpu"], torch.randn(2, 1, 64, 64), microbatches=1, replicas=1
        )


def test_a_call_that_does_not_fit_the_signature_is_the_callers_error() -> None:
    """Before, compile(model, devices, x, y) said "failed inside a dependency ... likely a
    crosscut bug"."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    with pytest.raises(InputError, match="do not fit") as info:
        crosscut.compile(model, ["cpu"], X, X)  # type: ignore[call-arg]
    assert "too many positional" in str(info.value) and "(x, y)" in str(info.value)
    assert "crosscut bug" not in str(info.value)
    with pytest.raises(InputError, match="missing a required argument: 'cluster'"):
        crosscut.partition(model)  # type: ignore[call-arg]


@pytest.mark.parametrize("wrapper", [nn.DataParallel])
def test_a_data_parallel_wrapper_is_refused_naming_the_module(wrapper: type) -> None:
    model = wrapper(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()))
    with pytest.raises(InputError, match="wrapped in DataParallel") as info:
        crosscut.compile(model, ["cpu", "cpu"], X)
    assert "model.module" in str(info.value) and "Sequential" in str(info.value)


def test_edge_models_and_inputs_are_refused_by_rule() -> None:
    """Before, each of these was "failed inside a dependency ... likely a crosscut bug"."""
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    with pytest.raises(InputError, match="computes nothing to place"):
        crosscut.compile(nn.Identity(), ["cpu", "cpu"], X)
    with pytest.raises(InputError, match="needs a batch dimension"):
        crosscut.compile(net, ["cpu", "cpu"], torch.tensor(1.0))
    meta = copy.deepcopy(net).to("meta")
    with pytest.raises(InputError, match="meta device") as info:
        crosscut.compile(meta, ["cpu", "cpu"], X)
    assert "'0.weight'" in str(info.value) and "to_empty" in str(info.value)
    plan = crosscut.partition(meta, ["cpu", "cpu"], X, microbatches=1, replicas=1)
    assert plan.stages  # a meta model is still planned


def test_compiled_module_refuses_to_move(resnet18: nn.Module) -> None:
    compiled = crosscut.compile(copy.deepcopy(resnet18), ["cpu"], X, microbatches=1, replicas=1)
    with pytest.raises(crosscut.CrosscutError, match="plan"):
        compiled.to("cpu")


def test_one_device_partition_is_one_optimal_stage() -> None:
    # regression: the CP-SAT bounds once took min() over the links of a 1-device
    # cluster (there are none) and crashed before solving
    model = torchvision.models.resnet18(num_classes=10)
    for cluster in (["cpu"], "1xV100"):
        plan = crosscut.partition(
            model, cluster, torch.randn(2, 3, 32, 32), microbatches=1, replicas=1
        )
        assert plan.solver.status == "OPTIMAL"
        assert [s.devices for s in plan.stages] == [[plan.cluster.devices[0].name]]


# ---- one options object (issue 26) -----------------------------------------------------


def test_the_keywords_types_list_exactly_the_options_fields() -> None:
    """A new option is a field of PlanRequest or RunOptions: the keywords' types must follow,
    or a type checker would refuse (or miss) it at every front door."""
    from crosscut.options import (
        PLAN_FIELDS,
        RUN_FIELDS,
        CompileKeywords,
        PlanKeywords,
    )

    assert set(PlanKeywords.__annotations__) | set(PlanKeywords.__optional_keys__) == set(
        PLAN_FIELDS
    )
    assert set(CompileKeywords.__optional_keys__) == set(PLAN_FIELDS) | set(RUN_FIELDS)
    from crosscut.runtime.local.compiled import LocalKeywords, LocalOptions

    local = {f.name for f in dataclasses.fields(LocalOptions)}
    assert set(LocalKeywords.__optional_keys__) == local


def test_an_unknown_option_is_refused_with_the_nearest_name(resnet18: nn.Module) -> None:
    x = torch.randn(4, 3, 32, 32)
    with pytest.raises(InputError, match=r"no option 'microbatch'.*did you mean 'microbatches'"):
        crosscut.partition(resnet18, ["cpu", "cpu"], x, microbatch=2)  # type: ignore[call-arg]
    with pytest.raises(InputError, match=r"crosscut\.partition has no option 'bn_mode'"):
        crosscut.partition(resnet18, ["cpu"], x, bn_mode="step")  # type: ignore[call-arg]
    with pytest.raises(InputError, match=r"crosscut\.compile has no option 'shedule'"):
        crosscut.compile(resnet18, ["cpu"], x, shedule="1f1b")  # type: ignore[call-arg]


def test_an_options_object_and_keywords_over_it_plan_alike() -> None:
    """options= is the same request as its fields given as keywords; a keyword wins."""
    from crosscut.options import PlanRequest, RunOptions, split_options

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(8, 8)
    base = PlanRequest(microbatches=2, schedule="gpipe", time_limit=5)
    by_object = crosscut.partition(model, ["cpu", "cpu"], x, options=base, replicas=1)
    by_keywords = crosscut.partition(
        model, ["cpu", "cpu"], x, microbatches=2, schedule="gpipe", time_limit=5, replicas=1
    )
    assert by_object.options.microbatches == by_keywords.options.microbatches == 2
    assert by_object.options.schedule == by_keywords.options.schedule == "gpipe"
    assert by_object.assignment == by_keywords.assignment
    # compile's run options: the run's recompute and precision also set the plan's;
    # exact batch norm fixes M and R at 1 and leaves out device groups unless given
    request, run = split_options(base, RunOptions(recompute="always"), {"bn_mode": "exact"})
    assert (request.recompute, run.recompute, run.bn_mode) == ("always", "always", "exact")
    assert (request.microbatches, request.replicas, request.cross_shaped) == (2, 1, False)
    request, _ = split_options(None, None, {"bn_mode": "exact", "cross_shaped": True})
    assert request.cross_shaped is True
    assert split_options(None, None, {})[0].cross_shaped is None  # "auto"
    request, _ = split_options(None, None, {"bn_mode": "step"})
    assert request.recompute == "never"  # "auto" cannot run under step statistics
    request, run = split_options(None, None, {"recompute": [True, False], "precision": "bf16"})
    assert (request.recompute, run.recompute) == ("never", (True, False))
    assert (request.precision, run.precision) == ("bf16", "bf16")
    # an options object plans; it does not pin a replayed plan's precision
    request, run = split_options(PlanRequest(time_limit=5), None, {})
    assert (request.precision, run.precision) == ("fp32", None)
    with pytest.raises(InputError, match="recompute must be one of"):
        RunOptions(recompute="sometimes")


class _DropPath(nn.Module):
    """timm's DropPath as it is written: a Python branch on the rate, traced away at 0."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_prob == 0.0:
            return x
        keep = torch.rand(x.shape[0], 1, 1, 1) >= self.drop_prob
        return x * keep / (1 - self.drop_prob)


class _Drops(nn.Module):
    """A stochastic depth (torchvision's, traced as one call whatever its rate) and a
    dropout; with ``path`` > 0 also a timm-style DropPath."""

    def __init__(self, path: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.sd = torchvision.ops.StochasticDepth(0.5, "row")
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.dp = _DropPath(path)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.c1(x))
        y = y + self.sd(torch.relu(self.c2(y)))
        return self.fc(self.drop(self.dp(y).mean((2, 3))))


def test_verify_switches_off_stochastic_depth_on_both_sides() -> None:
    """Before, only nn.Dropout was switched off, so every plan of a model with stochastic
    depth (torchvision's efficientnet, convnext) — data parallelism too — was reported
    as differing from eager: the two sides dropped different rows."""
    x = torch.randn(8, 3, 16, 16)
    plan = crosscut.partition(_Drops(), ["cpu"] * 2, x, replicas=2, time_limit=5)
    report = verify_plan(_Drops(), x, plan)
    assert report.ok, report.text()


def test_verify_names_a_drop_that_leaves_the_trace_when_switched_off() -> None:
    x = torch.randn(8, 3, 16, 16)
    plan = crosscut.partition(_Drops(path=0.5), ["cpu"] * 2, x, replicas=2, time_limit=5)
    with pytest.raises(PlanError, match=r"random drop off.*drop_path_rate=0\.0"):
        verify_plan(_Drops(path=0.5), x, plan)
    fixed = crosscut.partition(_Drops(path=0.0), ["cpu"] * 2, x, replicas=2, time_limit=5)
    assert verify_plan(_Drops(path=0.5), x, fixed).ok  # the remedy: a plan made without


def test_verify_checks_the_training_contract_bit_for_bit() -> None:
    """verify trains as a user does: ``train_step`` against eager running the same
    micro-batches' backwards in order. googlenet cut through its inception blocks,
    interleaved over 2 devices with 4 micro-batches, is equal there bit for bit (one
    backward through the threaded graph, verify's old path, met the fan-outs' readers in
    another order and differed in the last bits)."""
    torch.manual_seed(0)
    model = torchvision.models.googlenet(num_classes=10, aux_logits=False, init_weights=True)
    x = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    plan = crosscut.partition(model, ["cpu"] * 2, x, schedule="1f1b-v2", microbatches=4,
                              replicas=1, require_all_devices=True, time_limit=5)  # fmt: skip
    report = verify_plan(model, x, plan)
    assert report.ok, report.text()
    assert report.loss_diff == 0.0 and report.max_state_diff == 0.0, report.text()
    assert report.max_output_diff == 0.0, report.text()


def test_verify_compares_float64_states_in_float64() -> None:
    """Two float64 tensors that agree to 1e-12 either side of a float32 rounding
    boundary: cast to float32 (verify's old comparison) they are one float32 unit
    (2.4e-7) apart, over a float64 check's tolerance, and timm's rexnet_100 grouped
    plan was reported as differing from eager that way. In float64 they are close,
    and a real difference of 1e-6 is still caught."""
    edge = 2.0 + 2.0**-23  # halfway between the float32 neighbours 2.0 and 2.0 + 2**-22
    want = {"w": torch.tensor([edge - 1e-12], dtype=torch.float64)}
    near = {"w": torch.tensor([edge + 1e-12], dtype=torch.float64)}
    assert float(near["w"].float() - want["w"].float()) > 2e-7  # what the cast did
    worst, key, ok = compare_states(want, near, rtol=1e-7, atol=1e-8)
    assert ok and key == "w" and worst == pytest.approx(2e-12, rel=0.01)
    far = {"w": want["w"] + 1e-6}
    assert not compare_states(want, far, rtol=1e-7, atol=1e-8)[2]
    assert not compare_states(want, {}, rtol=1e-7, atol=1e-8)[2]  # a missing key


def test_verify_compares_counters_exactly() -> None:
    """Integer state (a call counter, num_batches_tracked) was skipped: a counter stepped
    twice passed. It must be equal now, whatever the tolerance; skipped keys stay skipped."""
    want = {"calls": torch.tensor(3), "w": torch.zeros(2)}
    twice = {"calls": torch.tensor(4), "w": torch.zeros(2)}
    worst, key, ok = compare_states(want, twice, rtol=1.0, atol=1.0)
    assert not ok and key == "calls" and worst == 1.0
    assert compare_states(want, twice, skip={"calls"}, rtol=1e-7, atol=1e-8)[2]
    assert compare_states(want, dict(want), rtol=1e-7, atol=1e-8)[2]


def test_the_verify_loss_keeps_float64_and_sums_half_precision_in_float32() -> None:
    assert loss_of(torch.ones(2, 3, dtype=torch.float64)).dtype == torch.float64
    assert loss_of(torch.ones(2, 3, dtype=torch.bfloat16)).dtype == torch.float32


class _TwoInputs(nn.Module):
    """An image and a mask, both batch-major."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(9, 8, 3, padding=1)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y = torch.cat([self.c1(x).relu(), mask], 1)
        return self.head(self.c2(y).relu().mean((2, 3)))


@pytest.mark.parametrize("devices", [2, 3])
def test_verify_takes_a_model_of_several_inputs(devices: int) -> None:
    """verify_plan chunked one tensor only (``x.chunk``): a two-input model could not be
    verified. Each input is cut into the plan's micro-batches and replicas alike."""
    torch.manual_seed(0)
    model = _TwoInputs().double()
    xs = (torch.randn(8, 3, 8, 8).double(), torch.randn(8, 1, 8, 8).double())
    plan = crosscut.partition(model, ["cpu"] * devices, xs, time_limit=3)
    report = verify_plan(model, xs, plan, rtol=1e-8, atol=1e-9)
    assert report.ok, report.text()
    assert report.checked_keys == len(model.state_dict())
