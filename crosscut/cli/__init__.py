"""The ``crosscut`` command line and its helpers, the top layer.

:mod:`~crosscut.cli.commands` (``partition``, ``show``, ``verify``,
``profile``, ``bench``, ``diff``, ``run``), :mod:`~crosscut.cli.args`
(argument types shared with ``crosscut run``), :mod:`~crosscut.cli.launch`
(``crosscut run``: the torchrun command from a plan) and
:mod:`~crosscut.cli.model_refs` (``torchvision:NAME``, ``timm:NAME``,
``file.py:factory``). ``python -m crosscut.cli`` and the ``crosscut`` console
script (``crosscut.cli:main``) both call :func:`main`.
"""

from crosscut.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
