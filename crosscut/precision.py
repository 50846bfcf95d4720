"""Mixed precision as a plan option: ``precision="fp32" | "bf16" | "fp16"``.

One mechanism prices and runs it: PyTorch's autocast. The trace propagates
shapes under ``torch.autocast`` with the chosen dtype (frontend/tracer.py),
so every op records the dtype it really produces — convolutions, linears and
matmuls in 16 bits, batch norm and reductions in fp32, the parameters (the
optimizer's master copy) in fp32. From there nothing else needs to know: the
analytic cost model prices an op at its dtype's peak (the device presets list
``float16`` and ``bfloat16``), activations and transfers are counted at the
bytes the ops produce, and the compiled module runs every call under the
same autocast, which the stage threads and ranks inherit
(runtime/thread_state.py, runtime/dist/wire_dtypes.py). With ``"fp16"`` the loss
needs scaling: use ``torch.amp.GradScaler`` with the local module, or
``crosscut.distributed.PipelineGradScaler`` under torchrun (its inf/NaN check
spans every stage and rank).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from crosscut.errors import InputError

__all__ = ["PRECISIONS", "autocast", "check_precision", "check_precision_devices", "dtype_of"]

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_PEAK_KEY = {"bf16": "bfloat16", "fp16": "float16"}


def check_precision(precision: Any) -> str:
    """``precision`` itself when it is one of :data:`PRECISIONS`, else a clear error."""
    if precision not in PRECISIONS:
        raise InputError(
            f"precision must be one of {list(PRECISIONS)}",
            value=precision,
            remedy="'fp32' (default), 'bf16' (Ampere GPUs and newer, CPUs), or 'fp16' "
            "(with a loss scaler)",
        )
    return str(precision)


def dtype_of(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (None: fp32, no autocast)."""
    return _DTYPES.get(check_precision(precision))


def autocast(precision: str, device_type: str) -> AbstractContextManager[Any]:
    """``torch.autocast`` for ``precision`` on ``device_type`` (nothing for fp32)."""
    dtype = dtype_of(precision)
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def check_precision_devices(precision: str, devices: Any) -> None:
    """Refuse bf16 on a device kind whose preset lacks it (GPUs before Ampere)."""
    if precision != "bf16":
        return
    lacking = sorted({d.kind for d in devices if _PEAK_KEY["bf16"] not in d.peak_flops})
    if lacking:
        raise InputError(
            f"precision='bf16' needs devices that compute in bfloat16; {', '.join(lacking)} "
            "cannot (bfloat16 arrived with NVIDIA Ampere)",
            value=lacking,
            remedy="use precision='fp16' with a loss scaler, or Ampere-or-newer devices "
            "(e.g. 4xA100-80GB)",
        )
