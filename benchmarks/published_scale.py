"""Predicted vs published: the epoch time of a large-scale ResNet-50 run, from its configuration.

Source: P. Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1
Hour" (Facebook, arXiv:1706.02677, 2017). Their configuration: 256 NVIDIA
Tesla P100 GPUs in 32 Big Basin servers of 8 (NVLink inside a server), 50
Gbit/s Ethernet between servers, 32 images per GPU (global batch 8,192), fp32,
ResNet-50 at 224×224, 90 epochs of the 1,281,167 ImageNet training images in
about one hour, i.e. about 40 s per epoch (the paper's headline; its data
loading, evaluation and the overlap of communication with backward are all
inside that hour).

crosscut plans the same job from that configuration alone (``"32x8xP100+eth50"``,
analytic costs, no profiling) and predicts the step; epoch = steps × step. The
planner does not model data loading or overlap, and its P100 preset is the
datasheet (10.6 TFLOPS fp32, 732 GB/s) times the cost model's efficiency.

    python benchmarks/published_scale.py
"""

from __future__ import annotations

import time

import torch
import torchvision

import crosscut

IMAGENET_TRAIN = 1_281_167
PUBLISHED_EPOCH_S = 3600 / 90  # "1 hour" for 90 epochs


def main() -> None:
    model = torchvision.models.resnet50(weights=None)
    x = torch.empty(8192, 3, 224, 224, device="meta")
    t0 = time.perf_counter()
    plan = crosscut.partition(model, "32x8xP100+eth50", x, time_limit=20)
    wall = time.perf_counter() - t0
    one = crosscut.partition(model, "1xP100", torch.empty(32, 3, 224, 224, device="meta"))
    step = plan.predicted.step_time_s
    epoch = IMAGENET_TRAIN / 8192 * step
    rep = plan.replication
    devices = len(plan.used_devices())
    print(f"plan: {rep.replicas} replicas x {devices} device(s), {rep.reduction} all-reduce "
          f"{rep.allreduce_s * 1e3:.1f} ms, planned in {wall:.1f} s")  # fmt: skip
    print(f"predicted step {step * 1e3:.1f} ms; one P100 at batch 32: "
          f"{one.predicted.step_time_s * 1e3:.1f} ms; scaling efficiency "
          f"{one.predicted.step_time_s / step:.2f}")  # fmt: skip
    print(f"epoch: predicted {epoch:.1f} s, published ~{PUBLISHED_EPOCH_S:.0f} s "
          f"(predicted / published = {epoch / PUBLISHED_EPOCH_S:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
