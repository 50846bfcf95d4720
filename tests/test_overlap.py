"""The replicas' all-reduce by DDP's reducer during a stage's last backward (runtime/dist/overlap).

In one process (a gloo group of one rank) the reduction is the identity, so
these tests look at *when* DDP starts each bucket without other processes:
during the armed backward, before the backward has produced every gradient;
never during an unarmed one. Across real replicas, 2 replicas × 2 stages
under both schedules and 1 or 2 micro-batches, with a parameter that gets no
gradient and with ``overlap_allreduce=False``, the gradients are checked
against eager training over the global batch, and the bucket launches against
each rank's own schedule (:func:`test_replicas_reduce_during_the_last_backward`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from crosscut.runtime.dist.overlap import ReplicaReducer
from crosscut.runtime.dist.p2p import Messenger


@pytest.fixture()
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


class Heads(nn.Module):
    """A trunk, the head the loss reads, and one it never reads (no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256))
        self.head = nn.Linear(256, 4)
        self.aux = nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.head(h), self.aux(h)


def _reducer(net: nn.Module, events: list[Any]) -> ReplicaReducer:
    """Small buckets (several launches); a comm hook records each launch."""
    red = ReplicaReducer(net, None, [0], Messenger(0, 30.0, "rank 0"), bucket_cap_mb=0.1)
    landed = [0]
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda _: landed.__setitem__(0, landed[0] + 1))

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations
        events.append(("bucket", bucket.index(), landed[0]))
        return default_hooks.allreduce_hook(state, bucket)

    red.ddp.register_comm_hook(red.group, hook)  # the state: the group to reduce over
    events.append(landed)
    return red


def test_buckets_start_during_the_armed_backward_only(one_rank: None) -> None:
    net, events = Heads(), []
    red = _reducer(net, events)
    landed = events.pop()
    x = torch.randn(8, 64)

    def roots() -> list[torch.Tensor]:
        out, _aux = net(x)  # the aux head runs but no loss reads it
        return [out.square().mean()]

    torch.autograd.backward(roots())  # an earlier micro-batch: nothing starts
    assert events == []
    want = {n: p.grad.clone() * 2 for n, p in net.named_parameters() if p.grad is not None}
    landed[0] = 0
    red.backward(roots(), [None])  # the step's last backward: DDP's reducer runs in it
    used = len(want)
    launches = [e for e in events if e[0] == "bucket"]
    assert len(launches) >= 2, launches
    assert launches[0][2] < used  # the first bucket left before the backward was done
    for n, p in net.named_parameters():
        if n.startswith("aux"):
            assert p.grad is None, n  # unused: no hang, and no gradient (as eager)
        else:
            assert p.grad is not None and torch.equal(p.grad, want[n]), n  # mean over 1 rank
    events.clear()
    torch.autograd.backward(roots())  # the next step's first backward: idle again
    assert events == []


def test_a_dtype_change_rebuilds_the_reducer(one_rank: None) -> None:
    """``.to(dtype)`` gives the parameters new gradient accumulators: DDP's hooks on the
    old ones would never fire, so the next step's reducer is a new one (collective)."""
    net, events = Heads(), []
    red = _reducer(net, events)
    events.pop()
    assert red.current() is red
    net.to(torch.float64).to(torch.float32).to(torch.float64)  # there and back: stale too
    stale_out = net(torch.randn(8, 64, dtype=torch.float64))[0].sum()
    red.backward([stale_out], [None])
    assert events == []  # the old reducer saw nothing: the step would go unreduced
    fresh = red.current()
    assert fresh is not red and fresh.current() is fresh
    fresh.ddp.register_comm_hook(fresh.group, lambda state, bucket: events.append(bucket.index()) or
                                 default_hooks.allreduce_hook(state, bucket))  # fmt: skip
    net.zero_grad()
    fresh.backward([net(torch.randn(8, 64, dtype=torch.float64))[0].sum()], [None])
    assert events and net.head.weight.grad is not None
    assert net.head.weight.grad.dtype == torch.float64


def _eager(m: int) -> dict[str, Any]:
    """One SGD step of the model in one process, the global batch in ``m`` chunks."""
    sys.path.insert(0, str(Path(__file__).parent / "dist_scripts"))
    from ddp_check import TwoHeads, batch, loss_fn  # type: ignore[import-not-found]

    import tests.test_distributed as td

    x, y = batch()
    return td.eager_steps(TwoHeads(), x, y, m, loss_fn)


def _check_log(log: list[Any], where: str) -> None:
    """Buckets launch only inside the row's last backward, the first before it is done."""
    starts = [i for i, e in enumerate(log) if e[0] == "B"]
    assert starts, where
    armed = [i for i in starts if log[i][2]]
    assert armed == [starts[-1]], (where, log)  # only the last backward is armed
    first, end = armed[0], next(i for i, e in enumerate(log) if e[0] == "end" and i > armed[0])
    buckets = [(i, e) for i, e in enumerate(log) if e[0] == "bucket"]
    assert len(buckets) >= 2, (where, log)  # 10 kB buckets: several per stage
    assert all(first < i < end for i, _ in buckets), (where, log)
    assert sorted(e[1] for _, e in buckets) == list(range(len(buckets))), (where, log)
    assert buckets[0][1][2] < log[end][2], (where, log)  # gradients were still to land


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_replicas_reduce_during_the_last_backward(tmp_path: Path) -> None:
    """2 replicas × 2 stages on 4 gloo ranks (tests/dist_scripts/ddp_check.py): with DDP's
    reducer and with the after-backward all-reduce, GPipe and 1F1B, 1 and 2 micro-batches,
    the loss, gradients and SGD step equal eager training over the global batch; the head
    no loss reads and the compared-only parameter get no gradient on either side."""
    import tests.test_distributed as td

    script = Path(__file__).parent / "dist_scripts" / "ddp_check.py"
    td.ok(td.launch(4, ["--out", str(tmp_path)], script=script, timeout=420))
    for m in (1, 2):
        ref = _eager(2 * m)  # 2 replicas × m micro-batches
        assert not any(k.startswith(("aux.", "gate")) for k in ref["grads"])
        for mode in ("ddp", "after"):
            for schedule in ("gpipe", "1f1b"):
                tag = f"mb{m}_{mode}_{schedule}"
                got = td.merged(tmp_path, tag, 4, 2)
                assert len(got["losses"]) == 2, tag  # both replicas' last stages
                td.compare(got, ref)  # also: the same keys have gradients as in eager
                if mode == "ddp":
                    for r in range(4):
                        d = torch.load(tmp_path / f"{tag}_rank{r}.pt", weights_only=False)
                        _check_log(d["log"], f"{tag} rank {r}")
    last = torch.load(tmp_path / "mb1_ddp_gpipe_rank1.pt", weights_only=False)
    assert last["layout"]["stage"] == 1 and "aux.weight" in last["keys"]  # unused head: last


@pytest.mark.distributed
@pytest.mark.xdist_group("dist")
def test_a_replica_lost_during_the_reduction_is_named(tmp_path: Path) -> None:
    """Rank 3 (stage 1 of replica 1) exits as its DDP backward starts: its replica peer,
    rank 1, fails in the reduction naming rank 3 and the group; nobody hangs."""
    import tests.test_distributed as td

    script = Path(__file__).parent / "dist_scripts" / "ddp_check.py"
    timeout = 20.0
    args = ["--out", str(tmp_path), "--die-rank", "3", "--timeout", str(timeout)]
    ranks = td.launch(4, args, script=script, timeout=240)
    assert ranks[3].rc == 1 and "exiting on purpose" in ranks[3].output
    assert ranks[1].rc == 3, ranks[1].output[-2000:]
    assert "rank 3 lost" in ranks[1].output, ranks[1].output[-2000:]
    assert "gradient all-reduce (DDP, group ranks [1, 3])" in ranks[1].output
    assert all(r.rc == 3 for r in (ranks[0], ranks[2])), [r.output[-800:] for r in ranks]
    assert max(r.seconds for r in ranks) < min(r.seconds for r in ranks) + timeout + 30
