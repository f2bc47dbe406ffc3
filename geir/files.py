"""Files the tools and the library write and read: whole or not at all, errors as one-line messages.

Used by the command-line tools and by library code that saves files (the frontends' `save`), so
it lives in the core, below every layer.
"""

from __future__ import annotations

import os
import re
import stat
import sys
import tempfile
import time
from pathlib import Path

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
# a temporary this young may belong to a run still writing it; an older one was left by a killed run
STALE_TEMPORARY_S = 60.0
# mkstemp's names: the prefix, then 8 characters of this alphabet (tempfile._RandomNameSequence)
_MKSTEMP_TAIL = r"[a-z0-9_]{8}"


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

    The file gets the mode the umask gives (0666 & ~umask), as any Unix tool's output does. A
    target that exists and is no regular file (/dev/null, a pipe, a terminal) is written in
    place: renaming over it would replace the device with a file. Temporaries of this target
    that a killed run left behind (older than STALE_TEMPORARY_S) are removed first.
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
    remove_stale_temporaries(target)
    try:
        fd, tmp = tempfile.mkstemp(prefix=_temporary_prefix(target), dir=target.parent)
    except OSError as e:
        raise ToolError(f"cannot write '{path}': {e.strerror or e}") from None
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp made it 0600
        os.replace(tmp, target)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):  # e.g. OUT is a directory: a diagnostic, not a traceback
            raise ToolError(f"cannot write '{path}': {e.strerror or e}") from None
        raise


def _temporary_prefix(target: Path) -> str:
    return f".{target.name}."


def remove_stale_temporaries(target: Path) -> None:
    """Remove the `.NAME.XXXXXXXX` temporaries of `target` that a killed write left beside it.

    Only regular files of this user whose name is exactly this target's temporary pattern and
    that nobody touched for STALE_TEMPORARY_S: a younger one may be another run's, still writing.
    """
    pattern = re.compile(re.escape(_temporary_prefix(target)) + _MKSTEMP_TAIL + r"\Z")
    now = time.time()
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return  # an unreadable folder: the write itself will say what is wrong
    for entry in entries:
        if not pattern.match(entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if (stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()
                    and now - st.st_mtime > STALE_TEMPORARY_S):
                os.unlink(entry.path)
        except OSError:
            pass  # gone already, or not ours to remove


def current_umask() -> int:
    """The process's umask, read without changing it where the system tells it (/proc on Linux).

    os.umask can only be read by setting it, which for a moment changes the mode of files
    other threads create; that is the fallback only.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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
