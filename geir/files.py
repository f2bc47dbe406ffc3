"""Files the tools and the library write and read: whole or not at all, errors as one-line messages.

Used by the command-line tools and by library code that saves files (the frontends' `save`), so
it lives in the core, below every layer.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class ToolError(Exception):
    """A problem outside any source file (unreadable input, bad flag value) and its exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILURE):
        super().__init__(message)
        self.code = code


def read_input(path: str) -> tuple[str, bytes]:
    """(name used in diagnostics, raw bytes) of a file, or of stdin for '-'."""
    if path == "-":
        return "<stdin>", sys.stdin.buffer.read()
    try:
        return path, Path(path).read_bytes()
    except OSError as e:
        raise ToolError(f"cannot read '{path}': {e.strerror or e}") from None


def write_atomically(path: str, data: str | bytes) -> None:
    """Write the whole file or nothing: a temporary file beside it, then a rename.

    A target that exists and is no regular file (/dev/null, a pipe, a terminal) is written in
    place: renaming over it would replace the device with a file.
    """
    target = Path(path)
    mode = "wb" if isinstance(data, bytes) else "w"
    if target.exists() and not target.is_file() and not target.is_dir():
        try:
            with open(target, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
                f.write(data)
        except OSError as e:
            raise ToolError(f"cannot write '{path}': {e.strerror or e}") from None
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent if str(target.parent) else ".")
    except OSError as e:
        raise ToolError(f"cannot write '{path}': {e.strerror or e}") from None
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):  # e.g. OUT is a directory: a diagnostic, not a traceback
            raise ToolError(f"cannot write '{path}': {e.strerror or e}") from None
        raise


def npz_bytes(arrays: dict) -> bytes:
    """An .npz archive of named arrays, as np.savez writes it, for any names: np.savez takes the names as
    keyword arguments, so arrays named 'file' or 'allow_pickle' would collide with its own parameters."""
    import io
    import zipfile

    import numpy as np

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, array in arrays.items():
            with z.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(array), allow_pickle=False)
    return buf.getvalue()
