"""Reading and writing result files so that a failure is one clear line and leaves nothing behind.

JSON files (plans, clusters, cost tables) are read one way (:func:`read_json`,
:func:`parse_json`): a missing or unreadable file and text that is not JSON
are each one error of the caller's class naming the file and the place.
Plans, pictures and profiles are written the same way: refuse a directory or
a path under a file before any work, write a temporary sibling, rename it
over the target (a crash never leaves half a file), remove the temporary on
any failure, and turn the operating system's error into an
:class:`~crosscut.errors.InputError` naming the path and a remedy.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from crosscut.errors import CrosscutError, InputError

__all__ = ["check_writable", "parse_json", "read_json", "write_atomic"]


def parse_json(
    text: str, error: type[CrosscutError], what: str, *, remedy: str = "", obj: bool = True
) -> Any:
    """``text`` parsed; not JSON (or, with ``obj``, not an object) is ``error`` naming ``what``."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(
            f"{what} must be valid JSON",
            value=f"{exc.msg} at line {exc.lineno} column {exc.colno}",
            remedy=remedy,
        ) from None
    if obj and not isinstance(data, dict):
        raise error(f"{what} must hold a JSON object", value=type(data).__name__, remedy=remedy)
    return data


def read_json(
    path: str | Path, error: type[CrosscutError], what: str, *, remedy: str = "", obj: bool = True
) -> Any:
    """The JSON in the file at ``path`` (see :func:`parse_json`); a missing file is ``error``."""
    p = Path(path)
    if not p.is_file():
        raise error(
            f"{what} path must name an existing file",
            value=str(p),
            remedy=remedy or "check the path",
        )
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{what} must be readable UTF-8 text", value=str(exc), remedy=remedy) from exc
    return parse_json(text, error, what, remedy=remedy, obj=obj)


def check_writable(path: str | Path, what: str) -> Path:
    """``path`` as a Path, refused early when it can never be written as a file."""
    out = Path(path)
    if out.is_dir():
        raise InputError(
            f"{what} must be written to a file, but {out} is a directory",
            value=str(out),
            remedy=f"name a file, e.g. {out / 'plan.json'}",
        )
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InputError(
                    f"cannot write {what} to {out}: {parent} is a file, not a directory",
                    value=str(out),
                    remedy="choose a path whose parent folders are directories",
                )
            break
    return out


def _umask() -> int:
    """The process umask (reading it means setting it, so it is set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: str | Path, data: str | bytes, what: str) -> Path:
    """Write ``data`` to ``path`` atomically (see the module docstring); returns the path."""
    out = check_writable(path, what)
    tmp: str | None = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; results are meant to be shared
        os.replace(tmp, out)
        tmp = None
    except OSError as exc:
        raise InputError(
            f"cannot write {what} to {out}: {exc.strerror or exc}",
            value=str(out),
            remedy="choose a writable location (check the folder exists and its permissions)",
        ) from exc
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return out
