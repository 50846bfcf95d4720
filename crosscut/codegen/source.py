"""Readable Python source of a staged program.

Each stage's ``GraphModule.code`` is the executable truth; the header in front
of it says what a reader needs to trust it without reading the runtime: the
device, every input with the stage it comes from and its size, and every
output with the stages (or the model output) that receive it.
"""

from __future__ import annotations

from crosscut.ir.program import INPUT, OUTPUT, Stage, StagedProgram

__all__ = ["program_source", "stage_source"]


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _src(stage: int) -> str:
    return "model input" if stage == INPUT else f"stage {stage}"


def stage_source(program: StagedProgram, stage: Stage) -> str:
    """The header comment and ``forward`` source of one stage."""
    lines = [f"# ---- stage {stage.index} on {stage.device} " + "-" * 40]
    lines.append("# inputs:")
    for value, src in stage.inputs:
        nbytes = program.node_bytes.get(value, 0)
        lines.append(f"#   {value:<32} from {_src(src):<12} {_human(nbytes)}")
    if not stage.inputs:
        lines.append("#   (none)")
    lines.append("# outputs:")
    receivers: dict[str, list[str]] = {}
    for t in program.transfers:
        if t.src_stage == stage.index:
            dst = "model output" if t.dst_stage == OUTPUT else f"stage {t.dst_stage}"
            receivers.setdefault(t.value, []).append(dst)
    for value in stage.outputs:
        to = ", ".join(receivers.get(value, [])) or "-"
        nbytes = program.node_bytes.get(value, 0)
        lines.append(f"#   {value:<32} to {to:<20} {_human(nbytes)}")
    lines.append(
        f"# parameters/buffers: {len(stage.param_keys)}; byte counts are for the traced batch"
    )
    lines.append(stage.module.code.strip("\n"))
    return "\n".join(lines) + "\n"


def program_source(program: StagedProgram) -> str:
    """All stages, in order, followed by the transfer list, as one string."""
    parts = [stage_source(program, s) for s in program.stages]
    xfers = ["# ---- transfers " + "-" * 48]
    for t in program.transfers:
        dst = "out" if t.dst_stage == OUTPUT else str(t.dst_stage)
        src = "in" if t.src_stage == INPUT else str(t.src_stage)
        xfers.append(
            f"# {t.name}: {src} -> {dst} ({t.src_device} -> {t.dst_device}) {_human(t.nbytes)}"
        )
    return "\n".join(parts) + "\n".join(xfers) + "\n"
