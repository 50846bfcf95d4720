"""Transfer ops as explicit records (Mariana's transfer layer).

Every value that crosses from one stage to another becomes exactly one
:class:`Transfer` per (value, destination stage) — never one per consumer: if
two ops on stage 2 read ``layer1_0_relu``, stage 2 receives it once. A skip
connection that jumps over stages is sent directly from its producer to its
consumer, never relayed through the stages in between. Stages are logical
devices (``["cpu"] * 4`` is four of them), so the destination is the stage.

The records are plain data with byte counts (for the batch that was traced or
shape-propagated) so the cost model, the visualiser and the runtime agree on
what moves where.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from crosscut.ir.program import INPUT, OUTPUT, Transfer

__all__ = ["plan_transfers", "transfer_name"]


def _stage_label(stage: int) -> str:
    if stage == INPUT:
        return "in"
    if stage == OUTPUT:
        return "out"
    return f"s{stage}"


def transfer_name(value: str, dst_stage: int) -> str:
    """``xfer_<value>_to_s<dst>`` (or ``_to_out`` for the model output)."""
    return f"xfer_{value}_to_{_stage_label(dst_stage)}"


def plan_transfers(
    stage_inputs: Sequence[Sequence[tuple[str, int]]],
    output_sources: Mapping[str, int],
    stage_devices: Sequence[str],
    node_bytes: Mapping[str, int],
    output_device: str | None = None,
) -> list[Transfer]:
    """One transfer per (value, destination stage), in destination-stage order.

    ``stage_inputs[s]`` lists ``(value, src_stage)`` for everything stage ``s``
    reads that it does not compute (``src_stage`` may be :data:`INPUT`).
    ``output_sources`` maps each value the model returns to the stage that
    produces it; those computed on a stage become transfers to :data:`OUTPUT`
    (placed on ``output_device``, by default the last stage's device).
    """
    out_dev = output_device if output_device is not None else stage_devices[-1]

    def device_of(stage: int, fallback: str) -> str:
        return stage_devices[stage] if stage >= 0 else fallback

    def transfer(value: str, src: int, dst: int, dst_device: str) -> Transfer:
        return Transfer(
            name=transfer_name(value, dst),
            value=value,
            src_stage=src,
            dst_stage=dst,
            src_device=device_of(src, "caller"),
            dst_device=dst_device,
            nbytes=int(node_bytes.get(value, 0)),
        )

    transfers: list[Transfer] = []
    for dst, inputs in enumerate(stage_inputs):
        seen: set[str] = set()
        for value, src in inputs:
            if value in seen or src == dst:
                continue
            seen.add(value)
            transfers.append(transfer(value, src, dst, stage_devices[dst]))
    for value, src in output_sources.items():
        if src < 0:
            continue
        transfers.append(transfer(value, src, OUTPUT, out_dev))
    return transfers
