"""Reading a file that came from outside KVScope (a lecture file, a model's config) within a bound, without ever
blocking on it: the first check every such reader makes, kept below every layer that reads one."""

from __future__ import annotations

import os
import stat


class FileRefused(OSError):
    """A file KVScope will not read or write, as an ``OSError`` (every caller already says an ``OSError``'s
    ``strerror``) whose ``strerror`` is the whole sentence a user reads."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.strerror = message

    def __str__(self) -> str:
        return self.strerror


class UnfitFile(FileRefused):
    """A file that is not what a reader may read (not a regular file, too large)."""


def read_bounded(path: str | os.PathLike, most: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``most`` of them, or ``UnfitFile`` saying why not. It is
    opened without blocking and checked by its descriptor, so a FIFO never blocks the reader, a device (a link to
    ``/dev/zero``) is never read, a sparse file of GiBs is refused by its size, and a file that grows while it is
    read is cut at the bound and refused."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise UnfitFile("it is a folder, not a file")
        if not stat.S_ISREG(info.st_mode):
            raise UnfitFile("it is not a regular file (a FIFO, a device or a link to one)")
        if info.st_size > most:
            raise UnfitFile(f"it is {info.st_size:,} bytes, more than such a file holds ({most:,})")
        data = f.read(most + 1)
    if len(data) > most:
        raise UnfitFile(f"it grew past {most:,} bytes while it was read")
    return data
