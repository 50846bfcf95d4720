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


def _files(cmd: str) -> tuple[set[str], set[str]]:
    """The JSON/HTML files a README command reads and the ones it writes (``-o``)."""
    words = shlex.split(cmd)
    wrote = {words[i + 1] for i, w in enumerate(words[:-1]) if w == "-o"}
    read = {w for w in words if w.endswith((".json", ".html"))} - wrote
    return read, wrote


def command_chains() -> list[list[str]]:
    """The README's commands in runs that share files: a command reading a plan joins the
    run(s) that wrote it (merged into one), any other starts a run of its own, each run in
    README order. Runs are independent, so they are separate tests that xdist can spread;
    only the one with ``crosscut run`` (torchrun) waits its turn with the distributed ones."""
    lines = [c for c in shell_lines() if not c.startswith("source ")]
    run_of = list(range(len(lines)))  # each command's run, by its first command's index
    writer: dict[str, int] = {}
    for i, cmd in enumerate(lines):
        read, wrote = _files(cmd)
        joined = {run_of[writer[f]] for f in read if f in writer} | {run_of[i]}
        first = min(joined)
        run_of = [first if r in joined else r for r in run_of]
        writer.update({f: i for f in wrote})
    return [[c for c, r in zip(lines, run_of) if r == k] for k in sorted(set(run_of))]


def _chain_params() -> list[object]:
    out: list[object] = []
    for chain in command_chains():
        name = f"{len(out)}-" + "-".join(shlex.split(chain[0])[1:3])
        runs = any(c.startswith("crosscut run ") for c in chain)
        dist = [pytest.mark.distributed, pytest.mark.xdist_group("dist")] if runs else []
        out.append(pytest.param(chain, id=name, marks=[pytest.mark.slow, *dist]))
    return out


def test_the_readme_activates_the_venv_make_creates() -> None:
    """``source`` lines are not run (this test's PATH already has the venv's bin first);
    the path they name must be the one ``make`` creates."""
    sources = [c for c in shell_lines() if c.startswith("source ")]
    assert sources and all(c == "source .venv/bin/activate" for c in sources), sources
    assert "VENV   ?= .venv" in (ROOT / "Makefile").read_text()


def test_the_command_chains_keep_every_command_once_in_order() -> None:
    chains = command_chains()
    flat = [c for chain in chains for c in chain]
    lines = [c for c in shell_lines() if not c.startswith("source ")]
    assert sorted(flat) == sorted(lines) and len(chains) > 1
    for chain in chains:  # README order within a run, and each file written before it is read
        assert chain == [c for c in lines if c in chain]
        written: set[str] = set()
        for cmd in chain:
            read, wrote = _files(cmd)
            assert read <= written or not any(read & _files(o)[1] for o in lines), cmd
            written |= wrote


@pytest.mark.parametrize("chain", _chain_params())
def test_every_readme_command_runs_as_written(tmp_path: Path, chain: list[str]) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for cmd in chain:
        done = _run(shlex.split(cmd), tmp_path, cmd)
        if cmd.startswith("crosscut run "):
            assert "went down" in done.stdout, done.stdout[-2000:]
        if cmd.startswith("crosscut verify "):
            assert "OK" in done.stdout + done.stderr
        if "plan-dp.json" in cmd:  # what the README says this plan chooses
            from crosscut.ir.plan import Plan

            plan = Plan.load(tmp_path / "plan-dp.json")
            assert (plan.replication.replicas, plan.num_stages) == (8, 1), done.stdout
        for out in _files(cmd)[1]:
            assert (tmp_path / out).stat().st_size > 0, (cmd, out)


@pytest.mark.slow
def test_every_readme_python_snippet_runs_as_written(tmp_path: Path) -> None:
    for i, code in enumerate(_blocks("python")):
        done = _run([sys.executable, "-c", code], tmp_path, f"python block {i}:\n{code}")
        assert "0.0478" not in done.stdout  # numbers are printed with units, rounded
