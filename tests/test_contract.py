"""The runtime contract (``tests/contract.py``) on both runtimes: local CPU devices,
2 and 4 gloo ranks under torchrun, and a cross-shaped plan on 4 ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import crosscut
from crosscut.ir.schedule import placement, virtual_stages

sys.path.insert(0, str(Path(__file__).parent))
from contract import Small, batch, check_contract, eager_loss

SCRIPT = Path(__file__).parent / "dist_scripts" / "contract_check.py"


@pytest.mark.parametrize(
    ("k", "m", "schedule"),
    [
        (2, 1, "1f1b"),
        (3, 2, "1f1b"),
        (3, 2, "gpipe"),
        (3, 4, "zb-h1"),
        (2, 4, "zb-h2"),
        (2, 2, "1f1b-v2"),  # 4 stages, 2 per device
        (2, 1, "1f1b-v2"),
        (2, 1, "1f1b-v3"),  # 6 stages, 3 per device; M not a multiple of the devices
        (2, 4, "1f1b-v4"),
        (2, 4, "zb-v2"),  # interleaved, each backward split into B and W
        (2, 1, "zb-v2"),
        (2, 4, "zbv"),  # two stages per device in a V: 0 and 3 on one, 1 and 2 on the other
        (2, 1, "zbv"),
        (3, 2, "zbv"),  # 6 stages on 3 devices, M below the workers
    ],
)
def test_local_runtime_keeps_the_contract(k: int, m: int, schedule: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Small()
    x, _ = batch()
    pipe = crosscut.compile(
        model,
        ["cpu"] * k,
        x,
        microbatches=m,
        require_all_devices=True,
        replicas=1,
        schedule=schedule,
    )
    assert check_contract(pipe, model, m, tmp_path) is not None
    if virtual_stages(schedule) > 1:  # V stages per device, round-robin or in a V
        want = [f"cpu{w}" for w in placement(schedule, k * virtual_stages(schedule))]
        assert [st.devices[0] for st in pipe.plan.stages] == want


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
@pytest.mark.parametrize(
    ("world", "case", "schedule"),
    [
        (2, "pipeline", "1f1b"),
        (4, "pipeline", "1f1b"),
        (4, "replicas", "1f1b"),
        (4, "cross", "1f1b"),
        (2, "pipeline", "zb-h1"),
        (4, "replicas", "zb-h1"),
        (4, "cross", "zb-h1"),
        (2, "pipeline", "1f1b-v2"),
        (4, "replicas", "1f1b-v2"),
        (2, "pipeline", "1f1b-v3"),
        (2, "pipeline", "zb-v2"),
        (4, "replicas", "zb-v2"),
        (2, "pipeline", "zbv"),
        (4, "replicas", "zbv"),
    ],
)
def test_torchrun_ranks_keep_the_contract(
    world: int, case: str, schedule: str, tmp_path: Path
) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    done = subprocess.run(
        [*cmd, "--nproc-per-node", str(world), str(SCRIPT), case, str(tmp_path), schedule],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # ranks' lines may interleave in torchrun's output: find the records, not the lines
    assert sorted(re.findall(r"OK (\d+)", done.stdout)) == [str(r) for r in range(world)]
    losses = [float(v) for v in re.findall(r"LOSS ([0-9.]+)", done.stdout)]
    torch.manual_seed(0)
    want = eager_loss(Small(), *batch(), 2)
    assert losses and all(abs(v - want) < 1e-5 for v in losses)
