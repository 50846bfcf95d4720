"""Runtime: run a staged program — local executor, ``CompiledModule``, input prefetch.

The names below load on first use (PEP 562): codegen's batch-split stage uses
this package's device threads (:mod:`crosscut.runtime.device_thread`), so
importing the package must not pull in the executors, which import codegen.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["BN_MODES", "CompiledModule", "LocalExecutor", "Prefetcher", "gather", "scatter"]

_HOME = {
    "BN_MODES": "crosscut.runtime.compiled",
    "CompiledModule": "crosscut.runtime.compiled",
    "LocalExecutor": "crosscut.runtime.local",
    "Prefetcher": "crosscut.runtime.prefetch",
    "gather": "crosscut.runtime.output_merge",
    "scatter": "crosscut.runtime.microbatch",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'crosscut.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
