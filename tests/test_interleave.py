"""Interleaved 1F1B in the planner: the re-cut, its price, and the choice."""

from __future__ import annotations

import itertools

import torch
import torchvision

import crosscut
from crosscut.ir.plan import Plan
from crosscut.partitioner.interleave import interleave
from crosscut.partitioner.schedule_choice import choose_schedule
from crosscut.partitioner.simulate import simulate
from crosscut.partitioner.validate import plan_problems


def _pipeline(cluster: str, micro: int = 4, replicas: int = 1) -> Plan:
    x = torch.randn(32 * replicas, 3, 64, 64)
    model = torchvision.models.resnet18(num_classes=10)
    return crosscut.partition(
        model, cluster, x, schedule="1f1b", microbatches=micro, replicas=replicas,
        require_all_devices=True, time_limit=5,
    )  # fmt: skip


def test_a_recut_is_round_robin_contiguous_and_valid() -> None:
    """S stages become 2S on the same devices, stage k on the device of stage k % S; each
    stage is a contiguous run of the node order (so no value flows backwards); the plan
    passes its own validation and says it is a heuristic re-cut."""
    plan = _pipeline("4xV100")
    assert plan.num_stages == 4
    out = interleave(plan, "1f1b-v2")
    assert out is not None and out is not plan and plan.options.schedule == "1f1b"
    assert out.options.schedule == "1f1b-v2" and out.num_stages == 8
    path = [st.devices for st in plan.stages]
    assert [st.devices for st in out.stages] == path + path
    assert plan_problems(out) == []
    order = [n.name for n in out.nodes if n.name in out.assignment]
    stages = [out.assignment[n] for n in order]
    assert stages == sorted(stages) and set(stages) == set(range(8))
    assert any("heuristic" in n for n in out.solver.notes)


def test_a_v_shaped_recut_pairs_each_device_s_stages_and_keeps_the_turn_local() -> None:
    """``zbv``: device ``r`` of ``W`` gets stages ``r`` and ``2W - 1 - r`` (the first and
    the last on one device, the two middle ones on another), contiguous chunks of the
    node order, valid; the turn from stage ``W - 1`` to ``W`` crosses no link, so the
    simulator shows no transfer there; and a plan that breaks the V is refused, naming
    the device the stage belongs on."""
    plan = _pipeline("4xV100")
    out = interleave(plan, "zbv")
    assert out is not None and out.options.schedule == "zbv" and out.num_stages == 8
    path = [st.devices for st in plan.stages]
    assert [st.devices for st in out.stages] == path + path[::-1]
    assert plan_problems(out) == []
    assert any("in a V" in n for n in out.solver.notes)
    order = [n.name for n in out.nodes if n.name in out.assignment]
    assert [out.assignment[n] for n in order] == sorted(out.assignment[n] for n in order)
    kinds = {e.kind for e in simulate(out).events}
    assert {"F", "B", "W"} <= kinds
    assert out.stages[3].devices == out.stages[4].devices  # the turn, on one device
    broken = Plan.from_dict(out.to_dict())
    broken.stages[4].devices, broken.stages[7].devices = path[0], path[3]
    problems = plan_problems(broken)
    assert any("stage 4 runs on ['gpu0']; under 'zbv' it runs on stage 3's device" in p
               for p in problems), problems  # fmt: skip


def test_a_recut_halves_the_bubble_of_a_balanced_pipeline() -> None:
    """The point of interleaving: with M = S the 1F1B bubble (S - 1)/(M + S - 1) is large;
    two stages per device shrink it, and the step with it, though every boundary is
    a transfer now."""
    plan = _pipeline("4xV100")
    out = interleave(plan, "1f1b-v2")
    assert out is not None
    assert out.predicted.bubble_fraction < plan.predicted.bubble_fraction - 0.05
    assert out.predicted.step_time_s < plan.predicted.step_time_s
    # each device's compute is the same work, cut differently: within 15 %
    load = {d: 0.0 for d in ("gpu0", "gpu1", "gpu2", "gpu3")}
    for st in out.stages:
        load[st.devices[0]] += st.compute_s
    assert max(load.values()) < 1.15 * sum(load.values()) / 4


def test_replicas_of_an_interleaved_pipeline_reduce_after_each_row() -> None:
    """A rank running two stages reduces their gradients after its whole row (both
    runtimes): the simulator starts each stage's all-reduce no earlier than the last
    action of its device, and the two stages of a device one after the other."""
    plan = interleave(_pipeline("2x2xV100", replicas=2), "1f1b-v2")
    assert plan is not None and plan.replication.replicas == 2
    sim = simulate(plan)
    work = [e for e in sim.events if e.kind in ("F", "B", "W")]
    reduces = sorted((e for e in sim.events if e.kind == "R"), key=lambda e: e.start)
    assert reduces
    for r in reduces:
        dev_end = max(e.end for e in work if e.device == r.device)
        assert r.start >= dev_end - 1e-12
    for dev in {r.device for r in reduces}:
        mine = [r for r in reduces if r.device == dev]
        assert all(a.end <= b.start + 1e-12 for a, b in itertools.pairwise(mine))


def test_the_choice_takes_the_recut_only_where_allowed_and_quicker() -> None:
    """``choose_schedule`` lists the re-cut with the others in its note, returns it only
    when it is the quickest that fits, and never under ``interleave=False`` (torchrun's
    own planning)."""
    base = _pipeline("4xV100", micro=4)
    kept = choose_schedule(Plan.from_dict(base.to_dict()), interleave=False)
    assert kept.options.schedule != "1f1b-v2" and kept.num_stages == 4
    chosen = choose_schedule(Plan.from_dict(base.to_dict()))
    note = next(n for n in chosen.solver.notes if n.startswith("schedule "))
    assert "1f1b-v2" in note
    recut = interleave(base, "1f1b-v2")
    assert recut is not None
    steps = {p.options.schedule: p.predicted.step_time_s for p in (kept, recut)}
    assert chosen.predicted.step_time_s == min(steps.values())
    assert chosen.options.schedule == min(steps, key=lambda k: steps[k])


def test_an_interleaved_replica_spanning_nodes_runs_in_its_placement_order() -> None:
    """Under torchrun a replica spanning nodes runs stage ``s`` on the rank its schedule
    places it on: an interleaved re-cut of a pipeline whose stages run in rank order is
    in rank order too (stage s on rank s % W), and swapping two stages' devices across
    the nodes breaks it."""
    from crosscut.partitioner.replicas import runs_in_rank_order, stage_nodes

    base = _pipeline("2x2xV100", micro=4)
    assert runs_in_rank_order(base, 2)
    recut = interleave(base, "1f1b-v2")
    assert recut is not None and recut.num_stages == 8
    assert stage_nodes(recut, 2) == stage_nodes(base, 2) * 2
    assert runs_in_rank_order(recut, 2)
    swapped = Plan.from_dict(recut.to_dict())
    swapped.stages[0].devices, swapped.stages[2].devices = (
        swapped.stages[2].devices,
        swapped.stages[0].devices,
    )
    assert not runs_in_rank_order(swapped, 2)


def test_nothing_to_interleave_gives_none() -> None:
    """One stage, an inference plan, or a stage on a device group: no re-cut."""
    x = torch.randn(8, 3, 32, 32)
    model = torchvision.models.resnet18(num_classes=10)
    one = crosscut.partition(model, "1xV100", x, schedule="1f1b", time_limit=5)
    assert one.num_stages == 1 and interleave(one, "1f1b-v2") is None
    infer = crosscut.partition(
        model, "2xV100", x, mode="infer", replicas=1, require_all_devices=True, time_limit=5
    )
    assert infer.num_stages == 2 and interleave(infer, "1f1b-v2") is None


def test_the_timeline_draws_each_virtual_stage_apart() -> None:
    """In the report's timeline a device's two stages are told apart: every F/B box of
    an interleaved device carries ``vstage-0`` or ``vstage-1`` (each as often as the
    simulator ran that stage's actions), and the tooltip names the stage."""
    from crosscut.viz.timeline import timeline_svg

    plan = interleave(_pipeline("2xV100"), "1f1b-v2")
    assert plan is not None and plan.num_stages == 4
    sim = simulate(plan)
    svg = timeline_svg(plan, sim)
    for v in (0, 1):
        ran = sum(
            e.kind in "FB" and e.stage in (2 * v, 2 * v + 1) for e in sim.events if e.kind != "T"
        )
        assert svg.count(f"vstage-{v}") == ran > 0
    assert "gpu0 stage 2 forward" in svg


def test_broken_interleaved_plans_are_refused_by_name() -> None:
    """A plan whose stages leave the round-robin, a model too small to cut twice per
    device, and a rank asked to switch to a schedule of another cut: each refused with
    the rule and a remedy."""
    import pytest
    from torch import nn

    from crosscut.errors import InputError, PartitionError
    from crosscut.runtime.dist.rank_stages import check_same_cut

    plan = interleave(_pipeline("2xV100"), "1f1b-v2")
    assert plan is not None
    plan.stages[2].devices = ["gpu1"]
    problems = plan_problems(plan)
    assert any("round-robin" in p and "stage 2" in p for p in problems), problems
    tiny = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
    with pytest.raises(PartitionError, match="stages per device") as err:
        crosscut.partition(
            tiny, "2xV100", torch.randn(8, 3, 8, 8), schedule="1f1b-v2", replicas=1,
            require_all_devices=True, microbatches=2, time_limit=5,
        )  # fmt: skip
    assert "1f1b" in str(err.value)
    with pytest.raises(InputError, match="was cut for 2"):
        check_same_cut("zb-h2", "1f1b-v2")
    check_same_cut("1f1b-v2", "1f1b-v2")
    check_same_cut("zb-v2", "1f1b-v2")  # the same round-robin cut: a rank may switch
    with pytest.raises(InputError, match="cut for 2 placed in a V"):
        check_same_cut("zb-v2", "zbv")  # two per rank too, but placed otherwise


def test_a_lead_within_the_profiles_spread_keeps_the_simpler_schedule() -> None:
    """With profiled costs a step is a measurement: where the quickest schedule's lead
    over a simpler one is inside the profiles' spread, the simplest within it is kept
    (1F1B first, the interleaved re-cut last) and the note says why; with no spread
    (analytic) the quickest wins."""
    base = _pipeline("4xV100", micro=4)
    quick = choose_schedule(Plan.from_dict(base.to_dict()), noise=0.0)
    assert quick.options.schedule != "1f1b"  # a pipeline of 4 with M=4: 1F1B is not quickest
    loose = choose_schedule(Plan.from_dict(base.to_dict()), noise=1.0)
    assert loose.options.schedule == "1f1b" and loose.num_stages == 4
    note = next(n for n in loose.solver.notes if n.startswith("schedule "))
    assert "within the profiles' spread of 100.0%" in note
    assert loose.predicted.step_time_s > quick.predicted.step_time_s


def test_a_recut_stops_refining_at_its_deadline_and_says_so() -> None:
    """A strategy search prices many pipelines in one time limit, so the re-cut's cut moves
    (up to 400 evaluations) stop when the deadline passes: an expired deadline prices the
    time-balanced cut itself, valid, and the note says the moves were cut short; with no
    deadline the moves run (the refined bottleneck is never worse) and no such note."""
    from crosscut.partitioner.deadline import Deadline

    base = _pipeline("4xV100")
    free = interleave(base, "1f1b-v2")
    cut = interleave(base, "1f1b-v2", Deadline(0.0))
    assert free is not None and cut is not None
    assert plan_problems(cut) == [] and cut.num_stages == free.num_stages == 8
    assert any("stopped at the time limit after 0" in n for n in cut.solver.notes)
    assert not any("stopped at the time limit" in n for n in free.solver.notes)
    assert free.predicted.bottleneck_s <= cut.predicted.bottleneck_s * (1 + 1e-9)


def test_the_choice_skips_recuts_once_its_deadline_passed() -> None:
    """With its deadline passed, ``choose_schedule`` still prices the four plain schedules
    (a few simulations) but starts no re-cut, and its note names the ones it left."""
    from crosscut.ir.schedule import AUTO_INTERLEAVED
    from crosscut.partitioner.deadline import Deadline

    base = _pipeline("4xV100", micro=4)
    late = choose_schedule(Plan.from_dict(base.to_dict()), deadline=Deadline(0.0))
    assert late.num_stages == 4 and late.options.schedule not in AUTO_INTERLEAVED
    note = next(n for n in late.solver.notes if n.startswith("schedule "))
    assert f"not tried at the time limit: {', '.join(AUTO_INTERLEAVED)}" in note
    assert all(name in note for name in ("1f1b", "zb-h1", "zb-h2", "gpipe"))


def test_no_recut_stage_holds_only_buffers_and_the_validator_says_so() -> None:
    """A model whose buffer (``get_attr``) sits between ops: the time-balanced cuts of a
    4-per-device re-cut could give a stage only that buffer, which codegen cannot build
    (``stages [4] have no nodes``, found when CPU prices moved the cuts). Every re-cut
    stage holds an op of its own; a plan edited to leave one with only the buffer is
    refused by validation, naming the stage."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from contract import Small, batch

    torch.manual_seed(0)
    x, _ = batch()
    for schedule, devices in (("1f1b-v4", 2), ("1f1b-v3", 2), ("zbv", 3), ("1f1b-v2", 3)):
        plan = crosscut.partition(
            Small(), ["cpu"] * devices, x, microbatches=4, require_all_devices=True,
            replicas=1, schedule=schedule,
        )  # fmt: skip
        ops = {n.name: n.op for n in plan.nodes}
        holding = {k for name, k in plan.assignment.items() if ops[name] != "get_attr"}
        assert holding == set(range(plan.num_stages)), (schedule, plan.assignment)
        assert plan_problems(plan) == []
    bad = Plan.from_dict(plan.to_dict())
    buffer = next(n.name for n in bad.nodes if n.op == "get_attr")
    lone = bad.assignment[buffer]
    for name, k in list(bad.assignment.items()):
        if k == lone and name != buffer:
            bad.assignment[name] = lone + 1 if lone + 1 < bad.num_stages else lone - 1
    assert any(f"stages [{lone}] hold no op of their own" in p for p in plan_problems(bad))
