"""Cross-shaped plans through the public API: partition, the plan file, compile.

A plan made for a V100 cluster (where groups pay) is saved, reloaded,
validated, simulated, then replayed on four logical CPU devices and compared
with eager mode; without ``cross_shaped`` nothing changes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch import nn

import crosscut
from crosscut.api import partition
from crosscut.errors import InputError
from crosscut.ir.plan import Plan
from crosscut.partitioner.simulate import simulate
from crosscut.partitioner.validate import validate_plan

torch.set_num_threads(1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.vgg11()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0  # batch-split replicas would each draw their own mask
    return model


def test_no_groups_when_forbidden_and_batch_splits_only_by_default() -> None:
    x = torch.randn(8, 3, 64, 64)
    plan = partition(
        _model(), "4xV100", x, time_limit=2, microbatches=1, replicas=1, cross_shaped=False
    )
    assert all(len(s.devices) == 1 and s.split == "none" for s in plan.stages)
    assert plan.options.widths == [1] and plan.options.splits == []
    auto = partition(_model(), "4xV100", x, time_limit=2, microbatches=1, replicas=1)
    assert auto.options.splits == ["batch"]  # channel splits stay opt-in
    assert {s.split for s in auto.stages} <= {"none", "batch"}


def test_cross_plan_round_trips_and_replays_exactly(tmp_path: object) -> None:
    model = _model()
    x = torch.randn(8, 3, 64, 64)
    # 5 s: under a loaded 2-core run, 2 s let the solver stop at a plan without groups.
    # K20c: on V100s at 8 samples no group pays for its shards' lower efficiency
    plan = partition(
        model, "4xK20c", x, cross_shaped=True, time_limit=5, microbatches=1, replicas=1
    )
    assert any(len(s.devices) > 1 for s in plan.stages), [s.devices for s in plan.stages]
    assert plan.predicted.bottleneck_s <= min(plan.solver.baselines.values()) * (1 + 1e-9)
    path = plan.save(f"{tmp_path}/plan.json")
    again = Plan.load(path)
    validate_plan(again)
    assert [(s.devices, s.split) for s in again.stages] == [
        (s.devices, s.split) for s in plan.stages
    ]
    sim = simulate(again)
    assert set(sim.device_peak_bytes) == set(again.used_devices())
    assert sim.step_time_s >= plan.predicted.bottleneck_s * (1 - 1e-9)

    ref = copy.deepcopy(model)
    c = crosscut.compile(model, ["cpu"] * 4, x, plan=again)
    assert any(len(s.devices) > 1 for s in c.program.stages)
    y = torch.randint(0, 1000, (8,))
    out = c(x)
    expected = ref(x)
    torch.testing.assert_close(out, expected)
    nn.functional.cross_entropy(out, y).backward()
    nn.functional.cross_entropy(expected, y).backward()
    sd = c.state_dict()
    assert list(sd) == list(ref.state_dict())
    c.close()


def test_bad_cross_options_are_refused() -> None:
    x = torch.randn(4, 3, 64, 64)
    with pytest.raises(InputError, match="splits"):
        partition(
            _model(), "4xV100", x, cross_shaped=True, splits=("rows",), microbatches=1, replicas=1
        )
    with pytest.raises(InputError, match="widths"):
        partition(
            _model(), "4xV100", x, cross_shaped=True, widths=(0, 2), microbatches=1, replicas=1
        )


def test_plan_problem_knows_the_model_inputs_and_outputs() -> None:
    """What a batch-split stage scatters and gathers comes from the traced model."""
    from crosscut.partitioner.build import plan_to_problem

    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            feats = self.conv(x).mean((2, 3))
            return self.head(feats), feats + x.mean()  # x read twice, two outputs

    plan = partition(TwoHeads(), ["cpu"] * 2, torch.randn(8, 3, 16, 16), microbatches=2, replicas=1)
    pb, _, _ = plan_to_problem(plan)
    ((nbytes, readers),) = pb.graph_inputs
    assert nbytes == 4 * 3 * 16 * 16 * 4  # one micro-batch of 4 float32 images
    assert [pb.names[v] for v in readers] == ["conv", "mean_1"]
    assert sorted(pb.names[v] for v in pb.graph_outputs) == ["add", "head"]


def test_cross_shaped_plans_where_no_pipeline_fits() -> None:
    # one conv's activations at batch 512 (6.6 GB) exceed a K20c (5 GB): no pipeline can
    # hold them, shares of a group can (of the batch or of the channels). The pipeline-only
    # solve's refusal used to end the search (issue 16: resnet50 at 8,192 on 256xV100)
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, 10),
        )
    x = torch.empty(512, 3, 224, 224, device="meta")
    with pytest.raises(crosscut.InfeasiblePlanError):
        partition(model, "4xK20c", x, time_limit=5, microbatches=1, replicas=1, cross_shaped=False)
    for asked in (True, None):  # asked for, and by default (batch-split groups)
        plan = partition(
            model, "4xK20c", x, cross_shaped=asked, time_limit=5, microbatches=1, replicas=1
        )
        assert all(s.split in ("batch", "channel") and len(s.devices) > 1 for s in plan.stages)
        assert any("no pipeline-only plan" in note for note in plan.solver.notes)
        assert all(len(note) < 2000 for note in plan.solver.notes)  # caps summarised


def test_a_cross_shaped_plan_records_the_seed_it_was_asked_for() -> None:
    """The group DP is deterministic, but the plan says which seed its solve ran with
    (it recorded 0 whatever the caller gave)."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    x = torch.randn(8, 3, 8, 8)
    plan = partition(
        model, "4xV100", x, time_limit=2, microbatches=1, replicas=1, cross_shaped=True, seed=7
    )
    assert plan.solver.seed == 7


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 10),
    )  # fmt: skip


def test_verify_compares_a_default_group_plan_with_what_its_shares_compute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A default plan may give a stage with batch norms a batch-split group; each device
    normalises its share apart and the leader's share updates the running statistics, as
    data parallelism does. ``crosscut verify`` replays it against an eager reference that
    does the same (and would report a mismatch against plain micro-batch eager)."""
    from crosscut import verify

    x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    plan = partition(_bn_net(), "4xK20c", x.to("meta"), time_limit=5)
    grouped = [s for s in plan.stages if s.split == "batch" and len(s.devices) > 1]
    held = {n.kind for n in plan.nodes if plan.assignment.get(n.name) in {s.index for s in grouped}}
    assert grouped and "batch_norm" in held, [(s.devices, s.split) for s in plan.stages]
    report = verify.verify_plan(_bn_net(), x, plan)
    assert report.ok and not report.not_compared, report.text()  # running statistics too
    monkeypatch.setattr(verify, "_shared_batch_norms", lambda model, plan: None)
    plain = verify.verify_plan(_bn_net(), x, plan)
    assert not plain.ok and plain.max_output_diff > 1e-3, plain.text()


def test_channel_shards_are_priced_at_their_own_size() -> None:
    """A channel-split stage's shards (a conv with 1/w of its filters, a classifier with
    1/w of its outputs) use a device less well than the whole layer: the plan carries
    each node's shard scale (``PlanNode.channel_scale``), re-pricing the plan from its
    JSON gives the same stage times, and every channel-split stage costs more than its
    linear share would."""
    from tests.plan_factory import reprice

    model = torchvision.models.alexnet(weights=None)
    plan = partition(model, "8xV100", torch.empty(64, 3, 224, 224, device="meta"),
                     cross_shaped=True, time_limit=10)  # fmt: skip
    split = [s for s in plan.stages if s.split == "channel"]
    assert split, [(s.devices, s.split) for s in plan.stages]
    priced = reprice(plan)
    assert priced.stage_time == pytest.approx([s.time_s for s in plan.stages])
    flat = reprice(plan, clear="channel_scale")
    for s in split:
        assert flat.stage_compute[s.index] < priced.stage_compute[s.index]
