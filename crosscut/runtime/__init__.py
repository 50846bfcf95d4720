"""Runtime: run a staged program — local executor, ``CompiledModule``, input prefetch."""

from crosscut.runtime.compiled import BN_MODES, CompiledModule
from crosscut.runtime.local import LocalExecutor, gather, scatter
from crosscut.runtime.prefetch import Prefetcher

__all__ = ["BN_MODES", "CompiledModule", "LocalExecutor", "Prefetcher", "gather", "scatter"]
