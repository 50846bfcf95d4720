"""Deadline: one point on the monotonic clock that every search of a partition call stops by.

A ``time_limit`` is a promise about the whole call (``partition`` returns
within it, give or take 10 %), not about each solver: a limit handed to every
step separately adds up (the pipeline CP-SAT took its 30 s, then the group DP
its own five minutes). So the call makes one ``Deadline`` at its start and
passes it down; each step takes what is left, or a share of it
(:meth:`Deadline.share`), or stops early to keep a reserve for what must
follow (:meth:`Deadline.before`). Steps that cannot be interrupted (building a
CP-SAT model, one numpy step of a DP) check the deadline between pieces and
keep their best answer so far, so an overrun is at most one piece.

``time.monotonic`` is the clock: wall-clock jumps (NTP, suspend) must not end
or extend a solve. Plain data, no torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

__all__ = ["Deadline"]

Clock = Callable[[], float]


class Deadline:
    """Seconds left until a fixed instant; sub-deadlines never end after their parent."""

    def __init__(
        self, seconds: float, *, clock: Clock = time.monotonic, start: float | None = None
    ) -> None:
        if not seconds >= 0.0:  # also refuses NaN
            raise ValueError(f"a deadline needs seconds >= 0, got {seconds!r}")
        self.clock = clock
        self.start = clock() if start is None else start
        self.seconds = float(seconds)
        self.end = self.start + self.seconds

    @classmethod
    def of(cls, deadline: Deadline | None, seconds: float) -> Deadline:
        """``deadline`` itself, or a new one of ``seconds`` from now when there is none."""
        return deadline if deadline is not None else cls(seconds)

    def left(self) -> float:
        """Seconds until the deadline, never negative."""
        return max(0.0, self.end - self.clock())

    def elapsed(self) -> float:
        """Seconds since the deadline was made."""
        return self.clock() - self.start

    def expired(self) -> bool:
        return self.clock() >= self.end

    def within(self, seconds: float) -> Deadline:
        """A sub-deadline ``seconds`` from now, or this one's end if that comes first."""
        now = self.clock()
        sub = Deadline(0.0, clock=self.clock, start=now)
        sub.end = min(self.end, now + max(0.0, seconds)) if math.isfinite(seconds) else self.end
        sub.seconds = sub.end - now
        return sub

    def share(self, fraction: float) -> Deadline:
        """A sub-deadline after ``fraction`` of the time left (the rest stays for later steps)."""
        return self.within(min(1.0, max(0.0, fraction)) * self.left())

    def before(self, reserve: float) -> Deadline:
        """A sub-deadline ending ``reserve`` seconds before this one (for what must follow)."""
        return self.within(self.left() - max(0.0, reserve))

    def __repr__(self) -> str:
        return f"Deadline({self.seconds:.3g} s, {self.left():.3g} s left)"
