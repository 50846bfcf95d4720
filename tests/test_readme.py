"""Every command and Python snippet of README.md runs as written.

The README is a newcomer's first hour: a line that fails there costs more
trust than any bug. This test reads README.md itself, so an edit that breaks
a line breaks the suite: each ```bash block line (``source``/``crosscut``
commands), each inline `` `crosscut ...` `` command that is not a synopsis
(no ``[optional]`` parts), and each ```python block, run in a scratch folder
that sees the repository's ``examples/``, with the venv's ``crosscut`` first
on PATH.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.S | re.M)


def shell_lines() -> list[str]:
    """The commands of the ```bash blocks that a reader runs after `make` (comments cut)."""
    out = []
    for block in _blocks("bash"):
        for line in block.splitlines():
            cmd = line.split("  #")[0].strip()
            if cmd.startswith(("crosscut ", "source ")):
                out.append(cmd)
    for cmd in re.findall(r"`(crosscut [^`]+)`", README):
        if "[" not in cmd and cmd not in out:
            out.append(cmd)
    return out


def _run(argv: list[str], cwd: Path, what: str) -> subprocess.CompletedProcess[str]:
    """Run one README line in ``cwd`` with the venv first on PATH; it must succeed."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1")
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{what}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def test_the_readme_has_what_this_test_runs() -> None:
    lines = shell_lines()
    assert any(c.startswith("crosscut run ") for c in lines), lines
    assert any(c.startswith("crosscut verify ") for c in lines), lines
    assert _blocks("python")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_every_readme_command_runs_as_written(tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for cmd in shell_lines():
        if cmd.startswith("source "):  # the venv's bin is already first on PATH here
            # ... and the path it names is the one `make` creates
            assert cmd == "source .venv/bin/activate", cmd
            assert "VENV   ?= .venv" in (ROOT / "Makefile").read_text()
            continue
        done = _run(shlex.split(cmd), tmp_path, cmd)
        if cmd.startswith("crosscut run "):
            assert "went down" in done.stdout, done.stdout[-2000:]
        if cmd.startswith("crosscut verify "):
            assert "OK" in done.stdout + done.stderr
        if "plan-dp.json" in cmd:  # what the README says this plan chooses
            from crosscut.ir.plan import Plan

            plan = Plan.load(tmp_path / "plan-dp.json")
            assert (plan.replication.replicas, plan.num_stages) == (8, 1), done.stdout
    assert (tmp_path / "plan.html").stat().st_size > 0


@pytest.mark.slow
def test_every_readme_python_snippet_runs_as_written(tmp_path: Path) -> None:
    for i, code in enumerate(_blocks("python")):
        done = _run([sys.executable, "-c", code], tmp_path, f"python block {i}:\n{code}")
        assert "0.0478" not in done.stdout  # numbers are printed with units, rounded
