"""Page faults per CPU training step under three malloc settings, side by side.

``crosscut/cpu_malloc.py`` keeps freed memory in the process so that a CPU step does
not fault its buffers back every iteration. This measures what each setting costs a
step, each in a fresh process (malloc's settings are per process):

* ``glibc``: glibc's defaults (``CROSSCUT_CPU_MALLOC=0``);
* ``thresholds``: crosscut's default, a 1 GiB trim threshold and glibc's largest
  mmap threshold (32 MiB);
* ``kept``: ``CROSSCUT_CPU_MALLOC=kept`` (no block mapped on its own, no trimming,
  one arena).

Per model and setting: minor page faults per step (``getrusage``), the median step
and the peak resident memory; then each setting's step over ``kept``'s. With
``--sequence``: ten torchvision models trained in turn in one process, twice, and the
resident memory after each, as a notebook or a test session holds memory over many
jobs (under ``kept``, ``keep_freed_memory`` is called before each model, as crosscut
calls it where a job starts, and gives the free heap back). Eager steps
run one model in the main thread; ``local`` rows run crosscut's local runtime on two
CPU devices (one worker thread each), a fixed 2-stage 1F1B plan with 4 micro-batches.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/page_faults.py [--sequence]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torchvision
from torch import nn

from crosscut.cpu_malloc import keep_freed_memory

__all__ = ["MODELS", "SEQUENCE", "SETTINGS", "main", "measure", "sequence"]

SETTINGS = ("glibc", "thresholds", "kept")
# name -> (torchvision factory, input size, batch, runtime: "eager" or "local")
MODELS: dict[str, tuple[str, int, int, str]] = {
    "vgg11_bn-64": ("vgg11_bn", 64, 8, "eager"),
    "mobilenet_v2-224": ("mobilenet_v2", 224, 8, "eager"),
    "resnet50-128": ("resnet50", 128, 8, "eager"),
    "vgg11_bn-64 local": ("vgg11_bn", 64, 16, "local"),
    "mobilenet_v2-160 local": ("mobilenet_v2", 160, 16, "local"),
}
SEQUENCE = [("resnet18", 64, 16), ("vgg11_bn", 64, 8), ("densenet121", 64, 8),
            ("mobilenet_v2", 224, 8), ("resnet50", 128, 8), ("efficientnet_b0", 128, 8),
            ("convnext_tiny", 64, 8), ("googlenet", 128, 8), ("alexnet", 128, 8),
            ("vgg16", 96, 4)]  # fmt: skip


def _apply(setting: str) -> None:
    """Set ``setting`` in this process: its child was started with the matching
    ``CROSSCUT_CPU_MALLOC`` (``_child``), so crosscut's own calls agree."""
    if setting != "glibc":
        assert keep_freed_memory(), "keep_freed_memory refused: not glibc?"


def measure(name: str, setting: str, steps: int) -> dict[str, float]:
    """One model's steps in this process under ``setting`` (call it first thing)."""
    _apply(setting)
    arch, size, batch, runtime = MODELS[name]
    torch.manual_seed(0)
    model: nn.Module = getattr(torchvision.models, arch)(num_classes=10).train()
    x = torch.randn(batch, 3, size, size)
    target = torch.randint(0, 10, (batch,))
    if runtime == "local":
        import crosscut

        model = crosscut.compile(
            model, ["cpu", "cpu"], x, microbatches=4, replicas=1, cost="analytic",
            schedule="1f1b",
        )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    times, faults = [], []
    for _ in range(steps + 2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), target).backward()  # type: ignore[no-untyped-call]
        opt.step()
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "step_s": statistics.median(times[2:]),
        "faults": statistics.median(faults[2:]),
        "rss_mib": rss,
    }


def sequence(setting: str) -> list[float]:
    """Resident GiB after each of ``SEQUENCE``'s models, trained three steps in turn, twice."""
    _apply(setting)
    resident = []
    for arch, size, batch in SEQUENCE * 2:
        if setting == "kept":
            keep_freed_memory()  # where a job starts: what the last one freed goes back
        extra = {"aux_logits": False, "init_weights": True} if arch == "googlenet" else {}
        model = getattr(torchvision.models, arch)(num_classes=10, **extra).train()
        x, target = torch.randn(batch, 3, size, size), torch.zeros(batch, dtype=torch.long)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), target).backward()  # type: ignore[no-untyped-call]
            opt.step()
        del model, x, opt
        with open("/proc/self/statm") as f:
            resident.append(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30)
    return resident


def _child(name: str, setting: str, steps: int) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["CROSSCUT_CPU_MALLOC"] = {"glibc": "0", "thresholds": "1", "kept": "kept"}[setting]
    run = subprocess.run(
        [sys.executable, __file__, "--child", name, setting, str(steps)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if run.returncode != 0:
        raise RuntimeError(f"{name} under {setting} failed:\n{run.stderr[-3000:]}")
    row: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated names")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sequence", action="store_true", help="memory over ten models in turn")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        name, setting, steps = args.child
        if name == "sequence":
            print(json.dumps({"resident": sequence(setting)}))
        else:
            print(json.dumps(measure(name, setting, int(steps))))
        return
    if args.sequence:
        print(f"resident GiB after each of {len(SEQUENCE)} models, trained in turn, twice")
        for s in SETTINGS:
            resident = _child("sequence", s, 0)["resident"]
            assert isinstance(resident, list)
            print(f"{s:<12}" + " ".join(f"{v:.2f}" for v in resident), flush=True)
        return
    print(f"torch on {torch.get_num_threads()} thread(s); load average {os.getloadavg()}")
    print(f"{'model':<24}{'setting':<12}{'faults/step':>12}{'step ms':>10}{'peak MiB':>10}"
          f"{'step/kept':>11}")  # fmt: skip
    for name in args.models.split(","):
        rows = {s: _child(name, s, args.steps) for s in SETTINGS}
        for s, r in rows.items():
            print(
                f"{name:<24}{s:<12}{r['faults']:>12.0f}{r['step_s'] * 1e3:>10.1f}"
                f"{r['rss_mib']:>10.0f}{r['step_s'] / rows['kept']['step_s']:>11.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
