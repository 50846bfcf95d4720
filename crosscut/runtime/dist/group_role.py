"""This rank's part in a cross-shaped stage's device group, beside the pipeline.

The executor (:mod:`crosscut.runtime.dist.rank_executor`) runs the pipeline — schedule
rows, messages between stage leaders, replicas. A stage split over a group of
ranks adds the group's own duties, kept here so the executor does not grow a
branch per split: the leader's forward joins its members through a token
chain, a non-leader follows the same schedule row with only its group's
messages, and a batch group starts identical, sums its members' gradients and
copies the leader's buffers after a training run. The member's share of the
stage itself is built by :mod:`crosscut.runtime.dist.group_members`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from crosscut.ir.schedule import Action
from crosscut.runtime.dist.group_comm import GroupLink, new_token
from crosscut.runtime.dist.world import allreduce_grads, broadcast_from_first, reached_by_leader

__all__ = ["GroupRole"]


class GroupRole:
    """This rank's part in its stage's device group: the member's runs and the group's collectives.

    The executor keeps the pipeline (schedule rows, messages between stage
    leaders, replicas); everything a device group adds on top lives here.
    """

    def __init__(self, link: GroupLink, split: str) -> None:
        self.link = link
        self.split = split

    def what(self, action: str) -> str:
        return f"the {action} of stage {self.link.stage}'s {self.split}-split group"

    def start_identical(self, module: nn.Module) -> None:
        """A batch group starts from its leader's parameters and buffers."""
        if self.split == "batch":
            tensors = [t.data for t in [*module.parameters(), *module.buffers()]]
            broadcast_from_first(
                tensors, self.link.group, self.link.ranks, self.link.msg, self.what("start-up")
            )

    @contextmanager
    def fresh_grads(self, module: nn.Module) -> Iterator[None]:
        """Around a step and its gradient all-reduce: a batch group's gradients from earlier
        steps are taken out of ``.grad`` and accumulated back afterwards, so the all-reduce
        sums the members' fresh gradients only (a failed step's partial ones are dropped).

        Why: after a step every member holds the group's summed gradient ``G``; a second
        step without ``zero_grad`` would sum ``G + g_i`` over ``n`` members, ``n·G``
        where eager accumulates one ``G`` (measured: 0.098 off eager on two ranks)."""
        held = []
        if self.split == "batch":
            held = [(p, p.grad) for p in module.parameters() if p.grad is not None]
        for p, _ in held:
            p.grad = None
        try:
            yield
        except BaseException:
            for p, old in held:
                p.grad = old
            raise
        for p, old in held:
            p.grad = old if p.grad is None else old.add_(p.grad)

    def reduce_grads(self, module: nn.Module) -> None:
        """A batch group sums its members' gradients: each saw a share of the same loss.
        A parameter the leader's backward never reached keeps grad None on every member,
        as in eager (``world.reached_by_leader`` says why the leader's)."""
        if self.split == "batch":
            msg, what = self.link.msg, self.what("gradient all-reduce")
            params = reached_by_leader(
                list(module.parameters()), self.link.group, self.link.ranks, msg, what
            )
            allreduce_grads(params, self.link.group, self.link.ranks, msg, mean=False, what=what)

    def sync_buffers(self, module: nn.Module) -> None:
        """A batch group's members take the leader's buffers (running statistics).

        As in the local runtime only the leader's share updates them; the
        members' own updates are overwritten after every training-mode run, so
        eval-mode forwards on every member use the leader's values.
        """
        buffers = list(module.buffers())
        if self.split == "batch" and module.training and buffers:
            broadcast_from_first(
                buffers, self.link.group, self.link.ranks, self.link.msg, self.what("buffer copy")
            )

    def lead(
        self, module: nn.Module, ins: Sequence[Any], microbatch: int, training: bool
    ) -> tuple[list[Any], torch.Tensor]:
        """The leader's forward of one micro-batch: (stage outputs, final token)."""
        self.link.microbatch = microbatch
        *outs, token = module(*ins, new_token(self.link.device, training))
        return outs, token

    def follow(self, module: nn.Module, row: Sequence[Action], training: bool) -> None:
        """A non-leader member's schedule row: only its group's messages, same F/B order."""
        tokens: dict[int, torch.Tensor] = {}
        for a in row:
            if a.kind == "F":
                self.link.microbatch = a.microbatch
                (token,) = module(new_token(self.link.device, training))
                if training:
                    tokens[a.microbatch] = token
            elif a.kind == "B":  # a group stage's backward is never split: W has no messages
                token = tokens.pop(a.microbatch)
                if token.requires_grad:
                    torch.autograd.backward([token], [torch.zeros_like(token)])
            self.link.msg.drain()
        self.link.msg.flush()
