"""The Plan format: JSON round trip, schema checks, and validation rules."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crosscut.errors import PlanError
from crosscut.ir.plan import SCHEMA_VERSION, Plan
from crosscut.partitioner.validate import plan_problems, validate_plan
from tests.plan_factory import make_plan


@pytest.fixture(scope="module")
def plan() -> Plan:
    p = make_plan(40, 3, cross_shaped=False, microbatches=2)
    for d in p.cluster.devices:  # roomy caps: these tests are about structure
        d.mem_cap = 1 << 40
    return p


def test_round_trip_is_lossless(plan: Plan, tmp_path: Path) -> None:
    again = Plan.from_json(plan.to_json())
    assert again == plan
    path = plan.save(tmp_path / "sub" / "plan.json")
    loaded = Plan.load(path)
    assert loaded.created_at  # stamped on save
    assert loaded.assignment == plan.assignment
    assert not list(tmp_path.rglob("*.tmp"))  # atomic write leaves no temp file


def test_valid_plan_has_no_problems(plan: Plan) -> None:
    assert plan_problems(plan) == []


def test_truncated_file_is_refused(plan: Plan, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json()[:500])
    with pytest.raises(PlanError, match="valid JSON"):
        Plan.load(path)


def test_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="existing file"):
        Plan.load(tmp_path / "nope.json")


def test_unknown_schema_version(plan: Plan) -> None:
    data = plan.to_dict()
    data["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(PlanError, match="schema_version"):
        Plan.from_dict(data)


def test_schema_names_the_field(plan: Plan) -> None:
    data = plan.to_dict()
    data["cluster"]["devices"][1]["mem_cap"] = -5
    with pytest.raises(PlanError, match="cluster/devices/1/mem_cap"):
        Plan.from_dict(data)


def test_negative_bandwidth_is_refused(plan: Plan) -> None:
    data = plan.to_dict()
    data["cluster"]["bandwidth"][0][1] = -1.0
    with pytest.raises(PlanError, match="bandwidth"):
        Plan.from_dict(data)


def _edited(plan: Plan, fn: Any) -> Plan:
    data = json.loads(plan.to_json())
    fn(data)
    return Plan.from_dict(data)


def test_backward_edge_is_named(plan: Plan) -> None:
    same_stage = (e for e in plan.edges if plan.assignment[e[0]] == plan.assignment[e[1]] == 0)
    src, _dst, _ = next(same_stage)

    def move(data: dict[str, Any]) -> None:
        data["assignment"][src] = 1

    with pytest.raises(PlanError, match=f"{src}.*backwards"):
        validate_plan(_edited(plan, move))


def test_missing_node_is_named(plan: Plan) -> None:
    victim = plan.nodes[5].name

    def drop(data: dict[str, Any]) -> None:
        del data["assignment"][victim]

    with pytest.raises(PlanError, match=victim):
        validate_plan(_edited(plan, drop))


def test_device_over_cap_is_named(plan: Plan) -> None:
    def shrink(data: dict[str, Any]) -> None:
        data["cluster"]["devices"][0]["mem_cap"] = 1000

    with pytest.raises(PlanError, match=r"gpu0.*cap 1000"):
        validate_plan(_edited(plan, shrink))


def test_unknown_stage_device(plan: Plan) -> None:
    def rename(data: dict[str, Any]) -> None:
        data["stages"][0]["devices"] = ["tpu7"]

    with pytest.raises(PlanError, match="tpu7"):
        validate_plan(_edited(plan, rename))


def test_other_model_is_refused(plan: Plan) -> None:
    class FakeGraph:
        nodes: tuple[Any, ...] = ()

        def fingerprint(self) -> str:
            return "deadbeef"

    with pytest.raises(PlanError, match="fingerprint"):
        validate_plan(plan, FakeGraph())


def _mutations(plan_json: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Random edits of a valid plan: delete, retype or replace a value at a random path."""
    leaves = st.one_of(
        st.none(),
        st.integers(-5, 5),
        st.floats(allow_nan=True),
        st.text(max_size=3),
        st.lists(st.integers(), max_size=2),
        st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    )
    return st.lists(
        st.tuples(st.integers(0, 10_000), st.integers(0, 2), leaves), min_size=1, max_size=4
    )


def _apply(data: Any, edits: list[tuple[int, int, Any]]) -> Any:
    for pick, op, value in edits:
        node, key = _walk(data, pick)
        if node is None:
            data = value
            continue
        if op == 0 and isinstance(node, dict):
            node.pop(key, None)
        else:
            node[key] = value
    return data


def _walk(data: Any, pick: int) -> tuple[Any, Any]:
    """A (container, key) pair chosen by ``pick`` among the paths of ``data``."""
    paths: list[tuple[Any, Any]] = []
    stack = [data]
    while stack and len(paths) < 400:
        cur = stack.pop()
        items = (
            cur.items()
            if isinstance(cur, dict)
            else enumerate(cur)
            if isinstance(cur, list)
            else []
        )
        for k, v in items:
            paths.append((cur, k))
            if isinstance(v, (dict, list)):
                stack.append(v)
    return paths[pick % len(paths)] if paths else (None, None)


_BASE = make_plan(12, 2, cross_shaped=False, microbatches=2).to_dict()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutations(_BASE))
def test_fuzz_loader_gives_plan_error_or_valid_plan(edits: list[tuple[int, int, Any]]) -> None:
    data = _apply(json.loads(json.dumps(_BASE)), edits)
    try:
        plan = Plan.from_dict(data)
    except PlanError:
        return
    # Loaded: validation must either pass or raise PlanError, nothing else.
    with contextlib.suppress(PlanError):
        validate_plan(plan)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, len(json.dumps(_BASE)) - 1))
def test_fuzz_truncation_is_a_plan_error(cut: int) -> None:
    with pytest.raises(PlanError):
        Plan.from_json(json.dumps(_BASE)[:cut])
