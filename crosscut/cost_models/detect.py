"""Detection: this machine's devices, and the nodes of a torchrun job.

Why a module apart from :mod:`crosscut.cost_models.cluster`: what is detected
comes from the process's surroundings (``torch.cuda``, torchrun's environment)
rather than from a spec, and its rules are the launcher's, not the cluster's.
:meth:`crosscut.cost_models.cluster.Cluster.detect` builds the cluster from what this
module reads.

Under torchrun every rank sees (``torch/distributed/run.py``; the agent sets
them in ``elastic/agent/server/local_elastic_agent.py``):

* ``WORLD_SIZE``: ranks in the whole job;
* ``LOCAL_WORLD_SIZE``: ranks on this node (``--nproc-per-node``), the same on
  every node (torchrun supports homogeneous nodes only);
* ``GROUP_WORLD_SIZE``: agents in the rendezvous, one per node (``--nnodes``);
  ``GROUP_RANK``: this node's index;
* ``ROLE_WORLD_SIZE``: ranks of this role, the world for a one-role job (not used).

So a job is ``GROUP_WORLD_SIZE`` nodes of ``LOCAL_WORLD_SIZE`` devices (one
rank per device), and ``WORLD_SIZE = GROUP_WORLD_SIZE × LOCAL_WORLD_SIZE``
must hold; other launchers that set only ``WORLD_SIZE`` and
``LOCAL_WORLD_SIZE`` give ``WORLD_SIZE // LOCAL_WORLD_SIZE`` nodes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from crosscut.cost_models.devices import DeviceSpec, preset
from crosscut.cost_models.links import measure_matmul_flops
from crosscut.errors import DeviceError

__all__ = ["TorchrunEnv", "cuda_spec", "parse_device", "preset_for_name", "torchrun_env"]

_GPU_NAME_HINTS = [  # substring of torch.cuda device name -> preset kind (first match wins)
    ("H200", "H200"),
    ("H100 PCIe", "H100-PCIe"),
    ("H100", "H100"),
    ("A100-PCIE", "A100-PCIe-80GB"),
    ("A100 80GB PCIe", "A100-PCIe-80GB"),
    ("A100", "A100-80GB"),
    ("RTX 6000 Ada", "RTX6000Ada"),
    ("RTX A6000", "RTXA6000"),
    ("RTX 8000", "RTX8000"),
    ("RTX 4090", "RTX4090"),
    ("RTX 3090", "RTX3090"),
    ("L40S", "L40S"),
    ("L4", "L4"),
    ("A40", "A40"),
    ("A10", "A10"),
    ("T4", "T4"),
    ("V100", "V100"),
    ("P100", "P100"),
    ("P40", "P40"),
    ("K20", "K20c"),
]
_LAUNCH_REMEDY = (
    "start the program with torchrun or `crosscut run` (which set them), or describe the "
    "cluster with a spec such as '2x8xV100'"
)


@dataclass(frozen=True)
class TorchrunEnv:
    """A torchrun job's shape as this rank sees it: ``nodes × local_world_size`` ranks."""

    world_size: int
    local_world_size: int
    nodes: int
    node_rank: int
    local_rank: int


def _int_var(env: Mapping[str, str], name: str, *, minimum: int) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise DeviceError(
            f"torchrun's {name} must be an integer >= {minimum}",
            value={name: raw},
            remedy=_LAUNCH_REMEDY,
        )
    return value


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv:
    """The job's nodes and ranks from torchrun's variables (``os.environ`` by default).

    Raises :class:`DeviceError` naming the variables when they are missing or
    disagree (``WORLD_SIZE`` not ``nodes × LOCAL_WORLD_SIZE``).
    """
    env = os.environ if environ is None else environ
    world = _int_var(env, "WORLD_SIZE", minimum=1)
    local = _int_var(env, "LOCAL_WORLD_SIZE", minimum=1)
    seen = {k: env[k] for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE") if k in env}
    if world is None or local is None:
        missing = [k for k, v in (("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", local)) if v is None]
        raise DeviceError(
            f"detecting a torchrun job's nodes needs WORLD_SIZE and LOCAL_WORLD_SIZE; "
            f"{' and '.join(missing)} unset",
            value=seen or None,
            remedy=_LAUNCH_REMEDY,
        )
    groups = _int_var(env, "GROUP_WORLD_SIZE", minimum=1)
    if world % local:
        raise DeviceError(
            f"WORLD_SIZE ({world}) must be a multiple of LOCAL_WORLD_SIZE ({local}): "
            "every node runs the same number of ranks",
            value=seen,
            remedy="launch every node with the same --nproc-per-node",
        )
    nodes = world // local
    if groups is not None and groups != nodes:
        raise DeviceError(
            f"WORLD_SIZE ({world}) must be GROUP_WORLD_SIZE × LOCAL_WORLD_SIZE "
            f"({groups} × {local} = {groups * local}): one torchrun agent per node",
            value=seen,
            remedy="start one torchrun per node, each with the same --nproc-per-node",
        )
    node_rank = _int_var(env, "GROUP_RANK", minimum=0) or 0
    local_rank = _int_var(env, "LOCAL_RANK", minimum=0) or 0
    if node_rank >= nodes or local_rank >= local:
        raise DeviceError(
            f"GROUP_RANK must be below the node count ({nodes}) and LOCAL_RANK below "
            f"LOCAL_WORLD_SIZE ({local})",
            value={"GROUP_RANK": node_rank, "LOCAL_RANK": local_rank, **seen},
            remedy=_LAUNCH_REMEDY,
        )
    return TorchrunEnv(world, local, nodes, node_rank, local_rank)


def parse_device(d: str | torch.device) -> torch.device:
    """A torch.device that exists here, or DeviceError with the devices that do."""
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    avail = ["cpu"] + [f"cuda:{i}" for i in range(n_gpu)]
    try:
        dev = torch.device(d)
    except (RuntimeError, TypeError, ValueError):
        raise DeviceError(
            "a device is 'cpu' or 'cuda:<index>'", value=d, remedy=f"available here: {avail}"
        ) from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise DeviceError(
            "only 'cpu' and 'cuda:<index>' devices are supported",
            value=str(d),
            remedy=f"available here: {avail}",
        )
    index = dev.index if dev.index is not None else (torch.cuda.current_device() if n_gpu else 0)
    if index >= n_gpu:
        raise DeviceError(
            "the device must exist on this machine", value=str(d), remedy=f"available here: {avail}"
        )
    return torch.device("cuda", index)


def preset_for_name(gpu: str, memory: int) -> str | None:
    """The preset of a GPU ``torch.cuda`` names ``gpu`` (``"NVIDIA H100 PCIe"``), with
    ``memory`` bytes (an A100's 40 or 80 GB); ``None`` for a GPU without one."""
    for hint, kind in _GPU_NAME_HINTS:  # a whole token: "A10" is not "A100", "L4" not "L40"
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(hint)}(?![A-Za-z0-9])", gpu):
            return kind.replace("80GB", "40GB") if memory < 60 * 10**9 else kind
    return None


def cuda_spec(dev: torch.device) -> DeviceSpec:
    """A preset matched by GPU name with the real memory size; unknown GPUs get a measured peak."""
    props = torch.cuda.get_device_properties(dev)
    name = f"cuda:{dev.index}"
    kind = preset_for_name(props.name, int(props.total_memory))
    if kind is not None:
        base = preset(kind, name, name)
        return DeviceSpec(
            base.name,
            base.kind,
            name,
            dict(base.peak_flops),
            base.mem_bw,
            int(props.total_memory),
            base.launch_overhead_s,
        )
    peak = measure_matmul_flops(dev)
    kind = re.sub(r"[^A-Za-z0-9]+", "-", props.name).strip("-")
    return DeviceSpec(name, kind, name, {"float32": peak}, 500e9, int(props.total_memory), 5e-6)
