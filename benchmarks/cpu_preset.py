"""The analytic CPU preset against this machine: a small CNN's training step, predicted vs measured.

The GPU presets are checked against published measurements
(``calibration.py``); the ``cpu`` preset (``devices.cpu_spec``: 40 GFLOP/s and
10 GB/s per thread torch computes on, 10 µs per op) can be checked right here.
For each small CNN this prints, side by side:

* the analytic step: forward + backward of every node (``analytic_costs`` on
  ``Cluster.from_spec("1xcpu")``), the optimizer update
  (``calibration.update_seconds``) and the per-iteration overhead;
* the same with this machine's rates measured right before (a 1024² fp32
  GEMM's FLOP/s, ``links.measure_matmul_flops``, and a 64 MB copy's bytes
  moved per second): what the preset would say if it were measured here, under
  whatever load the machine has at that moment;
* the measured step: median wall time of whole training steps (forward,
  backward, ``SGD(momentum=0.9).step()``) after warm-up.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_preset.py``. On a
shared, loaded VM the measured side moves by tens of percent between runs:
docs/BENCHMARKS.md records the figures with the machine's load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

import torch
import torchvision
from torch import nn

from crosscut.cost_models.analytic import analytic_costs
from crosscut.cost_models.calibration import step_overhead_s, update_seconds
from crosscut.cost_models.cluster import Cluster
from crosscut.cost_models.devices import DeviceSpec
from crosscut.cost_models.links import measure_matmul_flops
from crosscut.frontend.tracer import trace

__all__ = ["MODELS", "main", "measured_step", "predicted_step"]


def _lenet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


# name -> (factory, input shape of one sample, batch)
MODELS: dict[str, tuple[type[nn.Module] | object, tuple[int, ...], int]] = {
    "lenet-28": (_lenet, (1, 28, 28), 64),
    "resnet18-64": (lambda: torchvision.models.resnet18(num_classes=10), (3, 64, 64), 16),
    "mobilenet_v2-64": (lambda: torchvision.models.mobilenet_v2(num_classes=10), (3, 64, 64), 16),
}


def predicted_step(model: nn.Module, x: torch.Tensor, spec: DeviceSpec) -> float:
    """Analytic training step on ``spec``: nodes' forward + backward, update, overhead."""
    graph = trace(model, x, mode="train")
    cluster = Cluster.from_spec("1xcpu")
    cluster.devices[0] = replace(spec, name=cluster.devices[0].name)
    table = analytic_costs(graph, cluster, optimizer="momentum")
    params = [p.numel() * 4 for p in model.parameters()]
    update = update_seconds(
        sum(params),
        len(params),
        kind="cpu",
        device="cpu",
        mem_bw=spec.mem_bw,
        launch_s=spec.launch_overhead_s,
        optimizer="momentum",
        precision="fp32",
    )
    return table.total("cpu", "train") + update + step_overhead_s("cpu")


def measured_step(model: nn.Module, x: torch.Tensor, steps: int) -> float:
    """Median seconds of whole training steps (forward, backward, SGD with momentum)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    times: list[float] = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()  # type: ignore[no-untyped-call]
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Bytes/s a large tensor copy moves (read + write), best of ``repeats``."""
    a = torch.ones(nbytes // 4)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * nbytes / max(best, 1e-9)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    preset = Cluster.from_spec("1xcpu").devices[0]
    # the preset counts the threads torch computes on (devices.compute_threads)
    cores, threads = os.cpu_count() or 1, torch.get_num_threads()
    flops, bw = measure_matmul_flops(torch.device("cpu")), copy_bandwidth()
    here = replace(preset, peak_flops={k: flops for k in preset.peak_flops}, mem_bw=bw)
    print(
        f"{cores} cores, torch on {threads} thread(s); load average "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}; preset "
        f"{preset.peak('float32') / 1e9:.0f} GFLOP/s, {preset.mem_bw / 1e9:.0f} GB/s; "
        f"measured here {flops / 1e9:.1f} GFLOP/s, {bw / 1e9:.1f} GB/s"
    )
    print(
        f"{'model':<16}{'batch':>6}{'preset s':>10}{'here s':>8}"
        f"{'measured s':>11}{'preset/meas':>12}{'here/meas':>10}"
    )
    for name in args.models.split(","):
        factory, shape, batch = MODELS[name]
        model = factory().train()  # type: ignore[operator]
        x = torch.randn(batch, *shape)
        pred = predicted_step(model, x, preset)
        pred_h = predicted_step(model, x, here)
        meas = measured_step(model, x, args.steps)
        print(
            f"{name:<16}{batch:>6}{pred:>10.4f}{pred_h:>8.4f}{meas:>11.4f}"
            f"{pred / meas:>12.2f}{pred_h / meas:>10.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
