"""Channel-split stages on whole model families, against eager (``verify_plan``).

Channel splits are opt-in (``cross_shaped=True``), so the suite checks them on
a few models (``tests/test_cross_runtime.py``) and on random CNNs that write
into views (``tests/test_fuzz_models.py``); this sweeps every family of
``tests/test_group_families.py`` (19 torchvision, one timm model per family).
Per model, three plans replayed by ``crosscut.verify.verify_plan`` in float64
(batch 8, tolerance 1e-8 relative, 1e-9 absolute):

* the whole model on one stage split by channels over 3 devices;
* a two-stage 1F1B pipeline (M = 2) with its first, then its last stage split
  by channels over 2 devices (``tests.plan_factory.widen``).

Each model runs in its own process (one long process grew to 18 GB over the
torchvision list and was killed). Prints one line per model: ``ok``,
``MISMATCH`` with verify's report, ``REFUSED`` with the error, or ``CRASH``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/channel_families.py``
(``--models a,b``: only those; ``timm:<name>`` for a timm model).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

__all__ = ["check", "main"]


def check(name: str) -> str:
    """One model's three plans against eager, as one line."""
    import torch

    import crosscut
    from crosscut.errors import CrosscutError
    from crosscut.verify import verify_plan
    from tests.plan_factory import widen
    from tests.test_group_families import build
    from tests.test_timm_families import FAMILIES, SIZES

    torch.set_num_threads(1)
    timm_sizes = {f"timm:{FAMILIES[f]}": px for f, px in SIZES.items()}
    size = 96 if name == "inception_v3" else timm_sizes.get(name, 64)
    x = torch.randn(8, 3, size, size, generator=torch.Generator().manual_seed(1)).double()
    model = build(name)
    pipe = crosscut.partition(
        model, ["cpu"] * 2, x, replicas=1, microbatches=2, cross_shaped=False,
        time_limit=5, schedule="1f1b",
    )  # fmt: skip
    one = crosscut.partition(
        model, ["cpu"], x, replicas=1, microbatches=1, cross_shaped=False, time_limit=5
    )
    plans = {
        "whole model, 3 shards": widen(one, ((3, "channel"),)),
        "first stage 2 shards": widen(pipe, ((2, "channel"), (1, "none"))),
        "last stage 2 shards": widen(pipe, ((1, "none"), (2, "channel"))),
    }
    parts = []
    for label, plan in plans.items():
        try:
            report = verify_plan(build(name), x, plan, rtol=1e-8, atol=1e-9)
            parts.append(f"{label}: " + ("ok" if report.ok else "MISMATCH " + report.text()))
        except CrosscutError as exc:
            parts.append(f"{label}: REFUSED {type(exc).__name__}: {exc}")
        except Exception as exc:  # a crash is a finding, not the end of the sweep
            parts.append(f"{label}: CRASH {type(exc).__name__}: {exc}")
    return " | ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="", help="comma-separated (default: every family)")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.one:
        print(check(args.one), flush=True)
        return
    from tests.test_group_families import TIMM, TORCHVISION

    names = args.models.split(",") if args.models else TORCHVISION + TIMM
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    tally = {"ok": 0, "other": 0}
    for name in names:
        t0 = time.perf_counter()
        run = subprocess.run(
            [sys.executable, __file__, "--one", name], capture_output=True, text=True, env=env
        )
        line = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
        if run.returncode != 0:
            line = f"CRASH (exit {run.returncode}): {run.stderr.strip()[-300:]}"
        good = line.count(": ok") == 3
        tally["ok" if good else "other"] += 1
        print(f"{name} ({time.perf_counter() - t0:.0f} s): {line}", flush=True)
    print(f"models with all three plans equal to eager: {tally['ok']} of {len(names)}")


if __name__ == "__main__":
    main()
