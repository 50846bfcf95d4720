"""Each module's own train/eval flag, kept in the mode the model was compiled in.

A model may run some modules in another mode than itself: fine-tuning freezes
batch norms with ``bn.eval()`` inside a training model (or overrides the
model's ``train`` to keep them frozen, as detection backbones do). The tracer
traces the model's own mode with each module's own flag (``frontend/tracer.py``),
so a batch norm traced through keeps its frozen statistics in the graph; a
leaf module reads its flag when its stage calls it, so the compiled module
must not reset it. ``nn.Module.train`` would: it sets every descendant.

:class:`KeepsModuleFlags` records each stage submodule's flag when the
compiled module is built, and gives them back whenever it returns to the
mode it was compiled in (``.eval()`` then ``.train()``: the frozen batch norm
stays frozen, as the program traced with it expects). The other mode sets
every module, as ``model.eval()`` does.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import fx, nn

__all__ = ["KeepsModuleFlags"]


class KeepsModuleFlags(nn.Module):
    """A mixin for the compiled modules: ``train(mode)`` with the compile-time flags."""

    def keep_module_flags(self, stages: Iterable[nn.Module], compiled_training: bool) -> None:
        """Record every submodule flag of ``stages`` (their own as built) for that mode; not
        the graph modules crosscut built around them, whose code never reads the flag."""
        self._flags_mode = compiled_training
        self._module_flags = [
            (m, m.training)
            for st in stages
            for m in st.modules()
            if m is not st and not isinstance(m, fx.GraphModule)
        ]

    def train(self, mode: bool = True) -> KeepsModuleFlags:
        super().train(mode)
        if mode == getattr(self, "_flags_mode", None):
            for m, flag in self._module_flags:
                m.training = flag
        return self
