"""Run the heavy transparency tests, one model per process (``make test-heavy``).

Why one process per model: the 34 largest torchvision classifiers (vit_h_14,
regnet_y_128gf, ...) each build the model, its traced copy and the compiled
copy with gradients; in one long pytest process their memory piles up past
24 GiB and the kernel kills the run, while each alone fits. About 11 minutes
on a 2-core machine, plus one process per timm CNN family
(``tests/test_timm_families.py``: 2 and 3 devices, M in 1, 2, 4, recompute, bf16),
one per model of ``tests/test_group_families.py`` (batch-split groups, float64),
and one per model of ``tests/test_default_plans.py`` (the default plans, float64):
about two hours in all.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_group_families import TIMM, TORCHVISION  # noqa: E402
from tests.test_timm_families import FAMILIES  # noqa: E402
from tests.test_transparency import HEAVY  # noqa: E402


def main() -> int:
    env = dict(
        os.environ, CROSSCUT_HEAVY="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2")
    )
    failed = []
    tests = [
        f"tests/test_transparency.py::test_all_classification_models_two_stages[{n}]"
        for n in sorted(HEAVY)
    ]
    tests += [
        f"tests/test_timm_families.py::test_timm_family_is_eager_or_refused[{f}]"
        for f in sorted(FAMILIES)
    ]
    tests += [  # batch-split groups on every family, float64 (one process each: memory)
        f"tests/test_group_families.py::test_batch_groups_match_eager_on_the_family[{m}]"
        for m in TORCHVISION + TIMM
    ]
    tests += [  # the plans the planner makes by default, on 2, 3 and 4 devices, float64
        f"tests/test_default_plans.py::test_default_plans_match_eager_on_the_family[{m}]"
        for m in TORCHVISION + TIMM
    ]
    for test in tests:
        name = test.rsplit("[", 1)[1].rstrip("]")
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
        print(f"{name:<20} {status:<18} {time.perf_counter() - t0:6.1f} s", flush=True)
        if proc.returncode != 0:
            failed.append(name)
            print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n")
    print(f"{len(tests) - len(failed)}/{len(tests)} heavy runs eager or refused; failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
