"""oneDNN's verbose log of a script, for tests that hold a CPU price to the library's choices."""

from __future__ import annotations

import os
import subprocess
import sys

__all__ = ["verbose_log"]


def verbose_log(script: str, cases: object) -> str:
    """stdout of ``script`` run with ``repr(cases)`` as its argument, one thread and
    ``ONEDNN_VERBOSE=1`` (one line per primitive oneDNN executes)."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", script, repr(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
