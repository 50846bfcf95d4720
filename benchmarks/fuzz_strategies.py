"""Random CNNs that write into views and state, under recomputation and device groups.

``tests/test_fuzz_models.py`` draws these models (``MutatingCNN``: writes
through slices, ``narrow``, ``select`` and ``view`` views, into the model
input too, a call counter or an EMA buffer) for plain pipelines and for one
channel-split stage. This draws more strategies per model, many at a time:

* ``recompute``: ``crosscut.compile`` on 2-3 CPU devices, 1-2 micro-batches,
  1F1B, ``recompute="always"``; outputs and the state after two SGD steps
  (lr 1) against eager on the same micro-batches (float64, within 1e-6);
* ``channel`` / ``batch``: a two-stage pipeline with its first or last stage
  widened to a group of two split that way, replayed by ``verify_plan``
  (which normalises a batch-split share's batch norm apart, as the runtime).

A draw is ``ok``, ``refused`` (a crosscut error: state written once per
micro-batch, a batch split holding an op that mixes samples; by design) or
``BAD`` (a mismatch or a crash, printed with the model's description).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fuzz_strategies.py --seed 7 --draws 120``
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

__all__ = ["draw", "main", "run_one"]


def draw(rng: random.Random) -> dict[str, Any]:
    """One model and strategy: spec, writes, state, micro-batches, devices, mode."""
    from tests.test_fuzz_models import WRITES

    k = rng.randint(2, 6)
    spec = [
        (rng.randint(0, j), rng.randint(0, j), rng.choice(["none", "add", "cat"]),
         rng.random() < 0.4, rng.random() < 0.3)
        for j in range(k)
    ]  # fmt: skip
    writes = [(rng.randint(0, j + 1), rng.choice(WRITES)) for j in range(k)]
    return {
        "spec": spec,
        "writes": writes,
        "state": rng.choice(["none", "none", "counter", "ema"]),
        "micro": rng.choice([1, 2]),
        "devices": rng.choice([2, 3]),
        "mode": rng.choice(["recompute", "channel", "batch"]),
        "first": rng.random() < 0.5,
    }


def run_one(d: dict[str, Any]) -> tuple[str, str]:
    """(``ok`` | ``refused`` | ``BAD``, detail) for one draw."""
    import torch

    import crosscut
    from crosscut.errors import CrosscutError
    from crosscut.verify import verify_plan
    from tests.plan_factory import widen
    from tests.test_fuzz_models import MutatingCNN
    from tests.test_mutation import compiled_step, eager_step

    torch.manual_seed(0)
    model = MutatingCNN(
        d["spec"], d["writes"], d["state"] == "counter", d["state"] == "ema"
    ).double()
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    try:
        if d["mode"] != "recompute":
            pipe = crosscut.partition(
                model, ["cpu"] * 2, x, replicas=1, microbatches=1, cross_shaped=False,
                time_limit=3, schedule="1f1b", require_all_devices=True,
            )  # fmt: skip
            groups = ((2, d["mode"]), (1, "none")) if d["first"] else ((1, "none"), (2, d["mode"]))
            report = verify_plan(model, x, widen(pipe, groups), rtol=1e-8, atol=1e-9)
            return ("ok", "") if report.ok else ("BAD", report.text())
        c = crosscut.compile(
            model, ["cpu"] * d["devices"], x, microbatches=d["micro"], schedule="1f1b",
            time_limit=3, replicas=1, recompute="always", require_all_devices=True,
        )  # fmt: skip
    except CrosscutError as exc:
        return "refused", str(exc)[:160]
    ref = copy.deepcopy(model)
    worst = 0.0
    try:
        for _ in range(2):
            out, sd = compiled_step(c, x.clone())
            expected, ref_sd = eager_step(ref, x.clone(), d["micro"])
            worst = max(worst, float((out - expected).abs().max()))
            for key, value in ref_sd.items():
                if value.is_floating_point():
                    worst = max(worst, float((sd[key] - value).abs().max()))
    finally:
        c.close()
    return ("ok", f"{worst:.2g}") if worst < 1e-6 else ("BAD", f"max |diff| {worst:.3g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draws", type=int, default=30)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    tally: dict[str, int] = {}
    for i in range(args.draws):
        d = draw(rng)
        try:
            verdict, detail = run_one(d)
        except Exception as exc:  # a crash is a finding
            verdict, detail = "BAD", f"crash {type(exc).__name__}: {exc}"
        tally[f"{d['mode']} {verdict}"] = tally.get(f"{d['mode']} {verdict}", 0) + 1
        shown = d if verdict == "BAD" else ""
        print(i, verdict, d["mode"], detail if verdict != "ok" else "", shown, flush=True)
    print("tally:", dict(sorted(tally.items())))


if __name__ == "__main__":
    main()
