"""The overlapped all-reduce (runtime/overlap.py): buckets start during the armed backward.

In one process (a gloo group of one rank) the reduction is the identity, so
the test can look at *when* each bucket's all-reduce starts without other
processes: during the armed backward for every bucket whose gradients all
landed, at ``finish`` for the rest; unarmed backwards start nothing. The
numbers across real replicas are checked against eager training in
tests/test_distributed.py and tests/test_replicas.py (2 replicas × 2 stages).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from crosscut.runtime.overlap import OverlappedAllReduce
from crosscut.runtime.p2p import Messenger


@pytest.fixture()
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 4))


def test_buckets_start_during_the_armed_backward_only(one_rank: None) -> None:
    net = _net()
    unused = net[2]  # skipped by the forward below: its gradients never land
    msg = Messenger(0, 30.0, "rank 0")
    over = OverlappedAllReduce(list(net.parameters()), None, [0], msg, bucket_bytes=40_000)
    assert len(over.buckets) >= 3  # small buckets: several launches
    x = torch.randn(8, 64)

    def loss() -> torch.Tensor:
        return net[3](net[1](net[0](x))).sum()

    loss().backward()  # not armed: an earlier micro-batch, nothing starts
    assert over._works == {}
    want = {n: p.grad.clone() * 2 for n, p in net.named_parameters() if p.grad is not None}
    over.arm()
    loss().backward()
    started = set(over._works)
    unused_bucket = {over._bucket_of[id(p)] for p in unused.parameters()}
    assert started and started.isdisjoint(unused_bucket)  # launched mid-backward
    over.finish()
    for n, p in net.named_parameters():
        assert p.grad is not None
        if n in want:
            assert torch.equal(p.grad, want[n]), n  # a mean over one rank changes nothing
        else:
            assert not p.grad.any(), n  # an unused parameter contributes zeros
    assert over._works == {} and not over._armed
