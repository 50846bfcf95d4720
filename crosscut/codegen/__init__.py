"""Code generation: split a traced model into stages, plan transfers, export source.

Placement comes from the caller (a plan's ``stage_of``); this package only
honours it. It writes code and runs nothing: how a batch-split stage's
shares run is the runtime's (a wrapper passed in as ``batch_stage``). What it
produces, the :class:`~crosscut.ir.program.StagedProgram` and its transfer
records, is defined in :mod:`crosscut.ir.program`.
"""

from crosscut.codegen.source import program_source, stage_source
from crosscut.codegen.split import build_stages
from crosscut.codegen.transfers import plan_transfers, transfer_name

__all__ = [
    "build_stages",
    "plan_transfers",
    "program_source",
    "stage_source",
    "transfer_name",
]
