"""Writing a result file so that a failure is one clear line and leaves nothing behind.

Plans, pictures and profiles are written the same way: refuse a directory or
a path under a file before any work, write a temporary sibling, rename it
over the target (a crash never leaves half a file), remove the temporary on
any failure, and turn the operating system's error into an
:class:`~crosscut.errors.InputError` naming the path and a remedy.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from crosscut.errors import InputError

__all__ = ["check_writable", "write_atomic"]


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
