"""A plan saved, drawn, and replayed: the plan file as the unit of exchange.

Partitions a model, saves the plan as JSON, draws it as a self-contained HTML
report, loads it back, and compiles a fresh instance of the model with it —
the same workflow as ``crosscut partition`` → ``crosscut show`` →
``crosscut.compile(..., plan="plan.json")``.

    python examples/plan_roundtrip.py --out out/roundtrip
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torchvision

import crosscut
from crosscut.viz import render


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/roundtrip")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--size", type=int, default=64)
    args = p.parse_args(argv)
    out = Path(args.out)
    x = torch.randn(8, 3, args.size, args.size)
    model = torchvision.models.get_model(args.model, weights=None)
    plan = crosscut.partition(model, ["cpu", "cpu"], x, microbatches=2, require_all_devices=True)
    path = plan.save(out / "plan.json")
    html = render(plan, out / "plan.html")
    print(f"saved {path} and drew {html}")
    again = crosscut.Plan.load(path)
    fresh = torchvision.models.get_model(args.model, weights=None)
    compiled = crosscut.compile(fresh, ["cpu", "cpu"], x, plan=again)
    print(f"replayed: {compiled.plan.num_stages} stages, output {tuple(compiled(x).shape)}")
    return path


if __name__ == "__main__":
    main()
