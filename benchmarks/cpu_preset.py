"""The analytic CPU preset against this machine: a small CNN's training step, predicted vs measured.

The GPU presets are checked against published measurements
(``calibration.py``); the ``cpu`` preset (``devices.cpu_spec``: 40 GFLOP/s and
10 GB/s per thread torch computes on, 10 µs per op) can be checked right here.
For each small CNN this prints, side by side:

* the analytic step: forward + backward of every node (``analytic_costs`` on
  ``Cluster.from_spec("1xcpu")``), the optimizer update
  (``calibration.update_seconds``) and the per-iteration overhead;
* the same with this machine's rates measured right before, as
  ``Cluster.from_devices(["cpu"], measure=True)`` measures them (the best of
  three 1024² fp32 GEMMs' FLOP/s and of three 64 MB copies' bytes moved per
  second, ``links.measure_cpu_rates``): the preset of this CPU, under whatever
  load the machine has at that moment;
* the measured step: median wall time of whole training steps (forward,
  backward, ``SGD(momentum=0.9).step()``) after warm-up.

With ``--per-op`` it also prints, per op kind, each model's nodes timed inside whole
training steps (``profile_costs``, the profiled cost model) against their prices at
the rates measured here: where a wrong price sits (``cost_models/cpu_terms.py``
holds the two kinds this found far off).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_preset.py [--per-op]``
(``--models zoo``: one model of each of twelve torchvision families instead;
``--models faults``: four steps with blocks glibc maps afresh every step under the
default ``CROSSCUT_CPU_MALLOC``, priced by ``cpu_terms.fresh_blocks`` at the page-fault
rate ``links.measure_page_fault_rate`` measures). On a
shared, loaded VM the measured side moves by tens of percent between runs:
docs/BENCHMARKS.md records the figures with the machine's load.
"""

from __future__ import annotations

import argparse
import copy
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
from crosscut.cost_models.profiled import profile_costs
from crosscut.cpu_malloc import keep_freed_memory, mode
from crosscut.frontend.tracer import trace

__all__ = ["FAULTS", "MODELS", "ZOO", "main", "measured_step", "per_op", "predicted_step"]


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


def _tv(arch: str, **kwargs: object) -> object:
    return lambda: getattr(torchvision.models, arch)(num_classes=10, **kwargs)


# ``--models zoo``: one model of each torchvision CNN family, at batch 8 and sizes a
# CPU trains in seconds, to check the prices across families rather than on three.
ZOO: dict[str, tuple[type[nn.Module] | object, tuple[int, ...], int]] = {
    "resnet50-128": (_tv("resnet50"), (3, 128, 128), 8),
    "mobilenet_v2-224": (_tv("mobilenet_v2"), (3, 224, 224), 8),
    "mobilenet_v3_small-224": (_tv("mobilenet_v3_small"), (3, 224, 224), 8),
    "efficientnet_b0-128": (_tv("efficientnet_b0"), (3, 128, 128), 8),
    "densenet121-64": (_tv("densenet121"), (3, 64, 64), 8),
    "vgg11_bn-64": (_tv("vgg11_bn"), (3, 64, 64), 8),
    "shufflenet_v2_x1_0-128": (_tv("shufflenet_v2_x1_0"), (3, 128, 128), 8),
    "squeezenet1_1-128": (_tv("squeezenet1_1"), (3, 128, 128), 8),
    "mnasnet1_0-128": (_tv("mnasnet1_0"), (3, 128, 128), 8),
    "regnet_y_400mf-128": (_tv("regnet_y_400mf"), (3, 128, 128), 8),
    "googlenet-128": (_tv("googlenet", aux_logits=False, init_weights=True), (3, 128, 128), 8),
    "convnext_tiny-64": (_tv("convnext_tiny"), (3, 64, 64), 8),
}


# ``--models faults``: steps with blocks of 32 MiB and more, which glibc maps afresh under
# the default CROSSCUT_CPU_MALLOC (cpu_terms.fresh_blocks prices them): a large classifier
# weight gradient (VGG-11-BN, AlexNet) and large activations (ResNet-50 at 224 px).
FAULTS: dict[str, tuple[type[nn.Module] | object, tuple[int, ...], int]] = {
    "vgg11_bn-64": (_tv("vgg11_bn"), (3, 64, 64), 8),
    "alexnet-128": (_tv("alexnet"), (3, 128, 128), 8),
    "resnet50-224-b16": (_tv("resnet50"), (3, 224, 224), 16),
    "resnet50-224-b32": (_tv("resnet50"), (3, 224, 224), 32),
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


def per_op(model: nn.Module, x: torch.Tensor, spec: DeviceSpec) -> dict[str, list[float]]:
    """Op kind -> [nodes, measured fwd, measured bwd, priced fwd, priced bwd] (seconds):
    every node timed inside whole training steps against its analytic price on ``spec``."""
    graph = trace(model, x, mode="train")
    measured = profile_costs(graph, "cpu", cache_dir=None)
    cluster = Cluster.from_spec("1xcpu")
    cluster.devices[0] = replace(spec, name=cluster.devices[0].name)
    priced = analytic_costs(graph, cluster, optimizer="momentum")
    kinds: dict[str, list[float]] = {}
    for node in graph.nodes:
        if node.name not in measured.nodes or node.name not in priced.nodes:
            continue
        m, p = measured.nodes[node.name], priced.nodes[node.name]
        row = kinds.setdefault(node.kind, [0.0] * 5)
        times = (m.fwd, m.bwd, p.fwd, p.bwd)
        for i, v in enumerate((1.0, *(t.get("cpu", 0.0) for t in times))):
            row[i] += v
    return kinds


def _print_per_op(kinds: dict[str, list[float]]) -> None:
    for kind, (n, m_f, m_b, p_f, p_b) in sorted(kinds.items(), key=lambda kv: -kv[1][1] - kv[1][2]):
        if m_f + m_b < 2e-4:
            continue
        print(
            f"    {kind:<20}{int(n):>4} nodes  measured {m_f * 1e3:7.2f} + {m_b * 1e3:7.2f} ms  "
            f"priced/measured fwd {p_f / max(m_f, 1e-9):5.2f} bwd {p_b / max(m_b, 1e-9):5.2f}"
        )


def measured_step(model: nn.Module, x: torch.Tensor, steps: int) -> float:
    """Median seconds of whole training steps (forward, cross-entropy, backward, SGD with
    momentum). A classification loss, not ``output.sum()``: descending a sum drives
    every logit down and kills the ReLUs within a few steps, and an NCHW max pool over
    zeros runs 2.8x faster than over live activations (its compares stop
    mispredicting), so the step measured would be one no real training runs."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    target = torch.randint(0, 10, (x.shape[0],), generator=torch.Generator().manual_seed(0))
    times: list[float] = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), target).backward()  # type: ignore[no-untyped-call]
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated names, 'zoo' or 'faults'"
    )
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--per-op", action="store_true", help="also price each op kind")
    args = ap.parse_args(argv)
    keep_freed_memory()  # as crosscut's runtimes and profiler run: no page faults per step
    torch.manual_seed(0)
    preset = Cluster.from_spec("1xcpu").devices[0]
    # the preset counts the threads torch computes on (devices.compute_threads)
    cores, threads = os.cpu_count() or 1, torch.get_num_threads()
    here = Cluster.from_devices(["cpu"], measure=True).devices[0]  # this CPU's own rates
    flops, bw = here.peak("float32"), here.mem_bw
    print(
        f"{cores} cores, torch on {threads} thread(s); load average "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}; preset "
        f"{preset.peak('float32') / 1e9:.0f} GFLOP/s, {preset.mem_bw / 1e9:.0f} GB/s; "
        f"measured here {flops / 1e9:.1f} GFLOP/s, {bw / 1e9:.1f} GB/s, page faults "
        f"{here.page_fault_bw / 1e9:.2f} GB/s (preset {preset.page_fault_bw / 1e9:.1f}); "
        f"CROSSCUT_CPU_MALLOC={mode()}"
    )
    print(
        f"{'model':<24}{'batch':>6}{'preset s':>10}{'here s':>8}"
        f"{'measured s':>11}{'preset/meas':>12}{'here/meas':>10}"
    )
    sets = {"zoo": list(ZOO), "faults": list(FAULTS)}
    names = sets.get(args.models) or args.models.split(",")
    for name in names:
        factory, shape, batch = {**MODELS, **ZOO, **FAULTS}[name]
        model = factory().train()  # type: ignore[operator]
        x = torch.randn(batch, *shape)
        pred = predicted_step(model, x, preset)
        pred_h = predicted_step(model, x, here)
        fresh = copy.deepcopy(model)  # per_op profiles the untrained model
        meas = measured_step(model, x, args.steps)
        print(
            f"{name:<24}{batch:>6}{pred:>10.4f}{pred_h:>8.4f}{meas:>11.4f}"
            f"{pred / meas:>12.2f}{pred_h / meas:>10.2f}",
            flush=True,
        )
        if args.per_op:
            _print_per_op(per_op(fresh, x, here))


if __name__ == "__main__":
    main()
