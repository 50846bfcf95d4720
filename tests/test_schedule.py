"""Schedules as data: text round-trips, rule checks, deadlock detection, in-flight counts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crosscut.ir.schedule import (
    Action,
    ScheduleError,
    action_times,
    format_schedule,
    gpipe,
    in_flight,
    inference,
    make_schedule,
    max_inflight,
    one_f_one_b,
    parse_schedule,
    placement,
    validate_schedule,
    virtual_stages,
    zero_bubble_h1,
)

sizes = st.tuples(st.integers(1, 6), st.integers(1, 9))


def test_action_text_round_trips() -> None:
    a = Action(2, "F", 0)
    assert str(a) == "2F0"
    assert Action.parse("2F0") == a
    assert Action.parse("11B13") == Action(11, "B", 13)
    with pytest.raises(ScheduleError, match=re.escape("<stage><F|B|W><microbatch>")):
        Action.parse("2X0")


@given(sizes, st.sampled_from(["gpipe", "1f1b", "zb-h1", "zb-h2", "inference"]))
def test_builders_are_valid_and_round_trip(sm: tuple[int, int], name: str) -> None:
    s, m = sm
    sched = make_schedule(name, s, m)
    validate_schedule(sched, s, m, training=name != "inference")
    assert parse_schedule(format_schedule(sched)) == sched


def test_text_form_of_a_schedule() -> None:
    assert format_schedule(gpipe(2, 2)) == "0: 0F0 0F1 0B0 0B1\n1: 1F0 1F1 1B0 1B1"
    assert format_schedule(one_f_one_b(2, 3)).splitlines()[1] == "1: 1F0 1B0 1F1 1B1 1F2 1B2"
    with pytest.raises(ScheduleError, match="starts with its stage number"):
        parse_schedule("1: 1F0")


@given(sizes)
def test_inflight_counts(sm: tuple[int, int]) -> None:
    s, m = sm
    for k in range(s):
        assert max_inflight(gpipe(s, m), k) == m
        assert max_inflight(one_f_one_b(s, m), k) == min(m, s - k)
        assert max_inflight(inference(s, m), k) == m
        assert max_inflight(zero_bubble_h1(s, m), k) == min(m, s - k)


def test_deadlock_is_detected_and_named() -> None:
    # stage 0 wants B0 before F1, but stage 1 holds B0 until after its F1: cycle
    bad = parse_schedule("0: 0F0 0B0 0F1 0B1\n1: 1F0 1F1 1B0 1B1")
    with pytest.raises(ScheduleError, match=r"deadlocks: action 0B0 waits for \['1B0'\]"):
        validate_schedule(bad, 2, 2, training=True)


def test_rule_violations_name_the_action() -> None:
    with pytest.raises(ScheduleError, match="0B1 runs before its forward"):
        validate_schedule(parse_schedule("0: 0F0 0B1 0F1 0B0"), 1, 2, training=True)
    with pytest.raises(ScheduleError, match="0F0 appears more than once"):
        validate_schedule(parse_schedule("0: 0F0 0F0"), 1, 1, training=False)
    with pytest.raises(ScheduleError, match="1F1 is missing"):
        validate_schedule(parse_schedule("0: 0F0 0F1\n1: 1F0"), 2, 2, training=False)
    with pytest.raises(ScheduleError, match="not part of this run"):
        validate_schedule(gpipe(2, 2), 2, 2, training=False)
    with pytest.raises(ScheduleError, match="1F0 is on row 0; stage 1 runs on row 1"):
        validate_schedule(parse_schedule("0: 1F0\n1: 0F0"), 2, 1, training=False)


def test_simulated_makespan_matches_pipeline_formula() -> None:
    # forward-only pipeline with unit stages: S + M - 1 steps
    times = action_times(inference(4, 8), 4)
    assert max(end for _, end in times.values()) == 4 + 8 - 1
    # 1F1B and GPipe have the same bubble with uniform costs
    g = max(e for _, e in action_times(gpipe(3, 4), 3).values())
    o = max(e for _, e in action_times(one_f_one_b(3, 4), 3).values())
    assert g == o == (3 - 1) * 3 + 4 * 3


def test_unknown_schedule_name() -> None:
    with pytest.raises(ScheduleError, match="schedule name must be known"):
        make_schedule("zb", 2, 2)


@given(
    st.integers(1, 8),
    st.integers(1, 12),
    st.sampled_from(["gpipe", "1f1b", "zb-h1", "zb-h2", "inference"]),
)
def test_the_closed_form_in_flight_count_is_the_schedules_own(s: int, m: int, name: str) -> None:
    """``in_flight`` (what the evaluator and the solver price) equals the built schedule's peak."""
    from crosscut.ir.schedule import in_flight, least_in_flight

    built = make_schedule(name, s, m)
    assert [in_flight(name, s, k, m) for k in range(s)] == [
        max_inflight(built, k) for k in range(s)
    ]
    # a lower bound for every pipeline (the solver's memory bound): exact but for zb-h2,
    # whose stages all hold up to 2S - 1
    least = min(max_inflight(built, k) for k in range(s))
    assert least_in_flight(name, m) <= least
    assert name == "zb-h2" or least_in_flight(name, m) == least


@given(sizes)
def test_zb_h1_idles_less_than_1f1b_with_the_same_memory(sm: tuple[int, int]) -> None:
    """With F = B = W (a backward of two forwards), ZB-H1 never takes longer than 1F1B,
    is shorter whenever there is a pipeline, and holds as many micro-batches per stage."""
    s, m = sm
    zb, ofob = zero_bubble_h1(s, m), one_f_one_b(s, m)
    ones, twos = [1.0] * s, [2.0] * s
    t_zb = max(e for _, e in action_times(zb, s, ones, twos, ones).values())
    t_1f1b = max(e for _, e in action_times(ofob, s, ones, twos).values())
    assert t_zb <= t_1f1b
    if s > 1:
        assert t_zb < t_1f1b
    assert [max_inflight(zb, k) for k in range(s)] == [max_inflight(ofob, k) for k in range(s)]


@pytest.mark.parametrize(
    ("text", "micro", "training", "message"),
    [
        ("0: 0F0 0W0 0B0", 1, True, "before its input-gradient pass"),
        ("0: 0F0 0F1 0B0 0W0 0B1", 2, True, "0W1 is missing"),
        ("0: 0F0 0W0", 1, False, "not part of this run"),
    ],
)
def test_a_split_backward_keeps_its_rules(
    text: str, micro: int, training: bool, message: str
) -> None:
    """W after its own B, a W for every B once any W appears, none in inference."""
    validate_schedule(parse_schedule("0: 0F0 0B0 0W0"), 1, 1, training=True)
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(parse_schedule(text), 1, micro, training=training)


@given(sizes, st.sampled_from(["gpipe", "1f1b", "zb-h1", "zb-h2"]))
def test_pending_weights_is_the_built_schedules_peak_between_b_and_w(
    sm: tuple[int, int], name: str
) -> None:
    """What the evaluator prices a split backward's held gradients by: the most
    micro-batches a stage has run ``B`` for and not yet ``W``; none without a ``W``."""
    from crosscut.ir.schedule import pending_weights

    s, m = sm
    built = make_schedule(name, s, m)
    for k in range(s):
        splits = any(a.kind == "W" for a in built[k])
        pending: set[int] = set()
        peak = 0
        for a in built[k]:
            if a.kind == "B" and splits:
                pending.add(a.microbatch)
            elif a.kind == "W":
                pending.discard(a.microbatch)
            peak = max(peak, len(pending))
        assert pending_weights(name, s, k, m) == peak


@given(st.integers(1, 5), st.integers(2, 4), st.integers(1, 12))
def test_interleaved_schedules_are_valid_round_robin_and_ordered(w: int, v: int, m: int) -> None:
    """Every (workers, virtual stages, micro-batches) gives a valid schedule: stage ``s``
    on row ``s % W``, all of F and B once, no deadlock (validate_schedule), and each
    stage's backwards in micro-batch order (the order gradients accumulate in eager)."""
    from crosscut.ir.schedule import interleaved_1f1b, worker_of

    s = w * v
    built = make_schedule(f"1f1b-v{v}", s, m)
    assert built == interleaved_1f1b(s, m, v)
    assert len(built) == w
    validate_schedule(built, s, m, training=True)
    for r, row in enumerate(built):
        assert all(worker_of(built, a.stage) == r for a in row)
    for k in range(s):
        row = built[k % w]
        assert [a.microbatch for a in row if a.stage == k and a.kind == "B"] == list(range(m))
        assert [a.microbatch for a in row if a.stage == k and a.kind == "F"] == list(range(m))


@given(st.integers(1, 4), st.integers(2, 4), st.integers(1, 10))
def test_interleaved_zero_bubble_keeps_the_interleaved_order_and_memory(
    w: int, v: int, m: int
) -> None:
    """``zb-vV``: interleaved 1F1B's F and B in its order on every row, each B's W later
    on the same row, every stage's actions in micro-batch order (gradients accumulate as
    in eager), valid for any durations, and never more micro-batches in flight on a
    stage than interleaved 1F1B holds (a micro-batch's activations live until its W)."""
    from crosscut.ir.schedule import interleaved_zero_bubble, splits_backward

    s = w * v
    built = make_schedule(f"zb-v{v}", s, m)
    assert built == interleaved_zero_bubble(s, m, v) and splits_backward(built)
    base = make_schedule(f"1f1b-v{v}", s, m)
    validate_schedule(built, s, m, training=True)
    for row, plain in zip(built, base):
        assert [a for a in row if a.kind != "W"] == plain
        for a in row:
            if a.kind == "W":
                assert row.index(Action(a.stage, "B", a.microbatch)) < row.index(a)
    for k in range(s):
        row = built[k % w]
        for kind in "FBW":
            assert [a.microbatch for a in row if a.stage == k and a.kind == kind] == list(range(m))

    def peak(row: list[Action], release: str) -> int:  # a worker's micro-batches alive
        live = top = 0
        for a in row:
            live += {"F": 1, release: -1}.get(a.kind, 0)
            top = max(top, live)
        return top

    assert [peak(r, "W") for r in built] == [peak(r, "B") for r in base]
    assert [in_flight(f"zb-v{v}", s, k, m) for k in range(s)] == [
        max_inflight(built, k) for k in range(s)
    ]


@given(st.integers(2, 6), st.integers(1, 12))
def test_v_shaped_zero_bubble_is_valid_placed_in_a_v_and_keeps_1f1b_memory(w: int, m: int) -> None:
    """``zbv``: worker ``r`` runs stages ``r`` and ``2W - 1 - r`` and nothing else; every
    action once, no deadlock; each stage's F, B and W in micro-batch order (gradients
    accumulate as in eager) with each W after its B; a worker never holds activations of
    more than ``W`` micro-batches (1F1B's first stage holds ``W`` micro-batches of
    twice-as-large stages: the same bytes), which the evaluator's count agrees with."""
    from crosscut.ir.schedule import forward_only, splits_backward, worker_of

    s = 2 * w
    built = make_schedule("zbv", s, m)
    where = placement("zbv", s)
    assert where == tuple(list(range(w)) + list(range(w - 1, -1, -1)))
    assert len(built) == w and splits_backward(built)
    validate_schedule(built, s, m, True, where)
    validate_schedule(forward_only("zbv", s, m), s, m, False, where)
    for r, row in enumerate(built):
        assert {a.stage for a in row} == {r, s - 1 - r}
        assert all(worker_of(built, a.stage) == r for a in row)
        for a in row:
            if a.kind == "W":
                assert row.index(Action(a.stage, "B", a.microbatch)) < row.index(a)
        for k in (r, s - 1 - r):
            for kind in "FBW":
                assert [a.microbatch for a in row if (a.stage, a.kind) == (k, kind)] == list(
                    range(m)
                )
        alive: dict[int, int] = {}  # micro-batch -> its stages here not yet through W
        top = 0
        for a in row:
            alive[a.microbatch] = alive.get(a.microbatch, 0) + {"F": 1, "W": -1}.get(a.kind, 0)
            top = max(top, sum(v > 0 for v in alive.values()))
        assert top <= min(w, m)
    assert [in_flight("zbv", s, k, m) for k in range(s)] == [
        max_inflight(built, k) for k in range(s)
    ]


@pytest.mark.parametrize("w", [2, 3, 4, 5])
@pytest.mark.parametrize("extra", [0, 1, 3, 7])
def test_v_shaped_zero_bubble_idles_at_most_half_of_1f1b(w: int, extra: int) -> None:
    """With the same work per worker (two half-size stages, F = B = W = 1 each, against
    one stage with F = 2, B = 4) and at least as many micro-batches as workers, ZB-V
    idles at most half of 1F1B's ``(W - 1)(F + B)`` and no more than ZB-H1."""
    m, s = w + extra, 2 * w
    work = 6.0 * m
    zbv = max(e for _, e in action_times(make_schedule("zbv", s, m), s, [1] * s, [2] * s).values())
    flat = max(e for _, e in action_times(one_f_one_b(w, m), w, [2] * w, [4] * w).values())
    h1 = max(
        e for _, e in action_times(zero_bubble_h1(w, m), w, [2] * w, [4] * w, [2] * w).values()
    )
    assert zbv - work <= (flat - work) / 2 and zbv <= h1


@pytest.mark.parametrize(("w", "m"), [(2, 4), (4, 4), (4, 8), (3, 6)])
def test_interleaving_shrinks_the_bubble_by_about_its_virtual_stages(w: int, m: int) -> None:
    """The same work cut into twice the stages, two per worker: the idle time of
    1F1B, ``(W - 1)(F + B)``, about halves (unit F, two-unit B per worker's share)."""
    s = 2 * w
    flat = max(e for _, e in action_times(one_f_one_b(w, m), w).values())
    inter = make_schedule("1f1b-v2", s, m)
    half = max(e for _, e in action_times(inter, s, [0.5] * s, [1.0] * s).values())
    work = 3.0 * m
    assert flat - work == pytest.approx(3.0 * (w - 1))
    assert half - work == pytest.approx(3.0 * (w - 1) / 2)


def test_interleaved_rules_name_the_problem() -> None:
    from crosscut.ir.schedule import forward_only, in_flight, interleaved_1f1b

    with pytest.raises(ScheduleError, match=r"whole number \(2 or more\) of stages per worker"):
        interleaved_1f1b(5, 2, 2)
    with pytest.raises(ScheduleError, match="1F0 is on row 0; stage 1 runs on row 1"):
        validate_schedule(parse_schedule("0: 1F0 1B0\n1: 0F0 0B0 2F0 2B0 3F0 3B0"), 4, 1, True)
    with pytest.raises(ScheduleError, match="2 or more"):
        interleaved_1f1b(4, 3, 1)
    with pytest.raises(ScheduleError, match="two stages per worker on 2 or more workers"):
        make_schedule("zbv", 6 - 1, 2)
    with pytest.raises(
        ScheduleError, match=r"2F0 is on row 0; stage 2 runs on row 1 \(the schedule's placement"
    ):
        validate_schedule(make_schedule("zb-v2", 4, 2), 4, 2, True, placement("zbv", 4))
    # forwards only: the training rows' forwards, one row per worker
    fwd = forward_only("1f1b-v2", 4, 4)
    validate_schedule(fwd, 4, 4, training=False)
    assert len(fwd) == 2
    # the evaluator's in-flight count is the built schedule's, per stage
    built = make_schedule("1f1b-v2", 4, 4)
    assert [in_flight("1f1b-v2", 4, k, 4) for k in range(4)] == [
        max_inflight(built, k) for k in range(4)
    ]


def test_every_training_schedule_is_accepted_by_the_front_doors(tmp_path: Path) -> None:
    """The plan schema, the CLI and ``partition`` accept every schedule a plan may name,
    and a plan under each round-trips its JSON (an interleaved one with its stages
    round-robin over the devices)."""
    import torch
    from torch import nn

    import crosscut
    from crosscut.cli.commands import build_parser
    from crosscut.ir.plan import Plan, plan_schema
    from crosscut.ir.schedule import PIPELINE_SCHEDULES, SCHEDULE_CHOICES

    schema = plan_schema()["properties"]["options"]["properties"]["schedule"]["enum"]
    assert set(schema) == set(PIPELINE_SCHEDULES)
    x = torch.randn(8, 3, 8, 8)
    model = nn.Sequential(
        *(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.ReLU()) for _ in range(8))
    )
    for name in SCHEDULE_CHOICES:
        args = build_parser().parse_args(
            ["partition", "m:f", "--devices", "2xV100", "-o", "p.json", "--schedule", name]
        )
        assert args.schedule == name
    for name in PIPELINE_SCHEDULES:
        plan = crosscut.partition(
            model, "2xV100", x, schedule=name, microbatches=2, replicas=1,
            require_all_devices=True,
        )  # fmt: skip
        back = Plan.load(plan.save(tmp_path / f"{name}.json"))
        assert back.options.schedule == name
        devices = [st.devices[0] for st in back.stages]
        want = [f"gpu{w}" for w in placement(name, 2 * virtual_stages(name))]
        assert devices == want, (name, devices)
