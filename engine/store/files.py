"""Every file KVScope writes (traces, Perfetto traces, exports, its per-machine cache) is written the same way:
to a temporary file beside the target, then renamed over it, so a full disk or a crash mid-write leaves the
previous file intact; with the permissions the user's umask gives any other file.

The target is checked first. A folder, a missing folder or an unwritable one is refused with a sentence. So is
anything that exists and is not a regular file (a device such as ``/dev/null``, a FIFO, a socket): the rename
would replace it with an ordinary file. A symbolic link is followed: the file it points to is replaced, the
link stays.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from engine.facts.bounded import FileRefused


class WriteRefused(FileRefused):
    """The target cannot be written; ``strerror`` is the sentence a user reads."""


def writable_target(path: str | os.PathLike, what: str = "the file", example: str = "out.json",
                    inputs: Sequence[str | os.PathLike | None] = ()) -> Path:
    """The file a write to ``path`` will replace (a symlink resolved), or ``WriteRefused`` saying why not. A
    command's ``inputs`` are never written over, whichever name reaches them (given twice, a link, a hard link):
    an export to one of its own traces replaced the trace and said it had written it."""
    given = Path(path).expanduser()
    target = Path(os.path.realpath(given)) if given.is_symlink() else given
    for source in (Path(s).expanduser() for s in inputs if s):
        try:
            same = os.path.samefile(target, source)
        except OSError:                                  # one of them does not exist (yet): not the same file
            same = False
        if same:
            raise WriteRefused(f"{given} is {source}, one of the files this command reads: KVScope never writes "
                               f"over its input. Give {what} another name")
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise WriteRefused(f"Cannot write {what} to {given}: {exc.strerror or exc}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise WriteRefused(f"{given} is a folder: give a file name for {what}, e.g. {given / example}")
    if mode is not None and not stat.S_ISREG(mode):
        kind = ("a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a FIFO (named pipe)"
                if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise WriteRefused(f"{given} is {kind}: KVScope writes {what} only to an ordinary file, which it would "
                           "replace. Give a file name instead")
    folder = target.parent
    if not folder.is_dir():
        raise WriteRefused(f"Cannot write {what} to {given}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise WriteRefused(f"Cannot write {what} to {given}: the folder {folder} is not writable")
    return target


def write_atomically(path: str | os.PathLike, write: Callable[[IO], None], *, binary: bool = False,
                     what: str = "the file") -> Path:
    """Call ``write(f)`` on a temporary file beside the target, flush it to disk, then rename it over the target.
    On any failure (``OSError`` for a full disk) the temporary file is removed and the target is untouched."""
    target = writable_target(path, what)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        try:
            os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))          # replacing a file: keep its mode
        except FileNotFoundError:
            os.fchmod(fd, 0o666 & ~_umask())                 # mkstemp makes 0600; this is an ordinary file
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def write_text(path: str | os.PathLike, text: str, what: str = "the file") -> Path:
    return write_atomically(path, lambda f: f.write(text), what=what)


def write_bytes(path: str | os.PathLike, data: bytes, what: str = "the file") -> Path:
    return write_atomically(path, lambda f: f.write(data), binary=True, what=what)


def _umask() -> int:
    """The process umask, read without changing it (``os.umask`` sets it, which races with other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022
