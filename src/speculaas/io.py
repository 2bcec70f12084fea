"""Files the tools write, written atomically: to a temporary file in the same folder, then
renamed over the target. A kill or Ctrl-C mid-write leaves the old file (or none), never a torn
one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from PIL import Image

_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yields a temporary path beside `path`; on success it replaces `path`, else it vanishes."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give what open() would
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def save_image(image: Image.Image, path: str | Path) -> None:
    """Save with the format the suffix names (PNG for .png), atomically."""
    fmt = Image.registered_extensions().get(Path(path).suffix.lower())
    if fmt is None:
        raise ValueError(f"cannot tell the image format of {path}; use .png or .jpg")
    with atomic_path(path) as tmp:
        image.save(tmp, format=fmt)


def check_writable(path: str | Path) -> None:
    """Raise ValueError now, before any work, if `path` cannot be written."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"output path {path} is a folder; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".check", dir=path.parent)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise ValueError(f"cannot write {path}: {e.strerror or e}") from None
