"""Opening a path without following a symbolic link anywhere on it.

The server checks a client's path against the media roots with its links resolved, and hands
the real path on; the file is opened later, by every rank. Opened by name, a directory or the
file swapped for a link in between would lead wherever the link points. Opened here, one
component at a time relative to the directory opened before it and none through a link, the
path names the checked file or nothing: a link anywhere on it is an error naming it.

A decoder that takes only a path reads the opened file through :func:`fd_path`.
"""

from __future__ import annotations

import errno
import os
import stat

_PROC_FD = "/proc/self/fd"


def open_nofollow(path: str, what: str, *, directory: bool = False) -> int:
    """A read-only descriptor of ``path`` (a regular file, or with ``directory`` a directory),
    opened component by component with ``O_NOFOLLOW``; the caller closes it.

    ValueError naming ``what`` and ``path`` when a component is a symbolic link (not followed),
    the path holds ``..``, it is missing, or it is not a regular file (directory). A FIFO or a
    device does not block the open (``O_NONBLOCK``) and is refused as not a regular file.
    """
    def refuse(why: str) -> ValueError:
        return ValueError(f"{what} {path!r} cannot be opened: {why}")

    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise refuse("it holds '..'")
    if not parts:
        raise refuse("no file name")
    walk = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    last = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    if directory:
        last |= os.O_DIRECTORY
    fd = os.open("/" if path.startswith("/") else ".", walk)
    try:
        for i, part in enumerate(parts):
            final = i == len(parts) - 1
            try:
                nxt = os.open(part, last if final else walk, dir_fd=fd)
            except OSError as err:
                where = "/".join(parts[:i + 1])
                where = "/" + where if path.startswith("/") else where
                if err.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(where):
                    raise refuse("it is a symbolic link, not followed" if final else
                                 f"{where!r} on its path is a symbolic link, not followed"
                                 ) from None
                raise refuse(err.strerror or str(err)) from None
            os.close(fd)
            fd = nxt
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)):
            raise refuse("not a directory" if directory else "not a regular file")
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def fd_path(fd: int) -> str:
    """A path that opens the file of the open descriptor ``fd`` again (``/proc/self/fd/N``),
    for decoders that open by name; ValueError where the system has no ``/proc``."""
    if not os.path.isdir(_PROC_FD):
        raise ValueError(f"opening a video without following links needs {_PROC_FD} "
                         "(Linux's /proc), which this system does not have")
    return f"{_PROC_FD}/{fd}"
