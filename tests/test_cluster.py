"""DeviceSpec presets, cluster spec strings, topologies, detection and validation errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from crosscut.cost_models.cluster import Cluster
from crosscut.cost_models.devices import PRESETS, DeviceSpec, preset, preset_names
from crosscut.cost_models.links import GLOO_LOOPBACK, fit_alpha_beta, measure_link
from crosscut.errors import DeviceError


def test_presets_have_datasheet_numbers() -> None:
    names = preset_names()
    for kind in ("K20c", "P40", "V100", "A100-40GB", "A100-80GB", "H100", "H200", "cpu"):
        assert kind in names
    k20 = preset("K20c")
    assert k20.peak("float32") == pytest.approx(3.52e12)
    assert k20.mem_bw == pytest.approx(208e9)
    assert k20.mem_cap == int(4.8e9)
    assert k20.peak("float16") == k20.peak("float32")  # no fast fp16: falls back
    assert preset("H100").peak("bfloat16") > 10 * preset("H100").peak("float32")
    assert preset("H200").mem_cap > preset("H100").mem_cap
    for spec in PRESETS.values():
        spec.validate()
        assert DeviceSpec.from_dict(spec.to_dict()) == spec


def test_spec_string_pcie_two_switches() -> None:
    c = Cluster.from_spec("4xK20c")
    assert c.names == ["gpu0", "gpu1", "gpu2", "gpu3"]
    assert c.topology == "pcie"
    # gpu0/gpu1 share a switch, gpu2/gpu3 the other: same switch is faster and closer.
    assert c.bandwidth[0][1] > c.bandwidth[0][2]
    assert c.latency[0][1] < c.latency[0][2]
    assert c.bandwidth[2][3] == c.bandwidth[0][1]
    assert c.transfer_time(0, 1, 10**8) < c.transfer_time(1, 2, 10**8)
    assert c.transfer_time(3, 3, 10**8) == 0.0


@pytest.mark.parametrize(
    ("spec", "kind", "topology", "n"),
    [("8xH100-nvlink", "H100", "nvlink", 8), ("4xV100-pcie", "V100", "pcie", 4),
     ("2xcpu", "cpu", "cpu", 2), ("3xcpu-gloo", "cpu", "gloo", 3),
     ("2xA100-80GB", "A100-80GB", "nvlink", 2),
     ("1xP40", "P40", "pcie", 1)],
)  # fmt: skip
def test_spec_strings(spec: str, kind: str, topology: str, n: int) -> None:
    c = Cluster.from_spec(spec)
    assert len(c) == n and c.topology == topology and c.kinds == [kind]
    c.validate()


def test_nvlink_faster_than_pcie() -> None:
    assert (
        Cluster.from_spec("2xV100").bandwidth[0][1]
        > Cluster.from_spec("2xV100-pcie").bandwidth[0][1]
    )


@pytest.mark.parametrize(
    "bad", ["4xFoo", "0xV100", "V100", "4xK20c-nvlink", "2xcpu-pcie", "2xV100-gloo", "2xH100-cpu"]
)
def test_bad_specs(bad: str) -> None:
    with pytest.raises(DeviceError) as err:
        Cluster.from_spec(bad)
    if bad == "4xFoo":
        assert "K20c" in str(err.value) and "H100" in str(err.value)  # lists the presets


def test_cpu_ranks_talk_through_gloo_and_threads_copy() -> None:
    """Threads of one process hand tensors over in memory; torchrun's CPU ranks send
    them through gloo on loopback, whose per-message latency is 25x a copy's."""
    threads, ranks = Cluster.from_spec("2xcpu"), Cluster.from_spec("2xcpu-gloo")
    assert ranks.devices == threads.devices
    assert (ranks.bandwidth[0][1], ranks.latency[0][1]) == GLOO_LOOPBACK
    assert threads.latency[0][1] < ranks.latency[0][1] / 10
    small = 4096
    assert ranks.transfer_time(0, 1, small) > 10 * threads.transfer_time(0, 1, small)
    # several nodes of CPUs are processes: gloo inside each node as well as between them
    nodes = Cluster.from_spec("2x2xcpu")
    assert nodes.topology == "gloo" and nodes.latency[0][1] == GLOO_LOOPBACK[1]
    back = Cluster.from_dict(json.loads(json.dumps(ranks.to_dict())))
    assert back.topology == "gloo" and back.latency == ranks.latency
    with pytest.raises(DeviceError, match="'gloo'") as err:
        Cluster.from_spec("2xV100-gloo")
    assert err.value.remedy == "use '2xV100'"


def test_from_devices_cpu() -> None:
    c = Cluster.from_devices(["cpu", "cpu"])
    assert c.names == ["cpu0", "cpu1"] and c.topology == "cpu"
    assert all(d.device == "cpu" for d in c.devices)
    total = Cluster.from_devices(["cpu"]).devices[0].mem_cap
    assert c.devices[0].mem_cap == total // 2  # virtual devices share the RAM
    assert Cluster.from_devices([torch.device("cpu")]).names == ["cpu0"]


@pytest.mark.parametrize(
    "bad", [[], ["tpu:0"], ["cuda:x"], ["cuda:64"], ["cuda:0", "cuda:0"], 0, 65]
)
def test_from_devices_errors(bad: list[str] | int) -> None:
    with pytest.raises(DeviceError) as err:
        Cluster.from_devices(bad)
    assert "remedy" in str(err.value) or "got" in str(err.value)


def test_duplicate_cuda_is_rejected_even_without_gpu() -> None:
    if torch.cuda.is_available():
        with pytest.raises(DeviceError, match="once"):
            Cluster.from_devices(["cuda:0", "cuda:0"])
    else:
        with pytest.raises(DeviceError, match="available here"):
            Cluster.from_devices(["cuda:0", "cuda:0"])


def test_json_round_trip_and_from_any(tmp_path: Path) -> None:
    c = Cluster.from_spec("4xK20c")
    again = Cluster.from_json(c.to_json())
    assert again == c
    path = tmp_path / "cluster.json"
    c.save(path)
    assert Cluster.load(path) == c
    assert Cluster.from_any(str(path)) == c
    assert Cluster.from_any(path) == c
    assert Cluster.from_any("4xK20c") == c
    assert Cluster.from_any(c) is c
    assert Cluster.from_any(["cpu", "cpu"]).names == ["cpu0", "cpu1"]
    with pytest.raises(DeviceError):
        Cluster.from_any(3.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "i", "j", "value", "match"),
    [("bandwidth", 0, 1, -1.0, r"bandwidth\[0\]\[1\]"),
     ("bandwidth", 1, 0, 0.0, r"bandwidth\[1\]\[0\]"),
     ("latency", 0, 1, -1e-6, r"latency\[0\]\[1\]")],
)  # fmt: skip
def test_invalid_matrices(field: str, i: int, j: int, value: float, match: str) -> None:
    data = Cluster.from_spec("2xV100").to_dict()
    data[field][i][j] = value
    with pytest.raises(DeviceError, match=match):
        Cluster.from_json(json.dumps(data))


def test_non_square_and_mismatched() -> None:
    data = Cluster.from_spec("2xV100").to_dict()
    data["latency"] = [[0.0, 1e-6]]
    with pytest.raises(DeviceError, match="2x2"):
        Cluster.from_dict(data)
    data = Cluster.from_spec("2xV100").to_dict()
    data["devices"][0]["mem_bw"] = -5
    with pytest.raises(DeviceError, match="mem_bw"):
        Cluster.from_dict(data)
    with pytest.raises(DeviceError):
        Cluster.from_json("[1, 2]")
    with pytest.raises(DeviceError):
        Cluster.from_json("{not json")


def test_fit_alpha_beta_recovers_line() -> None:
    sizes = [1000, 10_000, 100_000]
    bw, lat = fit_alpha_beta(sizes, [5e-6 + s / 2e9 for s in sizes])
    assert bw == pytest.approx(2e9, rel=1e-6)
    assert lat == pytest.approx(5e-6, rel=1e-6)


def test_measure_link_cpu() -> None:
    bw, lat = measure_link("cpu", "cpu", sizes=(1 << 16, 1 << 20, 1 << 22), repeats=3, warmup=1)
    assert bw > 1e8  # any machine copies faster than 100 MB/s
    assert lat >= 0


# ---- clusters of nodes (issue 16) --------------------------------------------------------
@pytest.mark.timed
def test_nodes_spec_is_one_node_times_a_count_on_a_network() -> None:
    import time

    from crosscut.cost_models.links import NETWORKS

    t0 = time.perf_counter()
    big = Cluster.from_any("256x8xV100")  # 2,048 GPUs: an 8x8 matrix and a count
    assert time.perf_counter() - t0 < 1.0
    assert big.nodes == 256 and len(big.devices) == 8 and big.total_devices == 2048
    assert big.network == NETWORKS["ib100"] and big.network_name == "ib100"
    assert len(big.bandwidth) == 8  # never devices x devices
    assert big.bandwidth[0][1] > big.network[0]  # NVLink inside a node beats the network
    other = Cluster.from_spec("4x8xA100-80GB+ib400")
    assert other.network == NETWORKS["ib400"] and other.devices[0].kind == "A100-80GB"
    back = Cluster.from_json(other.to_json())
    assert (back.nodes, back.network, back.network_name) == (4, other.network, "ib400")
    assert Cluster.from_spec("2x4xK20c").network_name == "eth10"


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("32x8xV100+ib999", "network must be one of"),
        ("0x8xV100", "at least one node"),
        ("2x8xNOPE", "preset"),
    ],
)
def test_bad_nodes_specs(bad: str, match: str) -> None:
    with pytest.raises(DeviceError, match=match):
        Cluster.from_any(bad)


def test_a_multi_node_cluster_needs_a_network() -> None:
    c = Cluster.from_spec("2x2xV100")
    c.network = (0.0, 0.0)
    with pytest.raises(DeviceError, match="needs a network"):
        c.validate()


@pytest.mark.timed
def test_transfers_inside_a_node_and_between_nodes_are_priced_apart() -> None:
    import time

    from crosscut.cost_models.links import NETWORKS

    c = Cluster.from_spec("2x4xV100+ib100")
    nbytes = 10**8
    assert c.same_node(0, 3) and not c.same_node(3, 4) and c.same_node(4, 7)
    assert c.transfer_time(0, 3, nbytes) == pytest.approx(5e-6 + nbytes / 50e9)  # NVLink
    bw, lat = NETWORKS["ib100"]
    assert c.transfer_time(3, 4, nbytes) == pytest.approx(lat + nbytes / bw)  # the network
    assert c.transfer_time(5, 6, nbytes) == c.transfer_time(1, 2, nbytes)  # node 1's own links
    assert c.transfer_time(6, 6, nbytes) == 0.0
    slow = Cluster.from_spec("2x4xV100+eth25")  # the suffix changes links between nodes only
    assert slow.transfer_time(0, 3, nbytes) == c.transfer_time(0, 3, nbytes)
    assert slow.transfer_time(3, 4, nbytes) > 3 * c.transfer_time(3, 4, nbytes)
    assert Cluster.from_spec("4xV100").transfer_time(0, 3, nbytes) == c.transfer_time(0, 3, nbytes)
    t0 = time.perf_counter()
    big = Cluster.from_spec("256x8xV100")
    prices = [big.transfer_time(0, j, nbytes) for j in (1, 7, 8, 2047)]
    assert time.perf_counter() - t0 < 0.5
    assert prices[0] == prices[1] < prices[2] == prices[3]


def test_a_spec_of_several_kinds_is_one_node_in_order() -> None:
    c = Cluster.from_any("6xV100,1xK20c")
    assert [d.kind for d in c.devices] == ["V100"] * 6 + ["K20c"]
    assert [d.device for d in c.devices] == [f"cuda:{i}" for i in range(7)]
    assert c.topology == "pcie" and c.nodes == 1 and c.name == "6xV100,1xK20c"
    mixed = Cluster.from_any("2xA100-80GB,2xcpu")
    assert [d.name for d in mixed.devices] == ["gpu0", "gpu1", "cpu0", "cpu1"]
    assert mixed.devices[2].device == "cpu" and mixed.devices[2].mem_cap < mixed.devices[0].mem_cap
    assert Cluster.from_any("2xV100,2xA100-80GB").topology == "nvlink"  # a shared topology
    for bad in ("6xV100,", "0xV100,1xK20c", "2xV100,1xFOO"):
        with pytest.raises(DeviceError):
            Cluster.from_any(bad)


def test_nodes_with_several_nics_from_the_spec_and_json() -> None:
    c = Cluster.from_spec("4x8xA100-80GB+8xib200")
    assert (c.nodes, c.nics, c.network_name) == (4, 8, "ib200")
    assert Cluster.from_json(c.to_json()).nics == 8
    assert Cluster.from_spec("4x8xA100-80GB+ib200").nics == 1
    c.nics = 0
    with pytest.raises(DeviceError, match="NIC"):
        c.validate()
