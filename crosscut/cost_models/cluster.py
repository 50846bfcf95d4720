"""Cluster: the devices a model may be split across and the links between them.

A cluster is plain data, built from a spec string (``"4xK20c"``,
``"8xH100-nvlink"``), a list of real devices (``["cuda:0", "cuda:1"]``,
``["cpu", "cpu"]``), an int (the first N GPUs), a JSON file, or a torchrun
job's environment (``"torchrun"``: :meth:`Cluster.detect`). Default topology per kind:
V100, A100, H100 and H200 (SXM) on NVLink, as DGX/HGX boards ship them; every other
GPU on PCIe (K20c and P40 in Mariana's two-switch layout); ``cpu`` on shared memory.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from crosscut.cost_models.detect import cuda_spec, parse_device, torchrun_env
from crosscut.cost_models.devices import DeviceSpec, cpu_spec, preset, preset_names
from crosscut.cost_models.links import (
    DEFAULT_NETWORK,
    DEFAULT_TOPOLOGY,
    NETWORKS,
    TOPOLOGIES,
    default_link,
    measure_cpu_rates,
    measure_link,
    measure_page_fault_rate,
    network_link,
)
from crosscut.cost_models.mixed_node import mixed_devices
from crosscut.errors import DeviceError
from crosscut.fileio import parse_json, read_json, write_atomic

__all__ = ["DEFAULT_TOPOLOGY", "Cluster", "ClusterLike"]

_SPEC_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(.+?)\s*$")
# "NODESxGPUSxKIND[-TOPOLOGY][+[NICSx]NETWORK]", e.g. "32x8xV100", "4x8xH100+8xib400"
_NODES_RE = re.compile(
    r"^\s*(\d+)\s*[xX]\s*(\d+)\s*[xX]\s*([^+\s]+?)(?:\+(?:(\d+)[xX])?(\w+))?\s*$"
)
_TORCHRUN_RE = re.compile(r"^\s*torchrun(?:\+(\w+))?\s*$", re.I)  # "torchrun[+NETWORK]"
_KINDS = {k.lower() for k in preset_names()}  # preset names, as a spec may spell them


@dataclass
class Cluster:
    """Devices plus ``bandwidth[src][dst]`` (bytes/s) and ``latency[src][dst]`` (s).

    The diagonal is unused (a device does not send to itself); it is kept at the
    device's memory bandwidth and zero latency so the matrices stay square.
    """

    devices: list[DeviceSpec]
    bandwidth: list[list[float]]
    latency: list[list[float]]
    topology: str = "custom"
    meta: dict[str, Any] = field(default_factory=dict)
    name: str = ""  # how plans and reports label the cluster, e.g. the spec string
    # identical nodes of these devices, joined by ``network`` (bytes/s, latency s) per
    # node: ``devices`` and the matrices describe ONE node, so a 2,048-GPU cluster is an
    # 8x8 matrix and a count, never a 2,048x2,048 one
    nodes: int = 1
    network: tuple[float, float] = (0.0, 0.0)
    network_name: str = ""
    nics: int = 1  # network interfaces per node, ``network`` each (8 on DGX A100/H100)

    @property
    def total_devices(self) -> int:
        """Devices in every node together."""
        return self.nodes * len(self.devices)

    # ---- lookups -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.devices)

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.devices]

    @property
    def kinds(self) -> list[str]:
        """Distinct device kinds, in device order (what a CostTable is keyed by)."""
        return list(dict.fromkeys(d.kind for d in self.devices))

    def index(self, name: str) -> int:
        for i, d in enumerate(self.devices):
            if d.name == name:
                return i
        raise DeviceError(
            "a device name must exist in the cluster", value=name, remedy=f"use one of {self.names}"
        )

    def same_node(self, a: int, b: int) -> bool:
        """Whether devices ``a`` and ``b`` (indices over every node, node by node) share one."""
        return a // len(self.devices) == b // len(self.devices)

    def transfer_time(self, src: int, dst: int, nbytes: int) -> float:
        """Seconds to send ``nbytes`` from device ``src`` to ``dst`` (0 on the same device).

        Indices run over every node (``0 .. total_devices - 1``, node by node): one node's
        devices use its links, two nodes' the network. O(1), no matrix built."""
        if src == dst:
            return 0.0
        g = len(self.devices)
        if src // g != dst // g:
            return self.network[1] + nbytes / self.network[0]
        return self.latency[src % g][dst % g] + nbytes / self.bandwidth[src % g][dst % g]

    # ---- invariants ----------------------------------------------------------------
    def validate(self) -> None:
        """Square matrices of the device count, positive bandwidth, latency >= 0, unique names."""
        n = len(self.devices)
        if n == 0:
            raise DeviceError(
                "a cluster needs at least one device",
                value=[],
                remedy="list devices or use '2xcpu'",
            )
        seen: set[str] = set()
        for d in self.devices:
            if d.name in seen:
                raise DeviceError(
                    "device names in a cluster are unique", value=d.name, remedy="rename one"
                )
            seen.add(d.name)
            d.validate()
        for label, mat in (("bandwidth", self.bandwidth), ("latency", self.latency)):
            if len(mat) != n or any(len(row) != n for row in mat):
                raise DeviceError(
                    f"{label} must be a {n}x{n} matrix (one row and column per device)",
                    value=[len(row) for row in mat],
                    remedy="give one entry per (src, dst) device pair",
                )
        for i in range(n):
            for j in range(n):
                bw, lat = self.bandwidth[i][j], self.latency[i][j]
                pair = f"{self.devices[i].name}->{self.devices[j].name}"
                if not bw > 0:  # also rejects NaN
                    raise DeviceError(f"bandwidth[{i}][{j}] ({pair}) must be positive", value=bw)
                if not lat >= 0:
                    raise DeviceError(f"latency[{i}][{j}] ({pair}) must be >= 0", value=lat)
        if not (isinstance(self.nodes, int) and self.nodes >= 1):
            raise DeviceError("a cluster has at least one node", value=self.nodes)
        if not (isinstance(self.nics, int) and self.nics >= 1):
            raise DeviceError("a node has at least one NIC", value=self.nics, remedy="nics: 1")
        if self.nodes > 1 and not (self.network[0] > 0 and self.network[1] >= 0):
            raise DeviceError(
                "a cluster of several nodes needs a network: positive bandwidth, latency >= 0",
                value=self.network,
                remedy=f"e.g. Cluster.from_spec('2x8xV100+ib100'); networks: {sorted(NETWORKS)}",
            )

    # ---- builders ------------------------------------------------------------------
    @classmethod
    def from_specs(cls, devices: Sequence[DeviceSpec], topology: str) -> Cluster:
        """Fill the link matrices from presets for ``topology``.

        ``pcie`` follows Mariana: the first half of the devices hang off one PCIe
        switch (under CPU 0), the rest off another (under CPU 1); pairs on the
        same switch get the switch rate, pairs across it pay the QPI hop.
        """
        if topology not in TOPOLOGIES:
            raise DeviceError(
                "a topology must be one of the known names",
                value=topology,
                remedy=f"use one of {TOPOLOGIES}",
            )
        n = len(devices)
        half = (n + 1) // 2
        bw = [[0.0] * n for _ in range(n)]
        lat = [[0.0] * n for _ in range(n)]
        for i, a in enumerate(devices):
            for j, b in enumerate(devices):
                if i == j:
                    bw[i][j], lat[i][j] = a.mem_bw, 0.0
                    continue
                kind = a.kind if a.kind == b.kind else min(a.kind, b.kind)
                same = (i < half) == (j < half)
                bw[i][j], lat[i][j] = default_link(
                    kind, topology, same_switch=same, mem_bw=min(a.mem_bw, b.mem_bw)
                )
        cluster = cls(list(devices), bw, lat, topology)
        cluster.validate()
        return cluster

    @classmethod
    def from_nodes_spec(cls, spec: str) -> Cluster:
        """Parse ``"NODESxGPUSxKIND[-TOPOLOGY][+[NICSx]NETWORK]"``: nodes on a network.

        ``"32x8xV100"`` is 32 nodes of 8 V100 on NVLink, joined by the kind's
        usual network (``DEFAULT_NETWORK``: ib100 for V100); ``+ib200``,
        ``+eth25`` ... name another (``NETWORKS``), ``+8xib200`` eight NICs of it
        per node (the all-reduce uses them all: partitioner/replicas.py).
        """
        m = _NODES_RE.match(spec)
        if not m:
            raise DeviceError(
                "a multi-node cluster spec reads 'NODESxGPUSxKIND[+NETWORK]'",
                value=spec,
                remedy=f"e.g. '32x8xV100' or '4x8xA100-80GB+ib400'; networks: {sorted(NETWORKS)}",
            )
        nodes, per_node, kind, net = int(m.group(1)), int(m.group(2)), m.group(3), m.group(5)
        if nodes < 1 or per_node < 1:
            raise DeviceError(
                "a multi-node spec needs at least one node of at least one device",
                value=spec,
                remedy="e.g. '2x8xV100'",
            )
        # CPUs on several nodes are torchrun's processes: gloo on loopback inside a node too
        node = cls.from_spec(f"{per_node}x{kind}" + ("-gloo" if kind.lower() == "cpu" else ""))
        base_kind = node.devices[0].kind
        net = net or DEFAULT_NETWORK.get(base_kind, "eth25")
        if net not in NETWORKS:
            raise DeviceError(
                "a network must be one of the known names",
                value=net,
                remedy=f"use one of {sorted(NETWORKS)}",
            )
        node.nodes, node.network_name = nodes, net
        node.network = network_link(net, base_kind)
        node.nics, node.name, node.meta["spec"] = int(m.group(4) or 1), spec.strip(), spec
        return node

    @classmethod
    def from_spec(cls, spec: str) -> Cluster:
        """Parse ``"NxKIND[-TOPOLOGY]"`` (one node) or ``"NODESxGPUSxKIND[+NETWORK]"``.

        E.g. ``"4xK20c"``, ``"8xH100-nvlink"``, ``"4xV100-pcie"``, ``"2xcpu"`` (threads),
        ``"2xcpu-gloo"`` (processes on loopback, as torchrun runs CPU ranks),
        ``"32x8xV100+ib100"`` (:meth:`from_nodes_spec`), ``"6xV100,1xK20c"``
        (one node of several kinds: :func:`~crosscut.cost_models.mixed_node.mixed_devices`).
        """
        if _NODES_RE.match(spec):
            return cls.from_nodes_spec(spec)
        if "," in spec:
            cluster = cls.from_specs(*mixed_devices(spec))
            cluster.meta["spec"], cluster.name = spec, spec.strip()
            return cluster
        m = _SPEC_RE.match(spec)
        if not m:
            raise DeviceError(
                "a cluster spec reads 'NxKIND' or 'NxKIND-TOPOLOGY'",
                value=spec,
                remedy=(
                    f"e.g. '4xK20c', '8xH100-nvlink'; kinds: {preset_names()}; "
                    f"topologies: {TOPOLOGIES}"
                ),
            )
        count, rest = int(m.group(1)), m.group(2)
        topology: str | None = None
        for topo in TOPOLOGIES:  # a preset's own name may end so too: "H100-PCIe"
            if rest.lower().endswith("-" + topo) and rest.lower() not in _KINDS:
                rest, topology = rest[: -len(topo) - 1], topo
                break
        if count < 1:
            raise DeviceError(
                "a cluster spec needs at least one device",
                value=spec,
                remedy="use N >= 1, e.g. '2xV100'",
            )
        base = preset(rest)  # raises, listing the presets
        if base.kind == "cpu":
            devices = [cpu_spec(f"cpu{i}", share=count) for i in range(count)]
        else:
            devices = [base.renamed(f"gpu{i}", f"cuda:{i}") for i in range(count)]
        topo = topology or DEFAULT_TOPOLOGY.get(base.kind, "pcie")
        if (base.kind == "cpu") != (topo in ("cpu", "gloo")):
            raise DeviceError(
                "cpu devices take the 'cpu' topology (threads of one process) or 'gloo' "
                "(processes on loopback), and only they do",
                value=spec,
                remedy=f"use '{count}xcpu' or '{count}xcpu-gloo'"
                if base.kind == "cpu"
                else f"use '{count}x{rest}'",
            )
        cluster = cls.from_specs(devices, topo)
        cluster.meta["spec"], cluster.name = spec, spec.strip()
        return cluster

    @classmethod
    def from_devices(
        cls, devices: Sequence[str | torch.device] | int, *, measure: bool = False
    ) -> Cluster:
        """Detect real devices: a list of ``"cuda:i"`` / ``"cpu"`` / torch.device, or an int N.

        CUDA devices may appear once each; ``"cpu"`` may repeat (virtual CPU
        devices named cpu0, cpu1, ... for tests). With ``measure=True`` the link
        matrix is timed with :func:`measure_link` instead of taken from presets,
        and a CPU is priced at its own GEMM, copy and page-fault rates
        (``measure_cpu_rates``, ``measure_page_fault_rate``) instead of the
        reference core's.
        """
        if isinstance(devices, int):
            avail = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if devices < 1 or devices > avail:
                raise DeviceError(
                    f"an int asks for the first N GPUs, 1 <= N <= {avail} here",
                    value=devices,
                    remedy="pass a smaller N, or a list such as ['cpu', 'cpu']",
                )
            devices = [f"cuda:{i}" for i in range(devices)]
        if len(devices) == 0:
            raise DeviceError(
                "a cluster needs at least one device",
                value=[],
                remedy="e.g. ['cuda:0', 'cuda:1'] or ['cpu', 'cpu']",
            )
        torch_devs = [parse_device(d) for d in devices]
        cuda_ids = [d.index for d in torch_devs if d.type == "cuda"]
        dup = sorted({i for i in cuda_ids if cuda_ids.count(i) > 1 and i is not None})
        if dup:
            raise DeviceError(
                "each CUDA device may appear once in a cluster",
                value=[f"cuda:{i}" for i in dup],
                remedy="list each GPU once; repeat 'cpu' for virtual devices",
            )
        n_cpu = sum(1 for d in torch_devs if d.type == "cpu")
        peak, copies = measure_cpu_rates() if measure and n_cpu else (None, None)
        faults = measure_page_fault_rate() if measure and n_cpu else None
        specs: list[DeviceSpec] = []
        cpu_i = 0
        for d in torch_devs:
            if d.type == "cpu":
                specs.append(
                    cpu_spec(
                        f"cpu{cpu_i}", share=n_cpu, peak=peak, mem_bw=copies, page_fault_bw=faults
                    )
                )
                cpu_i += 1
            else:
                specs.append(cuda_spec(d))
        topo = "cpu" if n_cpu == len(specs) else DEFAULT_TOPOLOGY.get(specs[0].kind, "pcie")
        if n_cpu and n_cpu != len(specs):
            topo = "pcie"
        try:
            cluster = cls.from_specs(specs, topo)
        except DeviceError:  # e.g. a GPU with no NVLink preset
            cluster = cls.from_specs(specs, "pcie")
        if measure:
            cluster.measure_links()
        cluster.meta["detected"] = [str(d) for d in torch_devs]
        cluster.name = ",".join(cluster.meta["detected"])
        return cluster

    @classmethod
    def detect(
        cls,
        network: str | None = None,
        *,
        device: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Cluster:
        """The cluster of the torchrun job this process runs in: nodes × local ranks.

        Nodes and ranks per node come from torchrun's variables
        (:func:`~crosscut.cost_models.detect.torchrun_env`), one device per
        rank; the kind from this rank's device (``device``: ``"cuda"`` or
        ``"cpu"``; default CUDA when available, as ``crosscut.distributed.init``
        picks), a GPU matched to a preset by name with its real memory; the
        network from ``network``, else ``CROSSCUT_NETWORK``, else the kind's
        default (``links.DEFAULT_NETWORK``). ``"torchrun[+NETWORK]"`` in
        :meth:`from_any` (and ``--devices``) calls this.
        """
        env = os.environ if environ is None else environ
        job = torchrun_env(env)
        use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
        if device not in (None, "cuda", "cpu") or (use_cuda and not torch.cuda.is_available()):
            raise DeviceError(
                "Cluster.detect's device is 'cuda' (needs a GPU here) or 'cpu'",
                value=device,
                remedy="leave device out to use CUDA where it is available",
            )
        if use_cuda:  # this rank's GPU (cuda:LOCAL_RANK) names the kind of every device
            n_gpu = torch.cuda.device_count()
            spec = cuda_spec(torch.device("cuda", job.local_rank if job.local_rank < n_gpu else 0))
            local = [spec.renamed(f"gpu{i}", f"cuda:{i}") for i in range(job.local_world_size)]
            try:
                node = cls.from_specs(local, DEFAULT_TOPOLOGY.get(spec.kind, "pcie"))
            except DeviceError:  # a GPU with no NVLink preset
                node = cls.from_specs(local, "pcie")
        else:
            node = cls.from_spec(f"{job.local_world_size}xcpu-gloo")  # ranks talk through gloo
        kind = node.devices[0].kind
        net = network or env.get("CROSSCUT_NETWORK") or DEFAULT_NETWORK.get(kind, "eth25")
        if net not in NETWORKS:
            raise DeviceError(
                "a network must be one of the known names",
                value=net,
                remedy=f"use one of {sorted(NETWORKS)}",
            )
        node.nodes, node.network_name = job.nodes, net
        node.network = network_link(net, kind)
        node.name = f"{job.nodes}x{job.local_world_size}x{kind}+{net}"
        node.meta = {"spec": node.name, "detected": "torchrun"}
        return node

    def measure_links(self) -> None:
        """Replace every off-diagonal link by a measured (bandwidth, latency)."""
        for i, a in enumerate(self.devices):
            for j, b in enumerate(self.devices):
                if i != j:
                    self.bandwidth[i][j], self.latency[i][j] = measure_link(a.device, b.device)
        self.validate()

    @classmethod
    def from_any(cls, x: ClusterLike) -> Cluster:
        """Dispatch: Cluster, int, device list, "a,b" string, JSON path, spec, "torchrun"."""
        if isinstance(x, Cluster):
            x.validate()
            return x
        if isinstance(x, int):
            return cls.from_devices(x)
        if isinstance(x, (list, tuple)):
            return cls.from_devices(list(x))
        if isinstance(x, Path) or (
            isinstance(x, str) and (x.endswith(".json") or os.path.sep in x)
        ):
            return cls.load(x)
        if isinstance(x, str):
            if m := _TORCHRUN_RE.match(x):  # the job's own cluster, under torchrun
                return cls.detect(m.group(1))
            if _SPEC_RE.match(x):
                return cls.from_spec(x)
            # "cuda:0,cuda:1" / "cpu,cpu": the CLI's device-list form
            return cls.from_devices([d.strip() for d in x.split(",") if d.strip()] or [x])
        raise DeviceError(
            "a cluster is a Cluster, an int, a device list, a JSON path or a spec string",
            value=type(x).__name__,
            remedy="e.g. '4xK20c', ['cpu', 'cpu'], 2, 'cluster.json'",
        )

    # ---- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "topology": self.topology,
            "devices": [d.to_dict() for d in self.devices],
            "bandwidth": self.bandwidth,
            "latency": self.latency,
            "meta": self.meta,
            "name": self.name,
            "nodes": self.nodes,
            "network": list(self.network),
            "network_name": self.network_name,
            "nics": self.nics,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cluster:
        try:
            cluster = cls(
                devices=[DeviceSpec.from_dict(d) for d in data["devices"]],
                bandwidth=[[float(v) for v in row] for row in data["bandwidth"]],
                latency=[[float(v) for v in row] for row in data["latency"]],
                topology=str(data.get("topology", "custom")),
                meta=dict(data.get("meta", {})),
                name=str(data.get("name", "")),
                nodes=int(data.get("nodes", 1)),
                network=_pair(data.get("network", (0.0, 0.0))),
                network_name=str(data.get("network_name", "")),
                nics=int(data.get("nics", 1)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, DeviceError):
                raise
            raise DeviceError(
                "a cluster JSON needs 'devices', 'bandwidth' and 'latency'",
                value=repr(exc),
                remedy="start from Cluster.from_spec('2xV100').to_json()",
            ) from None
        cluster.validate()
        return cluster

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Cluster:
        return cls.from_dict(parse_json(text, DeviceError, "a cluster file"))

    def save(self, path: str | Path) -> None:
        write_atomic(path, self.to_json(), "the cluster")

    @classmethod
    def load(cls, path: str | Path) -> Cluster:
        remedy = "check the path or use a spec string"
        return cls.from_dict(read_json(path, DeviceError, "a cluster JSON", remedy=remedy))


ClusterLike = Cluster | int | str | Path | Sequence[str | torch.device]


def _pair(value: Any) -> tuple[float, float]:
    return (float(value[0]), float(value[1]))
