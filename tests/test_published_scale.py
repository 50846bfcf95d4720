"""Large published ResNet-50 runs, priced as their papers ran them (issue 24).

Why: a planner that prices communication wrongly picks the wrong layout on a
cluster. The papers' scaling efficiencies are ratios of one framework's own
steps (many GPUs against one, or one server), so they check the
communication model apart from how fast each framework computed: crosscut's
predicted efficiency must stay within 0.10 of each published one. The whole
run's time is the issue's ±25 % target, which the three P100/P40 runs and
Mikami et al. miss because their frameworks computed each GPU's step 1.4-3.6x
slower than the single-GPU figures crosscut is calibrated on
(docs/BENCHMARKS.md); those are strict xfails, so a change that meets the
target shows.

Held out (``bench.HELD_OUT``): NVIDIA's TensorFlow2 EfficientNet-B0/B4 runs on
2-8 DGX A100 and 4-8 DGX-1 nodes, a framework as fast per GPU as the
containers crosscut is calibrated on, and OneFlow's DLPerf reproduction of
NVIDIA's PyTorch ResNet-50 on 2 and 4 nodes of 8 V100 with one EDR NIC each.
The three TF2 TF32 runs and two B4 AMP runs on A100 and DLPerf's four runs
must land within ±25 % of the published time (DLPerf's: one epoch at its
measured rate). DLPerf's AMP runs keep PyTorch's NCHW layout and are priced
with cuDNN's transposes (``layout="nchw"``; without them they were 0.62-0.66).
The fp32 runs on DGX-1 and the
mixed-precision runs miss, and their published scaling efficiencies (0.64-0.92
against one GPU; 0.94 for B0 on the eight NVSwitch-joined GPUs of one node,
where no network is crossed) sit below anything crosscut's all-reduce model
predicts (0.996-0.999): those losses are not the network's, and crosscut does
not price the input pipeline (AutoAugment on each GPU's share of the host's
cores). They are strict xfails with that reason.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import published_scale as bench

RUNS = {run.name: run for run in bench.RUNS}
HELD = {run.name: run for run in bench.HELD_OUT}
# the TF2 runs whose whole time lands within the target: A100, TF32
# the held-out runs whose whole time lands within the target: TF2 on A100 (TF32, and B4
# in AMP), and DLPerf's fp32 PyTorch runs on 2 and 4 DGX-1-like nodes
HELD_WITHIN = (
    "EffNet-B0 16xA100",
    "EffNet-B4 32xA100",
    "EffNet-B4 64xA100",
    "EffNet-B4 32xA100 AMP",
    "EffNet-B4 64xA100 AMP",
    "DLPerf RN50 16xV100",
    "DLPerf RN50 32xV100",
    "DLPerf RN50 16xV100 AMP",
    "DLPerf RN50 32xV100 AMP",
)
_NOT_NETWORK = (
    "the published run loses more to scaling than the network explains (0.94 on one "
    "NVSwitch node); crosscut does not price the input pipeline"
)


@pytest.fixture(scope="module")
def priced() -> dict[str, bench.Breakdown]:
    return {name: bench.breakdown(run) for name, run in (RUNS | HELD).items()}


@pytest.mark.parametrize("name", list(RUNS))
def test_predicted_scaling_efficiency_within_a_tenth_of_published(
    name: str, priced: dict[str, bench.Breakdown]
) -> None:
    got, published = priced[name].scaling, RUNS[name].scaling
    assert abs(got - published) <= 0.10, (name, got, published)


def test_a_reduction_after_the_backward_is_waited_for_whole(
    priced: dict[str, bench.Breakdown],
) -> None:
    akiba = priced["Akiba et al. 2017"]  # ChainerMN in 2017: one fused ring after backward
    assert akiba.algorithm == "ring" and akiba.exposed == pytest.approx(akiba.wire)
    for name, b in priced.items():
        assert b.exposed <= b.wire + 1e-12, name
        if name in RUNS and RUNS[name].overlap:
            # DDP-style buckets hide most of 5-37 ms behind the backward; the held-out
            # runs reduce 0.4-4 ms, where the last bucket's latency is most of what is left
            assert b.exposed < 0.5 * b.wire, name
        assert b.step == pytest.approx(b.forward + b.backward + b.update + b.overhead + b.exposed)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=pytest.mark.xfail(
                strict=True,
                reason="the paper's framework ran one GPU's step slower than crosscut's "
                "calibration (published rate / scaling efficiency vs priced rate)",
            ),
        )
        for name in RUNS
    ],
)
def test_whole_run_within_25_percent_of_published(
    name: str, priced: dict[str, bench.Breakdown]
) -> None:
    assert abs(priced[name].total / RUNS[name].published_s - 1) <= bench.TOLERANCE


@pytest.mark.parametrize(
    "name",
    [
        name
        if name in HELD_WITHIN
        else pytest.param(
            name,
            marks=pytest.mark.xfail(strict=True, reason=_NOT_NETWORK),
        )
        for name in HELD
    ],
)
def test_held_out_run_within_25_percent_of_published(
    name: str, priced: dict[str, bench.Breakdown]
) -> None:
    assert abs(priced[name].total / HELD[name].published_s - 1) <= bench.TOLERANCE


def test_held_out_runs_within_target_price_one_gpu_like_its_framework_alone(
    priced: dict[str, bench.Breakdown],
) -> None:
    """The passing held-out runs pass for the right reason: one GPU priced as that framework
    ran it, and the scaling it lost not hidden in a compensating error.

    "Framework alone" is the published per-GPU rate over the published weak
    scaling, i.e. each source's own one-GPU figure (TF2: 1,209 and 165 images/s;
    DLPerf: 367).
    """
    for name in HELD_WITHIN:
        b = priced[name]
        assert 0.85 <= b.gpu_rate / b.framework_rate <= 1.15, (name, b.gpu_rate, b.framework_rate)
        # TF2's EfficientNets on 8 HDR NICs per node: a few MB of gradients, hidden; DLPerf's
        # 102 MB through one EDR NIC per node: the scaling lost is the network's, within 0.10
        assert b.scaling >= 0.99 or abs(b.scaling - HELD[name].scaling) <= 0.10, name


def test_one_server_runs_land_within_25_percent_with_their_all_reduce_hidden() -> None:
    """Held out (``bench.ONE_SERVER``): Lambda's rows for one server of 2-8 GPUs, the same
    script and tables as its one-GPU rows (``calibration.py``), none of it fitted on.
    DDP's all-reduce inside a server (NVSwitch, NVLink, PCIe) hides behind the backward
    (0.1-1.6 ms of a 316-759 ms step exposed), so one GPU's price decides each run:
    0.85-1.15 of the published time, the 8xA100 AMP row 0.85 (its published scaling,
    0.90, is lost to something no all-reduce of 102 MB over NVSwitch costs)."""
    for run in bench.ONE_SERVER:
        b = bench.breakdown(run)
        assert abs(b.total / run.published_s - 1) <= bench.TOLERANCE, (run.name, b.total)
        assert b.exposed < 0.01 * b.step, (run.name, b.exposed, b.step)
        assert b.scaling >= 0.99, (run.name, b.scaling)
