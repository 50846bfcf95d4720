"""Where a GPU training step's time goes: kernels, host dispatch and idle, per op class.

``gpu_check.py``'s per-node profiles time each fx node by CUDA events on the
stream, so a node whose kernels are short is charged the time the GPU waited
for the host to issue them: an SE block's sigmoid on a ``[256, C, 1, 1]``
tensor measured 70 µs where its kernels take a few. Such a profile cannot say
whether an analytic price is wrong about the kernel or about the host. This
separates the two, for each configuration (model, precision, layout, batch):

* ``step``: the plain training step (SGD with momentum, as ``gpu_check`` runs it);
* ``kernels``: the summed duration of the step's GPU kernels (``torch.profiler``,
  one step, median of ``--profile-repeats``), and per aten op class (convolution, batch norm,
  pooling, matmul, optimizer, casts, other elementwise) with their launches;
* ``host``: the host's seconds to issue one step, timed at a small batch
  (``--host-batch``, 8) where the GPU keeps up, so the host is what is timed;
* ``idle``: ``step - kernels``, the GPU waiting.

It writes ``kernels.json`` under ``--out``; ``--reprice FILE`` (no GPU) reads
one back and prints, per op class, the analytic price of the current model
against the kernels' time, and the step against ``max(kernels, host)``.

    python benchmarks/gpu_kernels.py --out out/kernels                  # on a GPU
    .venv/bin/python benchmarks/gpu_kernels.py --reprice docs/benchmarks/h200-kernels.json
    .venv/bin/python benchmarks/gpu_kernels.py --device cpu --quick     # code paths only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import calibration as calib
import gpu_check as gc

__all__ = ["CLASSES", "main", "measure", "node_class", "op_class"]

CONFIGS = (
    "resnet50:fp16:nhwc:256,resnet18:fp16:nhwc:256,regnet_y_400mf:fp16:nhwc:256,"
    "regnet_x_400mf:fp16:nhwc:256,efficientnet_b0:fp16:nhwc:256,mobilenet_v2:fp16:nhwc:256,"
    "mobilenet_v3_large:fp16:nhwc:256,shufflenet_v2_x1_0:fp16:nhwc:256,"
    "densenet121:fp16:nhwc:128,mnasnet1_0:fp16:nhwc:256,efficientnet_v2_s:fp16:nhwc:128,"
    "convnext_tiny:fp16:nhwc:128,resnext50_32x4d:fp16:nhwc:128,googlenet:fp16:nhwc:256,"
    "squeezenet1_0:fp16:nhwc:256,vgg16:fp16:nhwc:64,resnet50:fp32:nchw:256,"
    "mobilenet_v2:fp32:nchw:256,regnet_y_400mf:fp32:nchw:256"
)
CLASSES = ("conv", "batch_norm", "pool", "matmul", "cat", "optimizer", "cast", "other")


def op_class(name: str) -> str:
    """The class of an aten op by its name (the op that launched a kernel)."""
    n = name.removeprefix("aten::")
    if "conv" in n:
        return "conv"
    if "batch_norm" in n:
        return "batch_norm"
    if "pool" in n or n in ("mean", "sum"):
        return "pool"
    if n in ("mm", "addmm", "bmm", "matmul", "linear"):
        return "matmul"
    if n in ("cat", "_cat"):
        return "cat"
    if n.startswith("_foreach") or n.startswith("_fused"):
        return "optimizer"
    if n in ("_to_copy", "copy_", "to", "_copy_from"):
        return "cast"
    return "other"


def node_class(kind: str) -> str:
    """The op class of a traced node kind (``OpNode.kind``), as :func:`op_class` names it."""
    if "conv" in kind:
        return "conv"
    if "batch_norm" in kind:
        return "batch_norm"
    if "pool" in kind or kind == "mean":
        return "pool"
    if kind == "linear":
        return "matmul"
    if kind == "cat":
        return "cat"
    return "other"


def _ops(prof: Any, steps: int) -> dict[str, list[float]]:
    """aten op -> [kernels launched, self host µs, self kernel µs], per step."""
    out: dict[str, list[float]] = {}
    for e in prof.key_averages():
        dev_us = float(getattr(e, "self_device_time_total", 0.0) or 0.0)
        if not e.key.startswith("aten::") or (dev_us <= 0 and e.self_cpu_time_total <= 0):
            continue
        out[e.key] = [e.count / steps, e.self_cpu_time_total / steps, dev_us / steps]
    return out


def _shaped(prof: Any) -> list[list[Any]]:
    """[aten op, input shapes, calls, self kernel µs] of every op that ran kernels, by shape:
    which convolution (its weight's shape gives its groups) took how long."""
    out = []
    for e in prof.key_averages(group_by_input_shape=True):
        dev_us = float(getattr(e, "self_device_time_total", 0.0) or 0.0)
        if e.key.startswith("aten::") and dev_us > 0:
            out.append([e.key, str(e.input_shapes), e.count, dev_us])
    return out


def _kernel_launches(prof: Any, steps: int) -> float:
    """Kernels the GPU ran per step (device-side events)."""
    n = 0
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            n += 1
    return n / steps


def _build(name: str) -> torch.nn.Module:
    """``calibration.build_model``, but GoogLeNet and Inception v3 without their auxiliary
    heads (whose tuple output the loss cannot take)."""
    if name in ("googlenet", "inception_v3"):
        import torchvision

        model: torch.nn.Module = getattr(torchvision.models, name)(
            weights=None, aux_logits=False, init_weights=False
        )
        return model
    return calib.build_model(name)


def measure(
    config: tuple[str, str, str, int], dev: torch.device, ns: argparse.Namespace
) -> dict[str, Any]:
    """One configuration's step, kernels by class, host issue time and idle GPU."""
    name, prec, layout, batch = config
    torch.manual_seed(0)
    model = _build(name).to(dev)
    if layout == "nhwc":
        model = model.to(memory_format=torch.channels_last)
    if prec == "fp32-notf32":
        torch.backends.cudnn.allow_tf32 = False
    try:
        x, y = gc.inputs(batch, ns.size, layout, dev)
        step = gc.train_step(model, x, y, prec.split("-")[0])
        step_s = gc.timed(step, dev, 3, ns.iters, 3)
        activities = [ProfilerActivity.CPU]
        if dev.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        totals, per_op, launches = [], {}, 0.0
        for _ in range(ns.profile_repeats):
            with profile(activities=activities, record_shapes=True) as prof:
                step()
                gc.sync(dev)
            per_op = _ops(prof, 1)
            totals.append(sum(v[2] for v in per_op.values()) * 1e-6)
            launches = _kernel_launches(prof, 1)
        shaped = _shaped(prof)
        xs, ys = gc.inputs(ns.host_batch, ns.size, layout, dev)
        small = gc.train_step(model, xs, ys, prec.split("-")[0])
        host_s = gc.timed(small, dev, 3, ns.iters, 3)
        gc.sync(dev)
        t0 = time.perf_counter()
        for _ in range(ns.iters):
            small()
        issue_s = (time.perf_counter() - t0) / ns.iters  # no sync: the host's own time
        gc.sync(dev)
    finally:
        torch.backends.cudnn.allow_tf32 = True
    kernels_s = statistics.median(totals)
    classes: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for op, (count, cpu_us, dev_us) in per_op.items():
        c = classes[op_class(op)]
        c[0] += count
        c[1] += cpu_us * 1e-6
        c[2] += dev_us * 1e-6
    return {
        "model": name,
        "precision": prec,
        "layout": layout,
        "batch": batch,
        "step_s": step_s,
        "kernels_s": kernels_s,
        "idle_s": step_s - kernels_s,
        "launches": launches,
        "host_s": host_s,
        "host_issue_s": issue_s,
        "host_batch": ns.host_batch,
        "classes": {
            k: {"ops": v[0], "host_s": v[1], "kernels_s": v[2]} for k, v in classes.items()
        },
        "ops": per_op,
        "shaped": shaped,
    }


def _print_row(r: dict[str, Any]) -> None:
    cls = r["classes"]
    parts = " ".join(f"{k[:5]} {cls[k]['kernels_s'] * 1e3:6.2f}" for k in CLASSES if k in cls)
    print(
        f"{r['model']:19} {r['precision']:5} {r['layout']:4} {r['batch']:4} "
        f"step {r['step_s'] * 1e3:7.2f} ms  kernels {r['kernels_s'] * 1e3:7.2f}  "
        f"idle {r['idle_s'] / r['step_s']:5.1%}  host(b={r['host_batch']}) "
        f"{r['host_s'] * 1e3:6.2f} issue {r['host_issue_s'] * 1e3:6.2f}  "
        f"launches {r['launches']:5.0f} | {parts}",
        flush=True,
    )


def run(ns: argparse.Namespace) -> int:
    """Measure every configuration of ``--configs``, writing the JSON after each."""
    dev = torch.device(ns.device)
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True
    rows: list[dict[str, Any]] = []
    env = {"torch": torch.__version__, "device": str(dev)}
    if dev.type == "cuda":
        env["name"] = torch.cuda.get_device_name(dev)
        env["kind"] = gc.detect_kind(dev, ns.kind)
    ns.out.mkdir(parents=True, exist_ok=True)
    configs = gc.QUICK if ns.quick else gc.configs(ns.configs)
    print(f"== kernels, host and idle per step on {env.get('name', dev)}")
    for config in configs:
        try:
            rows.append(measure(config, dev, ns))
            _print_row(rows[-1])
        except Exception:  # one failing configuration must not end the call
            print(f"{config}: failed\n{traceback.format_exc(limit=3)}", flush=True)
        (ns.out / "kernels.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Measure on a GPU, or (``--reprice``) compare a saved measurement with the prices."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--kind", default="", help="preset to price with (default: detected)")
    ap.add_argument("--out", type=Path, default=Path("out/kernels"))
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--configs", default=CONFIGS, help="model:precision:layout:batch,...")
    ap.add_argument("--host-batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--profile-repeats", type=int, default=3, help="profiled steps (median)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: check the code paths")
    ap.add_argument("--reprice", type=Path, help="a kernels.json to compare with the prices")
    ns = ap.parse_args(argv)
    if ns.reprice:
        import kernels_reprice

        return kernels_reprice.report(json.loads(ns.reprice.read_text()))
    if ns.quick:
        ns.size, ns.host_batch, ns.iters = 32, 2, 2
    return run(ns)


if __name__ == "__main__":
    sys.exit(main())
