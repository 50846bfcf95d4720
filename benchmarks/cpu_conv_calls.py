"""The fixed cost of a oneDNN convolution call on a CPU, in context, against its price.

Every convolution PyTorch runs through oneDNN pays a cost per call whatever its
size (building the primitive, reordering the weights), far above a simple
op's dispatch. This times chains of ``--layers`` tiny convolutions (16 channels,
2-4 px, batch 16, where the arithmetic is under a microsecond) in training steps,
against the same chain of scalar multiplies, and prints what each convolution
adds, forward and backward, beside what the analytic CPU price charges a call
beyond its arithmetic (``cpu_terms.ONEDNN_CALL_FLOPS`` plus the launch overhead)
at this machine's measured GEMM rate.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_conv_calls.py
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from cpu_kernels import median_s  # run as a script: benchmarks/ is on the path
from torch import nn

from crosscut.cost_models.cpu_terms import ONEDNN_CALL_FLOPS
from crosscut.cost_models.devices import CPU_LAUNCH_S
from crosscut.cost_models.links import measure_cpu_rates

__all__ = ["CASES", "main", "per_call"]


class _Scale(nn.Module):
    """A scalar multiply with a weight: an op with a forward and a backward, no oneDNN."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


# name -> (a layer's factory, input shape)
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "1x1, 16 ch, 2 px": (lambda: nn.Conv2d(16, 16, 1, bias=False), (16, 16, 2, 2)),
    "3x3, 16 ch, 2 px": (lambda: nn.Conv2d(16, 16, 3, padding=1, bias=False), (16, 16, 2, 2)),
    "depthwise 3x3, 4 px": (
        lambda: nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False),
        (16, 16, 4, 4),
    ),
    "1x1 with bias, 2 px": (lambda: nn.Conv2d(16, 16, 1), (16, 16, 2, 2)),
}


def _chain(
    make: Callable[[], nn.Module], shape: tuple[int, ...], layers: int, repeats: int
) -> tuple[float, float]:
    model = nn.Sequential(*[make() for _ in range(layers)])
    x = torch.randn(*shape, requires_grad=True)
    fwd = median_s(lambda: model(x), repeats)
    step = median_s(lambda: model(x).sum().backward(), repeats)  # type: ignore[no-untyped-call]
    return fwd, step - fwd


def per_call(name: str, layers: int, repeats: int) -> tuple[float, float]:
    """(forward, backward) seconds one convolution of ``CASES[name]`` adds over a scalar
    multiply, in a chain of ``layers``."""
    make, shape = CASES[name]
    fwd, bwd = _chain(make, shape, layers, repeats)
    fwd0, bwd0 = _chain(_Scale, shape, layers, repeats)
    return (fwd - fwd0) / layers, (bwd - bwd0) / layers


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=31)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    flops, _ = measure_cpu_rates()
    fwd_p = ONEDNN_CALL_FLOPS["forward"] / flops + CPU_LAUNCH_S
    bwd_p = ONEDNN_CALL_FLOPS["backward"] / flops + 2 * CPU_LAUNCH_S
    print(
        f"torch on {torch.get_num_threads()} thread(s); GEMM {flops / 1e9:.1f} GFLOP/s; a call "
        f"priced {fwd_p * 1e6:.0f} us forward, {bwd_p * 1e6:.0f} us backward beyond its work"
    )
    print(f"{'convolution':<24}{'fwd us':>8}{'bwd us':>8}{'price/fwd':>11}{'price/bwd':>11}")
    for name in CASES:
        fwd, bwd = per_call(name, args.layers, args.repeats)
        print(
            f"{name:<24}{fwd * 1e6:>8.1f}{bwd * 1e6:>8.1f}{fwd_p / fwd:>11.2f}{bwd_p / bwd:>11.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
