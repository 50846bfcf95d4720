"""Code generation: split a traced model into stages, plan transfers, export source.

Placement comes from the caller (a plan's ``stage_of``); this package only
honours it. It writes code and runs nothing: how a batch-split stage's
shares run is the runtime's (a wrapper passed in as ``batch_stage``).
"""

from crosscut.codegen.source import program_source, stage_source
from crosscut.codegen.split import Stage, StagedProgram, ValueRef, build_stages, map_structure
from crosscut.codegen.transfers import INPUT, OUTPUT, Transfer, plan_transfers, transfer_name

__all__ = [
    "INPUT",
    "OUTPUT",
    "Stage",
    "StagedProgram",
    "Transfer",
    "ValueRef",
    "build_stages",
    "map_structure",
    "plan_transfers",
    "program_source",
    "stage_source",
    "transfer_name",
]
