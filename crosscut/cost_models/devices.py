"""DeviceSpec: what the cost model needs to know about one device.

A spec is plain data (no torch objects), so a Cluster can be written to JSON,
edited by hand, and priced on a machine that does not have the hardware. The
presets hold public datasheet numbers; they are upper bounds a roofline model
divides by, not promises (profiling, ``profiled.py``, gives real times).
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from crosscut.errors import DeviceError

__all__ = [
    "GB",
    "PRESETS",
    "TFLOPS",
    "DeviceSpec",
    "compute_threads",
    "cpu_spec",
    "preset",
    "preset_names",
]

GB = 10**9
TFLOPS = 10**12


@dataclass(frozen=True)
class DeviceSpec:
    """One device: a unique ``name`` in its cluster, a preset ``kind``, where it runs.

    ``peak_flops`` maps a dtype name ("float32", "float16", "bfloat16") to FLOP/s;
    a dtype missing from it is priced at the float32 rate (so K20c, which has no
    fast half precision, needs no fake entry). ``launch_overhead_s`` is the fixed
    cost of one operator (kernel launch plus framework dispatch), which dominates
    small ops and is why a roofline alone under-prices deep, thin graphs.
    ``page_fault_bw`` is the rate, in bytes/s, at which the operating system maps
    fresh memory in at its first touch (a page fault per 4 KiB page): what a CPU
    step pays for every buffer glibc maps afresh (``cpu_terms.fresh_blocks``). 0
    prices none, as on a GPU, whose caching allocator keeps its memory.
    """

    name: str
    kind: str
    device: str
    peak_flops: dict[str, float] = field(default_factory=dict)
    mem_bw: float = 0.0
    mem_cap: int = 0
    launch_overhead_s: float = 0.0
    page_fault_bw: float = 0.0

    def peak(self, dtype: str) -> float:
        """FLOP/s for ``dtype``, falling back to float32 (always present in presets)."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        return self.peak_flops.get("float32", 0.0)

    def renamed(self, name: str, device: str | None = None) -> DeviceSpec:
        """A copy with a new cluster name (and optionally a new torch device string)."""
        return replace(self, name=name, device=self.device if device is None else device)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceSpec:
        """Build from JSON data, naming the missing or bad field."""
        try:
            spec = cls(
                name=str(data["name"]),
                kind=str(data["kind"]),
                device=str(data.get("device", "cpu")),
                peak_flops={str(k): float(v) for k, v in dict(data["peak_flops"]).items()},
                mem_bw=float(data["mem_bw"]),
                mem_cap=int(data["mem_cap"]),
                launch_overhead_s=float(data.get("launch_overhead_s", 0.0)),
                page_fault_bw=float(data.get("page_fault_bw", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DeviceError(
                "a device entry needs name, kind, peak_flops, mem_bw and mem_cap",
                value=f"{data!r} ({exc!r})",
                remedy="compare with DeviceSpec.to_dict() of a preset",
            ) from None
        spec.validate()
        return spec

    def validate(self) -> None:
        """Positive speeds and capacity; the message names the device and field."""
        if self.peak("float32") <= 0:
            raise DeviceError(
                f"device {self.name!r}: peak_flops['float32'] must be positive",
                value=self.peak_flops,
            )
        for dtype, v in self.peak_flops.items():
            if v <= 0:
                raise DeviceError(
                    f"device {self.name!r}: peak_flops[{dtype!r}] must be positive", value=v
                )
        if self.mem_bw <= 0:
            raise DeviceError(f"device {self.name!r}: mem_bw must be positive", value=self.mem_bw)
        if self.mem_cap <= 0:
            raise DeviceError(f"device {self.name!r}: mem_cap must be positive", value=self.mem_cap)
        if self.launch_overhead_s < 0:
            raise DeviceError(
                f"device {self.name!r}: launch_overhead_s must be >= 0",
                value=self.launch_overhead_s,
            )
        if self.page_fault_bw < 0:
            raise DeviceError(
                f"device {self.name!r}: page_fault_bw must be >= 0 (0 prices no page faults)",
                value=self.page_fault_bw,
            )


def _gpu(
    kind: str,
    fp32: float,
    half: float | None,
    bw: float,
    cap: float,
    launch: float,
    tf32: float | None = None,
) -> DeviceSpec:
    flops = {"float32": fp32 * TFLOPS}
    if half is not None:
        flops["float16"] = half * TFLOPS
        flops["bfloat16"] = half * TFLOPS
    if tf32 is not None:
        flops["tfloat32"] = tf32 * TFLOPS
    return DeviceSpec(kind, kind, "cuda:0", flops, bw * GB, int(cap * GB), launch)


# Datasheet numbers (dense, boost clock). fp16 is the tensor-core rate where there is
# one; bfloat16 only exists from Ampere on, so it is dropped for older parts below;
# tfloat32 is the TF32 tensor-core rate PyTorch's fp32 convolutions run at on Ampere
# and later (efficiency.math_mode). These are peaks: efficiency.py prices achieved rates.
PRESETS: dict[str, DeviceSpec] = {
    # Tesla K20c: 3.52 TFLOPS fp32, 208 GB/s, 5 GB of which Mariana reports 4.8 GB usable.
    # No fast fp16: missing dtypes fall back to the fp32 rate.
    "K20c": _gpu("K20c", 3.52, None, 208, 4.8, 10e-6),
    # Tesla P40: 11.76 TFLOPS fp32, 346 GB/s, 24 GB. Its fp16 arithmetic runs at 1/64
    # rate, so cuDNN keeps fp16 tensors and computes in fp32: no float16 entry (the fp32
    # rate, 16-bit bytes), as Tencent's fp16 runs on P40 used it.
    "P40": _gpu("P40", 11.76, None, 346, 24, 7e-6),
    # Tesla P100 SXM2: 10.6 TFLOPS fp32, 21.2 TFLOPS fp16 (no tensor cores), 732 GB/s, 16 GB.
    "P100": _gpu("P100", 10.6, 21.2, 732, 16, 6e-6),
    # Tesla V100 SXM2: 15.7 TFLOPS fp32, 125 TFLOPS fp16 tensor, 900 GB/s, 16 GB.
    "V100": _gpu("V100", 15.7, 125, 900, 16, 5e-6),
    "V100-32GB": _gpu("V100-32GB", 15.7, 125, 900, 32, 5e-6),
    # A100 SXM: 19.5 TFLOPS fp32 (156 tf32), 312 TFLOPS fp16/bf16, 1555 / 2039 GB/s.
    "A100-40GB": _gpu("A100-40GB", 19.5, 312, 1555, 40, 4e-6, 156),
    "A100-80GB": _gpu("A100-80GB", 19.5, 312, 2039, 80, 4e-6, 156),
    # H100 SXM: 67 TFLOPS fp32, 495 tf32, 989 TFLOPS fp16/bf16 dense, 3.35 TB/s, 80 GB.
    "H100": _gpu("H100", 67, 989, 3350, 80, 4e-6, 495),
    # H200 SXM: H100 compute with 141 GB HBM3e at 4.8 TB/s.
    "H200": _gpu("H200", 67, 989, 4800, 141, 4e-6, 495),
    # Workstation, inference and consumer parts (datasheets; architecture whitepapers for the
    # GeForce cards, whose 16-bit tensor rate with the fp32 accumulation PyTorch's autocast
    # uses is half the professional parts' per SM: RTX 3090 71, RTX 4090 165.2 TFLOPS).
    # Turing: Quadro RTX 8000 16.3 TFLOPS fp32, 130.5 fp16 tensor, 672 GB/s, 48 GB;
    # T4 8.1, 65, 320 GB/s, 16 GB (no TF32, no bf16 tensor cores).
    "RTX8000": _gpu("RTX8000", 16.3, 130.5, 672, 48, 5e-6),
    "T4": _gpu("T4", 8.1, 65, 320, 16, 5e-6),
    # Ampere GA10x: A10 31.2 / tf32 62.5 / fp16 125, 600 GB/s, 24 GB; A40 37.4 / 74.8 /
    # 149.7, 696 GB/s, 48 GB; RTX A6000 38.7 / 77.4 / 154.8, 768 GB/s, 48 GB; RTX 3090
    # 35.6 / 35.6 / 71, 936 GB/s, 24 GB.
    "A10": _gpu("A10", 31.2, 125, 600, 24, 4e-6, 62.5),
    "A40": _gpu("A40", 37.4, 149.7, 696, 48, 4e-6, 74.8),
    "RTXA6000": _gpu("RTXA6000", 38.7, 154.8, 768, 48, 4e-6, 77.4),
    "RTX3090": _gpu("RTX3090", 35.6, 71, 936, 24, 4e-6, 35.6),
    # A100 PCIe: the SXM part's 108 SMs and peaks; 1555 (40 GB) or 1935 GB/s (80 GB).
    "A100-PCIe-40GB": _gpu("A100-PCIe-40GB", 19.5, 312, 1555, 40, 4e-6, 156),
    "A100-PCIe-80GB": _gpu("A100-PCIe-80GB", 19.5, 312, 1935, 80, 4e-6, 156),
    # Ada: L4 30.3 / 60 / 121, 300 GB/s, 24 GB; L40S 91.6 / 183 / 362, 864 GB/s, 48 GB;
    # RTX 6000 Ada 91.1 / 182.1 / 364.2, 960 GB/s, 48 GB; RTX 4090 82.6 / 82.6 / 165.2,
    # 1008 GB/s, 24 GB.
    "L4": _gpu("L4", 30.3, 121, 300, 24, 4e-6, 60),
    "L40S": _gpu("L40S", 91.6, 362, 864, 48, 4e-6, 183),
    "RTX6000Ada": _gpu("RTX6000Ada", 91.1, 364.2, 960, 48, 4e-6, 182.1),
    "RTX4090": _gpu("RTX4090", 82.6, 165.2, 1008, 24, 4e-6, 82.6),
    # H100 PCIe: 114 SMs, 51 TFLOPS fp32, 378 tf32, 756 fp16/bf16 dense, 2.0 TB/s, 80 GB.
    "H100-PCIe": _gpu("H100-PCIe", 51, 756, 2000, 80, 4e-6, 378),
}
for _k in ("V100", "V100-32GB", "P40", "P100", "RTX8000", "T4"):
    _flops = dict(PRESETS[_k].peak_flops)
    _flops.pop("bfloat16", None)
    PRESETS[_k] = replace(PRESETS[_k], peak_flops=_flops)

# CPU defaults are "measured-ish" for a current x86 server core running PyTorch eager:
# ~40 GFLOP/s fp32 per core achieved in conv/GEMM (AVX2/AVX-512 FMA at ~50 % of peak),
# ~10 GB/s of DRAM bandwidth per core up to ~40 GB/s, and ~10 µs of dispatch per op.
# bfloat16 runs at the fp32 rate (no AMX assumed). Use Cluster.from_devices(..., measure=True)
# or profile_costs() for numbers of the machine at hand.
CPU_FLOPS_PER_CORE = 40e9
CPU_BW_PER_CORE = 10e9
CPU_LAUNCH_S = 10e-6
# First touch of freshly mapped memory: a page fault and the kernel zeroing the page,
# about 1 µs per 4 KiB page on a bare-metal Linux server (an assumption, not measured
# here: dev-2c, a VM, measured 1.8 µs, 2.3 GB/s, because the hypervisor maps it too).
# ``Cluster.from_devices(..., measure=True)`` measures it (links.measure_page_fault_rate).
CPU_PAGE_FAULT_BW = 4e9


def physical_memory_bytes() -> int:
    """Installed RAM via os.sysconf (no psutil); 16 GB where sysconf cannot say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * GB


def compute_threads() -> int:
    """The threads torch computes on here, at most the cores.

    torch runs convolutions and GEMMs on its intra-op pool, not on every core:
    under ``OMP_NUM_THREADS=1`` (one thread per torchrun rank) pricing every
    core of a 2-core machine priced it twice as fast as it runs. torch's own
    setting when torch is loaded, else ``OMP_NUM_THREADS``, else the cores.
    """
    cores = os.cpu_count() or 1
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):
        return max(1, min(cores, int(torch.get_num_threads())))
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    return max(1, min(cores, int(env))) if env.isdigit() and int(env) > 0 else cores


def cpu_spec(
    name: str = "cpu0",
    *,
    share: int = 1,
    peak: float | None = None,
    mem_bw: float | None = None,
    page_fault_bw: float | None = None,
) -> DeviceSpec:
    """The CPU of this machine at torch's threads; ``share`` virtual devices split its RAM evenly.

    Virtual CPU devices (``["cpu", "cpu"]``) exist so the partitioner and the
    runtime can be tested without GPUs. They share one pool of RAM, so each gets
    ``1/share`` of it: a plan that fits every cap then also fits the machine.
    ``peak``, ``mem_bw`` and ``page_fault_bw`` replace the reference core's rates
    with measured ones (``Cluster.from_devices(..., measure=True)``).
    """
    cores = compute_threads()
    fp32 = peak if peak is not None else CPU_FLOPS_PER_CORE * cores
    return DeviceSpec(
        name=name,
        kind="cpu",
        device="cpu",
        peak_flops={"float32": fp32, "bfloat16": fp32},
        mem_bw=mem_bw if mem_bw is not None else min(CPU_BW_PER_CORE * cores, 40e9),
        mem_cap=max(physical_memory_bytes() // max(share, 1), 1),
        launch_overhead_s=CPU_LAUNCH_S,
        page_fault_bw=page_fault_bw if page_fault_bw is not None else CPU_PAGE_FAULT_BW,
    )


PRESETS["cpu"] = cpu_spec("cpu")


def preset_names() -> list[str]:
    """Every preset kind, in datasheet order (oldest GPU first, cpu last)."""
    return list(PRESETS)


def preset(kind: str, name: str | None = None, device: str | None = None) -> DeviceSpec:
    """The preset ``kind`` (case-insensitive), renamed; DeviceError lists the presets."""
    for key, spec in PRESETS.items():
        if key.lower() == kind.lower():
            return spec.renamed(name or key, device)
    raise DeviceError(
        "a device kind must be one of the presets",
        value=kind,
        remedy=f"use one of {preset_names()} or describe the device in a cluster JSON file",
    )
