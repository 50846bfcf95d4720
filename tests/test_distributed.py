"""Distributed executor: multi-process gloo runs on 127.0.0.1 against eager training.

Each test launches ``tests/dist_scripts/train_check.py`` once per rank (plain
processes with RANK/WORLD_SIZE/MASTER_* set, or torchrun where the launcher
itself is under test), with a subprocess timeout, and compares what the ranks
dumped with single-process eager training done here on one thread with the
same micro-batching (so batch-norm statistics match bit for bit).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from crosscut.cli.launch import check_port_free, free_port, run_main
from crosscut.distributed import assemble_checkpoint
from crosscut.errors import DistributedError
from crosscut.ir.plan import Plan

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("dist")]

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "dist_scripts" / "train_check.py"
sys.path.insert(0, str(SCRIPT.parent))

from train_check import batch, build, make_plan  # type: ignore[import-not-found]  # noqa: E402

MODELS = ("resnet18", "googlenet", "densenet121")


@dataclass
class Rank:
    rc: int | None
    output: str
    seconds: float


def launch(
    n: int,
    args: list[str],
    *,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
    script: Path | None = None,
) -> list[Rank]:
    """Start ``n`` ranks of ``script`` (default: ``SCRIPT`` when called, which some tests
    monkeypatch) on a fresh loopback port; never hangs past ``timeout``."""
    script = SCRIPT if script is None else script
    port = free_port()
    procs = []
    start = time.monotonic()
    for r in range(n):
        e = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            **(env or {}),
            **(rank_env or {}).get(r, {}),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=e,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    out = []
    for p in procs:
        left = max(1.0, timeout - (time.monotonic() - start))
        try:
            text, _ = p.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            text, _ = p.communicate()
            text += "\n<killed by the test timeout>"
        out.append(Rank(p.returncode, text, time.monotonic() - start))
    return out


def wait_all_ok(procs: list[subprocess.Popen[str]], *, timeout: float) -> None:
    """Wait for every process (node group) to exit 0; kill them all on a hang."""
    outs = []
    for p in procs:
        try:
            outs.append((p.communicate(timeout=timeout)[0], p.returncode))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a node group hung")
    assert all(rc == 0 for _, rc in outs), [o[-2000:] for o, _ in outs]


def run_node_groups(plan: Path, out: Path, script_args: list[str], nodes: int = 2) -> None:
    """``crosscut run --plan PLAN --nnodes N --node-rank i`` for every node on 127.0.0.1,
    each running SCRIPT with ``script_args`` and ``--out OUT``; every group must exit 0."""
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "crosscut.cli", "run", "--plan", str(plan),
             "--nnodes", str(nodes), "--node-rank", str(rank), "--port", port,
             "--timeout", "60", str(SCRIPT), *script_args, "--out", str(out)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(nodes)
    ]  # fmt: skip
    wait_all_ok(procs, timeout=240)


def ok(ranks: list[Rank]) -> None:
    bad = [(i, r.rc, r.output[-2000:]) for i, r in enumerate(ranks) if r.rc != 0]
    assert not bad, bad


def eager(name: str, n: int, size: int, chunks: int, steps: int = 1) -> dict[str, Any]:
    """Single-process training on one thread, the batch cut into ``chunks`` micro-batches."""
    x, y = batch(n, size)
    return eager_steps(build(name), x, y, chunks, nn.functional.cross_entropy, steps)


def eager_steps(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int, loss_fn: Any, steps: int = 1
) -> dict[str, Any]:
    """SGD steps (lr 0.1, momentum 0.9) on one thread, each micro-batch loss over ``chunks``:
    the last step's summed loss and gradients, and the state after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(steps):
            opt.zero_grad()
            total = 0.0
            for xm, ym in zip(x.chunk(chunks), y.chunk(chunks)):
                loss = loss_fn(model(xm), ym) / chunks
                loss.backward()
                total += float(loss.detach())
            grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
            opt.step()
        return {"loss": total, "grads": grads, "state": model.state_dict()}
    finally:
        torch.set_num_threads(threads)


def merged(out: Path, tag: str, world: int, stages: int) -> dict[str, Any]:
    grads: dict[str, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    losses = []
    for r in range(world):
        # mapped, not read: 4 ranks of vgg11 are ~3 GB, on a CI machine that also runs them
        d = torch.load(out / f"{tag}_rank{r}.pt", weights_only=False, mmap=True)
        grads.update(d["grads"])  # replicas hold the same (all-reduced) gradients
        if r < stages:
            state.update(d["state"])
        losses += [x for x in d["losses"] if x is not None]
    return {"grads": grads, "state": state, "losses": losses}


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal up to float re-association (fan-out gradients are summed in another order)."""
    scale = max(1.0, float(want.abs().max())) if want.is_floating_point() else 1.0
    torch.testing.assert_close(
        got, want, rtol=1e-4, atol=2e-6 * scale, msg=lambda m: f"{what}: {m}"
    )


def compare(got: dict[str, Any], ref: dict[str, Any], *, buffers: bool = True) -> None:
    assert got["losses"], "no last-stage rank reported a loss"
    for loss in got["losses"]:
        assert loss == pytest.approx(ref["loss"], rel=1e-5)
    assert set(got["grads"]) == set(ref["grads"])
    for k, g in ref["grads"].items():
        close(got["grads"][k], g, f"grad {k}")
    assert set(got["state"]) == set(ref["state"])
    for k, v in ref["state"].items():
        if buffers or k in ref["grads"]:
            close(got["state"][k], v, f"state {k}")


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_matches_eager(world: int, tmp_path: Path) -> None:
    """GPipe, 1F1B, ZB-H1 and ZB-H2 over 2 and 4 ranks: loss, gradients and the SGD step
    equal eager."""
    ranks = launch(
        world,
        [
            "--models",
            ",".join(MODELS),
            "--schedules",
            "gpipe,1f1b,zb-h1,zb-h2",
            "--microbatches",
            "2",
            "--out",
            str(tmp_path),
        ],
    )
    ok(ranks)
    for name in MODELS:
        ref = eager(name, 8, 32, 2)
        for schedule in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
            got = merged(tmp_path, f"{name}_{schedule}", world, world)
            assert len(got["losses"]) == 1  # only the last stage returns the loss
            compare(got, ref)
        layout = torch.load(tmp_path / f"{name}_gpipe_rank0.pt", weights_only=False)["layout"]
        assert layout["stages"] == world and layout["edges"], layout


@pytest.mark.parametrize("world", [2, 4])
def test_interleaved_pipeline_matches_eager(world: int, tmp_path: Path) -> None:
    """Interleaved 1F1B (two stages per rank, round-robin) over 2 and 4 ranks: each rank
    runs its two stages' actions in its schedule row's order, a value passed between
    its own stages never touches the wire; loss, gradients and the SGD step equal eager."""
    args = ["--models", ",".join(MODELS), "--schedules", "1f1b-v2", "--microbatches", "2"]
    ranks = launch(world, [*args, "--out", str(tmp_path)])
    ok(ranks)
    for name in MODELS:
        got = merged(tmp_path, f"{name}_1f1b-v2", world, world)
        assert len(got["losses"]) == 1  # the rank holding the last stage
        compare(got, eager(name, 8, 32, 2))
        layout = torch.load(tmp_path / f"{name}_1f1b-v2_rank0.pt", weights_only=False)["layout"]
        assert layout["stages"] == 2 * world and layout["stages_here"] == [0, world], layout


def test_worker_groups_allreduce(tmp_path: Path) -> None:
    """2 replicas × 2 stages: each replica takes half the batch; the all-reduce averages."""
    ok(
        launch(
            4,
            [
                "--models",
                "resnet18",
                "--schedules",
                "1f1b",
                "--replicas",
                "2",
                "--microbatches",
                "2",
                "--out",
                str(tmp_path),
            ],
        )
    )
    for name in ("resnet18",):
        got = merged(tmp_path, f"{name}_1f1b", 4, 2)
        assert len(got["losses"]) == 2  # both replicas' last stages return the global loss
        # BN running statistics are per replica (as in DDP); parameters and grads must match
        compare(got, eager(name, 8, 32, 4), buffers=False)


def test_an_output_no_loss_reads_gives_no_gradient_across_ranks(tmp_path: Path) -> None:
    """A layer on stage 0 whose output only leaves the model (the loss never reads it):
    eager gives it no gradient and SGD with weight decay leaves it alone. The last stage
    used to send zeros back for it, so the layer got zero gradients and decayed."""
    script = ROOT / "tests" / "dist_scripts" / "unused_output_check.py"
    sys.path.insert(0, str(script.parent))
    from unused_output_check import SideOutput, batch, loss_fn, plan_with_side_on_stage_0

    plan = plan_with_side_on_stage_0().save(tmp_path / "plan.json")
    ok(launch(2, ["--out", str(tmp_path), "--plan", str(plan)], script=script))

    model = SideOutput()
    x, y = batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    for xm, ym in zip(x.chunk(2), y.chunk(2)):
        (loss_fn(model(xm), ym) / 2).backward()
    assert model.side.weight.grad is None  # eager: no gradient at all
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    opt.step()
    got: dict[str, dict[str, torch.Tensor]] = {"grads": {}, "state": {}}
    for r in range(2):
        dump = torch.load(tmp_path / f"side_rank{r}.pt", weights_only=False)
        for part in got:
            got[part].update(dump[part])
    assert set(got["grads"]) == set(grads), set(got["grads"]) ^ set(grads)
    for k, g in grads.items():
        torch.testing.assert_close(got["grads"][k], g, rtol=1e-5, atol=1e-6)
    for k, t in model.state_dict().items():
        torch.testing.assert_close(got["state"][k], t, rtol=1e-5, atol=1e-6)


def local_step_bn(name: str, n: int, size: int, chunks: int) -> dict[str, Any]:
    """One SGD step of a local 2-stage CompiledModule with bn_mode="step" (tested vs eager
    in tests/test_batchnorm.py): the reference for the distributed "step" mode."""
    import crosscut

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, y = batch(n, size)
        c = crosscut.compile(
            build(name), ["cpu"] * 2, x, microbatches=chunks, bn_mode="step", replicas=1
        )
        opt = torch.optim.SGD(c.parameters(), lr=0.1, momentum=0.9)
        opt.zero_grad()
        loss = float(c.train_step(x, y, nn.functional.cross_entropy))
        opt.step()
        state = c.state_dict()
        c.close()
        return {"loss": loss, "state": state}
    finally:
        torch.set_num_threads(threads)


def test_step_batch_norm_across_replicas_and_stages(tmp_path: Path) -> None:
    """bn_mode="step" on 2 replicas × 2 stages: every rank commits the GLOBAL batch's
    running statistics once (all-reduced over the replicas), equal to the local runtime's
    "step" mode on the same four micro-batches; "micro" would differ (checked)."""
    args = ["--models", "resnet18", "--schedules", "1f1b", "--replicas", "2"]
    args += ["--microbatches", "2", "--bn-mode", "step", "--out", str(tmp_path)]
    ok(launch(4, args))
    ref = local_step_bn("resnet18", 8, 32, 4)
    micro = eager("resnet18", 8, 32, 4)["state"]
    for replica in (0, 1):
        state: dict[str, torch.Tensor] = {}
        for stage in (0, 1):
            d = torch.load(
                tmp_path / f"resnet18_1f1b_rank{2 * replica + stage}.pt", weights_only=False
            )
            state.update(d["state"])
            if d["losses"] and d["losses"][0] is not None:
                assert d["losses"][0] == pytest.approx(ref["loss"], rel=1e-5)
        assert set(state) == set(ref["state"])
        for k, v in ref["state"].items():
            close(state[k], v, f"replica {replica} state {k}")
    var = "layer4.1.bn2.running_var"
    assert not torch.allclose(micro[var], ref["state"][var], rtol=1e-3), "test cannot discriminate"
    assert int(ref["state"]["bn1.num_batches_tracked"]) == 1  # once per step, not per micro-batch


def test_two_node_groups_on_loopback(tmp_path: Path) -> None:
    """Two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1) train one step."""
    port = free_port()
    procs = []
    for node in range(2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "nodes",
            "--max-restarts",
            "0",
            str(SCRIPT),
            "--schedules",
            "gpipe",
            "--out",
            str(tmp_path),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    wait_all_ok(procs, timeout=180)
    compare(merged(tmp_path, "resnet18_gpipe", 2, 2), eager("resnet18", 8, 32, 2))


def test_lost_rank_is_named_within_timeout(tmp_path: Path) -> None:
    """Rank 2 of 3 dies after its first forward: ranks 0 and 1 fail naming rank 2, quickly."""
    timeout = 15.0
    ranks = launch(
        3,
        ["--schedules", "gpipe", "--timeout", str(timeout), "--out", str(tmp_path)],
        env={"CROSSCUT_TEST_KILL_RANK": "2"},
        timeout=120,
    )
    assert ranks[2].rc == 1 and "exiting on purpose" in ranks[2].output
    started = min(r.seconds for r in ranks)  # all exit well within the bound
    for r in ranks[:2]:
        assert r.rc == 3, r.output[-2000:]
        assert "DistributedError" in r.output and "rank 2 lost" in r.output, r.output[-2000:]
        assert "micro-batch" in r.output
    assert max(r.seconds for r in ranks) < started + timeout + 30


def test_hung_rank_times_out_with_its_name(tmp_path: Path) -> None:
    """A rank that stops answering (alive but stuck) is reported after timeout_s, not never."""
    timeout = 6.0
    start = time.monotonic()
    ranks = launch(
        2,
        ["--schedules", "gpipe", "--timeout", str(timeout), "--out", str(tmp_path)],
        env={"CROSSCUT_TEST_HANG_RANK": "1"},
        timeout=120,
    )
    assert ranks[0].rc == 3, ranks[0].output[-2000:]
    assert "rank 1 lost" in ranks[0].output and "did not answer within" in ranks[0].output
    assert ranks[0].seconds < 60 and time.monotonic() - start < 90


@pytest.fixture(scope="module")
def plan2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A resnet18 plan over two CPU stages (batch 8, 2 micro-batches), saved as JSON."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    make_plan("resnet18", 2, 1, 2, 8, 32, "1f1b").save(path)
    return path


def test_plan_mismatch_world_size_and_port(plan2: Path, tmp_path: Path) -> None:
    """Different plans per rank, a world that is not stages × replicas, a busy port."""
    other = Plan.load(plan2)
    other.options.schedule = "gpipe"  # same cut, another schedule: another hash
    other_path = other.save(tmp_path / "other.json")
    ranks = launch(
        2,
        ["--out", str(tmp_path)],
        timeout=120,
        rank_env={0: {"CROSSCUT_PLAN": str(plan2)}, 1: {"CROSSCUT_PLAN": str(other_path)}},
    )
    for r in ranks:
        assert r.rc == 3 and "every rank must run the same plan" in r.output, r.output[-2000:]
        assert "ranks [0]" in r.output and "ranks [1]" in r.output
    (one,) = launch(1, ["--plan", str(plan2), "--out", str(tmp_path)], timeout=120)
    assert one.rc == 3 and "2 × 1 = 2, but 1 ranks were started" in one.output, one.output[-2000:]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(DistributedError, match=f"port {port} on 127.0.0.1 is already in use"):
            check_port_free(port)
        assert run_main(["--plan", str(plan2), "--port", str(port), str(SCRIPT)]) == 2


def test_checkpoint_resume_equals_uninterrupted(plan2: Path, tmp_path: Path) -> None:
    """Save after step 1, lose a rank in step 2, resume from the files: == two clean steps."""
    ckpt, a, b = tmp_path / "ckpt", tmp_path / "a", tmp_path / "b"
    common = ["--plan", str(plan2), "--schedules", "1f1b"]
    ok(launch(2, [*common, "--steps", "1", "--save", str(ckpt), "--out", str(a)]))
    assembled = assemble_checkpoint(ckpt)
    one = eager("resnet18", 8, 32, 2, steps=1)
    assert list(assembled) == list(one["state"])  # original keys, original order
    for k, v in one["state"].items():
        close(assembled[k], v, f"checkpoint {k}")
    # step 2, interrupted: rank 1 dies mid-step; rank 0 must name it within the timeout
    died = launch(
        2,
        [
            *common,
            "--steps",
            "1",
            "--load",
            str(ckpt),
            "--timeout",
            "15",
            "--out",
            str(tmp_path / "died"),
        ],
        env={"CROSSCUT_TEST_KILL_RANK": "1"},
        timeout=120,
    )
    assert died[1].rc == 1 and died[0].rc == 3, died[0].output[-2000:]
    assert "rank 1 lost" in died[0].output
    assert died[0].seconds < 15 + 30
    # resume from the same checkpoint: step 2 again, this time to the end
    ok(launch(2, [*common, "--steps", "1", "--load", str(ckpt), "--out", str(b)]))
    # the uninterrupted run goes through the launcher: `crosscut run --plan ... script`
    c = tmp_path / "c"
    rc = run_main(
        [
            "--plan",
            str(plan2),
            "--port",
            "0",
            str(SCRIPT),
            "--schedules",
            "1f1b",
            "--steps",
            "2",
            "--out",
            str(c),
        ]
    )
    assert rc == 0
    resumed = merged(b, "resnet18_1f1b", 2, 2)["state"]
    straight = merged(c, "resnet18_1f1b", 2, 2)["state"]
    two = eager("resnet18", 8, 32, 2, steps=2)
    for k in two["state"]:
        close(resumed[k], straight[k], f"resumed vs uninterrupted {k}")
        close(straight[k], two["state"][k], f"uninterrupted vs eager {k}")


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_crosscut_run_with_a_user_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`crosscut run --plan plan.json script.py`: init() + crosscut.compile() in each rank."""
    import crosscut
    from crosscut.cli import main as cli_main
    from tests.dist_scripts import user_script

    x, y = user_script.data()
    plan = crosscut.partition(
        user_script.model(), ["cpu", "cpu"], x, microbatches=2, require_all_devices=True, replicas=1
    )
    path = plan.save(tmp_path / "plan.json")
    script = Path(user_script.__file__)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(script.parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    port = str(free_port())
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "crosscut.cli",
            "run",
            "--plan",
            str(path),
            "--port",
            port,
            "--timeout",
            "60",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [
        float(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("LOSS")
    ]
    assert len(losses) == 1  # printed by the last stage only
    eager = torch.nn.functional.cross_entropy(user_script.model()(x), y)
    assert losses[0] == pytest.approx(float(eager.detach()), rel=1e-5)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert cli_main(["run", "--plan", str(path), "--dry-run", str(script)]) == 0
    assert not list((tmp_path / "tmp").iterdir())  # a dry run leaves no log folder behind
