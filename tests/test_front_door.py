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


def run(case: str, tmp: Path) -> list[str]:
    """Each rank's record (``rank<r>.txt``), in rank order."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*cmd, str(SCRIPT), case, str(tmp)],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    # torchrun's closing summary alone hides the failed rank's traceback above it
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-8000:]
    return [(tmp / f"rank{r}.txt").read_text() for r in range(2)]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("bogus-schedule", "InputError: schedule must be one of ['auto', 'gpipe', '1f1b', 'zb-h1'"),
        ("zero-microbatches", "InputError: microbatches must be a positive integer; got: 0"),
        ("three-devices", "InputError: under torchrun, devices must list one device per"),
    ],
)
def test_every_rank_refuses_a_bad_option_alike(case: str, message: str, tmp_path: Path) -> None:
    first, second = run(case, tmp_path)
    assert first.startswith(f"ERROR {message}"), first
    assert first == second  # the same error, word for word, on every rank


def test_planning_options_are_honoured_under_torchrun(tmp_path: Path) -> None:
    assert run("latency", tmp_path) == ["PLAN latency 2", "PLAN latency 2"]
