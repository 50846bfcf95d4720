"""How many micro-batches of what a pipeline stage keeps in memory at once.

The memory half of the cost model (:mod:`crosscut.partitioner.evaluate` has
the formulas): a stage keeps the activations of the micro-batches it has in
flight (one, when it recomputes), a receive buffer per received tensor for
each of them, and, in a schedule that splits each backward into ``B`` and
``W``, the gradients its ``W`` restarts from. The counts come from the
schedule (:mod:`crosscut.ir.schedule`), so the evaluator, the CP-SAT model
and the baselines size memory from one place.
"""

from __future__ import annotations

from crosscut.ir.problem import PartitionProblem
from crosscut.ir.schedule import in_flight as schedule_in_flight
from crosscut.ir.schedule import pending_weights

__all__ = [
    "activation_factor",
    "buffer_factor",
    "held_gradients",
    "in_flight",
    "recomputes",
    "weight_grad_bytes",
]


def in_flight(problem: PartitionProblem, k: int, num_stages: int) -> int:
    """Micro-batches stage ``k`` has started but not finished backward (training)."""
    return schedule_in_flight(problem.schedule, num_stages, k, problem.microbatches)


def activation_factor(problem: PartitionProblem, k: int, num_stages: int) -> int:
    """Micro-batches whose activations stage ``k`` keeps at once (0 in inference).

    A recomputing stage keeps one: the micro-batch whose forward it re-runs in
    backward; its inputs for the others are the receive buffers
    (:func:`buffer_factor`), which stay one per in-flight micro-batch.
    """
    if not problem.training:
        return 0
    if recomputes(problem, k):
        return 1
    return in_flight(problem, k, num_stages)


def held_gradients(problem: PartitionProblem, k: int, num_stages: int) -> int:
    """Micro-batches whose weight-node gradients stage ``k`` holds from ``B`` to ``W``."""
    if not problem.training:
        return 0
    return pending_weights(problem.schedule, num_stages, k, problem.microbatches)


def weight_grad_bytes(problem: PartitionProblem, v: int) -> int:
    """Bytes ``W`` restarts node ``v`` from: its output's gradient, if it has parameters."""
    return problem.out_bytes[v] if problem.grad_bytes(v) > 0 else 0


def recomputes(problem: PartitionProblem, k: int) -> bool:
    """Whether stage ``k`` recomputes: every stage, or a known solution's own choice."""
    if problem.stage_recompute:
        return problem.training and k < len(problem.stage_recompute) and problem.stage_recompute[k]
    return problem.recompute and problem.training


def buffer_factor(problem: PartitionProblem, k: int, num_stages: int) -> int:
    """Receive buffers per received tensor: one per in-flight micro-batch (1 in inference)."""
    if not problem.training:
        return 1
    return in_flight(problem, k, num_stages)
