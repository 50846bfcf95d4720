"""CPU kernels the roofline misprices: max pool, batch norm, narrow 1x1 and depthwise convolutions.

``cost_models/cpu_terms.py`` prices an NCHW max pool and a training batch norm on
a CPU in *FLOP-equivalents*: seconds × the CPU's GEMM rate. This measures what
those are on this machine, with the GEMM and copy rates measured in the same run
(``links.measure_cpu_rates``, the best of three, before and after):

* each max pool (NCHW, and channels-last for contrast) forward and backward;
* each batch norm (NCHW, training) forward and backward (input and weight
  gradients, one autograd call);
* each 1x1 convolution at batch 8 and 1-4 pixels a side, which PyTorch runs as
  ``Slow2d`` on one thread (one GEMM per sample, as wide as its pixels) forward
  and backward (input and weight gradients);
* each depthwise convolution (NCHW, batch 8-16) of ``DW_SHAPES``, forward and
  backward, where oneDNN runs a pass on its GEMM fallback and one control;
* each activation of ``ACTIVATIONS`` at the sizes of ``ACT_SHAPES``, on a tensor
  that needs a gradient and is not a leaf (a convolution's output; an in-place one
  copies it first for autograd), the backward less that of the ``x * 1.0`` before it;
* per row: the time, FLOP-equivalents per output (pool), per element (batch
  norm) or per multiply-add (convolution), the bytes-equivalents of the forward
  (seconds × the copy rate), and the analytic price's ratio to the time at this
  machine's two rates.

``--out FILE`` writes the rows as JSON; ``tests/test_cpu_terms.py`` re-prices the
recorded files (``docs/benchmarks/cpu-kernels.json``: pools and batch norms;
``cpu-kernels-slow2d.json``: the 1x1 convolutions; ``cpu-kernels-dw.json``: the
depthwise ones; ``cpu-kernels-act.json``: the activations) with the current model.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_kernels.py \\
        --ops max_pool2d,batch_norm --out docs/benchmarks/cpu-kernels.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_kernels.py \\
        --ops conv2d_1x1 --out docs/benchmarks/cpu-kernels-slow2d.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_kernels.py \\
        --ops conv2d_dw --out docs/benchmarks/cpu-kernels-dw.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_kernels.py \\
        --ops activation --out docs/benchmarks/cpu-kernels-act.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from crosscut.cost_models.analytic import node_times
from crosscut.cost_models.devices import cpu_spec
from crosscut.cost_models.links import measure_cpu_rates
from crosscut.frontend.tracer import trace

__all__ = [
    "ACTIVATIONS",
    "ACT_SHAPES",
    "BN_SHAPES",
    "CONV_SHAPES",
    "DW_SHAPES",
    "POOL_SHAPES",
    "cpu_name",
    "main",
    "median_s",
    "priced",
]

# (batch, channels, height, kernel, stride, padding): LeNet's, ResNet's and
# GoogLeNet's pools among them (28² 2x2; 32-112² 3x3 stride 2; 3x3 stride 1)
POOL_SHAPES = (
    (64, 32, 28, 2, 2, 0),
    (64, 64, 14, 2, 2, 0),
    (16, 256, 16, 2, 2, 0),
    (16, 64, 32, 3, 2, 1),
    (8, 64, 112, 3, 2, 1),
    (16, 128, 32, 3, 1, 1),
)
# (batch, channels, height): ResNet-18 and MobileNetV2 at 64 px, and LeNet's sizes
BN_SHAPES = (
    (16, 64, 32),
    (16, 64, 16),
    (64, 32, 28),
    (16, 144, 16),
    (16, 128, 8),
    (16, 256, 4),
    (16, 512, 2),
    (16, 960, 2),
)

# (batch, in channels, out channels, height): 1x1 convolutions of DenseNet-121's last
# block and MobileNetV2's last stages at 64 px (2x2), at 3x3 and 1x1, and a 4x4 control
CONV_SHAPES = (
    (8, 512, 128, 2),
    (8, 1024, 128, 2),
    (8, 96, 576, 2),
    (8, 576, 96, 2),
    (8, 160, 960, 2),
    (8, 512, 128, 3),
    (8, 128, 32, 1),
    (8, 1024, 128, 1),
    (8, 512, 128, 4),
)


# (batch, channels, kernel, stride, height): depthwise convolutions, padding kernel // 2.
# Weight gradients oneDNN runs on its GEMM fallback (cpu_terms.depthwise_fallbacks): 3x3
# under its kernel's input size, and 5x5 and 7x7 at MobileNetV3's, EfficientNet's and
# ConvNeXt's sizes; forwards on it (5x5 and 7x7 at 1-2 px); and a 3x3 control, all on
# oneDNN's depthwise kernels.
DW_SHAPES = (
    (16, 384, 3, 1, 2),
    (16, 960, 3, 1, 2),
    (16, 384, 3, 2, 3),
    (16, 96, 5, 1, 16),
    (8, 240, 5, 1, 14),
    (8, 576, 5, 1, 7),
    (16, 384, 5, 2, 8),
    (8, 120, 5, 1, 28),
    (8, 192, 7, 1, 8),
    (8, 96, 7, 1, 32),
    (16, 960, 5, 1, 1),
    (16, 384, 5, 2, 2),
    (8, 768, 7, 1, 2),
    (16, 384, 3, 1, 8),
)

# activations, by name: a ReLU control, the ones that compute exp/erf/log1p per element
# (cpu_terms.CPU_ELEMENTWISE_FLOPS), and in-place ones autograd copies the input of
ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "sigmoid": nn.Sigmoid,
    "silu": nn.SiLU,
    "gelu": nn.GELU,
    "exp": lambda: _Exp(),
    "tanh": nn.Tanh,
    "elu": nn.ELU,
    "softplus": nn.Softplus,
    "log_sigmoid": nn.LogSigmoid,
    "silu_": lambda: nn.SiLU(inplace=True),
    "hardswish_": lambda: nn.Hardswish(inplace=True),
    "relu6_": lambda: nn.ReLU6(inplace=True),
    "relu_": lambda: nn.ReLU(inplace=True),
    # last: once a process has run a Mish, ELU, softplus and log-sigmoid run 6-7x faster
    # (cpu_terms.CPU_ELEMENTWISE_FLOPS); the record keeps the state a process starts in
    "mish": nn.Mish,
}
# (batch, channels, height): EfficientNet-B0's at 128 px (16 px x 240, 4 px x 1,152) and
# one of MobileNetV2's at 224 px (56 px x 144, 14.5 MB)
ACT_SHAPES = ((8, 240, 16), (8, 1152, 4), (8, 144, 56))


class _Exp(nn.Module):
    """``torch.exp`` as a module (one traced node, like the others)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)


def median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn``, after two to warm caches and pools."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def priced(
    module: nn.Module, shape: tuple[int, ...], flops: float, mem_bw: float, channels_last: bool
) -> tuple[float, float]:
    """(forward, backward) analytic seconds of ``module``'s one node at ``shape`` on
    the cpu preset at ``flops`` and ``mem_bw``: the price the current model gives it."""
    x = torch.randn(*shape)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    graph = trace(nn.Sequential(module).train(), x, mode="train")
    spec = cpu_spec("cpu", peak=flops, mem_bw=mem_bw)
    ops = [n for n in graph.nodes if n.op == "call_module"]  # an in-place one: not the clone
    (node,) = ops or [n for n in graph.nodes if n.op == "call_function"]
    return node_times(graph, node, spec)


def _time(
    module: nn.Module, shape: tuple[int, ...], channels_last: bool, repeats: int
) -> tuple[float, float, int]:
    x = torch.randn(*shape)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_(True)
    module.train()
    fwd = median_s(lambda: module(x), repeats)
    y = module(x)
    grad = torch.randn_like(y)
    wrt = [x, *module.parameters()]
    bwd = median_s(lambda: torch.autograd.grad(y, wrt, grad, retain_graph=True), repeats)
    return fwd, bwd, y.numel()


def _time_activation(
    module: nn.Module, shape: tuple[int, ...], repeats: int
) -> tuple[float, float, int]:
    """(forward, backward, elements) of ``module`` on ``x * 1.0``, a non-leaf that needs a
    gradient as a convolution's output does. The backward is timed to ``x * 1.0`` itself,
    or for an in-place module (whose output is that tensor) to ``x``, less the ``* 1.0``'s."""
    x = torch.randn(*shape, requires_grad=True)
    module.train()

    def forward() -> float:
        y = x * 1.0
        t0 = time.perf_counter()
        module(y)
        return time.perf_counter() - t0

    for _ in range(2):
        forward()
    fwd = statistics.median(forward() for _ in range(repeats))
    y = x * 1.0
    out = module(y)
    grad = torch.randn_like(out)
    if out is not y:
        bwd = median_s(lambda: torch.autograd.grad(out, [y], grad, retain_graph=True), repeats)
        return fwd, bwd, out.numel()
    alone = x * 1.0
    bwd = median_s(lambda: torch.autograd.grad(out, [x], grad, retain_graph=True), repeats)
    mul = median_s(lambda: torch.autograd.grad(alone, [x], grad, retain_graph=True), repeats)
    return fwd, max(bwd - mul, 1e-9), out.numel()


def _cases() -> list[tuple[str, nn.Module, tuple[int, ...], bool, list[Any]]]:
    cases: list[tuple[str, nn.Module, tuple[int, ...], bool, list[Any]]] = []
    for n, c, h, k, s, p in POOL_SHAPES:
        for cl in (False, True):
            cases.append(("max_pool2d", nn.MaxPool2d(k, s, p), (n, c, h, h), cl, [k, s, p]))
    for n, c, h in BN_SHAPES:
        cases.append(("batch_norm", nn.BatchNorm2d(c), (n, c, h, h), False, []))
    for n, c, out, h in CONV_SHAPES:
        cases.append(("conv2d_1x1", nn.Conv2d(c, out, 1), (n, c, h, h), False, [out]))
    for n, c, k, s, h in DW_SHAPES:
        dw = nn.Conv2d(c, c, k, stride=s, padding=k // 2, groups=c, bias=False)
        cases.append(("conv2d_dw", dw, (n, c, h, h), False, [k, s]))
    for name in ACTIVATIONS:  # every size of one before the next: Mish (last) speeds up ELU
        for n, c, h in ACT_SHAPES:
            cases.append(("activation", ACTIVATIONS[name](), (n, c, h, h), False, [name]))
    return cases


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument(
        "--ops",
        default="max_pool2d,batch_norm,conv2d_1x1,conv2d_dw,activation",
        help="comma-separated op families to time (default: all five)",
    )
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    flops, bw = measure_cpu_rates()
    print(
        f"{cpu_name()}, torch on {torch.get_num_threads()} thread(s); load "
        f"{os.getloadavg()[0]:.2f}; GEMM {flops / 1e9:.1f} GFLOP/s, copies {bw / 1e9:.1f} GB/s"
    )
    print(
        f"{'op':<11}{'shape':<16}{'layout':>7}{'fwd ms':>8}{'bwd ms':>8}"
        f"{'fwd F/unit':>11}{'bwd F/unit':>11}{'fwd B/unit':>11}"
        f"{'price/fwd':>10}{'price/bwd':>10}"
    )
    rows: list[dict[str, Any]] = []
    for op, module, shape, cl, window in _cases():
        if op not in args.ops.split(","):
            continue
        if op == "activation":
            fwd, bwd, outputs = _time_activation(module, shape, args.repeats)
        else:
            fwd, bwd, outputs = _time(module, shape, cl, args.repeats)
        units = outputs if op == "max_pool2d" else math.prod(shape)
        if op == "conv2d_1x1":  # multiply-adds
            units = outputs * shape[1]
        if op == "conv2d_dw":  # multiply-adds: one channel each
            units = outputs * window[0] ** 2
        p_fwd, p_bwd = priced(module, shape, flops, bw, cl)
        row = {
            "op": op,
            "shape": list(shape),
            "channels_last": cl,
            "pool": window if op == "max_pool2d" else [],
            "out_channels": window[0] if op == "conv2d_1x1" else None,
            "kernel_stride": window if op == "conv2d_dw" else None,
            "activation": window[0] if op == "activation" else None,
            "fwd_s": fwd,
            "bwd_s": bwd,
            "units": units,
            "fwd_flops_per_unit": fwd * flops / units,
            "bwd_flops_per_unit": bwd * flops / units,
            "fwd_bytes_per_unit": fwd * bw / units,
            "priced": [p_fwd, p_bwd],
        }
        rows.append(row)
        print(
            f"{window[0] if op == 'activation' else op:<11}{'x'.join(map(str, shape)):<16}"
            f"{'NHWC' if cl else 'NCHW':>7}"
            f"{fwd * 1e3:>8.3f}{bwd * 1e3:>8.3f}{row['fwd_flops_per_unit']:>11.0f}"
            f"{row['bwd_flops_per_unit']:>11.0f}{row['fwd_bytes_per_unit']:>11.1f}"
            f"{p_fwd / fwd:>10.2f}{p_bwd / bwd:>10.2f}",
            flush=True,
        )
    after = measure_cpu_rates()
    print(f"rates after: GEMM {after[0] / 1e9:.1f} GFLOP/s, copies {after[1] / 1e9:.1f} GB/s")
    if args.out:
        meta = {
            "cpu": cpu_name(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "gemm_flops_per_s": flops,
            "copy_bytes_per_s": bw,
            "after": list(after),
            "load": os.getloadavg()[0],
            "command": "OMP_NUM_THREADS=1 python benchmarks/cpu_kernels.py "
            f"--ops {args.ops} --out FILE",
        }
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
