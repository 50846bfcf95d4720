"""Which device orders the CP-SAT driver must search, from the devices' symmetries.

A plan is a stage→device map; the order model (``cpsat_model.py``) fixes
stage ``k`` on ``order[k]``, so covering every plan means covering every
order. Most orders are the same problem: two devices are *interchangeable*
when they have the same compute times, the same memory and swapping them
leaves every link unchanged (a transposition that is an automorphism of the
link matrices). Interchangeability is an equivalence (transpositions that
preserve the links compose to permutations that do), so devices fall into
classes, and two orders with the same sequence of classes are the same
problem. The distinct orders are the multiset permutations of the class
labels: ``d! / Π c_i!`` of them — 7 for six identical accelerators and a CPU,
1 for identical devices, ``d!`` when every device differs.

Up to :data:`ORDER_LIMIT` distinct orders are enumerated (exact: every plan is
searched) unless the class model applies: on links that cost the same between
every pair, the class model (``OrderModel`` with ``classes``) searches every
order at once, a stage picking a class, at most as many stages per class as
it has devices (exact, both objectives). Above the limit on links that
differ by pair, the class model with every transfer on the fastest link gives
a bound valid for every order, and a few orders are searched one by one
(heuristic plan, proven bound).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from crosscut.ir.problem import PartitionProblem
from crosscut.partitioner.solvers.baselines import device_order

__all__ = [
    "ORDER_LIMIT",
    "STRATEGIES",
    "candidate_orders",
    "class_order",
    "count_orders",
    "device_classes",
    "uniform_links",
]

ORDER_LIMIT = 24  # distinct orders searched one model each (4 different devices: 24)
# how solve_cpsat covers device orders: "auto" (the class model where its prices are
# exact, else every distinct order up to ORDER_LIMIT, else a few orders bounded by the
# class model), "enumerate" (never the class model), "heuristic" (the first two orders
# only, bounded by a relaxation: what crosscut did before the class model)
STRATEGIES = ("auto", "enumerate", "heuristic")


def _swap_preserves_links(pb: PartitionProblem, a: int, b: int) -> bool:
    """Whether exchanging devices ``a`` and ``b`` leaves every link as it was."""

    def sw(x: int) -> int:
        return b if x == a else a if x == b else x

    for m in (pb.bandwidth, pb.latency):
        for x in range(pb.num_devices):
            for y in range(pb.num_devices):
                if x != y and m[x][y] != m[sw(x)][sw(y)]:
                    return False
    return True


def device_classes(pb: PartitionProblem) -> list[list[int]]:
    """Interchangeable devices (module docstring), each class sorted, classes by first device."""
    classes: list[list[int]] = []
    same_links = uniform_links(pb)  # then every swap preserves them (fast path: 2,048 devices)
    for dev in range(pb.num_devices):
        col = tuple(row[dev] for row in pb.compute)
        for cls in classes:
            rep = cls[0]
            if (
                pb.mem_cap[rep] == pb.mem_cap[dev]
                and tuple(row[rep] for row in pb.compute) == col
                and (same_links or _swap_preserves_links(pb, rep, dev))
            ):
                cls.append(dev)
                break
        else:
            classes.append([dev])
    return classes


def count_orders(classes: list[list[int]]) -> int:
    """Distinct device orders: the multiset permutations of the class labels."""
    out = math.factorial(sum(len(c) for c in classes))
    for c in classes:
        out //= math.factorial(len(c))
    return out


def uniform_links(pb: PartitionProblem) -> bool:
    """Whether every pair of distinct devices has the same link (transfers cost the same)."""
    d = pb.num_devices
    links = {(pb.bandwidth[a][b], pb.latency[a][b]) for a in range(d) for b in range(d) if a != b}
    return len(links) <= 1


def class_order(classes: list[list[int]], labels: list[int]) -> list[int]:
    """A device order from a sequence of class labels: each class's devices in index order."""
    nxt = [0] * len(classes)
    out = []
    for c in labels:
        out.append(classes[c][nxt[c]])
        nxt[c] += 1
    return out


def _label_sequences(counts: list[int], prefix: list[int]) -> Iterator[list[int]]:
    if not any(counts):
        yield list(prefix)
        return
    for c, left in enumerate(counts):
        if left:
            counts[c] -= 1
            prefix.append(c)
            yield from _label_sequences(counts, prefix)
            prefix.pop()
            counts[c] += 1


def candidate_orders(
    pb: PartitionProblem, limit: int = ORDER_LIMIT, classes: list[list[int]] | None = None
) -> tuple[list[list[int]], bool]:
    """Device orders to search one by one, and whether they cover every stage→device map.

    The first is the baselines' order (:func:`device_order`: cheapest links
    between consecutive stages). Exhaustive up to ``limit`` distinct orders;
    above it the primary order and the devices by speed (the caller adds the
    class model where it applies). ``classes``: :func:`device_classes`, when known.
    """
    primary = device_order(pb)
    classes = device_classes(pb) if classes is None else classes
    if count_orders(classes) <= max(1, limit):
        label = {dev: c for c, cls in enumerate(classes) for dev in cls}
        first = [label[dev] for dev in primary]
        out = [primary]
        for labels in _label_sequences([len(c) for c in classes], []):
            if labels != first:
                out.append(class_order(classes, labels))
        return out, True
    d = pb.num_devices
    speed = sorted(range(d), key=lambda x: (sum(r[x] for r in pb.compute), -pb.mem_cap[x], x))
    return ([primary] if speed == primary else [primary, speed]), False
