"""Links: bandwidth and latency between two devices, from presets or a stopwatch.

A transfer of ``b`` bytes from ``a`` to ``d`` is priced ``latency + b / bandwidth``
(the alpha-beta model the partition problem uses). ``measure_link`` fits both
numbers from timed copies of several sizes, so a Cluster can be calibrated on
the machine it will run on.
"""

from __future__ import annotations

import mmap
import statistics
import time
from collections.abc import Sequence

import torch

from crosscut.errors import DeviceError

__all__ = [
    "DEFAULT_NETWORK",
    "DEFAULT_TOPOLOGY",
    "GLOO_LOOPBACK",
    "NETWORKS",
    "TOPOLOGIES",
    "LinkSpec",
    "default_link",
    "fit_alpha_beta",
    "measure_copy_rate",
    "measure_cpu_rates",
    "measure_link",
    "measure_matmul_flops",
    "measure_page_fault_rate",
    "network_link",
]

TOPOLOGIES = ("nvlink", "pcie", "cpu", "gloo")

LinkSpec = tuple[float, float]  # (bandwidth bytes/s, latency s)

# Per-pair unidirectional bandwidth and latency. NVLink: V100 DGX-1 pairs (2 links x 25 GB/s),
# A100 / H100 through NVSwitch (300 / 450 GB/s). PCIe: gen2 x16 for K20c (~6 GB/s
# measured peer-to-peer), gen3 for P40/V100, gen4 for A100, gen5 for H100/H200.
_NVLINK: dict[str, LinkSpec] = {
    "P100": (20e9, 6e-6),
    "V100": (50e9, 5e-6),
    "V100-32GB": (50e9, 5e-6),
    "A100-40GB": (300e9, 4e-6),
    "A100-80GB": (300e9, 4e-6),
    "H100": (450e9, 3e-6),
    "H200": (450e9, 3e-6),
}
_PCIE: dict[str, LinkSpec] = {
    "K20c": (6e9, 10e-6),
    "P40": (12e9, 8e-6),
    "P100": (12e9, 8e-6),
    "V100": (12e9, 8e-6),
    "V100-32GB": (12e9, 8e-6),
    "A100-40GB": (24e9, 8e-6),
    "A100-80GB": (24e9, 8e-6),
    "H100": (50e9, 6e-6),
    "H200": (50e9, 6e-6),
    # the workstation, inference and consumer parts: gen3 (Turing), gen4 (GA10x, Ada,
    # A100 PCIe), gen5 (H100 PCIe); GeForce cards have no peer-to-peer, staged via the host
    "RTX8000": (12e9, 8e-6),
    "T4": (12e9, 8e-6),
    "A10": (24e9, 8e-6),
    "A40": (24e9, 8e-6),
    "RTXA6000": (24e9, 8e-6),
    "RTX3090": (12e9, 10e-6),
    "A100-PCIe-40GB": (24e9, 8e-6),
    "A100-PCIe-80GB": (24e9, 8e-6),
    "L4": (24e9, 8e-6),
    "L40S": (24e9, 8e-6),
    "RTX6000Ada": (24e9, 8e-6),
    "RTX4090": (12e9, 10e-6),
    "H100-PCIe": (50e9, 6e-6),
}
# Between nodes: one NIC's worth (bytes/s, latency); a node may have several
# (Cluster.nics, "+8xib200"). InfiniBand FDR/EDR/HDR/NDR (56/100/200/400 Gb/s,
# ~2-5 µs with GPUDirect RDMA); Ethernet with RoCE (~10 µs) or TCP.
NETWORKS: dict[str, LinkSpec] = {
    "eth10": (1.25e9, 30e-6),
    "eth25": (3.125e9, 15e-6),
    "eth50": (6.25e9, 12e-6),
    "eth100": (12.5e9, 10e-6),
    "ib56": (7e9, 5e-6),
    "ib100": (12.5e9, 5e-6),
    "ib200": (25e9, 4e-6),
    "ib400": (50e9, 3e-6),
}
# how the devices of one node of each kind are joined: K20c and P40 on PCIe in Mariana's
# two-switch layout (no NVLink), the later parts on NVLink as DGX/HGX boards ship them
DEFAULT_TOPOLOGY: dict[str, str] = {"K20c": "pcie", "P40": "pcie", "cpu": "cpu"} | dict.fromkeys(
    ("P100", "V100", "V100-32GB", "A100-40GB", "A100-80GB", "H100", "H200"), "nvlink"
)
# what a node of each kind was usually wired with in its time
DEFAULT_NETWORK: dict[str, str] = {
    "K20c": "eth10",
    "P40": "eth25",
    "P100": "eth50",
    "V100": "ib100",
    "V100-32GB": "ib100",
    "A100-40GB": "ib200",
    "A100-80GB": "ib200",
    "H100": "ib400",
    "H200": "ib400",
    "A100-PCIe-40GB": "ib200",
    "A100-PCIe-80GB": "ib200",
    "H100-PCIe": "ib400",
    "cpu": "eth25",
}
# Mariana's layout: two PCIe switches, one under each CPU. Peer-to-peer inside a switch
# runs at the switch rate; across switches traffic is staged through host memory over
# QPI, which roughly halves the bandwidth and doubles the latency.
CROSS_SWITCH_BW_FACTOR = 0.5
CROSS_SWITCH_LATENCY_FACTOR = 2.0
# Virtual CPU devices share DRAM: a copy reads and writes, so it moves at about half the
# memory bandwidth, after ~2 µs of queueing/dispatch between worker threads.
CPU_COPY_LATENCY_S = 2e-6
# CPU processes on one machine (torchrun's CPU ranks) exchange tensors through gloo
# over TCP on loopback, not a memory copy: each message crosses the kernel's socket
# buffers and gloo's pair handshake. One-way ping-pong between two one-thread ranks,
# measured on two 2-vCPU VMs: 47-64 µs for 1-4 KB, 2.9-3.9 GB/s from 4 MB on
# (docs/BENCHMARKS.md, "The engine's per-action cost and gloo's links, priced").
GLOO_LOOPBACK: LinkSpec = (3.5e9, 55e-6)


def default_link(
    kind: str, topology: str, *, same_switch: bool = True, mem_bw: float = 20e9
) -> LinkSpec:
    """Preset (bandwidth, latency) for two devices of ``kind`` on ``topology``."""
    if topology == "cpu":
        return (mem_bw / 2, CPU_COPY_LATENCY_S)
    if topology == "gloo":
        return GLOO_LOOPBACK
    if topology == "nvlink":
        if kind not in _NVLINK:
            raise DeviceError(
                f"devices of kind {kind!r} have no NVLink preset",
                value=kind,
                remedy=f"use the 'pcie' topology, or one of {sorted(_NVLINK)} for 'nvlink'",
            )
        return _NVLINK[kind]
    if topology == "pcie":
        bw, lat = _PCIE.get(kind, (12e9, 8e-6))
        if not same_switch:
            return (bw * CROSS_SWITCH_BW_FACTOR, lat * CROSS_SWITCH_LATENCY_FACTOR)
        return (bw, lat)
    raise DeviceError(
        "a topology must be one of the known names",
        value=topology,
        remedy=f"use one of {TOPOLOGIES}",
    )


def network_link(network: str, kind: str) -> LinkSpec:
    """(bandwidth, latency) between two nodes of ``kind`` devices on ``network``.

    CPU ranks exchange tensors through gloo over TCP, between nodes as inside
    one: a message costs at least what it costs on loopback (its kernel socket
    path and gloo's handshake), so a CPU cluster's network is never priced
    quicker than :data:`GLOO_LOOPBACK`. GPUs keep the network's own figures.
    """
    bw, lat = NETWORKS[network]
    if kind != "cpu":
        return (bw, lat)
    return (min(bw, GLOO_LOOPBACK[0]), max(lat, GLOO_LOOPBACK[1]))


def fit_alpha_beta(sizes: Sequence[int], times: Sequence[float]) -> LinkSpec:
    """Least-squares fit of ``t = latency + size / bandwidth``; both kept positive."""
    n = len(sizes)
    if n < 2 or n != len(times):
        raise DeviceError("fitting a link needs >= 2 (size, time) pairs", value=(sizes, times))
    mx = sum(sizes) / n
    my = sum(times) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    sxy = sum((x - mx) * (y - my) for x, y in zip(sizes, times))
    slope = sxy / sxx if sxx > 0 else 0.0
    if slope <= 0:  # noise swamped the size dependence: use the biggest copy alone
        slope = max(times[-1], 1e-12) / max(sizes[-1], 1)
    latency = max(my - slope * mx, 0.0)
    return (1.0 / slope, latency)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure_link(
    src_device: str | torch.device,
    dst_device: str | torch.device,
    sizes: Sequence[int] = (1 << 16, 1 << 20, 1 << 22, 1 << 24),
    *,
    repeats: int = 7,
    warmup: int = 2,
) -> LinkSpec:
    """Time copies of ``sizes`` bytes from ``src_device`` to ``dst_device``; return (bw, latency).

    Each size is copied ``warmup`` times untimed, then ``repeats`` times; the
    median is kept (robust to a stray context switch). Between two CPU devices
    the copy is ``dst.copy_(src)`` into a preallocated buffer, which is what the
    local runtime does between virtual CPU stages.
    """
    src, dst = torch.device(src_device), torch.device(dst_device)
    medians: list[float] = []
    for size in sizes:
        a = torch.empty(max(size // 4, 1), dtype=torch.float32, device=src).uniform_()
        b = torch.empty_like(a, device=dst)
        samples: list[float] = []
        for i in range(warmup + repeats):
            _sync(src)
            _sync(dst)
            t0 = time.perf_counter()
            b.copy_(a, non_blocking=False)
            _sync(dst)
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
        medians.append(statistics.median(samples))
    return fit_alpha_beta([max(s // 4, 1) * 4 for s in sizes], medians)


def measure_matmul_flops(dev: torch.device, n: int = 1024, repeats: int = 5) -> float:
    """Achieved fp32 GEMM FLOP/s: a quick, honest stand-in for an unknown device's peak."""
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    best = float("inf")
    for _ in range(repeats + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        torch.mm(a, b)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / max(best, 1e-9)


def measure_copy_rate(dev: torch.device, mib: int = 64, repeats: int = 5) -> float:
    """Bytes/s a ``mib`` MiB fp32 copy reads and writes on ``dev``, the best of
    ``repeats``: what ``DeviceSpec.mem_bw`` means for a CPU, whose elementwise prices
    and bytes-equivalent terms (``cpu_terms.py``) all divide by it."""
    a = torch.ones(mib * 2**20 // 4, device=dev)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(repeats + 1):
        _sync(dev)
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * a.numel() * 4 / max(best, 1e-9)


def measure_cpu_rates(tries: int = 3) -> tuple[float, float]:
    """(GEMM FLOP/s, copy bytes/s) of this CPU at torch's threads, each the best of
    ``tries`` probes (about 0.1 s in all): the two rates the ``cpu`` preset prices
    with, measured here instead of the reference core's (``devices.cpu_spec``). The
    best, because a shared machine's other work only ever slows a probe down."""
    cpu = torch.device("cpu")
    flops = max(measure_matmul_flops(cpu) for _ in range(tries))
    return flops, max(measure_copy_rate(cpu) for _ in range(tries))


def measure_page_fault_rate(mib: int = 64, tries: int = 3) -> float:
    """Bytes/s at which this machine maps fresh memory in at its first touch, the best
    of ``tries``: ``DeviceSpec.page_fault_bw`` for a CPU. A fresh anonymous mapping of
    ``mib`` MiB is filled twice; the first fill pays a page fault per page (the
    kernel zeroes it, a hypervisor may map it too), the second only the writes, and
    the difference is the mapping's price. Measured this way, not as the first
    fill's rate, because the cost model already prices writing a tensor's bytes."""
    size, best = mib * 2**20, 0.0
    for _ in range(tries):
        region = mmap.mmap(-1, size)
        view = torch.frombuffer(region, dtype=torch.uint8)
        t0 = time.perf_counter()
        view.fill_(1)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        view.fill_(2)
        again = time.perf_counter() - t0
        del view
        region.close()
        best = max(best, size / max(first - again, 1e-9))
    return best
