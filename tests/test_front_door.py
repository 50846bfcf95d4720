"""One front door: ``crosscut.compile`` validates every option the same way on every
rank under torchrun (the same error everywhere, no rank left waiting), and honours
the planning options there instead of dropping them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("dist")]
SCRIPT = Path(__file__).parent / "dist_scripts" / "options_check.py"


def run(case: str) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*cmd, str(SCRIPT), case],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return sorted(line for line in done.stdout.splitlines() if line.startswith(("ERROR", "PLAN")))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("bogus-schedule", "InputError: schedule must be one of ['gpipe', '1f1b']; got: bogus"),
        ("zero-microbatches", "InputError: microbatches must be a positive integer; got: 0"),
        ("three-devices", "InputError: under torchrun, devices must list one device per"),
    ],
)
def test_every_rank_refuses_a_bad_option_alike(case: str, message: str) -> None:
    lines = run(case)
    assert [line.split()[:2] for line in lines] == [["ERROR", "0"], ["ERROR", "1"]]
    assert all(line.split(" ", 2)[2].startswith(message) for line in lines), lines
    assert lines[0].split(" ", 2)[2] == lines[1].split(" ", 2)[2]


def test_planning_options_are_honoured_under_torchrun() -> None:
    assert run("latency") == ["PLAN 0 latency 2", "PLAN 1 latency 2"]
