"""Model references for the CLI, the examples and the benchmarks.

``load_model("torchvision:resnet50")`` builds an untrained torchvision model
(crosscut plans depend on shapes, not weights, and this machine has no hub
access); ``"timm:NAME"`` does the same when timm is installed;
``"path/to/file.py:factory"`` calls a function in a user's file. Each comes with
its default input shape so ``crosscut partition torchvision:inception_v3`` just
works.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from crosscut.errors import InputError

__all__ = ["default_input_shape", "load_model", "torchvision_classification_models"]

_INPUT_299 = ("inception_v3",)
_INPUT_224_ONLY = ("vit_", "swin_", "maxvit_")


def torchvision_classification_models() -> list[str]:
    """Every classification model torchvision lists, sorted."""
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def default_input_shape(ref: str) -> tuple[int, int, int]:
    """The (C, H, W) a model reference expects by default."""
    name = ref.split(":", 1)[-1]
    if name in _INPUT_299:
        return (3, 299, 299)
    return (3, 224, 224)


def load_model(ref: str, *, num_classes: int | None = None) -> nn.Module:
    """Build the model named by ``ref``; a clear error for anything unknown."""
    scheme, sep, name = ref.partition(":")
    if not sep:
        raise InputError(
            "a model reference is torchvision:NAME, timm:NAME or path/to/file.py:factory",
            value=ref,
            remedy="e.g. torchvision:resnet50",
        )
    if scheme == "torchvision":
        return _torchvision(name, num_classes)
    if scheme == "timm":
        return _timm(name, num_classes)
    if ref.rsplit(":", 1)[0].endswith(".py"):
        path, _, factory = ref.rpartition(":")
        return _from_file(Path(path), factory)
    raise InputError(
        "a model reference is torchvision:NAME, timm:NAME or path/to/file.py:factory",
        value=ref,
        remedy="e.g. torchvision:resnet50 or examples/models.py:lenet",
    )


def _torchvision(name: str, num_classes: int | None) -> nn.Module:
    import torchvision

    known = torchvision_classification_models()
    seg = sorted(torchvision.models.list_models(module=torchvision.models.segmentation))
    kwargs: dict[str, Any] = {"weights": None}
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    if name in ("googlenet", "inception_v3"):
        kwargs.update(aux_logits=False, init_weights=False)
    if name in known:
        model: nn.Module = torchvision.models.get_model(name, **kwargs)
    elif name in seg:
        kwargs["weights_backbone"] = None
        kwargs.pop("aux_logits", None)
        model = torchvision.models.get_model(name, **kwargs)
    else:
        close = [m for m in known + seg if name[:4] in m][:6]
        raise InputError(
            "torchvision:NAME must name a torchvision classification or segmentation model",
            value=name,
            remedy=f"try one of {close or known[:6]}",
        )
    return model


def _timm(name: str, num_classes: int | None) -> nn.Module:
    if importlib.util.find_spec("timm") is None:
        raise InputError(
            "timm:NAME needs the timm package",
            value=name,
            remedy="pip install timm",
        )
    import timm

    kwargs: dict[str, Any] = {"pretrained": False}
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    try:
        model: nn.Module = timm.create_model(name, **kwargs)
    except RuntimeError as exc:
        raise InputError("timm:NAME must name a timm model", value=name) from exc
    return model


def _from_file(path: Path, factory: str) -> nn.Module:
    if not path.is_file():
        raise InputError(
            "path/to/file.py:factory must name an existing Python file",
            value=str(path),
            remedy="check the path",
        )
    spec = importlib.util.spec_from_file_location(f"crosscut_user_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise InputError("could not import the model file", value=str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    fn = getattr(module, factory, None)
    if not callable(fn):
        raise InputError(
            f"{path} must define a callable {factory!r} returning an nn.Module",
            value=factory,
            remedy=f"names there: {sorted(n for n in vars(module) if not n.startswith('_'))[:8]}",
        )
    model = fn()
    if not isinstance(model, nn.Module):
        raise InputError(
            f"{path}:{factory}() must return an nn.Module",
            value=type(model).__name__,
        )
    return model


def example_batch(shape: tuple[int, ...], batch: int, *, seed: int = 0) -> torch.Tensor:
    """A deterministic random input batch of ``(batch, *shape)``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((batch, *shape), generator=gen)
