"""Costs a GPU user can trust: achieved rates, math modes, and predictions vs published figures.

Why: a planner is only as good as its prices. These check the physics the
analytic model rests on (TF32 as PyTorch runs it, fp16 storage where fp16
math is slow, in-place ops move bytes, grouped convolutions achieve less) and
that the predicted single-GPU training throughput stays within ±15 % of the
published figures it was calibrated on (``cost_models/calibration.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from crosscut.cost_models.analytic import analytic_costs
from crosscut.cost_models.calibration import MEASURED, PUBLISHED
from crosscut.cost_models.cluster import Cluster
from crosscut.frontend.tracer import trace
from crosscut.partitioner.replicas import reduction

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import calibration as bench

TOL = 0.15


def _conv_graph(groups: int = 1, precision: str = "fp32", inplace: bool = False) -> object:
    model = nn.Sequential(
        nn.Conv2d(256, 256, 3, padding=1, groups=groups, bias=False), nn.ReLU(inplace=inplace)
    )
    return trace(model, torch.empty(64, 256, 28, 28, device="meta"), precision=precision)


def test_tf32_follows_pytorchs_switch_on_ampere_only() -> None:
    g = _conv_graph()
    a100, v100 = Cluster.from_spec("1xA100-80GB"), Cluster.from_spec("1xV100")
    on = analytic_costs(g, a100, tf32=True).total("A100-80GB")  # type: ignore[arg-type]
    off = analytic_costs(g, a100, tf32=False).total("A100-80GB")  # type: ignore[arg-type]
    assert on < off / 1.5  # TF32 tensor cores vs fp32 FMA
    assert "tf32" in analytic_costs(g, a100, tf32=True).meta["rates"]["A100-80GB"]  # type: ignore[arg-type]
    v_on = analytic_costs(g, v100, tf32=True).total("V100")  # type: ignore[arg-type]
    v_off = analytic_costs(g, v100, tf32=False).total("V100")  # type: ignore[arg-type]
    assert v_on == v_off  # Volta has no TF32


def test_p40_fp16_is_fp16_storage_with_fp32_math() -> None:
    fp32 = analytic_costs(_conv_graph(), Cluster.from_spec("1xP40")).total("P40")  # type: ignore[arg-type]
    half = _conv_graph(precision="fp16")
    amp = analytic_costs(half, Cluster.from_spec("1xP40")).total("P40")  # type: ignore[arg-type]
    assert 0.5 < amp / fp32 < 1.2  # not 64x slower: cuDNN computes in fp32 there
    rates = analytic_costs(half, Cluster.from_spec("1xP40")).meta["rates"]["P40"]  # type: ignore[arg-type]
    assert "fp32 math" in rates


def test_in_place_relu_moves_its_bytes() -> None:
    g = _conv_graph(inplace=True)
    table = analytic_costs(g, Cluster.from_spec("1xV100"))  # type: ignore[arg-type]
    relu = next(n for n in g.nodes if "relu" in n.kind)  # type: ignore[attr-defined]
    launch = Cluster.from_spec("1xV100").devices[0].launch_overhead_s
    assert table.fwd_s(relu.name, "V100") > launch + relu.out_bytes / 900e9


def test_grouped_convolutions_achieve_less_per_flop() -> None:
    v100 = Cluster.from_spec("1xV100")
    dense, grouped = _conv_graph(), _conv_graph(groups=64)
    per_flop = []
    for g in (dense, grouped):
        conv = next(n for n in g.nodes if n.kind.startswith("conv"))  # type: ignore[attr-defined]
        per_flop.append(analytic_costs(g, v100).fwd_s(conv.name, "V100") / conv.fwd_flops)  # type: ignore[arg-type]
    assert per_flop[1] > 2 * per_flop[0]


def test_the_all_reduce_overlaps_the_backward() -> None:
    import crosscut
    from crosscut.partitioner.simulate import simulate

    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(3 * 32 * 32, 2048)]
    for _ in range(8):  # 16 MB of weights each: several 25 MB buckets
        layers += [nn.ReLU(), nn.Linear(2048, 2048)]
    model = nn.Sequential(*layers)
    plan = crosscut.partition(model, "1xV100", torch.empty(64, 3, 32, 32, device="meta"))
    plan.cluster.nodes, plan.cluster.network = 4, [12.5e9, 5e-6]
    plan.cluster.node_link = [50e9, 5e-6]
    plan.replication.replicas = 32
    red = reduction(plan, 32)
    assert len(red.positions[0].buckets) >= 2  # DDP's 1 MB first bucket, then 25 MB
    sim = simulate(plan)
    assert 0 <= sim.exposed_s < red.seconds  # the first buckets ran during the backward
    plan.cluster.nics = 4
    assert reduction(plan, 32).seconds < red.seconds


@pytest.mark.slow
@pytest.mark.parametrize(
    "point", [p for p in PUBLISHED if p.fitted], ids=lambda p: f"{p.model}-{p.kind}-{p.precision}"
)
def test_single_gpu_throughput_within_15_percent_of_published(point: object) -> None:
    got = bench.predict(point)  # type: ignore[arg-type]
    want = point.images_per_s  # type: ignore[attr-defined]
    assert abs(got / want - 1) <= TOL, (got, want)


HELD_OUT = [p for p in PUBLISHED if not p.fitted]


@pytest.mark.slow
@pytest.mark.parametrize(
    "point",
    [p for p in HELD_OUT if p.precision == "fp32" and p.source not in ("dle-tf2", "lambda")],
    ids=lambda p: f"{p.model}-{p.kind}-{p.precision}",
)
def test_held_out_fp32_points_within_20_percent(point: object) -> None:
    """Points no parameter was fitted to: VGG-16 (all 3x3 Winograd convolutions) and
    EfficientNet-B0/B4 in fp32 and TF32 (depthwise convolutions, memory-bound ops)."""
    got = bench.predict(point)  # type: ignore[arg-type]
    assert abs(got / point.images_per_s - 1) <= 0.20, got  # type: ignore[attr-defined]


_PT_HALF = [p for p in HELD_OUT if p.precision == "fp16" and p.source == "dle-effnet"]


@pytest.mark.slow
@pytest.mark.parametrize("point", _PT_HALF, ids=lambda p: f"{p.model}-{p.kind}")
def test_held_out_efficientnet_mixed_precision_within_35_percent(point: object) -> None:
    """PyTorch's EfficientNets under AMP: within 35 % (1.01-1.34x published) once depthwise
    convolutions run on the CUDA cores (they were 1.30-1.85x priced on tensor cores)."""
    got = bench.predict(point)  # type: ignore[arg-type]
    assert abs(got / point.images_per_s - 1) <= 0.35, got  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="PyTorch 21.03 runs EfficientNet under AMP 1.3x slower than priced (B0, B4 on "
    "A100): TensorFlow2 with XLA runs the same models within 9 % of the price "
    "(test_tf2_one_gpu_point), so the rest is that framework's unfused kernels",
)
def test_held_out_efficientnet_mixed_precision() -> None:
    assert all(abs(bench.predict(p) / p.images_per_s - 1) <= TOL for p in _PT_HALF)


_TF2_OUT = {
    ("efficientnet_b0", "V100-32GB", "fp16"): "AMP is 1.15x fp32 on one V100 in the README: "
    "bound by something other than the GPU's arithmetic (the input pipeline, not priced)",
}  # B4 in fp32 on a V100 (1.15) is inside since autograd's copy before an in-place SiLU
# is priced (1.11; op_terms.autograd_copy_bytes)


@pytest.mark.slow
@pytest.mark.parametrize(
    "point",
    [
        pytest.param(
            p,
            marks=[pytest.mark.xfail(strict=True, reason=_TF2_OUT[key])]
            if (key := (p.model, p.kind, p.precision)) in _TF2_OUT
            else [],
            id=f"{p.model}-{p.kind}-{p.precision}",
        )
        for p in HELD_OUT
        if p.source == "dle-tf2"
    ],
)
def test_tf2_one_gpu_point(point: object) -> None:
    """TensorFlow2 + XLA's one-GPU EfficientNet rows (held out, TF32 and AMP): within 15 %."""
    got = bench.predict(point)  # type: ignore[arg-type]
    assert abs(got / point.images_per_s - 1) <= TOL, got  # type: ignore[attr-defined]


_A100_TF32 = (
    "Lambda's A100 TF32 run (NGC 22.09+, batch 640) is 14 % faster than DeepLearningExamples' "
    "fitted one (21.03, batch 256, 0.92) on the same card, where the model prices the two "
    "within 2 %; the H100's TF32 rows are at 0.85-0.87"
)
_GEFORCE_AMP = (
    "GA10x and Ada in AMP priced 0.74-0.81 (RTX 3090, RTX A6000, RTX 4090), where their TF32 "
    "rows land at 0.92-0.99 and the RTX 6000 Ada's and A10's AMP rows at 0.92-0.97: the A100's "
    "tensor-core fraction, assumed for these parts, is not theirs (not fitted: no published "
    "point of these parts is in the fit)"
)
_LAMBDA_OUT = {
    ("A100-80GB", "fp32"): f"priced 0.82: {_A100_TF32}",
    ("A100-PCIe-40GB", "fp32"): f"priced 0.84, as the SXM part: {_A100_TF32}",
    ("A100-PCIe-80GB", "fp32"): f"priced 0.84, as the SXM part: {_A100_TF32}",
    ("RTX8000", "fp32"): "priced 1.24 on Volta's fractions (assumed for Turing); its AMP row "
    "lands at 1.02",
    ("RTX3090", "fp16"): f"priced 0.74: {_GEFORCE_AMP}",
    ("RTXA6000", "fp16"): f"priced 0.81: {_GEFORCE_AMP}",
    ("RTX4090", "fp16"): f"priced 0.78: {_GEFORCE_AMP}",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "point",
    [
        pytest.param(
            p,
            marks=[pytest.mark.xfail(strict=True, reason=_LAMBDA_OUT[key])]
            if (key := (p.kind, p.precision)) in _LAMBDA_OUT
            else [],
            id=f"{p.kind}-{p.precision}",
        )
        for p in HELD_OUT
        if p.source == "lambda"
    ],
)
def test_lambda_one_gpu_resnet50_point(point: object) -> None:
    """An independent source, held out: Lambda's one-GPU ResNet-50 on V100, A100 and H100,
    and on nine parts no point was fitted on (Turing, GA10x, Ada, the PCIe A100 and H100).
    In fp32 (TF32 on A100 and H100, as PyTorch runs it) and in AMP, run NCHW (priced
    with cuDNN's transposes and NCHW batch norm's kernels), each within 15 %."""
    got = bench.predict(point)  # type: ignore[arg-type]
    assert abs(got / point.images_per_s - 1) <= TOL, got  # type: ignore[attr-defined]


# every row within 15 % from the 16th session to the 22nd
_MEASURED_OUT: dict[tuple[str, ...], str] = {
    ("H100", "mobilenet_v2", "fp16", "nhwc"): "priced 0.85 (0.90 before): autograd's copy of "
    "the input of every in-place ReLU6, real on every device (HardtanhBackward0 saves its "
    "input), is priced since the 22nd session; the rest of MobileNetV2's H100 price was "
    "already 10 % under its step, on the same prices that put the H200's within 8 %, and "
    "no GPU has been lent since to find which ops",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "point",
    [
        pytest.param(
            p,
            marks=[pytest.mark.xfail(strict=True, reason=_MEASURED_OUT[key])]
            if (key := (p.kind, p.model, p.precision, p.layout)) in _MEASURED_OUT
            or (key := (p.model, p.precision, p.layout)) in _MEASURED_OUT
            else [],
            id=f"{p.kind}-{p.model}-{p.precision}-{p.layout}-{p.batch}"
            + ("" if p.tf32 else "-notf32"),
        )
        for p in MEASURED
    ],
)
def test_crosscuts_own_gpu_measurements(point: object) -> None:
    """benchmarks/gpu_check.py's H100 and H200 throughputs (``calibration.MEASURED``):
    every math mode (TF32 on and off, fp16, bf16) and both layouts on one machine, each
    within 15 %; those that are not, strict xfails naming what the per-node profiles
    show. The H200's rows were all held out: none set a constant."""
    got = bench.predict(point)  # type: ignore[arg-type]
    assert abs(got / point.images_per_s - 1) <= TOL, got  # type: ignore[attr-defined]


def test_batch_norm_is_priced_by_the_kernels_pytorch_runs_it_with() -> None:
    """Training batch norm of a 16-bit NCHW tensor runs cuDNN's non-persistent kernels
    and bf16 runs slower again (measured on an H100: ``BN_16BIT_KERNELS``): its memory
    time scales by that factor against fp16 channels-last, the fitted baseline. fp32
    (whose fitted points ran NCHW), inference and a CPU keep theirs."""
    from crosscut.cost_models.analytic import BN_16BIT_KERNELS, MathFlags, bn_kernels, node_times
    from crosscut.cost_models.devices import preset
    from crosscut.cost_models.op_terms import bn_channel_occupancy, bn_nhwc_occupancy

    def bn_time(precision: str, last: bool, kind: str, mode: str = "train") -> float:
        net = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64))
        x = torch.empty(256, 64, 56, 56, device="meta")  # memory-bound, as in ResNet-50
        if last:
            net, x = (
                net.to(memory_format=torch.channels_last),
                x.to(memory_format=torch.channels_last),
            )
        g = trace(net, x, mode=mode, precision=precision)
        bn = next(n for n in g.nodes if "batch_norm" in n.kind)
        spec = preset(kind) if kind != "cpu" else Cluster.from_spec("1xcpu").devices[0]
        gpu_train = kind != "cpu" and mode == "train"
        kernels = BN_16BIT_KERNELS.get((bn.dtype, last), 1.0) if gpu_train else 1.0
        occupancy = bn_channel_occupancy(bn, spec) if gpu_train and not last else 1.0
        if gpu_train and last and precision != "fp32":  # 64 channels: short 16-bit rows
            occupancy = bn_nhwc_occupancy(bn)
            assert 1.05 < occupancy < 1.1
        assert bn_kernels(g, bn, spec) == pytest.approx(kernels * occupancy)
        return sum(node_times(g, bn, spec, MathFlags()))

    for kind in ("V100", "A100-80GB", "H100"):
        base = bn_time("fp16", True, kind)
        assert bn_time("fp16", False, kind) > 1.5 * base
        assert bn_time("bf16", True, kind) > 1.2 * base
        assert bn_time("bf16", False, kind) > bn_time("fp16", False, kind)
        # 64 channels leave SMs idle in NCHW: fp32 too (bn_channel_occupancy)
        assert bn_time("fp32", False, kind) > 1.1 * bn_time("fp32", True, kind)
        assert bn_time("fp16", False, kind, "infer") == bn_time("fp16", True, kind, "infer")
    assert bn_time("bf16", False, "cpu") == bn_time("bf16", True, "cpu")
    # the plan's record of its rates names the batch-norm kernels it was priced with
    from crosscut.cost_models.analytic import priced_rate

    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    for precision, layout, factor in (("fp16", False, "1.39"), ("bf16", True, "1.31")):
        x = torch.empty(8, 3, 16, 16, device="meta")
        if layout:
            net, x = (
                net.to(memory_format=torch.channels_last),
                x.to(memory_format=torch.channels_last),
            )
        g = trace(net, x, precision=precision)
        where = "channels-last" if layout else "NCHW"
        assert (
            f"batch norm: {where} {precision} kernels priced at {factor}x fp16 channels-last's"
            in priced_rate(g, preset("H100"))["math"]
        )  # type: ignore[operator]
    g = trace(net, x, precision="fp16")
    assert not any("batch norm" in m for m in priced_rate(g, preset("H100"))["math"])  # type: ignore[union-attr]
    fresh = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))  # fp32 NCHW: occupancy only
    g = trace(fresh, torch.empty(8, 3, 16, 16, device="meta"))
    math_modes = priced_rate(g, preset("H100"))["math"]
    assert any("NCHW channel occupancy priced" in m for m in math_modes)  # type: ignore[union-attr]
    assert not any("kernels priced at" in m for m in math_modes)  # type: ignore[union-attr]


def test_cudnn_picks_its_fp32_kernels_where_they_beat_the_tensor_cores() -> None:
    """cudnn.benchmark times cuDNN's fp32 kernels (Winograd for a 3x3) beside its TF32 and
    pseudo-half tensor-core ones and keeps the faster: on an A100 or H100 the tensor cores
    win, on an RTX 3090 (TF32 35.6 TFLOPS, fp32 35.6) a 3x3 convolution runs fp32
    Winograd. Before: TF32 forced, Lambda's RTX 3090 ResNet-50 priced at 0.61 of its
    published rate (0.95 now), the RTX 4090 at 0.65 (0.99)."""
    from crosscut.cost_models.analytic import node_times
    from crosscut.cost_models.conv_math import MathFlags, flop_times, node_mode, priced_mode
    from crosscut.cost_models.devices import preset

    net = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1))
    for precision in ("fp32", "fp16"):
        g = trace(net, torch.empty(64, 64, 28, 28, device="meta"), precision=precision)
        c3 = next(n for n in g.nodes if n.conv is not None)  # the 3x3
        flags = MathFlags()
        for kind, fma_wins in (("A100-80GB", False), ("H100", False), ("RTX3090", True)):
            spec = preset(kind)
            mode = priced_mode(g, c3, spec, flags)
            assert (mode.unit == "fma") == fma_wins, (kind, precision, mode)
            tensor = node_mode(c3, spec, flags)
            assert tensor.unit in ("tf32", "tensor")
            moved = float(c3.read_bytes + c3.out_bytes)
            ck = (0.0, 1.0) if precision == "fp32" else (1.5 * c3.param_bytes, 2.0)
            on_tensor = flop_times(g, c3, spec, tensor, 1.0, moved, ck)
            got = node_times(g, c3, spec, flags)
            assert sum(got) <= sum(on_tensor) * (1 + 1e-12)
            assert (sum(got) < sum(on_tensor)) == fma_wins, (kind, precision)
        # with TF32 off an fp32 convolution is FMA math anyway: nothing to choose
        if precision == "fp32":
            off = MathFlags(False, False)
            assert priced_mode(g, c3, preset("RTX3090"), off).name == "fp32 FMA"


def test_the_workstation_and_consumer_presets_parse_and_price() -> None:
    """The 31st session's presets: each parses as a cluster spec (an ``-PCIe`` in a
    preset's name is not a topology), sits on PCIe by default, and has its generation's
    fractions and its SM count."""
    from crosscut.cost_models.efficiency import GENERATIONS, efficiency_of, sm_count

    for kind in ("RTX8000", "T4", "A10", "A40", "RTXA6000", "RTX3090", "A100-PCIe-40GB",
                 "A100-PCIe-80GB", "L4", "L40S", "RTX6000Ada", "RTX4090", "H100-PCIe"):  # fmt: skip
        cluster = Cluster.from_spec(f"2x{kind}")
        assert cluster.devices[0].kind == kind and cluster.devices[0].mem_bw > 0
        assert kind in GENERATIONS and sm_count(kind) != 80  # 80: an unknown GPU's
        assert efficiency_of(kind, "cuda:0").generation == GENERATIONS[kind]
        assert cluster.bandwidth[0][1] <= 50e9  # PCIe, not NVLink
    h100 = Cluster.from_spec("1xH100-PCIe").devices[0]
    assert h100.peak("float32") == 51e12 and h100.mem_bw == 2000e9
    assert Cluster.from_spec("2xV100-pcie").devices[0].kind == "V100"  # a topology still
    with pytest.raises(Exception, match="no NVLink preset"):
        Cluster.from_spec("2xRTX4090-nvlink")


def test_nchw_tensor_core_convolutions_pay_the_transposes() -> None:
    """A model left in PyTorch's default NCHW layout runs a 16-bit or TF32 convolution on
    tensor cores behind cuDNN's transposes to NHWC and back: priced as that memory traffic
    (``nchw_transposes``) plus the transpose kernels, forward and backward. A model
    converted to channels-last (weights or input) pays none, and neither does fp32 FMA
    math (a V100, or TF32 switched off), nor a CPU."""
    from crosscut.cost_models.analytic import node_times
    from crosscut.cost_models.conv_math import (
        NCHW_BWD_KERNELS,
        NCHW_FWD_KERNELS,
        MathFlags,
        nchw_transposes,
    )
    from crosscut.cost_models.devices import preset
    from crosscut.cost_models.efficiency import efficiency_of
    from crosscut.frontend.tracer import runs_channels_last

    def graph(last: bool, precision: str, by_input: bool = False) -> object:
        net = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.ReLU())
        x = torch.empty(32, 64, 28, 28, device="meta")
        if last:
            x = x.to(memory_format=torch.channels_last)
            net = net if by_input else net.to(memory_format=torch.channels_last)
        return trace(net, x, precision=precision)

    nchw, nhwc = graph(False, "fp16"), graph(True, "fp16")
    assert not nchw.channels_last and nhwc.channels_last  # type: ignore[attr-defined]
    # the same model in another layout runs other kernels: its profile is cached apart,
    # while a plan made for one layout still replays on the other (same fingerprint)
    from crosscut.cost_models.profiled import cache_key

    assert nchw.fingerprint() == nhwc.fingerprint()  # type: ignore[attr-defined]
    assert cache_key(nchw, "cpu") != cache_key(nhwc, "cpu")  # type: ignore[arg-type]
    # the plan's record of its rates says so (Plan.rates, the summary and the report)
    from crosscut.cost_models.analytic import priced_rate

    v100 = preset("V100")
    assert (
        "NCHW: cuDNN's transposes priced (channels_last avoids them)"
        in priced_rate(nchw, v100)["math"]
    )  # type: ignore[arg-type]
    assert not any("NCHW" in m for m in priced_rate(nhwc, v100)["math"])  # type: ignore[arg-type]
    fp32_nchw = graph(False, "fp32")  # TF32 on an A100 pays them too; fp32 FMA on a V100 not
    assert any("NCHW: cuDNN" in m for m in priced_rate(fp32_nchw, preset("A100-80GB"))["math"])  # type: ignore[arg-type]
    assert not any("NCHW: cuDNN" in m for m in priced_rate(fp32_nchw, v100)["math"])  # type: ignore[arg-type]
    assert graph(True, "fp16", by_input=True).channels_last  # type: ignore[attr-defined]
    net = nn.Conv2d(8, 8, 1).to(memory_format=torch.channels_last)  # 1x1: both layouts
    assert not runs_channels_last(net, [torch.empty(2, 8, 4, 4)])
    flags = MathFlags()
    for kind in ("V100", "A100-80GB", "H100"):
        spec = preset(kind)
        bw = spec.mem_bw * efficiency_of(spec.kind, spec.device).memory
        conv_a = next(n for n in nchw.nodes if n.conv is not None)  # type: ignore[attr-defined]
        conv_b = next(n for n in nhwc.nodes if n.conv is not None)  # type: ignore[attr-defined]
        fa, ba = node_times(nchw, conv_a, spec, flags)  # type: ignore[arg-type]
        fb, bb = node_times(nhwc, conv_b, spec, flags)  # type: ignore[arg-type]
        b_fwd, b_bwd = nchw_transposes(conv_a)
        launch = spec.launch_overhead_s
        assert fa - fb == pytest.approx(b_fwd / bw + NCHW_FWD_KERNELS * launch)
        assert ba - bb == pytest.approx(b_bwd / bw + NCHW_BWD_KERNELS * launch)
        assert b_bwd > b_fwd > 0
        g32a, g32b = graph(False, "fp32"), graph(True, "fp32")
        c32a = next(n for n in g32a.nodes if n.conv is not None)  # type: ignore[attr-defined]
        c32b = next(n for n in g32b.nodes if n.conv is not None)  # type: ignore[attr-defined]
        fma = MathFlags(False, False)  # TF32 off: FMA math reads NCHW as it is
        assert node_times(g32a, c32a, spec, fma) == node_times(g32b, c32b, spec, fma)  # type: ignore[arg-type]
        t_a, t_b = node_times(g32a, c32a, spec, flags), node_times(g32b, c32b, spec, flags)  # type: ignore[arg-type]
        if kind == "V100":  # no TF32 on Volta: fp32 is FMA math either way
            assert t_a == t_b
        else:  # TF32 tensor cores behind the same transposes, of 4-byte elements, or
            # cuDNN's fp32 kernels where those are faster (conv_math.conv_choice)
            f32, b32 = nchw_transposes(c32a)
            assert b32 > f32 > 0
            tensor = (
                t_b[0] + f32 / bw + NCHW_FWD_KERNELS * launch,
                t_b[1] + b32 / bw + NCHW_BWD_KERNELS * launch,
            )
            fp32 = node_times(g32a, c32a, spec, fma)  # type: ignore[arg-type]
            want = tensor if sum(tensor) <= sum(fp32) else fp32
            assert t_a == pytest.approx(want)


def test_depthwise_convolutions_run_half_precision_on_cuda_cores() -> None:
    """No tensor-core kernel serves a depthwise convolution (one channel in, one out per
    group: nothing to fill a matrix tile), so in fp16 it runs at the CUDA cores' half
    rate (V100: 2x fp32, A100: 4x); a grouped one with several channels per group, a
    dense one, and fp32 keep their modes."""
    from crosscut.cost_models.conv_math import MathFlags, node_mode
    from crosscut.cost_models.devices import preset

    def conv(groups: int, out: int = 64) -> object:
        g = trace(
            nn.Conv2d(64, out, 3, padding=1, groups=groups, bias=False),
            torch.empty(8, 64, 28, 28, device="meta"),
        )
        node = next(n for n in g.nodes if n.kind.startswith("conv"))
        node.dtype = "float16"
        return node

    flags = MathFlags()
    for kind, ratio in (("V100", 2.0), ("A100-80GB", 4.0)):
        spec = preset(kind)
        depthwise = node_mode(conv(64), spec, flags)  # type: ignore[arg-type]
        assert depthwise.unit == "fma" and "depthwise" in depthwise.name
        assert depthwise.peak == pytest.approx(spec.peak_flops["float32"] * ratio)
        for other in (conv(1), conv(16), conv(64, out=128)):  # dense, 4 per group, x2
            assert node_mode(other, spec, flags).unit == "tensor"  # type: ignore[arg-type]
    assert node_mode(conv(64), preset("P100"), flags).unit == "fma"  # type: ignore[arg-type]


def test_a_depthwise_backward_is_two_convolutions_of_its_forward_size() -> None:
    """torch 2.14's formula leaves groups out of a convolution's backward: a depthwise
    3x3 on 144 channels counted 145x its forward. Each gradient is one forward's work."""
    for groups in (1, 4, 144):
        model = nn.Conv2d(144, 144, 3, padding=1, groups=groups, bias=False)
        g = trace(model, torch.empty(8, 144, 16, 16, device="meta"))
        conv = next(n for n in g.nodes if n.kind.startswith("conv"))
        assert conv.fwd_flops == 2 * 8 * 144 * 16 * 16 * (144 // groups) * 9
        assert conv.bwd_flops == 2 * conv.fwd_flops  # input and weight gradients
        assert conv.conv is not None and conv.conv["groups"] == groups


def test_winograd_prices_dense_3x3_stride_1_fp32_only() -> None:
    from crosscut.cost_models.conv_math import winograd
    from crosscut.cost_models.efficiency import WINOGRAD, efficiency_of

    def conv_node(**kw: int) -> object:
        model = nn.Conv2d(64, 64, bias=False, **kw)
        g = trace(model, torch.empty(32, 64, 28, 28, device="meta"))
        return next(n for n in g.nodes if n.kind.startswith("conv"))

    dense = conv_node(kernel_size=3, padding=1)
    assert winograd(dense)  # type: ignore[arg-type]
    for other in (
        conv_node(kernel_size=3, padding=1, stride=2),
        conv_node(kernel_size=1),
        conv_node(kernel_size=3, padding=1, groups=64),
        conv_node(kernel_size=3, padding=2, dilation=2),
    ):
        assert not winograd(other)  # type: ignore[arg-type]
    g = trace(
        nn.Conv2d(256, 256, 3, padding=1, bias=False), torch.empty(64, 256, 28, 28, device="meta")
    )
    conv = next(n for n in g.nodes if n.kind.startswith("conv"))
    v100 = analytic_costs(g, Cluster.from_spec("1xV100"))
    fma = efficiency_of("V100", "cuda").fma
    flops_time = conv.fwd_flops / (15.7e12 * fma)  # the fp32 FMA rate before Winograd
    assert v100.fwd_s(conv.name, "V100") < flops_time / (WINOGRAD * 0.9)
    a100 = analytic_costs(g, Cluster.from_spec("1xA100-80GB"), tf32=True)
    tf32 = analytic_costs(g, Cluster.from_spec("1xA100-80GB"), tf32=False)
    assert a100.fwd_s(conv.name, "A100-80GB") < tf32.fwd_s(conv.name, "A100-80GB")


@pytest.mark.slow
def test_the_committed_fractions_are_what_the_fit_gives() -> None:
    """``benchmarks/fit_efficiency.py`` refits each large-op fraction so its published
    points' geometric-mean ratio is 1. The committed fractions (first fitted by hand)
    must stay within its tolerance (10 %; the hand fit sits within 7 %) of that: a
    change to how ops are counted that moves the fit further fails here until the
    fractions are refitted, instead of being absorbed."""
    import fit_efficiency

    from crosscut.cost_models.efficiency import EFFICIENCIES

    before = dict(EFFICIENCIES)
    got = fit_efficiency.main([])
    assert dict(EFFICIENCIES) == before  # restored
    assert len(got) == len(fit_efficiency.FIELDS)
    for (generation, field), (committed, fitted) in got.items():
        assert abs(fitted / committed - 1) <= fit_efficiency.TOLERANCE, (generation, field)


@pytest.mark.slow
def test_per_op_reprices_the_recorded_h100_profiles() -> None:
    """``benchmarks/per_op.py`` re-prices the H100's per-node profiles with the current
    analytic model. Its stage cut must be right for its imbalance figures to mean
    anything: priced as measured (every op kind named in ``--oracle``), the per-op error
    is zero and four stages cut at equal price come out within 10 % of even."""
    import per_op

    rows = per_op.main(["--models", "resnet50"])
    assert len(rows) == 6  # three precisions, two layouts
    for row in rows:
        assert 0.5 < row.ratio < 2.0 and row.l1 > 0.05
        assert all(v >= 1.0 for v in row.imbalance.values())
    every = ",".join(sorted({k for row in rows for k in row.kinds}))
    for row, exact in zip(rows, per_op.main(["--models", "resnet50", "--oracle", every])):
        assert exact.l1 < 1e-9 and abs(exact.ratio - 1.0) < 1e-9
        assert exact.imbalance[4] < 1.10 and exact.imbalance[4] <= row.imbalance[4]


@pytest.mark.slow
def test_per_op_prices_balance_resnet50_stages_on_the_h100() -> None:
    """The per-op physics (the stem on CUDA cores, NCHW batch norm's channel occupancy,
    max pool's gather, ``add``'s free backward and the gradient sums where a tensor
    fans out) against the H100's recorded per-node times: ResNet-50 cut into four
    stages of equal analytic price comes out within 25 % of even on average over the
    six precisions and layouts (1.35 before those terms), and the per-node error stays
    below a third (0.41 before)."""
    import per_op

    rows = per_op.main(["--models", "resnet50"])
    assert sum(r.imbalance[4] for r in rows) / len(rows) <= 1.25
    assert sum(r.l1 for r in rows) / len(rows) <= 0.33


def _one(module: nn.Module, x: torch.Tensor, kind: str, precision: str = "fp32") -> object:
    g = trace(module, x, mode="train", precision=precision)
    return g, next(n for n in g.nodes if n.kind == kind)


def test_an_rgb_stem_runs_on_cuda_cores() -> None:
    """A dense convolution with fewer than 8 input channels cannot fill the tensor cores'
    loads: priced on the CUDA cores in fp16 (at the half-precision FMA rate) and in
    fp32 with TF32 on; 8 channels and a grouped convolution with 4 per group keep the
    tensor cores (``narrow_input``)."""
    from crosscut.cost_models.conv_math import MathFlags, narrow_input, node_mode
    from crosscut.cost_models.devices import preset

    spec, flags = preset("A100-80GB"), MathFlags()
    _, stem = _one(nn.Conv2d(3, 64, 7, 2, 3), torch.empty(8, 3, 64, 64, device="meta"), "conv2d")
    _, eight = _one(nn.Conv2d(8, 64, 3), torch.empty(8, 8, 32, 32, device="meta"), "conv2d")
    _, grouped = _one(
        nn.Conv2d(128, 128, 3, groups=32), torch.empty(8, 128, 16, 16, device="meta"), "conv2d"
    )
    assert narrow_input(stem) and not narrow_input(eight) and not narrow_input(grouped)  # type: ignore[arg-type]
    assert node_mode(stem, spec, flags).name == "fp32 FMA"  # type: ignore[arg-type]
    assert node_mode(eight, spec, flags).unit == "tf32"  # type: ignore[arg-type]
    for node in (stem, eight, grouped):
        node.dtype = "float16"  # type: ignore[attr-defined]
    half = node_mode(stem, spec, flags)  # type: ignore[arg-type]
    assert half.unit == "fma" and "few input channels" in half.name
    assert node_mode(eight, spec, flags).unit == "tensor"  # type: ignore[arg-type]
    assert node_mode(grouped, spec, flags).unit == "tensor"  # type: ignore[arg-type]


def test_max_pool_backward_is_priced_as_its_gather() -> None:
    """The tracer records a max pool's window; on a GPU its training backward reads, per
    input element, the int64 index and the gradient of each covering window
    (``prod(kernel / stride)``), so ResNet's overlapping 3x3/2 pool costs more than a
    2x2/2 one of the same tensors; a CPU prices its outputs (``cpu_terms``)."""
    from crosscut.cost_models import cpu_terms as ct
    from crosscut.cost_models.analytic import MathFlags, node_times
    from crosscut.cost_models.devices import preset
    from crosscut.cost_models.op_terms import max_pool_bytes

    x = torch.empty(32, 64, 112, 112, device="meta")
    g3, p3 = _one(nn.MaxPool2d(3, 2, 1), x, "max_pool2d")
    g2, p2 = _one(nn.MaxPool2d(2, 2), x, "max_pool2d")
    assert p3.pool == {"kernel": [3, 3], "stride": [2, 2]}  # type: ignore[attr-defined]
    assert p2.pool == {"kernel": [2, 2], "stride": [2, 2]}  # type: ignore[attr-defined]
    inp = 32 * 64 * 112 * 112
    fwd, bwd = max_pool_bytes(p3)  # type: ignore[arg-type]
    assert bwd == pytest.approx(inp * (2.25 * (8 + 4) + 4))
    assert fwd == pytest.approx(inp * 4 + (inp / 4) * (4 + 8))
    spec, flags = preset("H100"), MathFlags()
    assert node_times(g3, p3, spec, flags)[1] > 1.5 * node_times(g2, p2, spec, flags)[1]  # type: ignore[arg-type]
    cpu = Cluster.from_spec("1xcpu").devices[0]
    fwd, bwd = node_times(g3, p3, cpu, flags)  # type: ignore[arg-type]
    outputs = inp / 4
    launch = cpu.launch_overhead_s
    rate = cpu.peak("float32")
    per_output = ct.CPU_POOL_OUTPUT_FLOPS + 9 * ct.CPU_POOL_TAP_FLOPS  # a 3x3 window
    assert fwd == pytest.approx(outputs * per_output / rate + launch)
    assert bwd == pytest.approx(outputs * ct.CPU_POOL_BWD_FLOPS / rate + launch)


def test_an_add_passes_its_gradient_and_fan_out_pays_the_sum() -> None:
    """A residual ``add`` has no backward kernel (autograd hands the gradient to both
    inputs); the tensor read by both the block and the shortcut pays one add of the
    two gradients in its backward instead (``fan_out_seconds``)."""
    from crosscut.cost_models.analytic import analytic_costs
    from crosscut.cost_models.op_terms import consumers, passes_gradient_through

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(16, 16, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(x)
            return self.conv(y) + y

    g = trace(Block(), torch.empty(8, 16, 32, 32, device="meta"), mode="train")
    add = next(n for n in g.nodes if n.kind == "add")
    relu = next(n for n in g.nodes if n.kind == "relu")
    assert passes_gradient_through(g, add) and consumers(g)[relu.name] == 2
    table = analytic_costs(g, Cluster.from_spec("1xH100"))
    assert table.nodes[add.name].bwd["H100"] == 0.0
    alone = trace(nn.ReLU(), torch.empty(8, 16, 32, 32, device="meta"), mode="train")
    single = analytic_costs(alone, Cluster.from_spec("1xH100"))
    (r,) = [n for n in alone.nodes if n.kind == "relu"]
    assert table.nodes[relu.name].bwd["H100"] > 1.5 * single.nodes[r.name].bwd["H100"]


def test_nchw_batch_norm_occupancy_follows_the_h100_curve() -> None:
    """``bn_channel_occupancy`` on the H100 gives the measured ratios (2.8-2.9x at 64
    channels, 1.5-1.8x at 128, about 1 from 512) and scales with a GPU's bandwidth: a
    V100 fills from fewer channels."""
    from crosscut.cost_models.devices import preset
    from crosscut.cost_models.op_terms import bn_channel_occupancy

    def occ(channels: int, kind: str) -> float:
        net = nn.Sequential(nn.BatchNorm2d(channels))
        _, bn = _one(net, torch.empty(8, channels, 8, 8, device="meta"), "batch_norm")
        return bn_channel_occupancy(bn, preset(kind))  # type: ignore[arg-type]

    assert 2.6 < occ(64, "H100") < 2.9 and 1.5 < occ(128, "H100") < 1.8
    assert occ(512, "H100") < 1.06 and occ(2048, "H100") < 1.01
    assert occ(64, "V100") < occ(64, "A100-80GB") < occ(64, "H100")


@pytest.mark.parametrize(
    ("gpu", "gib", "kind"),
    [
        ("NVIDIA H100 80GB HBM3", 80, "H100"),
        ("NVIDIA H100 PCIe", 80, "H100-PCIe"),
        ("NVIDIA H200", 141, "H200"),
        ("NVIDIA A100-SXM4-80GB", 80, "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", 40, "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", 40, "A100-PCIe-40GB"),
        ("NVIDIA A100 80GB PCIe", 80, "A100-PCIe-80GB"),
        ("NVIDIA A10", 24, "A10"),
        ("NVIDIA A40", 48, "A40"),
        ("NVIDIA L4", 24, "L4"),
        ("NVIDIA L40S", 48, "L40S"),
        ("NVIDIA GeForce RTX 4090", 24, "RTX4090"),
        ("NVIDIA GeForce RTX 3090", 24, "RTX3090"),
        ("NVIDIA RTX A6000", 48, "RTXA6000"),
        ("NVIDIA RTX 6000 Ada Generation", 48, "RTX6000Ada"),
        ("Quadro RTX 8000", 48, "RTX8000"),
        ("Tesla T4", 16, "T4"),
        ("Tesla V100-SXM2-16GB", 16, "V100"),
        ("NVIDIA GeForce GTX 1080", 8, None),
        ("NVIDIA L40", 48, None),  # not an L4, nor an L40S
        ("NVIDIA A10G", 24, None),  # AWS's A10 variant: its own clocks
    ],
)
def test_a_gpu_is_matched_to_its_preset_by_name(gpu: str, gib: int, kind: str | None) -> None:
    """``Cluster.from_devices(["cuda:0"])`` prices a GPU by the preset its name matches:
    an A100 before an A10, an H100 PCIe before an H100 (before, every A100 PCIe and H100
    PCIe was priced as the SXM part, and the GA10x, Ada and Turing parts had no preset)."""
    from crosscut.cost_models.detect import preset_for_name

    assert preset_for_name(gpu, gib * 2**30) == kind
