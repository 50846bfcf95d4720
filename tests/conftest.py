# mypy: disable-error-code="no-any-return"
"""Shared fixtures: torchvision models built on the meta device (no weights, no init cost)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import settings
from torch import nn

# CI replays a fixed set of examples (reproducible, never red by luck); a developer's
# run draws new ones, so property tests keep searching between commits.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

__all__ = ["SEGMENTATION", "build_meta", "classification_names", "graphviz", "input_size"]


@pytest.fixture(autouse=True)
def _release_freed_memory() -> Iterator[None]:
    """Give freed heap memory back to the kernel after each test. A test worker runs
    hundreds of models and glibc keeps what they freed: the worker that runs the
    torchrun tests grew to 9.8 GB, beside its 4 ranks, and CI's 24 GB ran out.
    Under ``CROSSCUT_CPU_MALLOC=kept`` (``crosscut/cpu_malloc.py``) crosscut's own call
    does it; otherwise glibc's ``malloc_trim(0)``, where there is glibc."""
    yield
    from crosscut.cpu_malloc import release_freed_memory

    if not release_freed_memory() and _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc() -> Any:
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


@pytest.fixture
def graphviz() -> None:
    """Tests that draw SVG/PNG need Graphviz's ``dot``: skipped on a machine without it.

    A system tool may enable tests, never be required; CI installs Graphviz and sets
    ``CROSSCUT_REQUIRE_DOT=1``, so there a missing ``dot`` is a failure, not a skip.
    """
    import shutil

    if shutil.which("dot"):
        return
    msg = "Graphviz `dot` is not on PATH (apt-get install graphviz)"
    if os.environ.get("CROSSCUT_REQUIRE_DOT") == "1":
        pytest.fail(msg + " and CROSSCUT_REQUIRE_DOT=1")
    pytest.skip(msg + "; set CROSSCUT_REQUIRE_DOT=1 to make this a failure")


SEGMENTATION = (
    "fcn_resnet50",
    "deeplabv3_resnet50",
    "deeplabv3_mobilenet_v3_large",
    "lraspp_mobilenet_v3_large",
)


def classification_names() -> list[str]:
    """Every classification model torchvision ships (the test matrix)."""
    from torchvision import models

    return list(models.list_models(module=models))


def input_size(name: str) -> int:
    """The smallest square input each family accepts (ViT/MaxViT fix 224, Inception 75+)."""
    if name.startswith(("vit_", "maxvit")):
        return 224
    if name == "inception_v3":
        return 75
    return 64


@contextmanager
def _regnet_on_cpu() -> Iterator[None]:
    """RegNet computes its block widths with ``tensor.tolist()``, which meta tensors refuse."""
    from torchvision.models import regnet

    original = regnet.BlockParams.from_init_params

    def on_cpu(*args: Any, **kwargs: Any) -> Any:
        with torch.device("cpu"):
            return original(*args, **kwargs)

    regnet.BlockParams.from_init_params = on_cpu  # type: ignore[method-assign]
    try:
        yield
    finally:
        regnet.BlockParams.from_init_params = original  # type: ignore[method-assign]


def build_meta(name: str, **kwargs: Any) -> nn.Module:
    """Build a torchvision model with parameters on the meta device (weights=None)."""
    from torchvision import models

    if name in ("googlenet", "inception_v3"):
        kwargs = {"aux_logits": False, "init_weights": False, **kwargs}
    if name in SEGMENTATION:
        kwargs = {"weights_backbone": None, **kwargs}
    with torch.device("meta"), _regnet_on_cpu():
        return models.get_model(name, weights=None, **kwargs)


@pytest.fixture(scope="session")
def resnet50_graph() -> Any:
    """resnet50 traced once at batch 1, 3x224x224, shared by the graph and trace tests."""
    from crosscut.frontend import trace

    return trace(build_meta("resnet50"), torch.empty(1, 3, 224, 224, device="meta"))
