"""What a model must be before it is traced: an ``nn.Module`` whose tensors exist.

A lazy module (``nn.LazyConv2d``, ``nn.LazyLinear``, ...) has no parameter
shapes until its first call. Tracing reads every parameter's size to price
it, and torch refuses that on an uninitialised one, which surfaced from deep
inside the cost model as if crosscut had failed. Torch's own rule is the
remedy: call the model once on an example batch, which materialises them.

A model already handed to another compiler or data-parallel wrapper is refused
too, naming the module (``nn.DataParallel`` and ``DistributedDataParallel``
scatter the batch themselves, which crosscut plans as replicas):
``torch.compile(model)`` returns a wrapper whose forward is dynamo's, which
torch.fx refuses to trace; a TorchScript module (``torch.jit.script`` or
``torch.jit.trace``) keeps its code and state in C++, where fx cannot read its
ops and crosscut cannot copy it per stage or replay its buffers (it failed deep
in the trace, on its buffer table). The remedy is the Python module before that
step. (A ``torch.compile``d *submodule* is fine: it runs whole, as a leaf.)
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.nn.utils.weight_norm import WeightNorm

from crosscut.errors import InputError

__all__ = ["check_model"]


def check_model(model: Any) -> None:
    """Raise an InputError unless ``model`` is an ``nn.Module`` with every tensor made."""
    if not isinstance(model, nn.Module):
        raise InputError(
            "trace() needs a torch.nn.Module",
            value=type(model).__name__,
            remedy="pass the model object itself (e.g. torchvision.models.resnet50(weights=None))",
        )
    _refuse_other_compilers(model)
    lazy = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if is_lazy(t)]
    if lazy:
        raise InputError(
            f"the model has {len(lazy)} uninitialised lazy parameters or buffers (a "
            "LazyConv2d, LazyLinear, ...): their shapes are not known until the model "
            "runs once, and crosscut prices every parameter by its size",
            value=lazy[:8],
            remedy="call the model once on an example batch before compiling "
            "(model(x) materialises them, as torch requires before any other use)",
        )


def _refuse_other_compilers(model: nn.Module) -> None:
    """A data-parallel or ``torch.compile`` wrapper as the model; a hook-based weight norm or a
    TorchScript module anywhere in it."""
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        raise InputError(
            f"the model is wrapped in {type(model).__name__}, which splits the batch across "
            "devices itself: crosscut chooses the replicas (data parallelism) as part of "
            "its plan, and torch.fx cannot trace the wrapper's scatter and gather",
            value=type(model.module).__name__,
            remedy="pass the wrapped module (model.module); crosscut replicates it where "
            "that is fastest (replicas='auto')",
        )
    weight_norms = [
        name or "(the model)"
        for name, m in model.named_modules()
        if any(isinstance(h, WeightNorm) for h in m._forward_pre_hooks.values())
    ]
    if weight_norms:
        raise InputError(
            "the model uses torch.nn.utils.weight_norm, whose hook keeps a derived weight "
            "tensor that torch cannot copy (deepcopy refuses non-leaf tensors), and crosscut "
            "copies the model into its stages",
            value=weight_norms[:8],
            remedy="use torch.nn.utils.parametrizations.weight_norm (torch's replacement; "
            "crosscut supports parametrized modules)",
        )
    frames = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing compiled
    if frames is not None and isinstance(model, frames.OptimizedModule):
        raise InputError(
            "the model is a torch.compile wrapper (OptimizedModule): its forward is "
            "dynamo's, which torch.fx cannot trace",
            value=type(model._orig_mod).__name__,
            remedy="pass the module before torch.compile (model._orig_mod, the same "
            "parameters); torch.compile a submodule instead if you want it compiled",
        )
    scripted: list[str] = []
    for name, m in model.named_modules():
        inside = (
            any(name.startswith(f"{outer}.") for outer in scripted) or "(the model)" in scripted
        )
        if isinstance(m, torch.jit.ScriptModule) and not inside:
            scripted.append(name or "(the model)")
    if scripted:
        raise InputError(
            "the model holds TorchScript modules (torch.jit.script or torch.jit.trace): "
            "their ops and state live in C++, which torch.fx cannot trace and crosscut "
            "cannot copy per stage",
            value=scripted[:8],
            remedy="pass the Python nn.Module each was scripted or traced from",
        )
