"""The pipelining peer's multi-piece schedules: where it cuts, where pieces run, that they run.

Why: ``benchmarks/pipelining_peer.py`` times torch's bubble-closing schedules
(interleaved 1F1B, interleaved zero bubble, ZB-V) next to crosscut's (issue
25). Their figures only mean something if the peer cuts the model the way its
docstring says (parameter-balanced; near equal forward-time shares), places
the pieces the way torch's schedules expect, and really runs them; a schedule
torch refuses must be reported in the table, not crash the benchmark. The
split rules are checked on made-up candidates (no torch run); one toy run of
``benchmarks/distributed.py`` checks the rest.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import pipelining_peer as peer

ROOT = Path(__file__).resolve().parent.parent

# (name, parameter share before it, forward-time share before it), in call order
CANDS = [("a", 0.0, 0.1), ("b", 0.1, 0.2), ("c", 0.2, 0.28), ("d", 0.3, 0.45),
         ("e", 0.4, 0.52), ("f", 0.6, 0.7), ("g", 0.9, 0.77), ("h", 0.95, 0.9)]  # fmt: skip


def test_one_cut_is_what_the_single_stage_peer_always_picked() -> None:
    """With 2 pieces: the first half-parameters module; the tries nearest the forward's middle."""
    assert peer.balanced_splits(CANDS, 2) == [peer.balanced_split(CANDS)] == ["f"]
    near = sorted(CANDS, key=lambda c: abs(c[2] - 0.5))[:3]
    assert peer.tried_splits(CANDS, 2, 3) == [[c[0]] for c in near]


def test_several_cuts_are_ordered_distinct_and_near_their_shares() -> None:
    assert peer.balanced_splits(CANDS, 4) == ["d", "f", "g"]  # 25 %, 50 %, 75 % of parameters
    tried = peer.tried_splits(CANDS, 4, 4)
    assert tried[0] == ["c", "e", "g"]  # nearest 25 %, 50 %, 75 % of the forward
    assert len(tried) == 4 and len({tuple(t) for t in tried}) == 4
    for cuts in tried:
        idx = [[c[0] for c in CANDS].index(n) for n in cuts]
        assert idx == sorted(set(idx)), cuts  # increasing: each piece non-empty
        assert sum(a != b for a, b in zip(cuts, tried[0])) <= 1  # one cut moved at a time


def test_parameters_at_the_end_still_give_distinct_cuts_or_a_clear_refusal() -> None:
    tail = [("a", 0.0, 0.2), ("b", 0.0, 0.5), ("c", 0.99, 0.9)]
    assert peer.balanced_splits(tail, 3) == ["b", "c"]  # the first cut leaves "c" to the second
    assert peer.balanced_splits(tail, 4) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="cannot make 5 pieces"):
        peer.balanced_splits(tail, 5)
    assert peer.tried_splits(tail, 4, 4) == [["a", "b", "c"]]  # the only 3 distinct cuts
    assert peer.tried_splits(tail[:2], 4, 4) == []


def test_pieces_land_where_torch_schedules_expect_them() -> None:
    loop, v = peer.SCHEDULES["interleaved1f1b"], peer.SCHEDULES["zbv"]
    assert [loop.rank_of(i, 2) for i in range(loop.pieces(2))] == [0, 1, 0, 1]
    assert [v.rank_of(i, 2) for i in range(v.pieces(2))] == [0, 1, 1, 0]
    assert [v.rank_of(i, 3) for i in range(v.pieces(3))] == [0, 1, 2, 2, 1, 0]
    assert peer.SCHEDULES["1f1b"].pieces(2) == 2


def test_schedule_names_are_checked_by_argparse() -> None:
    assert peer.schedule_names("interleavedzb, zbv") == ["interleavedzb", "zbv"]
    with pytest.raises(argparse.ArgumentTypeError, match="choose from 1f1b"):
        peer.schedule_names("zb-h1")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_two_pieces_per_rank_schedules_run_beside_crosscut() -> None:
    """Toy resnet18: interleaved zero bubble and ZB-V each get a timed row, next to crosscut's."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "distributed.py"),
           "--models", "resnet18", "--batch", "8", "--size", "32", "--microbatches", "2",
           "--steps", "1", "--warmup", "0", "--rounds", "1", "--timeout", "300",
           "--peer", "--peer-tries", "1", "--peer-schedule", "interleavedzb,zbv"]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    out = run.stdout
    assert "ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble" in out, out
    rows = [line.split() for line in out.splitlines() if line.startswith("resnet18 ")]
    best = {r[5]: r for r in rows if r[1] == "best"}  # best of 1 tried <schedule> <cuts> ...
    assert set(best) == {"interleavedzb", "zbv"}, out
    for sched, row in best.items():
        assert len(row[6].split(",")) == 3, row  # 4 pieces on 2 ranks
        assert 0 < float(row[-4]) < 300, (sched, row)  # the peer really ran
