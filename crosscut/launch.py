"""``crosscut run --plan plan.json script.py ...``: start one process per plan device × replica.

Why a wrapper around torchrun: the plan already knows how many processes the
job needs (plan devices × replicas: one per stage, or one per device of a
stage's channel/batch-split group), so asking the user for ``--nproc-per-node``
invites a mismatch; and a rendezvous port that is already taken makes
torchrun fail with a long traceback after a wait, while a check up front can
name the port and the remedy in one line. The wrapper hands the plan path to
every rank in ``CROSSCUT_PLAN`` (read by
:func:`crosscut.distributed.compile_distributed`).

Multi-node: run it once per node with the same ``--nnodes``, ``--host`` and
``--port`` and its own ``--node-rank``; node 0 hosts the c10d rendezvous.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from crosscut.cli_args import _nonnegative_int, _port, _positive_float, _positive_int
from crosscut.errors import CrosscutError, DistributedError, InputError

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
        "--replicas", type=_positive_int, default=1, help="data-parallel pipeline copies"
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
        ns.script, *ns.script_args,
    ]  # fmt: skip


def run_main(argv: Sequence[str]) -> int:
    """Entry point of ``crosscut run``; returns the job's exit status (2 for bad usage)."""
    from crosscut.partitioner.plan import Plan

    try:
        ns = parse_args(argv)
        plan = Plan.load(ns.plan)
        if ns.port == 0:
            if ns.nnodes > 1:
                raise InputError(
                    "--port 0 (pick a free port) works on one node only",
                    remedy="give every node the same explicit --port",
                )
            ns.port = free_port(ns.host)
        if ns.node_rank == 0:
            check_port_free(ns.port, ns.host)
        # one process per plan device of each replica: a channel/batch group has one per member
        ranks = sum(
            len(st.devices) if st.split in ("channel", "batch") else 1 for st in plan.stages
        )
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
        return 0
    return subprocess.run(cmd, env=env, check=False).returncode
