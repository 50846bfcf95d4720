"""diff_plans: what moved between two plans, in words.

Plans are JSON, so ``diff`` works, but a 300-node assignment makes a noisy
textual diff. This says what a reviewer wants: whether the model and cluster
are the same, which nodes changed stage or device, and how the predictions and
the solver record moved.
"""

from __future__ import annotations

from crosscut.ir.plan import Plan

__all__ = ["diff_plans"]


def _pct(a: float, b: float) -> str:
    if a == 0:
        return "n/a"
    return f"{(b - a) / a:+.1%}"


def diff_plans(a: Plan, b: Plan, *, limit: int = 20) -> str:
    """A readable report of the differences from plan ``a`` to plan ``b``."""
    lines: list[str] = []
    same_model = a.model.name == b.model.name and a.model.batch_size == b.model.batch_size
    if a.model.fingerprint != b.model.fingerprint and not (
        same_model and a.options.microbatches != b.options.microbatches
    ):  # the fingerprint covers the micro-batch size: new micro-batches alone change it
        lines.append(
            f"model differs: {a.model.name} ({a.model.fingerprint}) -> "
            f"{b.model.name} ({b.model.fingerprint})"
        )
    if [d.name for d in a.cluster.devices] != [d.name for d in b.cluster.devices]:
        lines.append(
            f"cluster differs: {[d.name for d in a.cluster.devices]} -> "
            f"{[d.name for d in b.cluster.devices]}"
        )
    for field in ("objective", "schedule", "microbatches", "overlap_comm", "optimizer"):
        va, vb = getattr(a.options, field), getattr(b.options, field)
        if va != vb:
            lines.append(f"option {field}: {va} -> {vb}")
    if a.num_stages != b.num_stages:
        lines.append(f"stages: {a.num_stages} -> {b.num_stages}")
    moved = []
    for name in a.assignment:
        if name in b.assignment:
            da = a.device_of(name)
            db = b.device_of(name)
            if a.assignment[name] != b.assignment[name] or da != db:
                moved.append(
                    f"  {name}: stage {a.assignment[name]} {da} -> stage {b.assignment[name]} {db}"
                )
    only_a = sorted(set(a.assignment) - set(b.assignment))
    only_b = sorted(set(b.assignment) - set(a.assignment))
    if moved:
        lines.append(
            f"{len(moved)} of {len(a.nodes)} nodes moved "
            f"({len(a.assignment)} placed by the solver; inputs and outputs follow them):"
        )
        lines += moved[:limit]
        if len(moved) > limit:
            lines.append(f"  ... and {len(moved) - limit} more")
    if only_a or only_b:
        lines.append(f"nodes only in a: {only_a[:limit]}; only in b: {only_b[:limit]}")
    pa, pb = a.predicted, b.predicted
    lines.append(
        f"bottleneck {pa.bottleneck_s * 1e3:.3f} -> {pb.bottleneck_s * 1e3:.3f} ms "
        f"({_pct(pa.bottleneck_s, pb.bottleneck_s)}); step {pa.step_time_s * 1e3:.3f} -> "
        f"{pb.step_time_s * 1e3:.3f} ms ({_pct(pa.step_time_s, pb.step_time_s)}); "
        f"transfers {len(a.transfers)} -> {len(b.transfers)}"
    )
    lines.append(
        f"solver {a.solver.solver}/{a.solver.status} gap {a.solver.gap:.2%} -> "
        f"{b.solver.solver}/{b.solver.status} gap {b.solver.gap:.2%}"
    )
    if not moved and not only_a and not only_b and len(lines) == 2:
        lines.insert(0, "the plans assign every node identically")
    return "\n".join(lines)
