"""Cross-shaped stages in the distributed runtime: 4 gloo ranks against eager training.

Every device of a group is a rank. ``tests/dist_scripts/cross_check.py`` runs
each case (a model, its stages' group widths and splits, the schedules) on
every rank and dumps what each rank holds; here the dumps are re-assembled
under the original keys (channel shards concatenated by
``crosscut.runtime.dist.state_files.assemble_parts``, whole tensors from the group
leaders) and compared with single-process eager training on the same
micro-batches: the loss, every parameter's gradient, and every parameter and
buffer after one SGD step. Batch-split cases run batch norm in eval mode
(each member normalises its share of the micro-batch alone, like the local
runtime), and the members of a batch group must end the step identical.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from crosscut.cli.launch import free_port
from crosscut.distributed import assemble_checkpoint
from crosscut.errors import DistributedError
from crosscut.runtime.dist.state_files import assemble_parts
from crosscut.runtime.dist.world import RankLayout, check_world

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("dist")]

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "dist_scripts" / "cross_check.py"
sys.path.insert(0, str(SCRIPT.parent))

from cross_check import CASES, batch, bn_eval, build  # type: ignore[import-not-found]  # noqa: E402


def launch(
    n: int, args: list[str], *, timeout: float = 400, env: dict[str, str] | None = None
) -> list[tuple[int | None, str, float]]:
    """``n`` ranks of the script on a fresh loopback port: (exit code, output, seconds)."""
    port = free_port()
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), *args],
            env=dict(
                os.environ,
                RANK=str(r),
                WORLD_SIZE=str(n),
                LOCAL_RANK=str(r),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                **(env or {}),
            ),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(n)
    ]
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            text, _ = p.communicate()
            text += "\n<killed by the test timeout>"
        out.append((p.returncode, text, time.monotonic() - start))
    return out


def ok(ranks: list[tuple[int | None, str, float]]) -> None:
    bad = [(i, rc, text[-3000:]) for i, (rc, text, _) in enumerate(ranks) if rc != 0]
    assert not bad, bad


def eager(name: str) -> dict[str, Any]:
    """One SGD step of the original model on the case's micro-batches, on one thread.

    Replicas each take a slice of the batch and average their gradients: the
    same as ``replicas × microbatches`` micro-batches on one process.
    """
    case = CASES[name]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build(case.model)
        if case.bn_eval:
            bn_eval(model)
        x, y = batch(case.batch, case.size)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        total = 0.0
        m = case.microbatches * case.replicas
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            loss = nn.functional.cross_entropy(model(xm), ym) / m
            loss.backward()  # type: ignore[no-untyped-call]
            total += float(loss.detach())
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
        model.eval()
        with torch.no_grad():
            infer = model(x)
        return {"loss": total, "grads": grads, "state": model.state_dict(), "infer": infer}
    finally:
        torch.set_num_threads(threads)


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal up to float re-association (shards and shares sum in another order)."""
    scale = max(1.0, float(want.abs().max())) if want.is_floating_point() else 1.0
    torch.testing.assert_close(
        got, want, rtol=1e-4, atol=2e-6 * scale, msg=lambda m: f"{what}: {m}"
    )


def compare_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for k, v in want.items():
        close(got[k], v, f"{what} {k}")


def check_case(out: Path, name: str) -> None:
    """Every schedule's dumps of case ``name`` against :func:`eager` (module docstring)."""
    case = CASES[name]
    ref = eager(name)
    members = [m for w, _ in case.groups for m in range(w)] * case.replicas
    for schedule in case.schedules:
        what = f"{name}/{schedule}"
        files = [out / f"{name}_{schedule}_rank{r}.pt" for r in range(len(members))]
        parts = [torch.load(f, mmap=True) for f in files]  # no copy of the big dumps
        assert [p["layout"]["member"] for p in parts] == members
        losses = [p["loss"] for p in parts if p["loss"] is not None]
        assert len(losses) == case.replicas, losses  # each replica's last leader only
        assert losses == pytest.approx([ref["loss"]] * case.replicas, rel=1e-5), what
        compare_state(assemble_parts(parts, "grads", "shard_grads"), ref["grads"], what + " grad")
        compare_state(assemble_parts(parts), ref["state"], what + " state")
        outputs = [p["infer"] for p in parts if p["infer"] is not None]
        assert len(outputs) == case.replicas
        for r, got in enumerate(outputs):  # each replica infers its slice of the batch
            close(got, ref["infer"].chunk(case.replicas)[r], f"{what} inference")
        if any(split == "channel" for _, split in case.groups):  # pieces on every member
            assert {p["layout"]["member"] for p in parts if p.get("shards")} > {0}
        for p in parts:  # batch members and replicas end the step identical to their first
            lay = p["layout"]
            twin = parts[lay["position"]] if lay["replica"] else None
            if lay["split"] == "batch" and lay["member"] > 0:
                twin = parts[lay["rank"] - lay["member"]]
            if twin is not None:
                assert p["digests"] or p["shard_digests"], (what, lay)
                assert p["digests"] == twin["digests"], (what, lay)
                assert p["shard_digests"] == twin["shard_digests"], (what, lay)
    if case.checkpoint:
        assembled = assemble_checkpoint(out / f"{name}_ckpt")
        assert list(assembled) == list(ref["state"])  # original keys, original order
        compare_state(assembled, ref["state"], f"{name} checkpoint")


GROUPS = [
    ("alexnet_channel", "alexnet_batch", "vgg11_channel", "vgg11_batch"),
    (
        "resnet18_channel",
        "resnet18_batch",
        "resnet18_replicas",
        "googlenet_channel",
        "googlenet_mixed",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("names", GROUPS, ids=["alexnet+vgg11", "resnet18+googlenet"])
def test_cross_shaped_stages_on_four_ranks_match_eager(
    names: tuple[str, ...], tmp_path: Path
) -> None:
    """Channel- and batch-split groups over 4 gloo ranks: loss, gradients, SGD step == eager."""
    ok(launch(4, ["--cases", ",".join(names), "--out", str(tmp_path)]))
    for name in names:
        check_case(tmp_path, name)


def test_rank_layout_and_world_size_rule() -> None:
    """Rank = replica × W + offset[stage] + member; a wrong world names widths and remedy."""
    lay = RankLayout((1, 3), 2)
    assert lay.per_replica == 4 and lay.world_size == 8
    assert [lay.role(r) for r in (0, 1, 3, 4, 7)] == [
        (0, 0, 0),
        (0, 1, 0),
        (0, 1, 2),
        (1, 0, 0),
        (1, 1, 2),
    ]
    assert lay.group_ranks(1, 1) == [5, 6, 7] and lay.position_ranks(2) == [2, 6]
    check_world(8, [1, 3], 2)
    with pytest.raises(DistributedError, match=r"4 × 1 = 4 .*group widths \[1, 3\].*but 2 ranks"):
        check_world(2, [1, 3], 1)
    with pytest.raises(DistributedError, match="pass replicas=2"):
        check_world(8, [1, 3], 1)


def test_grouped_plan_on_a_wrong_world_size_is_refused(tmp_path: Path) -> None:
    """A 4-device grouped plan started on 2 ranks: both fail naming the rule, fast."""
    ranks = launch(2, ["--cases", "alexnet_channel", "--out", str(tmp_path)], timeout=180)
    for rc, text, _ in ranks:
        assert rc == 3, text[-2000:]
        assert "DistributedError" in text and "plan devices × replicas = 4 × 1 = 4" in text
        assert "but 2 ranks were started" in text and "launch 4 processes" in text


def test_lost_group_member_is_named(tmp_path: Path) -> None:
    """Member rank 2 of a 4-wide channel group dies after a forward: its leader names it.

    The other members wait on the leader, which exits with its error (taking
    the job's store with it, as rank 0 hosts it), so they name the rank they
    lost: the leader, or the dead member where the store still answered.
    """
    timeout = 15.0
    ranks = launch(
        4,
        ["--cases", "alexnet_channel", "--timeout", str(timeout), "--out", str(tmp_path)],
        env={"CROSSCUT_TEST_KILL_RANK": "2"},
        timeout=180,
    )
    assert ranks[2][0] == 1 and "exiting on purpose" in ranks[2][1]
    rc, text, _ = ranks[0]
    assert rc == 3 and "DistributedError: rank 2 lost" in text, text[-2000:]
    assert "member 2 = rank 2" in text and "micro-batch" in text, text[-2000:]
    for r in (1, 3):
        rc, text, _ = ranks[r]
        assert rc == 3, text[-2000:]
        assert "DistributedError: rank 0 lost" in text or "rank 2 lost" in text, text[-2000:]
    assert max(s for *_, s in ranks) < min(s for *_, s in ranks) + timeout + 60


def test_colocated_stages_are_refused_by_name() -> None:
    """A co-located tail (two stages on one group) cannot map to one rank per device."""
    import dataclasses

    from crosscut.runtime.dist.rank_executor import DistributedPipeline, check_one_stage_per_device
    from tests.plan_factory import make_plan

    plan = make_plan(n_nodes=30, n_devices=4, cross_shaped=True)
    check_one_stage_per_device(plan)  # groups on distinct devices: fine
    stages = list(plan.stages)
    stages[-1] = dataclasses.replace(stages[-1], devices=list(stages[-2].devices))
    shared = dataclasses.replace(plan, stages=stages)
    with pytest.raises(DistributedError, match=r"stages 1 and 2 of the plan share device"):
        DistributedPipeline(nn.Linear(1, 1), None, shared)  # type: ignore[arg-type]


def test_run_counts_a_process_per_group_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`crosscut run` starts plan devices × replicas processes and names that count on refusal."""
    from crosscut.cli.launch import run_main
    from tests.plan_factory import make_plan

    plan = make_plan(n_nodes=30, n_devices=4, cross_shaped=True)
    widths = [len(st.devices) if st.split in ("channel", "batch") else 1 for st in plan.stages]
    assert sum(widths) > plan.num_stages, "test needs a device group"
    path = plan.save(tmp_path / "plan.json")
    devices = sum(widths)
    assert run_main(["--plan", str(path), "--dry-run", "--replicas", "2", "script.py"]) == 0
    assert f"--nproc-per-node {2 * devices} " in capsys.readouterr().out
    nodes = devices + 1  # never divides `devices` processes
    argv = ["--plan", str(path), "--nnodes", str(nodes), "--port", str(free_port()), "x.py"]
    assert run_main(argv) == 2
    err = capsys.readouterr().err
    assert f"plan devices × replicas = {devices} × 1 = {devices}" in err, err
    assert f"--replicas a multiple of {nodes}" in err, err
