"""Published single-GPU training throughputs, and the step the cost model predicts for them.

The efficiency parameters (``efficiency.py``) are fitted to these points and
checked against them (``tests/test_calibration.py``, ``benchmarks/calibration.py``);
docs/BENCHMARKS.md lists them with their sources. Every point is one GPU
training a torchvision-equivalent CNN on synthetic or DALI-fed ImageNet-sized
images (224×224), images per second as published:

* ``dle-rn50``: NVIDIA DeepLearningExamples, PyTorch ConvNets, ResNet-50 v1.5
  README, "Training performance" tables (pytorch-21.03 NGC container; DGX-1
  16 GB V100: FP32 and AMP; DGX A100 80 GB: TF32 and AMP; batch 256 per GPU,
  FP32 112 on the 16 GB V100), 1-GPU rows;
* ``dle-rnx101``: the same repository's ResNeXt-101 32x4d README (pytorch-20.06
  container; batch 128, FP32 64 on V100), 1-GPU rows;
* ``dle-effnet``: the same repository's PyTorch EfficientNet README
  (pytorch-21.03; batch sizes from its ``configs.yml``), 1-GPU rows;
* ``dle-tf2``: its TensorFlow2 EfficientNet v1 README (tensorflow:21.09-tf2-py3,
  XLA; per-GPU batch from its ``train_benchmark_8x*.sh`` scripts), the 1-GPU
  rows of its "Training performance" tables (DGX A100 80 GB, DGX-1 32 GB V100);
* ``tf-bench``: TensorFlow's "Benchmarks" page (tf_cnn_benchmarks, 2017),
  NVIDIA DGX-1 with P100, fp32, 1 GPU (batch 64 for ResNet-50 and -152,
  32 for VGG-16; real data);
* ``lambda``: Lambda's GPU benchmark (github.com/lambdal/deeplearning-benchmark,
  ``pytorch/pytorch-train-throughput-fp32.csv`` and ``-fp16.csv``): the same
  DeepLearningExamples ResNet-50 v1.5 script in NGC pytorch:22.09 or later,
  synthetic data, one GPU; per-GPU batch from its ``pytorch-train-bs-*.csv``
  (V100 16 GB: 128 and 256; 80 GB GPUs: 640 and 1,280, the H100 SXM5 taking
  its 80 GB template's). H100 SXM5 is the median of its four one-GPU systems
  (Lambda 1,753, Dell 1,893, Supermicro 1,893, 1CC 1,898 in TF32; 2,616,
  2,776, 2,787, 2,791 in AMP); H100 PCIe the mean of its two (1,197 and 1,182;
  1,866 and 1,851). Its other one-GPU rows (Quadro RTX 8000, RTX 3090, A10,
  A100 PCIe 40 and 80 GB, RTX A6000, RTX 4090, RTX 6000 Ada, H100 PCIe) are held
  out on presets no point was fitted on. Its AMP runs keep PyTorch's default NCHW
  layout (V100: 833 images/s, against 1,200 in DeepLearningExamples' own
  NHWC table), priced with cuDNN's transposes (``layout="nchw"``).

:data:`MEASURED` holds crosscut's own measurements (``gpu-check``):
``benchmarks/gpu_check.py`` on one H100 80GB HBM3 (SXM5; PyTorch 2.11, cuDNN
9.19, ``cudnn.benchmark``), synthetic data resident on the GPU, SGD with
momentum, no loss scaling, the median of three runs of ten steps (the mean of
two calls where a configuration ran in both). They add what no published
table holds: bf16, fp32 with TF32 off (``tf32=False``), channels-last fp32, and
NCHW against NHWC on one machine. The ResNet-50 16-bit rows set
``op_terms.BN_16BIT_KERNELS`` through their per-node profiles and are marked
fitted; the rest are held out.

The step predicted for a point is the single-device training step: forward +
backward of every node (``analytic_costs``), the optimizer update
(:func:`update_seconds`) and the per-iteration overhead
(``efficiency.STEP_OVERHEAD_S``) — what ``partitioner/simulate.py`` adds to a
plan's pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from crosscut.cost_models.efficiency import (
    ACTION_OVERHEAD_S,
    STEP_OVERHEAD_S,
    efficiency_of,
    update_bytes_per_param,
)

__all__ = [
    "MEASURED",
    "PUBLISHED",
    "Published",
    "accumulate_seconds",
    "action_overhead_s",
    "step_overhead_s",
    "update_seconds",
]


@dataclass(frozen=True)
class Published:
    """One published single-GPU training throughput."""

    model: str  # "resnet50", "resnext101_32x4d", "resnet152", "vgg16"
    kind: str  # device preset
    precision: str  # "fp32" (TF32 convolutions on Ampere, as PyTorch runs them) | "fp16"
    batch: int
    images_per_s: float
    source: str  # key of the module docstring's list
    fitted: bool = True  # used to fit efficiency.py (False: a held-out check)
    image: int = 224  # input height and width
    optimizer: str = "momentum"  # the update the run's step includes
    # the tensors' layout: DeepLearningExamples' configs.yml runs every AMP configuration
    # channels-last ("nhwc") and leaves FP32/TF32 at its main.py's default, "nchw", as
    # tf_cnn_benchmarks does on a GPU; in "nchw" 16-bit and TF32 convolutions pay cuDNN's
    # transposes (analytic.nchw_transposes) and batch norm its channel occupancy
    # (analytic.bn_channel_occupancy)
    layout: str = "nhwc"
    # Ampere and later: fp32 convolutions on TF32 tensor cores (PyTorch's default)
    tf32: bool = True


PUBLISHED: list[Published] = [
    Published("resnet50", "V100", "fp32", 112, 367.0, "dle-rn50", layout="nchw"),
    Published("resnet50", "V100", "fp16", 256, 1200.0, "dle-rn50"),
    Published("resnet50", "A100-80GB", "fp32", 256, 938.0, "dle-rn50", layout="nchw"),
    Published("resnet50", "A100-80GB", "fp16", 256, 2470.0, "dle-rn50"),
    Published("resnext101_32x4d", "V100", "fp32", 64, 150.0, "dle-rnx101", layout="nchw"),
    Published("resnext101_32x4d", "V100", "fp16", 128, 535.0, "dle-rnx101"),
    Published("resnext101_32x4d", "A100-40GB", "fp32", 128, 300.0, "dle-rnx101", layout="nchw"),
    Published("resnext101_32x4d", "A100-40GB", "fp16", 128, 908.0, "dle-rnx101"),
    Published("resnet50", "P100", "fp32", 64, 219.0, "tf-bench", layout="nchw"),
    Published("resnet152", "P100", "fp32", 64, 91.8, "tf-bench", layout="nchw"),
    Published("vgg16", "P100", "fp32", 32, 154.0, "tf-bench", fitted=False, layout="nchw"),
    Published(
        "efficientnet_b0",
        "V100",
        "fp32",
        64,
        655.0,
        "dle-effnet",
        False,
        optimizer="rmsprop",
        layout="nchw",
    ),
    Published(
        "efficientnet_b0", "V100", "fp16", 128, 1301.0, "dle-effnet", False, optimizer="rmsprop"
    ),
    Published(
        "efficientnet_b0",
        "A100-80GB",
        "fp32",
        256,
        1078.0,
        "dle-effnet",
        False,
        optimizer="rmsprop",
        layout="nchw",
    ),
    Published(
        "efficientnet_b0",
        "A100-80GB",
        "fp16",
        256,
        2489.0,
        "dle-effnet",
        False,
        optimizer="rmsprop",
    ),
    Published(
        "efficientnet_b4", "V100", "fp32", 16, 83.0, "dle-effnet", False, 380, "rmsprop", "nchw"
    ),
    Published("efficientnet_b4", "V100", "fp16", 32, 204.0, "dle-effnet", False, 380, "rmsprop"),
    Published(
        "efficientnet_b4",
        "A100-80GB",
        "fp32",
        64,
        157.0,
        "dle-effnet",
        False,
        380,
        "rmsprop",
        "nchw",
    ),
    Published(
        "efficientnet_b4", "A100-80GB", "fp16", 128, 331.0, "dle-effnet", False, 380, "rmsprop"
    ),
    # the TensorFlow2 EfficientNet v1 README's one-GPU rows (XLA; batch of its scripts)
    *(
        Published(m, k, p, b, r, "dle-tf2", False, img, "rmsprop")
        for m, k, p, b, r, img in (
            ("efficientnet_b0", "A100-80GB", "fp32", 512, 1209.0, 224),
            ("efficientnet_b0", "A100-80GB", "fp16", 1024, 3454.0, 224),
            ("efficientnet_b4", "A100-80GB", "fp32", 80, 165.0, 380),
            ("efficientnet_b4", "A100-80GB", "fp16", 160, 470.0, 380),
            ("efficientnet_b0", "V100-32GB", "fp32", 256, 752.0, 224),
            ("efficientnet_b0", "V100-32GB", "fp16", 512, 868.0, 224),
            ("efficientnet_b4", "V100-32GB", "fp32", 32, 79.0, 380),
            ("efficientnet_b4", "V100-32GB", "fp16", 64, 211.0, 380),
        )
    ),
    # Lambda's one-GPU ResNet-50 rows (held out): the only published H100 training figures
    *(
        Published("resnet50", k, p, b, r, "lambda", False, layout="nchw")
        for k, p, b, r in (
            ("V100", "fp32", 128, 369.0),
            ("A100-80GB", "fp32", 640, 1066.0),
            ("H100", "fp32", 640, 1893.0),
            ("V100", "fp16", 256, 833.0),
            ("A100-80GB", "fp16", 1280, 1582.0),
            ("H100", "fp16", 1280, 2781.5),
            # the same tables' other one-GPU rows, on parts no point was fitted on (the
            # 31st session's presets); the A10 has no batch row: its 24 GB template's
            ("RTX8000", "fp32", 496, 274.0),
            ("RTX8000", "fp16", 928, 651.0),
            ("RTX3090", "fp32", 224, 513.0),
            ("RTX3090", "fp16", 448, 905.0),
            ("A10", "fp32", 224, 349.0),
            ("A10", "fp16", 448, 638.0),
            ("A100-PCIe-40GB", "fp32", 360, 882.0),
            ("A100-PCIe-40GB", "fp16", 720, 1396.0),
            ("A100-PCIe-80GB", "fp32", 640, 1014.0),
            ("A100-PCIe-80GB", "fp16", 1280, 1527.0),
            ("RTXA6000", "fp32", 496, 514.0),
            ("RTXA6000", "fp16", 928, 916.0),
            ("RTX4090", "fp32", 224, 721.0),
            ("RTX4090", "fp16", 448, 1301.0),
            ("RTX6000Ada", "fp32", 496, 647.0),
            ("RTX6000Ada", "fp16", 928, 1146.0),
            ("H100-PCIe", "fp32", 640, 1189.5),
            ("H100-PCIe", "fp16", 1280, 1858.5),
        )
    ),
]


#: crosscut's own H100 and H200 measurements (module docstring, ``gpu-check``)
MEASURED: list[Published] = [
    Published(m, "H100", p, b, r, "gpu-check", fit, layout=lay, tf32=tf)
    for m, p, lay, b, r, fit, tf in (
        ("resnet50", "fp32", "nchw", 256, 1864.0, False, True),
        ("resnet50", "fp32", "nchw", 256, 986.5, False, False),
        ("resnet50", "fp32", "nhwc", 256, 2518.1, False, True),
        ("resnet50", "fp16", "nhwc", 256, 4911.7, True, True),
        ("resnet50", "fp16", "nchw", 256, 2764.8, True, True),
        ("resnet50", "bf16", "nhwc", 256, 3974.8, True, True),
        ("resnet50", "bf16", "nchw", 256, 2240.1, True, True),
        ("resnet50", "fp16", "nhwc", 512, 5100.2, False, True),
        ("resnext101_32x4d", "fp16", "nhwc", 128, 2354.0, False, True),
        ("efficientnet_b0", "fp16", "nhwc", 256, 5349.8, False, True),
        ("mobilenet_v2", "fp16", "nhwc", 256, 7899.3, False, True),
        ("vgg16", "fp32", "nchw", 64, 1201.8, False, True),
    )
] + [
    # the same script on a lent H200 (2026-11-27, fourteenth session): every row held
    # out; where a configuration ran twice (cuDNN's benchmark on and
    # off) the mean of both, which agreed within 4 %
    Published(m, "H200", p, b, r, "gpu-check", False, layout=lay, tf32=tf)
    for m, p, lay, b, r, tf in (
        ("resnet50", "fp32", "nchw", 256, 2196.2, True),
        ("resnet50", "fp32", "nchw", 256, 1057.6, False),
        ("resnet50", "fp16", "nchw", 256, 3042.7, True),
        ("resnet50", "fp16", "nhwc", 256, 6077.7, True),
        ("resnet50", "bf16", "nhwc", 256, 4666.0, True),
        ("resnet50", "fp16", "nhwc", 512, 6414.4, True),
        ("resnext101_32x4d", "fp16", "nhwc", 128, 2797.7, True),
        ("efficientnet_b0", "fp16", "nhwc", 256, 5988.6, True),
        ("mobilenet_v2", "fp16", "nhwc", 256, 8571.7, True),
        ("vgg16", "fp32", "nchw", 64, 1331.8, True),
    )
]


def update_seconds(
    param_bytes: int,
    tensors: int,
    *,
    kind: str,
    device: str,
    mem_bw: float,
    launch_s: float,
    optimizer: str,
    precision: str,
) -> float:
    """One optimizer step over ``param_bytes`` of fp32 parameters in ``tensors`` tensors.

    Memory traffic over parameters, gradients and optimizer state at the
    generation's achieved bandwidth, plus one (multi-tensor) kernel per
    parameter-holding node.
    """
    if param_bytes <= 0:
        return 0.0
    eff = efficiency_of(kind, device)
    moved = param_bytes / 4.0 * update_bytes_per_param(optimizer, precision)
    return moved / (mem_bw * eff.memory) + tensors * launch_s


def accumulate_seconds(
    param_bytes: int, tensors: int, *, kind: str, device: str, mem_bw: float, launch_s: float
) -> float:
    """One micro-batch's weight gradients added into those of the micro-batches before it.

    Autograd adds each new gradient into ``.grad`` (read both, write one: three
    passes over the gradients' bytes) in one kernel per parameter. The first
    micro-batch of a step writes fresh gradients and pays nothing. Measured on
    resnet18's last stage on one CPU thread (10.5 M parameters): +6 ms on a 57 ms
    backward.
    """
    if param_bytes <= 0:
        return 0.0
    eff = efficiency_of(kind, device)
    return 3.0 * param_bytes / (mem_bw * eff.memory) + tensors * launch_s


def _host_class(device: str) -> str:
    """The key of the host-overhead tables: ``"cpu"`` for a CPU device, else ``"gpu"``."""
    return "cpu" if device.startswith("cpu") else "gpu"


def step_overhead_s(device: str) -> float:
    """The fixed per-iteration host overhead of one training step on ``device``."""
    return STEP_OVERHEAD_S[_host_class(device)]


def action_overhead_s(device: str) -> float:
    """The stage engine's host seconds per schedule action on ``device``, beyond its kernels.

    Why a pipeline step is priced with it: a schedule with more actions per
    micro-batch (an interleaved one: a forward and a backward per virtual stage;
    a zero-bubble one: a third, ``W``) or more micro-batches pays it more often,
    and on a CPU that is what such a schedule loses to its smaller bubble
    (docs/BENCHMARKS.md, "What one action costs the engine")."""
    return ACTION_OVERHEAD_S[_host_class(device)]
