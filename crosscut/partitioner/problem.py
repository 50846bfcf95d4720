"""PartitionProblem: the partition problem as plain numbers — no torch past this line.

The solvers (``partitioner/solvers``) see only this object, so they can be
tested on random DAGs and checked against brute force without a model. All
times are seconds per micro-batch, all sizes bytes. ``build_problem`` (in
``partitioner/build.py``) fills it from an OpGraph, a CostTable and a Cluster.

The model (``docs/ARCHITECTURE.md``, "The partition problem"):

* node ``v`` has compute time ``compute[v][d]`` on device ``d`` (forward, or
  forward+backward when ``training``), ``resident[v]`` bytes that live on its
  device for the whole run (parameters; with gradients and optimizer state when
  training), ``activation[v]`` bytes saved per in-flight micro-batch, and an
  output of ``out_bytes[v]`` bytes per micro-batch.
* a plan puts every node in a stage ``s(v)``; every edge ``u → v`` has
  ``s(u) <= s(v)``; stage ``k`` runs on device ``stage_device[k]``.
* a node ``u`` whose output is read in a later stage ``k`` is sent once to
  each such stage, directly (not relayed), costing
  ``latency[a][b] + out_bytes[u] / bandwidth[a][b]`` between their devices;
  in training its gradient flows back along the same pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["OBJECTIVES", "SCHEDULES", "PartitionProblem"]

OBJECTIVES = ("throughput", "latency")
SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class PartitionProblem:
    """Everything a solver needs, as lists indexed by node and device."""

    names: list[str]  # node names, topological order
    compute: list[list[float]]  # [node][device] seconds per micro-batch
    resident: list[int]  # [node] bytes resident for the whole run
    activation: list[int]  # [node] bytes saved per in-flight micro-batch
    out_bytes: list[int]  # [node] output bytes per micro-batch
    edges: list[tuple[int, int]]  # (producer, consumer), producer < consumer
    devices: list[str]  # device names
    mem_cap: list[int]  # [device] bytes
    bandwidth: list[list[float]]  # [src][dst] bytes/s (diagonal unused)
    latency: list[list[float]]  # [src][dst] seconds
    ties: list[list[int]] = field(default_factory=list)  # node groups that share a stage
    microbatches: int = 1
    schedule: str = "1f1b"
    objective: str = "throughput"
    training: bool = True
    overlap_comm: bool = False  # count a stage as max(compute, comm) instead of their sum

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def num_devices(self) -> int:
        return len(self.devices)
