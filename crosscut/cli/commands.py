"""The ``crosscut`` command line: partition, show, verify, profile, bench, diff.

Every command is a thin layer over the Python API. User mistakes (an unknown
model, a bad device spec, a missing or malformed file) end in one line on
stderr and exit code 2 — never a traceback; ``--debug`` shows the traceback
for bug reports.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from crosscut.cli.args import _positive_float, _positive_int, _shape
from crosscut.errors import CrosscutError
from crosscut.fileio import check_writable, write_atomic
from crosscut.ir.schedule import AUTO_SCHEDULE, SCHEDULE_CHOICES
from crosscut.options import OPTIMIZERS
from crosscut.version import __version__

__all__ = ["build_parser", "main"]

if TYPE_CHECKING:
    from crosscut.options import PlanRequest

EXIT_USAGE = 2


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="torchvision:NAME, timm:NAME or path/to/file.py:factory")
    p.add_argument("--batch", type=_positive_int, default=32, help="batch size (default 32)")
    p.add_argument(
        "--input-shape",
        type=_shape,
        default=None,
        help="per-sample input shape CxHxW (default: the model's, e.g. 3x224x224)",
    )
    p.add_argument("--num-classes", type=_positive_int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crosscut",
        description="Split a CNN across devices: partition, draw, verify and replay plans.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on error")
    parser.add_argument("--version", action="version", version=f"crosscut {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _partition_parser(sub)
    _plan_parsers(sub)
    return parser


def _partition_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``crosscut partition``: the model, the cluster and the planner's options."""
    p = sub.add_parser("partition", help="find a plan for a model on a cluster")
    _model_args(p)
    p.add_argument(
        "--devices",
        required=True,
        help="preset spec (4xK20c, 8xH100-nvlink, 32x8xV100), device list (cpu,cpu), cluster "
        "JSON, or torchrun[+NETWORK] (the nodes of the torchrun job this runs in)",
    )
    p.add_argument("--mode", choices=["train", "infer"], default="train")
    p.add_argument("--objective", choices=["throughput", "latency"], default="throughput")
    p.add_argument("--schedule", choices=SCHEDULE_CHOICES, default=AUTO_SCHEDULE)
    p.add_argument(
        "--microbatches",
        type=_positive_int,
        default=None,
        help="micro-batches per step (default: the planner's, per replica layout)",
    )
    p.add_argument(
        "--replicas",
        type=_positive_int,
        default=None,
        help="data-parallel replicas (default: the planner's; data parallelism on every "
        "device is always priced)",
    )
    p.add_argument("--time-limit", type=_positive_float, default=10.0, help="solver seconds")
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="sgd")
    p.add_argument("--cost", choices=["analytic", "profiled"], default="analytic")
    p.add_argument(
        "--measure",
        action="store_true",
        help="with a device list (cpu,cpu): price a CPU at the GEMM, copy and page-fault "
        "rates measured here, and time the links, instead of the presets' (about a second)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cross-shaped",
        action="store_true",
        default=None,
        help="let stages run on device groups split by batch or channels (default: "
        "batch-split groups in the one-replica layout, priced at their shares' batch)",
    )
    p.add_argument(
        "--no-cross-shaped",
        dest="cross_shaped",
        action="store_false",
        help="no device groups: every stage on one device",
    )
    p.add_argument(
        "--no-colocate",
        action="store_true",
        help="with --cross-shaped: one stage per device (for `crosscut run`)",
    )
    p.add_argument(
        "--recompute",
        choices=["auto", "never", "always"],
        default="auto",
        help="recompute activations in backward: auto = where it makes a plan fit or faster",
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="price and run ops under autocast with this dtype",
    )
    p.add_argument("-o", "--output", required=True, help="where to write plan.json")


def _plan_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The commands that read, run or measure a plan: show, verify, profile, bench, run, diff."""
    p = sub.add_parser("show", help="draw a plan (html, svg, png, dot) or print its summary")
    p.add_argument("plan")
    p.add_argument("-o", "--output", help="out.html | out.svg | out.png | out.dot")

    p = sub.add_parser("verify", help="run a plan on CPU devices and compare with eager")
    _model_args(p)
    p.add_argument("--plan", required=True)

    p = sub.add_parser("profile", help="measure per-node costs on a real device")
    _model_args(p)
    p.add_argument("--devices", default="cpu")
    p.add_argument("--mode", choices=["train", "infer"], default="train")
    p.add_argument("-o", "--output", required=True, help="where to write the cost table JSON")

    p = sub.add_parser(
        "bench", help="measure a plan's step time on CPU and compare with the prediction"
    )
    _model_args(p)
    p.add_argument("--plan", required=True)
    p.add_argument("--steps", type=_positive_int, default=3)

    p = sub.add_parser(
        "run",
        help="launch a training script under torchrun, one process per plan stage",
        add_help=False,
    )
    p.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="--plan plan.json [--replicas R] [--nnodes N ...] script.py [args]",
    )

    p = sub.add_parser("diff", help="say what moved between two plans")
    p.add_argument("a")
    p.add_argument("b")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        # `run` passes everything through to the launcher (argparse's REMAINDER
        # would swallow or reject leading options such as --plan or --help)
        from crosscut.cli.launch import run_main

        try:
            return run_main(argv[1:])
        except CrosscutError as exc:
            print(f"crosscut: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = _COMMANDS[args.command]
    try:
        out = getattr(args, "output", None)
        if out:  # a path that can never be written fails now, not after the work
            check_writable(out, f"the {args.command} output")
        return handler(args)
    except CrosscutError as exc:
        if args.debug:
            raise
        print(f"crosscut: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("crosscut: interrupted", file=sys.stderr)
        return 130


# ---- commands ---------------------------------------------------------------------------


def _console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def _load(args: argparse.Namespace, *, meta: bool = False) -> tuple[Any, Any]:
    """The model and an example batch for ``args.model`` / ``--batch`` / ``--input-shape``.

    ``meta``: the batch only gives shapes (planning), so nothing is allocated: a
    global batch of 8,192 images for a cluster of nodes costs no memory.
    """
    import torch

    from crosscut.cli.model_refs import default_input_shape, example_batch, load_model

    model = load_model(args.model, num_classes=args.num_classes)
    shape = args.input_shape or default_input_shape(args.model)
    if meta:
        return model, torch.empty((args.batch, *shape), device="meta")
    return model, example_batch(tuple(shape), args.batch)


def _plan_request(args: argparse.Namespace) -> PlanRequest:
    """The planning options the command line gave: every PlanRequest field it has a flag for."""
    from crosscut.options import PLAN_FIELDS, PlanRequest

    given = {name: getattr(args, name) for name in PLAN_FIELDS if hasattr(args, name)}
    return PlanRequest(**given, colocate=not args.no_colocate)


def _cmd_partition(args: argparse.Namespace) -> int:
    import crosscut
    from crosscut.viz import print_summary

    console = _console()
    with console.status(f"tracing {args.model} ...") as status:
        model, x = _load(args, meta=True)
        t0 = time.perf_counter()

        def progress(wall: float, objective: float, bound: float) -> None:
            gap = (objective - bound) / objective if objective > 0 else 0.0
            status.update(
                f"solving: incumbent {objective * 1e3:.3f} ms, bound {bound * 1e3:.3f} ms, "
                f"gap {gap:.1%}, {wall:.1f} s"
            )

        devices = _measured(args.devices) if args.measure else args.devices
        status.update("tracing, pricing and solving ...")
        plan = crosscut.partition(
            model,
            devices,
            x,
            model_name=args.model,
            progress=progress,
            options=_plan_request(args),
        )
    plan.save(args.output)
    print_summary(plan)
    console.print(f"plan written to {args.output} in {time.perf_counter() - t0:.1f} s")
    return 0


def _measured(devices: str) -> Any:
    """The cluster of the device list ``devices``, its CPU rates and links timed here."""
    from crosscut.cost_models.cluster import Cluster
    from crosscut.errors import DeviceError

    listed = Cluster.from_any(devices).meta.get("detected")
    if not listed:
        raise DeviceError(
            "--measure times the devices of this machine: it needs a device list",
            value=devices,
            remedy="pass --devices cpu,cpu (or cuda:0,cuda:1), or drop --measure",
        )
    return Cluster.from_devices(listed, measure=True)


def _cmd_show(args: argparse.Namespace) -> int:
    from crosscut.ir.plan import Plan
    from crosscut.partitioner.validate import validate_plan
    from crosscut.viz import print_summary, render

    plan = Plan.load(args.plan)
    validate_plan(plan)
    if args.output:
        out = render(plan, args.output)
        _console().print(f"wrote {out}")
    else:
        print_summary(plan)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from crosscut.verify import verify_plan

    model, x = _load(args)
    report = verify_plan(model, x, args.plan)
    print(report.text())
    return 0 if report.ok else 1


def _cmd_profile(args: argparse.Namespace) -> int:
    import crosscut
    from crosscut.cost_models.cluster import Cluster
    from crosscut.cost_models.profiled import profile_costs

    model, x = _load(args)
    cluster = Cluster.from_any(args.devices)
    graph = crosscut.trace(model, x, mode=args.mode)
    device = cluster.devices[0]
    table = profile_costs(graph, device.device, kind=device.kind)
    write_atomic(args.output, table.to_json(), "the profile")
    _console().print(f"profiled {len(graph)} nodes on {device.device}; wrote {args.output}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from crosscut.verify import bench_plan

    model, x = _load(args)
    print(bench_plan(model, x, args.plan, steps=args.steps).text())
    return 0


def _cmd_diff(args: argparse.Namespace) -> int:
    from crosscut.ir.plan import Plan
    from crosscut.partitioner.diff import diff_plans

    print(diff_plans(Plan.load(args.a), Plan.load(args.b)))
    return 0


_COMMANDS = {
    "partition": _cmd_partition,
    "show": _cmd_show,
    "verify": _cmd_verify,
    "profile": _cmd_profile,
    "bench": _cmd_bench,
    "diff": _cmd_diff,
}
