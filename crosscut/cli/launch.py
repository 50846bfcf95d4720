"""``crosscut run --plan plan.json script.py ...``: start one process per plan device × replica.

Why a wrapper around torchrun: the plan already knows how many processes the
job needs (plan devices × replicas: one per stage, or one per device of a
stage's channel/batch-split group), so asking the user for ``--nproc-per-node``
invites a mismatch; and a rendezvous port that is already taken makes
torchrun fail with a long traceback after a wait, while a check up front can
name the port and the remedy in one line. The wrapper hands the plan path to
every rank in ``CROSSCUT_PLAN`` (read by
:func:`crosscut.distributed.compile_distributed`).

A failed job ends in one line, not torchrun's 30-line ``ChildFailedError``
traceback: every rank's output is shown as it comes, its stderr lines tagged
with the rank (torchrun's ``--tee 2``; stdout stays as the script wrote it),
and torchrun's own failure report is kept in the job's log directory, which
that last line names with the rank that failed first and its exit code.

Multi-node: run it once per node with the same ``--nnodes``, ``--host`` and
``--port`` and its own ``--node-rank``; node 0 hosts the c10d rendezvous.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from crosscut.cli.args import _nonnegative_int, _port, _positive_float, _positive_int
from crosscut.errors import CrosscutError, DistributedError, InputError
from crosscut.fileio import check_writable

__all__ = ["build_command", "check_port_free", "free_port", "parse_args", "run_main"]

DEFAULT_PORT = 29500


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free right now on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Raise :class:`DistributedError` naming ``port`` when something already listens on it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise DistributedError(
                f"the rendezvous port {port} on {host} is already in use ({exc.strerror})",
                value=port,
                remedy=f"pass --port with a free port (e.g. --port {free_port(host)}, or "
                "--port 0 to pick one), or stop the process listening on it "
                f"(`ss -ltnp 'sport = :{port}'`)",
            ) from exc


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="crosscut run",
        description="Run a training script with one process per plan device and replica.",
    )
    ap.add_argument("--plan", required=True, help="plan JSON (from `crosscut partition`)")
    ap.add_argument(
        "--replicas",
        type=_positive_int,
        default=None,
        help="data-parallel pipeline copies (default: the plan's, 1 for one-node plans)",
    )
    ap.add_argument(
        "--nnodes", type=_positive_int, default=1, help="number of nodes (launch once each)"
    )
    ap.add_argument(
        "--node-rank", type=_nonnegative_int, default=0, help="this node's index, 0..nnodes-1"
    )
    ap.add_argument("--host", default="127.0.0.1", help="rendezvous host (node 0)")
    ap.add_argument("--port", type=_port, default=DEFAULT_PORT, help="rendezvous port; 0 = pick")
    ap.add_argument(
        "--timeout", type=_positive_float, default=300.0, help="per-wait timeout (seconds)"
    )
    ap.add_argument(
        "--log-dir",
        default=None,
        help="where each rank's log and torchrun's failure report go (default: a new "
        "temporary directory, removed when the job succeeds)",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the torchrun command only")
    ap.add_argument("script", help="the training script")
    ap.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return ap.parse_args(list(argv))


def build_command(ns: argparse.Namespace, devices: int) -> list[str]:
    """The torchrun command line for this node (plain data, so tests can read it).

    ``devices`` is the processes of one replica: the plan's stages, with a
    channel/batch-split stage counted once per device of its group.
    """
    total = devices * ns.replicas
    if ns.replicas < 1 or ns.nnodes < 1 or not 0 <= ns.node_rank < ns.nnodes:
        raise InputError(
            "replicas and nnodes must be >= 1 and node-rank in 0..nnodes-1",
            value={"replicas": ns.replicas, "nnodes": ns.nnodes, "node_rank": ns.node_rank},
        )
    if total % ns.nnodes:
        step = ns.nnodes // math.gcd(devices, ns.nnodes)
        raise InputError(
            f"the processes, plan devices × replicas = {devices} × {ns.replicas} = {total} "
            "(one per device of each stage's group), must split evenly over the nodes, "
            f"but {total} does not divide by --nnodes {ns.nnodes}",
            value={
                "plan_devices": devices,
                "replicas": ns.replicas,
                "processes": total,
                "nnodes": ns.nnodes,
            },
            remedy=f"use --nnodes in {[n for n in range(1, total + 1) if total % n == 0]}, "
            f"or --replicas a multiple of {step} to keep --nnodes {ns.nnodes}",
        )
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(ns.nnodes),
        "--node-rank", str(ns.node_rank),
        "--nproc-per-node", str(total // ns.nnodes),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{ns.host}:{ns.port}",
        "--rdzv-id", f"crosscut-{ns.port}",
        "--max-restarts", "0",
        "--tee", "2",  # stderr lines reach the console tagged "[default<rank>]:"
        "--log-dir", str(ns.log_dir),
        ns.script, *ns.script_args,
    ]  # fmt: skip


def run_main(argv: Sequence[str]) -> int:
    """Entry point of ``crosscut run``; returns the job's exit status (2 for bad usage)."""
    from crosscut.ir.plan import Plan

    try:
        ns = parse_args(argv)
        plan = Plan.load(ns.plan)
        if ns.replicas is None:  # the layout the planner chose (strategy.py)
            ns.replicas = plan.replication.replicas
        if ns.port == 0:
            if ns.nnodes > 1:
                raise InputError(
                    "--port 0 (pick a free port) works on one node only",
                    remedy="give every node the same explicit --port",
                )
            ns.port = free_port(ns.host)
        if ns.node_rank == 0:
            check_port_free(ns.port, ns.host)
        # one process per plan device of each replica: a channel/batch group has one per member;
        # an interleaved plan's stages share devices, round-robin (one rank runs V stages)
        from crosscut.ir.schedule import workers

        ranks = sum(
            len(st.devices) if st.split in ("channel", "batch") else 1
            for st in plan.stages[: workers(plan.options.schedule, plan.num_stages)]
        )
        own_logs = ns.log_dir is None
        if own_logs:
            ns.log_dir = tempfile.mkdtemp(prefix="crosscut-run-")
        else:
            check_writable(Path(ns.log_dir) / "torchrun-report.txt", "the job's logs")
            try:
                Path(ns.log_dir).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise InputError(
                    f"--log-dir must be a folder crosscut can create: {exc.strerror or exc}",
                    value=ns.log_dir,
                    remedy="choose a writable folder, or leave --log-dir out",
                ) from exc
        cmd = build_command(ns, ranks)
    except CrosscutError as exc:
        print(f"crosscut run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["CROSSCUT_PLAN"] = str(Path(ns.plan).resolve())
    env["CROSSCUT_REPLICAS"] = str(ns.replicas)
    env["CROSSCUT_TIMEOUT_S"] = str(ns.timeout)
    env.setdefault("OMP_NUM_THREADS", "1")
    if ns.dry_run:
        print(" ".join(cmd))
        if own_logs:  # the printed command names it; torchrun makes it again when run
            shutil.rmtree(ns.log_dir, ignore_errors=True)
        return 0
    rc = _supervise(cmd, env, Path(ns.log_dir))
    if rc == 0 and own_logs:
        shutil.rmtree(ns.log_dir, ignore_errors=True)
    return rc


# torchrun's own lines once a rank has failed: its error log line, then the traceback
# of its ChildFailedError and the report; kept in a file rather than shown
_AGENT_FAILED = re.compile(r"elastic/multiprocessing/api\.py:\d+\] failed \(exitcode")
_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def _supervise(cmd: list[str], env: dict[str, str], log_dir: Path) -> int:
    """Run torchrun, pass its ranks' lines through, and end a failure in one line."""
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace")
    assert proc.stderr is not None
    report: list[str] = []
    for line in proc.stderr:
        if report or (_AGENT_FAILED.search(line) and not line.startswith("[default")):
            report.append(line)
            continue
        sys.stderr.write(line)
        sys.stderr.flush()
    rc = proc.wait()
    if rc == 0:
        return 0
    text = "".join(report)
    (log_dir / "torchrun-report.txt").write_text(text)
    cause = _ROOT_CAUSE.search(text)
    who = (
        f"rank {cause.group(1)} failed first (exit code {cause.group(2)})"
        if cause
        else (f"torchrun exited with code {rc}")
    )
    print(
        f"crosscut run: the job failed: {who}; its error is above (lines tagged "
        f"[default<rank>]); torchrun's report and each rank's log: {log_dir}",
        file=sys.stderr,
    )
    return rc
