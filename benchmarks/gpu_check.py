"""What only a GPU can show, measured side by side with crosscut's prices, in one call.

Written for a lent GPU with minutes of device time (docs/BENCHMARKS.md, "GPU
check"). Every part prints a table and writes JSON under ``--out``; a part that
fails prints its error and the next part still runs.

1. **throughput**: single-GPU training images/s of torchvision CNNs on
   synthetic data (SGD with momentum, ``cudnn.benchmark``), in fp32 with TF32
   on (PyTorch's default) and off, and under fp16/bf16 autocast in PyTorch's
   default NCHW layout and channels-last, next to the analytic prediction for
   the detected preset (``benchmarks/calibration.predict``): the figures
   issue 24's published tables stand in for.
2. **pipeline**: crosscut's local runtime on CUDA. A 2-stage plan on
   ``["cuda:0", "cuda:1"]`` (where there are two GPUs) under 1F1B, ZB-H1
   and ZB-V trains two momentum steps against eager's micro-batches in order,
   with deterministic cuDNN: losses and weights must be bit-exact. Then a
   one-stage compiled step against the eager step, and its predicted step.
3. **profile**: ``profile_costs`` on the GPU (in-context, fresh): the sum of
   the per-node prices against the measured step and the analytic price; the
   tables are written out for an offline per-op comparison.

    python benchmarks/gpu_check.py --out out/gpu            # on a GPU machine
    python benchmarks/gpu_check.py --device cpu --quick     # a dry run of the code paths
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import calibration as calib

import crosscut
from crosscut.cost_models.analytic import analytic_costs
from crosscut.cost_models.calibration import Published
from crosscut.cost_models.cluster import Cluster
from crosscut.cost_models.memory import peak_memory
from crosscut.cost_models.profiled import profile_costs
from crosscut.frontend.tracer import trace
from crosscut.precision import autocast

__all__ = ["main"]

# (model, precision, layout, batch): ResNet-50 in every math mode and layout, then CNNs
# whose convolutions achieve less (depthwise, grouped, small)
THROUGHPUT = [
    ("resnet50", "fp32", "nchw", 256),
    ("resnet50", "fp32-notf32", "nchw", 256),
    ("resnet50", "fp16", "nchw", 256),
    ("resnet50", "fp16", "nhwc", 256),
    ("resnet50", "bf16", "nhwc", 256),
    ("resnet50", "fp16", "nhwc", 512),
    ("resnext101_32x4d", "fp16", "nhwc", 128),
    ("efficientnet_b0", "fp16", "nhwc", 256),
    ("mobilenet_v2", "fp16", "nhwc", 256),
    ("vgg16", "fp32", "nchw", 64),
]
QUICK = [("resnet18", "fp32", "nchw", 4), ("mobilenet_v2", "fp32", "nhwc", 4)]
# one precision and layout per step's batch norm and convolution path: cuDNN's persistent
# NHWC kernels, its NCHW ones, and bf16 (whose batch norm measured slower in both)
PROFILES = [
    ("resnet50", "fp16", "nhwc", 256),
    ("resnet50", "fp16", "nchw", 256),
    ("resnet50", "fp32", "nchw", 256),
    ("resnet50", "fp32", "nhwc", 256),
    ("resnet50", "bf16", "nhwc", 256),
    ("resnet50", "bf16", "nchw", 256),
    ("efficientnet_b0", "fp16", "nhwc", 256),
]


# per-op data for fitting the analytic model without a GPU: each family's convolutions
# (1x1, 3x3, grouped, depthwise, the stem), batch norm and elementwise ops, in the two
# math modes a GPU user runs (fp16 channels-last; TF32 in both layouts)
ZOO = [
    (m, p, lay, b)
    for m, b in (
        ("resnet50", 256),
        ("resnext101_32x4d", 128),
        ("efficientnet_b0", 256),
        ("mobilenet_v2", 256),
        ("densenet121", 128),
        ("vgg16", 64),
    )
    for p, lay in (("fp16", "nhwc"), ("fp32", "nhwc"), ("fp32", "nchw"))
]


def configs(text: str) -> list[tuple[str, str, str, int]]:
    """``model:precision:layout:batch`` entries, comma-separated; "profiles":
    :data:`PROFILES`; "zoo": :data:`ZOO`."""
    if text in ("profiles", "zoo"):
        return PROFILES if text == "profiles" else ZOO
    out = []
    for entry in text.split(","):
        model, precision, layout, batch = entry.split(":")
        out.append((model, precision, layout, int(batch)))
    return out


def sync(dev: torch.device) -> None:
    """Wait for the device: its work is asynchronous, and a host clock must not run ahead."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(step: Callable[[], None], dev: torch.device, warmup: int, iters: int, reps: int) -> float:
    """Median over ``reps`` of the mean seconds of ``iters`` back-to-back steps."""
    for _ in range(warmup):
        step()
    sync(dev)
    if dev.type == "cuda":  # the peak of the timed steps, not of cudnn.benchmark's trials
        torch.cuda.reset_peak_memory_stats(dev)
    means = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        sync(dev)
        means.append((time.perf_counter() - t0) / iters)
    return statistics.median(means)


def train_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str
) -> Callable[[], None]:
    """One training step as the vendors' tables time it: forward under autocast, backward,
    SGD with momentum (no loss scaler)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast(precision, x.device.type):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    return step


def inputs(
    batch: int, size: int, layout: str, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images (channels-last for ``"nhwc"``) and ImageNet labels, on ``dev``."""
    x = torch.randn(batch, 3, size, size, device=dev)
    if layout == "nhwc":
        x = x.to(memory_format=torch.channels_last)
    return x, torch.randint(0, 1000, (batch,), device=dev)


def throughput(ns: argparse.Namespace, dev: torch.device, kind: str) -> list[dict[str, Any]]:
    """Part 1: images/s and memory peak of each configuration beside its analytic price.

    A configuration that fails (out of memory, a missing kernel) is reported
    and skipped: the others still run within the call's minutes."""
    rows = []
    print(f"\n== 1. throughput: one {kind} ({dev}), synthetic data, SGD momentum")
    print(
        f"{'model':18} {'prec':12} {'layout':6} {'batch':>5} {'measured':>10} "
        f"{'predicted':>10} {'pred/meas':>9} {'peak GiB':>9} {'predicted':>9}"
    )
    for model_name, prec, layout, batch in QUICK if ns.quick else ns.throughput:
        precision = prec.split("-")[0]
        on = prec != "fp32-notf32"  # matmuls keep this process's switch (off by default)
        with calib.tf32_switches(on, on and torch.backends.cuda.matmul.allow_tf32):
            try:
                torch.manual_seed(0)
                model = calib.build_model(model_name).to(dev)
                if layout == "nhwc":
                    model = model.to(memory_format=torch.channels_last)
                x, y = inputs(batch, ns.size, layout, dev)
                iters = 3 if ns.quick else 10
                s = timed(train_step(model, x, y, precision), dev, 2 if ns.quick else 8, iters, 3)
                peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
                del model, x, y
                point = Published(
                    model_name,
                    kind,
                    precision,
                    batch,
                    0.0,
                    "measured",
                    fitted=False,
                    image=ns.size,
                    layout=layout,
                    tf32=on,  # predict sets the switches from the point, not from this block
                )
                pred = calib.predict(point)
                # the memory model's peak of one plain step (gradients appear during the
                # backward); the measured peak also holds cuDNN's workspaces
                mem = peak_memory(calib.traced(point), optimizer="momentum", grads_resident=False)
                row = {
                    "model": model_name,
                    "precision": prec,
                    "layout": layout,
                    "batch": batch,
                    "measured_img_s": batch / s,
                    "predicted_img_s": pred,
                    "step_s": s,
                    "peak_bytes": peak,
                    "predicted_peak_bytes": mem,
                }
                rows.append(row)
                print(
                    f"{model_name:18} {prec:12} {layout:6} {batch:5d} {batch / s:10.1f} "
                    f"{pred:10.1f} {pred / (batch / s):9.2f} {peak / 2**30:9.2f} "
                    f"{mem / 2**30:9.2f}",
                    flush=True,
                )
            except Exception as exc:  # one failed configuration must not cost the others
                print(f"{model_name} {prec} {layout} {batch}: FAILED {exc!r}", flush=True)
                rows.append({"model": model_name, "precision": prec, "error": repr(exc)})
            finally:
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(dev)
    return rows


def eager_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int, steps: int) -> Any:
    """The reference: SGD momentum steps over ``m`` micro-batches in order, as eager runs them."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        total = torch.zeros((), device=x.device)
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            loss = F.cross_entropy(model(xm), ym) * (1.0 / m)
            loss.backward()
            total = total + loss.detach()
        losses.append(float(total))
        opt.step()
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def compiled_steps(c: Any, x: torch.Tensor, y: torch.Tensor, steps: int) -> Any:
    """The same steps through the compiled pipeline."""
    opt = torch.optim.SGD(c.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(float(c.train_step(x, y, F.cross_entropy)))
        opt.step()
    return losses, {k: v.detach().cpu() for k, v in c.state_dict().items()}


def pipeline(ns: argparse.Namespace, dev: torch.device) -> list[dict[str, Any]]:
    """Part 2: two stages under three schedules against eager, bit for bit, and one stage's
    overhead; deterministic cuDNN, so that a difference is the runtime's."""
    import torchvision

    rows: list[dict[str, Any]] = []
    print(f"\n== 2. pipeline: crosscut's local runtime on {dev}")
    if dev.type == "cuda" and torch.cuda.device_count() < 2:
        # a cluster lists each GPU once (two stages cannot share cuda:0): one stage only
        print("two stages need two GPUs; this machine has one: the one-stage check alone")
        return [one_stage(ns, dev)]
    devices = [str(dev)] * 2 if dev.type == "cpu" else ["cuda:0", "cuda:1"]
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    batch, m = (8, 2) if ns.quick else (32, 4)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x, y = torch.randn(batch, 3, 64, 64), torch.randint(0, 10, (batch,))
    want = eager_steps(copy.deepcopy(model).to(dev), x.to(dev), y.to(dev), m, 2)
    for schedule in ("1f1b", "zb-h1", "zbv"):
        try:
            c = crosscut.compile(
                copy.deepcopy(model),
                devices,
                x,
                schedule=schedule,
                microbatches=m,
                replicas=1,
                require_all_devices=True,
                time_limit=10,
            )
            got = compiled_steps(c, x, y, 2)
            c.close()
            worst = max(
                float((got[1][k].double() - v.double()).abs().max())
                for k, v in want[1].items()
                if v.is_floating_point()
            )
            exact = got[0] == want[0] and all(torch.equal(got[1][k], v) for k, v in want[1].items())
            rows.append(
                {
                    "schedule": schedule,
                    "bit_exact": exact,
                    "max_abs_diff": worst,
                    "losses": got[0],
                    "eager_losses": want[0],
                }
            )
            print(
                f"resnet18 2 stages M={m} {schedule:6}: bit-exact {exact}, "
                f"largest weight difference {worst:.3g}",
                flush=True,
            )
        except Exception as exc:
            traceback.print_exc()
            rows.append({"schedule": schedule, "error": repr(exc)})
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, ns.benchmark
    rows.append(one_stage(ns, dev))
    return rows


def one_stage(ns: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """One stage compiled vs eager: the runtime's overhead, and the predicted step."""
    model_name, batch = ("resnet18", 4) if ns.quick else ("resnet50", 128)
    try:
        torch.manual_seed(0)
        model = calib.build_model(model_name)
        x, y = inputs(batch, ns.size, "nchw", torch.device("cpu"))
        eager = copy.deepcopy(model).to(dev)
        ex, ey = x.to(dev), y.to(dev)
        c = crosscut.compile(model, [str(dev)], x, replicas=1, time_limit=10)
        opt = torch.optim.SGD(c.parameters(), lr=0.01, momentum=0.9)

        def compiled() -> None:
            opt.zero_grad(set_to_none=True)
            c.train_step(ex, ey, F.cross_entropy)
            opt.step()

        iters = 2 if ns.quick else 10
        t_eager = timed(train_step(eager, ex, ey, "fp32"), dev, 3, iters, 3)
        t_comp = timed(compiled, dev, 3, iters, 3)
        pred = c.plan.predicted.step_time_s
        c.close()
        print(
            f"{model_name} batch {batch} fp32, one stage: eager {t_eager * 1e3:.1f} ms, "
            f"compiled {t_comp * 1e3:.1f} ms ({t_comp / t_eager:.3f}x), predicted "
            f"{pred * 1e3:.1f} ms (predicted/measured {pred / t_comp:.2f})",
            flush=True,
        )
        return {
            "one_stage": model_name,
            "batch": batch,
            "eager_s": t_eager,
            "compiled_s": t_comp,
            "predicted_s": pred,
        }
    except Exception as exc:
        traceback.print_exc()
        return {"one_stage": model_name, "error": repr(exc)}


def profiles(
    ns: argparse.Namespace,
    dev: torch.device,
    kind: str,
    measured: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    save: Callable[[], None],
) -> None:
    """Appends one row per profile to ``rows`` and saves after each: a profile takes
    tens of seconds, and the call's time limit may stop the part midway."""
    print(f"\n== 3. profile: per-node prices on {dev} against the step")
    print(
        f"{'model':16} {'prec':5} {'layout':6} {'batch':>5} {'profiled':>9} {'steps':>9} "
        f"{'analytic':>9} {'took':>6}"
    )
    todo = [("resnet18", "fp32", "nchw", 4)] if ns.quick else ns.profiles
    for model_name, precision, layout, batch in todo:
        try:
            model = calib.build_model(model_name)
            x = torch.empty(batch, 3, ns.size, ns.size, device="meta")
            if layout == "nhwc":
                model = model.to(memory_format=torch.channels_last)
                x = x.to(memory_format=torch.channels_last)
            graph = trace(model, x, mode="train", precision=precision)
            t0 = time.perf_counter()
            table = profile_costs(
                graph,
                dev,
                repeats=3,
                warmup=2,
                cache_dir=ns.out / "profiles",
                optimizer="momentum",
                kind=kind,
            )
            took = time.perf_counter() - t0
            prof = table.total(kind, "train")
            steps = table.meta.get("steps") or [float("nan")]
            an = analytic_costs(graph, Cluster.from_spec(f"1x{kind}"), optimizer="momentum")
            ana = an.total(kind, "train")
            seen = next(
                (
                    r["step_s"]
                    for r in measured
                    if r.get("model") == model_name
                    and r.get("precision") == precision
                    and r.get("layout") == layout
                    and r.get("batch") == batch
                ),
                None,
            )
            per_node = {
                n.name: {
                    "kind": n.kind,
                    "profiled": table.node_time(n.name, kind, True),
                    "analytic": an.node_time(n.name, kind, True),
                }
                for n in graph.nodes
            }
            rows.append(
                {
                    "model": model_name,
                    "precision": precision,
                    "layout": layout,
                    "batch": batch,
                    "profiled_s": prof,
                    "context_steps": steps,
                    "analytic_s": ana,
                    "throughput_step_s": seen,
                    "profile_took_s": took,
                    "nodes": per_node,
                }
            )
            print(
                f"{model_name:16} {precision:5} {layout:6} {batch:5d} {prof * 1e3:7.1f}ms "
                f"{statistics.median(steps) * 1e3:7.1f}ms {ana * 1e3:7.1f}ms {took:5.0f}s",
                flush=True,
            )
        except Exception as exc:
            traceback.print_exc()
            rows.append({"model": model_name, "precision": precision, "error": repr(exc)})
        save()


def detect_kind(dev: torch.device, given: str) -> str:
    """The preset to price with: ``given``, else the GPU matched by name."""
    if given:
        return given
    if dev.type != "cuda":
        return "V100"  # a dry run on the CPU prices a preset all the same
    from crosscut.cost_models.detect import cuda_spec

    return cuda_spec(dev).kind


def main(argv: list[str] | None = None) -> int:
    """Run the parts named by ``--parts``, saving the JSON after each."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--kind", default="", help="preset to price with (default: detected)")
    ap.add_argument("--out", type=Path, default=Path("out/gpu"))
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--parts", default="throughput,pipeline,profile")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: check the code paths")
    ap.add_argument(
        "--throughput",
        type=configs,
        default=THROUGHPUT,
        help="model:precision:layout:batch,..., 'profiles' or 'zoo' (default: ResNet-50 in "
        "every mode, then CNNs whose convolutions achieve less)",
    )
    ap.add_argument("--profiles", type=configs, default=PROFILES,
                    help="model:precision:layout:batch,..., 'profiles' or 'zoo'")  # fmt: skip
    ap.add_argument(
        "--no-cudnn-benchmark", dest="benchmark", action="store_false",
        help="cuDNN's default algorithms: the peaks then hold less workspace",
    )  # fmt: skip
    ns = ap.parse_args(argv)
    if ns.quick:
        ns.size = 32
    dev = torch.device(ns.device)
    ns.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cudnn.benchmark = ns.benchmark
    kind = detect_kind(dev, ns.kind)
    env = {"torch": torch.__version__, "device": str(dev), "kind": kind,
           "cudnn_benchmark": ns.benchmark}  # fmt: skip
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        env |= {
            "name": props.name,
            "sms": props.multi_processor_count,
            "memory": props.total_memory,
            "cudnn": torch.backends.cudnn.version(),
        }
    print(json.dumps(env))
    result: dict[str, Any] = {"env": env}

    def save() -> None:
        (ns.out / "gpu_check.json").write_text(json.dumps(result, indent=1))

    parts = ns.parts.split(",")
    if "throughput" in parts:
        result["throughput"] = throughput(ns, dev, kind)
        save()
    if "pipeline" in parts:
        result["pipeline"] = pipeline(ns, dev)
        save()
    if "profile" in parts:
        result["profile"] = []
        profiles(ns, dev, kind, result.get("throughput", []), result["profile"], save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
