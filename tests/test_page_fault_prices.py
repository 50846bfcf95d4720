"""Page faults in the analytic CPU price (cost_models/cpu_terms.fresh_blocks).

Under crosscut's default CROSSCUT_CPU_MALLOC ("thresholds") and glibc's own defaults,
a block of 32 MiB or more gets a mapping of its own unless a free chunk of the heap
holds it, and its pages are faulted in afresh every step. These tests hold the rule
(which blocks, which node, which pass, which setting) on traced graphs: tracing does
not run the model, so the shapes can be as large as the rule needs.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torchvision
from torch import nn

from crosscut.cost_models.analytic import analytic_costs, priced_rate
from crosscut.cost_models.cluster import Cluster
from crosscut.cost_models.cpu_terms import GLIBC_THRESHOLDS, fresh_blocks
from crosscut.cost_models.devices import DeviceSpec, cpu_spec, preset
from crosscut.cost_models.links import measure_page_fault_rate
from crosscut.errors import DeviceError
from crosscut.frontend.tracer import trace
from crosscut.ir.graph import OpGraph

MIB = 1 << 20


def _classifier() -> OpGraph:
    """A small step whose one large block is a 128 MiB weight gradient (VGG's kind)."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(8192, 4096), nn.ReLU(), nn.Linear(4096, 10))
    return trace(model, torch.randn(4, 8, 32, 32), mode="train")


def _chain(convs: int) -> OpGraph:
    """``convs`` 1x1 convolutions over 16 MiB activations, then one to a 64 MiB block."""
    layers: list[nn.Module] = [nn.Conv2d(16, 16, 1) for _ in range(convs)]
    model = nn.Sequential(*layers, nn.Conv2d(16, 64, 1))
    return trace(model, torch.randn(1, 16, 512, 512), mode="train")


def _cpu_table(graph: OpGraph, spec: DeviceSpec) -> dict[str, tuple[float, float]]:
    cluster = Cluster.from_spec("1xcpu")
    cluster.devices[0] = replace(spec, name=cluster.devices[0].name)
    table = analytic_costs(graph, cluster, optimizer="momentum")
    return {name: (c.fwd["cpu"], c.bwd["cpu"]) for name, c in table.nodes.items()}


def test_a_weight_gradient_larger_than_the_heap_is_mapped_afresh_in_its_backward() -> None:
    graph = _classifier()
    first = next(n for n in graph.nodes if n.kind == "linear")
    assert first.param_bytes >= 128 * MIB
    for setting in ("thresholds", "off"):
        blocks = fresh_blocks(graph, setting)
        assert blocks[first.name] == (0, first.param_bytes), setting
        assert sum(f + b for f, b in blocks.values()) == first.param_bytes
    assert fresh_blocks(graph, "kept") == {}  # nothing is mapped on its own


def test_small_blocks_are_never_priced() -> None:
    graph = trace(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()), torch.randn(2, 3, 32, 32))
    for setting in GLIBC_THRESHOLDS:
        assert fresh_blocks(graph, setting) == {}


def test_a_block_the_heap_could_hold_is_priced_only_once_the_heap_is_trimmed_each_step() -> None:
    """64 MiB beside 30 blocks of 16 MiB (480 MiB of heap, under the 1 GiB trim
    threshold): a free chunk may hold it, not priced. Beside 70 (1.1 GiB): the heap
    goes back to the kernel at every step's end, so the block is mapped afresh, in
    the forward that writes it and in the backward that writes its gradient."""
    assert fresh_blocks(_chain(30), "thresholds") == {}
    graph = _chain(70)
    last = graph.compute_nodes()[-1]
    assert last.out_bytes == 64 * MIB
    blocks = fresh_blocks(graph, "thresholds")
    assert blocks == {last.name: (64 * MIB, 0)}  # its input's gradient is 16 MiB
    # glibc's own defaults trim at twice the mmap threshold: priced with 30 too
    assert fresh_blocks(_chain(30), "off") == {_chain(30).compute_nodes()[-1].name: (64 * MIB, 0)}


def test_the_analytic_price_adds_the_bytes_at_the_specs_page_fault_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CROSSCUT_CPU_MALLOC", "thresholds")
    graph = _classifier()
    first = next(n for n in graph.nodes if n.kind == "linear")
    priced = _cpu_table(graph, cpu_spec("cpu", page_fault_bw=2e9))
    free = _cpu_table(graph, cpu_spec("cpu", page_fault_bw=0.0))
    for name in priced:
        extra_bwd = first.param_bytes / 2e9 if name == first.name else 0.0
        assert priced[name][0] == pytest.approx(free[name][0])
        assert priced[name][1] == pytest.approx(free[name][1] + extra_bwd)
    monkeypatch.setenv("CROSSCUT_CPU_MALLOC", "kept")
    assert _cpu_table(graph, cpu_spec("cpu", page_fault_bw=2e9)) == free


def test_gpus_pay_no_page_faults_and_the_plan_says_what_a_cpu_was_priced_at() -> None:
    graph = _classifier()
    assert all(preset(k).page_fault_bw == 0 for k in ("V100", "A100-80GB", "H100"))
    assert cpu_spec("cpu").page_fault_bw > 0
    words = priced_rate(graph, cpu_spec("cpu", page_fault_bw=2.5e9))["efficiency"]
    assert "page faults at 2.5 GB/s" in words and "CROSSCUT_CPU_MALLOC=" in words


def test_page_fault_rate_round_trips_through_json_and_is_checked() -> None:
    spec = cpu_spec("cpu0", page_fault_bw=3e9)
    assert DeviceSpec.from_dict(spec.to_dict()) == spec
    old = spec.to_dict()
    del old["page_fault_bw"]  # a cluster file written before the field existed
    assert DeviceSpec.from_dict(old).page_fault_bw == 0.0
    with pytest.raises(DeviceError, match="page_fault_bw must be >= 0"):
        DeviceSpec.from_dict({**spec.to_dict(), "page_fault_bw": -1.0})


def test_the_page_fault_probe_measures_a_finite_rate() -> None:
    rate = measure_page_fault_rate(mib=8, tries=2)
    assert math.isfinite(rate) and 1e8 < rate < 1e12


_CHILD = """
import resource, statistics, sys, torch, torchvision
from crosscut.cpu_malloc import keep_freed_memory
assert keep_freed_memory()
model = torchvision.models.alexnet(num_classes=10).train()
opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
x, target = torch.randn(8, 3, 128, 128), torch.randint(0, 10, (8,))
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), target).backward()
    opt.step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(statistics.median(faults[2:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc on Linux")
def test_the_priced_blocks_are_the_pages_glibc_faults_in_every_step() -> None:
    """AlexNet at 128 px, batch 8, under the default setting: its two classifier weight
    gradients (144 and 64 MiB) are larger than its heap, so glibc maps them afresh
    every step. The pages a settled step faults in (``getrusage``) are the priced
    bytes over the page size, within 10 %: the mechanism, measured, not a timing."""
    model = torchvision.models.alexnet(num_classes=10).train()
    graph = trace(model, torch.randn(8, 3, 128, 128), mode="train")
    priced = sum(f + b for f, b in fresh_blocks(graph, "thresholds").values())
    assert priced > 200 * MIB
    env = dict(os.environ, CROSSCUT_CPU_MALLOC="thresholds", OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    faults = float(run.stdout.split()[-1])
    pages = priced / os.sysconf("SC_PAGE_SIZE")
    assert 0.9 * pages <= faults <= 1.1 * pages, (faults, pages)
