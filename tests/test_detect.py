"""Detecting the cluster of a torchrun job (issue 16): nodes × local ranks, kind, network.

``Cluster.detect`` (and ``"torchrun[+NETWORK]"`` wherever a cluster is
accepted) reads torchrun's variables (crosscut/cost_models/detect.py): unit
tests give it environments by hand, GPUs by monkeypatching ``torch.cuda``; one
test starts 2 real torchrun node groups on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from crosscut.cost_models.cluster import Cluster
from crosscut.cost_models.detect import torchrun_env
from crosscut.cost_models.links import GLOO_LOOPBACK, NETWORKS
from crosscut.errors import DeviceError, InputError

ROOT = Path(__file__).resolve().parent.parent


def _env(world: int, local: int, groups: int | None = None, **extra: str) -> dict[str, str]:
    env = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local), **extra}
    if groups is not None:
        env["GROUP_WORLD_SIZE"] = str(groups)
    return env


def test_torchrun_env_reads_nodes_and_ranks() -> None:
    job = torchrun_env(_env(8, 4, 2, GROUP_RANK="1", LOCAL_RANK="3", RANK="7"))
    assert (job.world_size, job.local_world_size, job.nodes) == (8, 4, 2)
    assert (job.node_rank, job.local_rank) == (1, 3)
    # launchers that set no GROUP_WORLD_SIZE: nodes = WORLD_SIZE // LOCAL_WORLD_SIZE
    assert torchrun_env(_env(12, 4)).nodes == 3


def test_detect_on_cpu_is_the_nodes_spec_of_the_job() -> None:
    c = Cluster.detect(device="cpu", environ=_env(8, 4, 2))
    spec = Cluster.from_spec("2x4xcpu")
    assert (c.nodes, len(c), c.total_devices, c.kinds) == (2, 4, 8, ["cpu"])
    assert c.devices == spec.devices and c.bandwidth == spec.bandwidth
    # cpu's default network, eth25 (3.125 GB/s, 15 µs), as gloo runs on it: no message
    # is quicker than on loopback (55 µs)
    assert c.network == spec.network == (NETWORKS["eth25"][0], GLOO_LOOPBACK[1])
    assert c.name == "2x4xcpu+eth25" and c.meta["detected"] == "torchrun"
    assert c.same_node(0, 3) and not c.same_node(3, 4)
    assert c.transfer_time(3, 4, 10**6) == pytest.approx(55e-6 + 10**6 / 3.125e9)
    assert c.transfer_time(0, 1, 10**6) == pytest.approx(55e-6 + 10**6 / 3.5e9)  # one node


def test_the_network_is_an_argument_else_crosscut_network_else_the_default() -> None:
    env = _env(4, 2, 2)
    assert Cluster.detect("ib200", device="cpu", environ=env).network_name == "ib200"
    # a GPU-class network under gloo: its bandwidth capped at loopback's, its latency floored
    assert Cluster.detect("ib200", device="cpu", environ=env).network == GLOO_LOOPBACK
    env["CROSSCUT_NETWORK"] = "eth100"
    assert Cluster.detect(device="cpu", environ=env).network_name == "eth100"
    assert Cluster.detect("ib400", device="cpu", environ=env).network_name == "ib400"
    with pytest.raises(DeviceError, match="network must be one of") as err:
        Cluster.detect("ib999", device="cpu", environ=env)
    assert "ib100" in str(err.value)


def test_from_any_torchrun_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for k, v in _env(6, 3, 2, GROUP_RANK="0", LOCAL_RANK="0").items():
        monkeypatch.setenv(k, v)
    c = Cluster.from_any("torchrun+ib100")
    assert (c.nodes, len(c), c.network_name, c.kinds) == (2, 3, "ib100", ["cpu"])
    assert Cluster.from_any("torchrun").network_name == "eth25"


@pytest.mark.parametrize(
    ("env", "match"),
    [({}, "WORLD_SIZE and LOCAL_WORLD_SIZE unset"),
     ({"WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE unset"),
     (_env(6, 4), r"WORLD_SIZE \(6\) must be a multiple of LOCAL_WORLD_SIZE \(4\)"),
     (_env(8, 4, 3), r"GROUP_WORLD_SIZE × LOCAL_WORLD_SIZE \(3 × 4 = 12\)"),
     (_env(4, 0), "LOCAL_WORLD_SIZE must be an integer >= 1"),
     ({"WORLD_SIZE": "two", "LOCAL_WORLD_SIZE": "1"}, "WORLD_SIZE must be an integer"),
     (_env(4, 2, LOCAL_RANK="2"), "LOCAL_RANK below")],
)  # fmt: skip
def test_inconsistent_environments_are_named(env: dict[str, str], match: str) -> None:
    with pytest.raises(DeviceError, match=match) as err:
        Cluster.detect(device="cpu", environ=env)
    assert "remedy" in str(err.value)


def test_a_bad_device_is_refused() -> None:
    with pytest.raises(DeviceError, match="'cuda'"):
        Cluster.detect(device="tpu", environ=_env(2, 1))


@pytest.mark.parametrize(
    ("gpu", "memory", "kind", "topology", "network"),
    [("NVIDIA H100 80GB HBM3", 85_000_000_000, "H100", "nvlink", "ib400"),
     ("NVIDIA A100-SXM4-40GB", 42_000_000_000, "A100-40GB", "nvlink", "ib200"),
     ("Tesla V100-SXM2-16GB", 16_900_000_000, "V100", "nvlink", "ib100")],
)  # fmt: skip
def test_gpus_map_to_their_preset_with_real_memory(
    monkeypatch: pytest.MonkeyPatch, gpu: str, memory: int, kind: str, topology: str, network: str
) -> None:
    seen: list[torch.device] = []

    def props(dev: torch.device) -> SimpleNamespace:
        seen.append(dev)
        return SimpleNamespace(name=gpu, total_memory=memory)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    c = Cluster.detect(environ=_env(32, 8, 4, LOCAL_RANK="5"))
    assert seen == [torch.device("cuda", 5)]  # this rank's own GPU
    assert (c.nodes, len(c), c.kinds, c.topology) == (4, 8, [kind], topology)
    assert c.network_name == network and c.name == f"4x8x{kind}+{network}"
    assert all(d.mem_cap == memory for d in c.devices)
    assert [d.device for d in c.devices] == [f"cuda:{i}" for i in range(8)]


def test_compile_under_torchrun_refuses_a_cluster_of_nodes() -> None:
    from crosscut.distributed import _plan_cluster

    with pytest.raises(InputError, match="planned as replicas"):
        _plan_cluster("2x2xcpu", 2, torch.device("cpu"))


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_two_torchrun_node_groups_each_detect_two_nodes(tmp_path: Path) -> None:
    """2 torchrun agents on 127.0.0.1 (--nnodes 2, 2 ranks each): every rank detects
    the 2-node cluster of 2 devices per node from its own environment."""
    import tests.test_distributed as td
    from crosscut.cli.launch import free_port

    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "CROSSCUT_NETWORK"):
        env.pop(k, None)
    script = ROOT / "tests" / "dist_scripts" / "detect_check.py"

    def node_cmd(rank: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--node-rank", str(rank), "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", f"detect-{port}", "--rdzv-conf", "join_timeout=60",
                "--max-restarts", "0", str(script), str(tmp_path)]  # fmt: skip

    procs = [
        subprocess.Popen(
            node_cmd(rank), cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]  # fmt: skip
    td.wait_all_ok(procs, timeout=120)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert {g["group_rank"] for g in got} == {0, 1}
    for g in got:
        assert g["env"] == {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2"}
        assert (g["nodes"], g["per_node"], g["total"]) == (2, 2, 4), g
        assert g["same_node_0_1"] and not g["same_node_0_per_node"]
        if not torch.cuda.is_available():
            assert g["kinds"] == ["cpu"] and g["name"] == "2x2xcpu+eth25", g
