"""Atomic file and folder writes: the one place the package writes a result that a crash must not half-write.

Temporary file in the same folder, fsync, ``os.replace``: a reader sees the old file or the new one.
Standard library only (``benchmarks/gpu_check.py`` imports it with just torch and triton).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on a clean exit it is fsync-ed and renamed over ``path``.

    For writers that take a file name; ``suffix`` ends the temporary name (writers that pick the format
    from it, e.g. ``".mp4"``). The parent folder is created if missing.

    Raises:
        FileNotFoundError: the block wrote nothing. Whatever the block raises (``path`` left as it was).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{suffix}", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; the result is an ordinary file
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temporary file in the same folder, flush + fsync,
    ``os.replace``); create the parent folder if missing. Returns ``path`` as a ``Path``.

    Raises:
        TypeError: ``data`` is not ``bytes`` / ``bytearray`` / ``memoryview``.
        OSError: the folder is not writable (``path`` is left as it was).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"atomic_write_bytes writes bytes; got {type(data).__name__} (use atomic_write_text for str)")
    path = Path(path)
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically, as :func:`atomic_write_bytes`. Returns ``path``.

    Raises:
        TypeError: ``text`` is not a ``str``.
    """
    if not isinstance(text, str):
        raise TypeError(f"atomic_write_text writes str; got {type(text).__name__} (use atomic_write_bytes for bytes)")
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, **dumps_kwargs: Any) -> Path:
    """Write ``json.dumps(obj, **dumps_kwargs)`` (default ``indent=2``) plus a newline to ``path`` atomically; returns ``path``.

    Raises:
        TypeError / ValueError: from ``json.dumps``, before anything is written.
    """
    dumps_kwargs.setdefault("indent", 2)
    return atomic_write_text(path, json.dumps(obj, **dumps_kwargs) + "\n")


@contextlib.contextmanager
def atomic_directory(out_dir: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``out_dir``; on success it replaces ``out_dir`` in one rename.

    Raises:
        FileExistsError: if ``out_dir`` exists, is not empty and ``overwrite`` is False.
        ValueError: ``overwrite`` would replace a folder that contains the current directory.
    """
    out = Path(out_dir).resolve()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out} exists and is not empty; choose another folder or pass overwrite=True (--overwrite on the command "
            "line), which replaces the folder's whole content"
        )
    if overwrite and out.exists() and Path.cwd().resolve().is_relative_to(out):
        raise ValueError(f"refusing to replace {out}: it contains the current directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it owner-only; the result is an ordinary folder
    try:
        yield tmp
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
