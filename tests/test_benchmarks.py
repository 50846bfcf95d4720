"""The distributed benchmark still runs end to end, at a toy size.

Why: benchmarks are run by hand, rarely, and rot silently when the APIs they
call change. This runs ``benchmarks/distributed.py`` with a tiny model and
checks its table: the rows exist and the speed-up column is the ratio of the
columns it claims to divide. The figures themselves are not checked; timing
belongs to the benchmark, not to a unit test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.xdist_group("dist")]

ROOT = Path(__file__).resolve().parent.parent


def test_distributed_benchmark_prints_interleaved_rounds_and_its_table() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "distributed.py"),
           "--models", "resnet18", "--batch", "8", "--size", "32", "--microbatches", "2",
           "--steps", "1", "--warmup", "0", "--rounds", "2", "--timeout", "300"]  # fmt: skip
    run = _run(cmd)
    lines = run.stdout.splitlines()
    assert sum("resnet18 round" in line for line in lines) == 2
    (row,) = [line.split() for line in lines if line.startswith("resnet18 ")]
    eager, micro, pipe = (float(v) for v in row[1:4])
    assert min(eager, micro, pipe) > 0
    assert ratio_fits(float(row[4].rstrip("x")), eager, pipe)
    assert ratio_fits(float(row[5].rstrip("x")), micro, pipe)


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a benchmark command from the repository root, one thread per process; must pass."""
    run = subprocess.run(
        cmd,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run


def ratio_fits(shown: float, num: float, den: float, half: float = 0.005) -> bool:
    """Whether ``shown`` can be ``num / den`` when all three were rounded to 2 decimals."""
    low = (num - half) / (den + half) - half
    high = (num + half) / max(den - half, 1e-9) + half
    return low <= shown <= high


def test_ratio_fits_allows_rounding_only() -> None:
    assert ratio_fits(0.37, 0.11, 0.30)  # 0.1149 / 0.2951 = 0.389 at most
    assert not ratio_fits(0.50, 0.11, 0.30)


def test_the_pipelining_peer_runs_in_the_same_rounds() -> None:
    """torch.distributed.pipelining's two splits are timed beside crosscut (toy size)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "distributed.py"),
           "--models", "resnet18", "--batch", "8", "--size", "32", "--microbatches", "2",
           "--steps", "1", "--warmup", "0", "--rounds", "1", "--timeout", "300",
           "--peer", "--peer-tries", "2"]  # fmt: skip
    out = _run(cmd).stdout
    assert out.count("pipelining trial split at") == 2, out
    rows = [line.split() for line in out.splitlines() if line.startswith("resnet18 ")]
    peer_rows = [r for r in rows if r[1] in ("parameter-balanced", "best")]
    assert len(peer_rows) == 2, out
    for row in peer_rows:
        seconds = float(row[-4])
        assert 0 < seconds < 300, row  # a finite time: the peer really ran
