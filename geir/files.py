"""Files the tools and the library write and read: whole or not at all, errors as one-line messages.

Used by the command-line tools and by library code that saves files (the frontends' `save`), so
it lives in the core, below every layer.
"""

from __future__ import annotations

import errno
import os
import random
import re
import stat
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
# a temporary this young may belong to a run still writing it; an older one was left by a killed run
STALE_TEMPORARY_S = 60.0
# mkstemp's names: the prefix, then 8 characters of this alphabet (tempfile._RandomNameSequence)
_MKSTEMP_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789_"
_MKSTEMP_TAIL = f"[{_MKSTEMP_ALPHABET}]{{8}}"


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
    """Write the whole file or nothing: a temporary file beside it, then a rename (see write_all_atomically)."""
    write_all_atomically([(path, data)])


def write_all_atomically(files: Sequence[tuple[str, str | bytes]]) -> None:
    """Write every file or none, and never lose a file that was there: temporaries first, renames last.

    Each file is written whole to a temporary beside its target; only when all of them are written
    are they renamed over their targets. If a rename fails, the files already replaced get their
    old contents back (kept as hard links until the end), and a file that was not there is removed.
    The files get the mode the umask gives (0666 & ~umask), as any Unix tool's output does. A
    target that exists and is no regular file (/dev/null, a pipe, a terminal) is written in place,
    after every temporary and before any rename, so a failing device write replaces nothing:
    renaming over it would replace the device with a file. Temporaries of a target that a killed
    run left behind (older than STALE_TEMPORARY_S) are removed first.
    """
    staged: list[tuple[str, Path]] = []  # (temporary, target), in the order given
    in_place: list[tuple[str, str | bytes]] = []
    try:
        for path, data in files:
            target = Path(path)
            if _written_in_place(target):
                in_place.append((path, data))
            else:
                staged.append((_stage(path, data), target))
        for path, data in in_place:
            try:
                with open(path, "wb" if isinstance(data, bytes) else "w",
                          **({} if isinstance(data, bytes) else {"encoding": "utf-8"})) as f:
                    f.write(data)
            except OSError as e:
                raise ToolError(f"cannot write '{path}': {e.strerror or e}") from None
        _commit(staged)
    finally:
        for tmp, _ in staged:  # what _commit did not rename: an earlier failure, or an interrupt
            _unlink_quietly(tmp)


def output_problem(path: str) -> str | None:
    """Why `path` cannot be written as an output, in the system's words, or None when it can.

    Asked before a run, so that a long run does not end in a write error: a regular target's
    folder must let a temporary be created in it (what write_all_atomically does), a directory is
    no output, a device or pipe must be writable.
    """
    target = Path(path)
    if target.is_dir():
        return os.strerror(errno.EISDIR)
    if _written_in_place(target):
        return None if os.access(target, os.W_OK) else os.strerror(errno.EACCES)
    folder = target.parent
    if not folder.exists():
        return os.strerror(errno.ENOENT)
    if not folder.is_dir():
        return os.strerror(errno.ENOTDIR)
    try:
        fd, tmp = tempfile.mkstemp(prefix=_temporary_prefix(target), dir=folder)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    _unlink_quietly(tmp)
    return None


def _written_in_place(target: Path) -> bool:
    """An existing device, pipe or terminal: written in place, as renaming over it would replace it."""
    return target.exists() and not target.is_file() and not target.is_dir()


def _stage(path: str, data: str | bytes) -> str:
    """A temporary beside `path` holding all of `data`, with the umask's mode; ToolError naming `path`."""
    target = Path(path)
    remove_stale_temporaries(target)
    try:
        fd, tmp = tempfile.mkstemp(prefix=_temporary_prefix(target), dir=target.parent)
    except OSError as e:
        raise ToolError(f"cannot write '{path}': {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w",
                       **({} if isinstance(data, bytes) else {"encoding": "utf-8"})) as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp made it 0600
    except BaseException as e:
        _unlink_quietly(tmp)
        if isinstance(e, OSError):  # a full disk: a diagnostic, not a traceback
            raise ToolError(f"cannot write '{path}': {e.strerror or e}") from None
        raise
    return tmp


def _commit(staged: list[tuple[str, Path]]) -> None:
    """Rename every temporary over its target, or, when one rename fails, put back every target as it was."""
    done: list[tuple[Path, str | None]] = []  # (target replaced, the hard link keeping its old file, or None)
    try:
        for i, (tmp, target) in enumerate(staged):
            # the last rename has none after it that could fail: nothing to put back, no link to make
            kept = _keep(target) if i < len(staged) - 1 else None
            try:
                os.replace(tmp, target)
            except BaseException as e:
                if kept is not None:
                    _unlink_quietly(kept)
                if isinstance(e, OSError):
                    raise ToolError(f"cannot write '{target}': {e.strerror or e}") from None
                raise
            done.append((target, kept))
    except BaseException:
        for target, kept in reversed(done):
            try:
                if kept is not None:
                    os.replace(kept, target)
                else:
                    os.unlink(target)  # it was not there before
            except OSError:
                pass
        raise
    for _, kept in done:
        if kept is not None:
            _unlink_quietly(kept)


def _keep(target: Path) -> str | None:
    """A hard link to the file at `target` under a temporary's name, or None when there is none (or no link can be made)."""
    if not target.is_file():
        return None
    for _ in range(8):
        name = str(target.parent / (_temporary_prefix(target) + "".join(random.choices(_MKSTEMP_ALPHABET, k=8))))
        try:
            os.link(target, name, follow_symlinks=False)
            return name
        except FileExistsError:
            continue
        except OSError:
            return None  # a file system without hard links: the rename cannot be undone, as before
    return None


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


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
