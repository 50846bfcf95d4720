"""Runtime: run a staged program.

A shared core (the stage engine, the module contract, recomputation, step
batch norm, output merging, micro-batching, device threads, thread state,
seeded random draws, batch-split stages) with two wings: ``local/`` (a thread
per device in one process: ``CompiledModule``) and ``dist/`` (a rank per
stage under torchrun). The runtime sits above codegen and imports it; nothing
below imports the runtime, so the names below are imported eagerly.
"""

from __future__ import annotations

from crosscut.runtime.local.compiled import BN_MODES, CompiledModule
from crosscut.runtime.local.thread_executor import LocalExecutor
from crosscut.runtime.microbatch import scatter
from crosscut.runtime.output_merge import gather
from crosscut.runtime.prefetch import Prefetcher

__all__ = ["BN_MODES", "CompiledModule", "LocalExecutor", "Prefetcher", "gather", "scatter"]
