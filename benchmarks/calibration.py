"""Predicted vs published single-GPU training throughput (``cost_models/calibration.py``).

For every published point (and crosscut's own H100 and H200 measurements, ``MEASURED``):
build the model, trace it at the published batch
under the published precision (autocast fp16 for "mixed precision"), price it
with the analytic cost model on the GPU's preset, and predict images/s =
batch / (forward + backward + optimizer update + per-iteration overhead).
Target: every point within ±15 % (``tests/test_calibration.py`` checks it).

    .venv/bin/python benchmarks/calibration.py            # the table
    .venv/bin/python benchmarks/calibration.py --points 3 # the first three only
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import torch
import torchvision
from torch import nn

from crosscut.cost_models.analytic import analytic_costs
from crosscut.cost_models.calibration import (
    MEASURED,
    PUBLISHED,
    Published,
    step_overhead_s,
    update_seconds,
)
from crosscut.cost_models.cluster import Cluster
from crosscut.frontend.tracer import trace
from crosscut.ir.graph import OpGraph

__all__ = ["build_model", "main", "predict", "single_step_s", "tf32_switches", "traced"]

TOLERANCE = 0.15


def build_model(name: str) -> nn.Module:
    """A torchvision model by name; ResNeXt-101 32x4d built from torchvision's ResNet."""
    if name == "resnext101_32x4d":
        from torchvision.models.resnet import Bottleneck, ResNet

        return ResNet(Bottleneck, [3, 4, 23, 3], groups=32, width_per_group=4)
    model: nn.Module = getattr(torchvision.models, name)(weights=None)
    return model


@lru_cache(maxsize=8)
def _graph(
    name: str, batch: int, precision: str, image: int = 224, layout: str = "nhwc"
) -> OpGraph:
    """The traced step at the point's batch, precision, image size and layout."""
    x = torch.empty(batch, 3, image, image, device="meta")
    model = build_model(name)
    if layout == "nhwc":  # as the vendors' tables run it (channels-last)
        model = model.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    return trace(model, x, mode="train", precision=precision)


def single_step_s(
    graph: OpGraph, kind: str, optimizer: str = "momentum", tf32: bool | None = None
) -> float:
    """One training step of ``graph`` on one ``kind`` device (module docstring);
    ``tf32`` None follows this process's switches."""
    cluster = Cluster.from_spec(f"1x{kind}")
    spec = cluster.devices[0]
    table = analytic_costs(graph, cluster, optimizer=optimizer, tf32=tf32)
    params = [n.param_bytes for n in graph.nodes if n.param_bytes > 0]
    update = update_seconds(
        sum(params),
        len(params),
        kind=spec.kind,
        device=spec.device,
        mem_bw=spec.mem_bw,
        launch_s=spec.launch_overhead_s,
        optimizer=optimizer,
        precision=graph.precision,
    )
    return table.total(spec.kind, "train") + update + step_overhead_s(spec.device)


def traced(point: Published) -> OpGraph:
    """The training step ``point`` prices, traced (cached)."""
    return _graph(point.model, point.batch, point.precision, point.image, point.layout)


def predict(point: Published) -> float:
    """Predicted images/s of ``point``'s configuration."""
    graph = _graph(point.model, point.batch, point.precision, point.image, point.layout)
    # the point's switches: TF32 convolutions as it ran them, matmuls at PyTorch's default (off)
    with tf32_switches(point.tf32, False):
        return point.batch / single_step_s(graph, point.kind, point.optimizer)


@contextmanager
def tf32_switches(conv: bool, matmul: bool) -> Iterator[None]:
    """cuDNN's and cuBLAS's TF32 switches set for the block: the analytic prices read
    them (``MathFlags.from_torch``), as does the GPU itself."""
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv, matmul
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=len(PUBLISHED) + len(MEASURED))
    args = ap.parse_args(argv)
    print(f"{'model':<18}{'GPU':<15}{'prec':<6}{'batch':>6}{'pred':>9}{'publ':>9}{'ratio':>7}  src")
    for p in [*PUBLISHED, *MEASURED][: args.points]:
        got = predict(p)
        flag = "" if abs(got / p.images_per_s - 1) <= TOLERANCE else "  OUT"
        held = "" if p.fitted else " (held out)"
        how = f" {p.layout}" + ("" if p.tf32 else " no-tf32") if p.source == "gpu-check" else ""
        print(
            f"{p.model:<18}{p.kind:<15}{p.precision:<6}{p.batch:>6}{got:>9.0f}"
            f"{p.images_per_s:>9.0f}{got / p.images_per_s:>7.2f}  {p.source}{how}{held}{flag}"
        )


if __name__ == "__main__":
    main()
