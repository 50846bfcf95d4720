"""One node of several device kinds from one spec string: ``"6xV100,1xK20c"``.

Heterogeneous clusters are where the order of the devices in the pipeline
matters (``partitioner/solvers/orders.py``); a cluster JSON file describes
any of them, and this spelling covers the common case on the command line:
comma-separated ``NxKIND[-TOPOLOGY]`` parts, GPUs numbered ``gpu0``,
``gpu1``, ... (``cuda:0``, ...) across the parts in order, CPU cores
``cpu0``, ... (``"4xA100-80GB,2xcpu"``). The node's links: the parts' common
topology when they share one (``"4xV100,4xA100-80GB"``: NVLink), else PCIe
(a GPU and a CPU core, or cards of different generations, meet over PCIe).
"""

from __future__ import annotations

import re

from crosscut.cost_models.devices import DeviceSpec, cpu_spec, preset, preset_names
from crosscut.cost_models.links import DEFAULT_TOPOLOGY, TOPOLOGIES
from crosscut.errors import DeviceError

__all__ = ["mixed_devices"]

_PART_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*([^\s,]+?)\s*$")


def mixed_devices(spec: str) -> tuple[list[DeviceSpec], str]:
    """The devices of ``spec`` (module docstring) and the node's topology."""
    parts: list[tuple[int, DeviceSpec, str]] = []
    for text in spec.split(","):
        m = _PART_RE.match(text)
        if not m or int(m.group(1)) < 1:
            raise DeviceError(
                "a spec of several kinds reads 'NxKIND,NxKIND,...' (N >= 1 each)",
                value=spec,
                remedy=f"e.g. '6xV100,1xK20c' or '4xA100-80GB,2xcpu'; kinds: {preset_names()}",
            )
        kind, topo = m.group(2), None
        for t in TOPOLOGIES:
            if kind.lower().endswith("-" + t):
                kind, topo = kind[: -len(t) - 1], t
        base = preset(kind)  # raises, listing the presets
        parts.append((int(m.group(1)), base, topo or DEFAULT_TOPOLOGY.get(base.kind, "pcie")))
    cpus = sum(n for n, base, _ in parts if base.kind == "cpu")
    devices: list[DeviceSpec] = []
    gpu = cpu = 0
    for n, base, _ in parts:
        for _ in range(n):
            if base.kind == "cpu":
                devices.append(cpu_spec(f"cpu{cpu}", share=cpus))
                cpu += 1
            else:
                devices.append(base.renamed(f"gpu{gpu}", f"cuda:{gpu}"))
                gpu += 1
    topologies = {t for _, _, t in parts}
    return devices, topologies.pop() if len(topologies) == 1 else "pcie"
