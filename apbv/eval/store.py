"""The output files of an evaluation run: the JSONL of finished samples and its lock.

:class:`ResultLog` reads the JSONL (repairing a half-written last line), appends rows one
fsynced line at a time, and rewrites it whole when failed rows are dropped for a retry.
:class:`OutputLock` holds an exclusive ``fcntl.flock`` on ``OUT.jsonl.lock`` while a run
writes its files, so a second run on the same output is refused at once instead of mixing its
lines into the file.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Row = dict[str, Any]


class ResultLog:
    """The JSONL file of finished samples: read (and repaired) on resume, then appended to."""

    def __init__(self, path: Path):
        self.path = path
        self._file: Any = None

    def read(self, task: str, mode: str, compare: bool) -> tuple[list[Row], str | None]:
        """The rows already written, and a note when a half-written last line was cut off.

        Raises ValueError for a damaged line before the last, a line that is not a row, a
        sample id twice, or rows of another task or mode, or with(out) the comparison against
        exact attention when this run is not (resuming into them would mix runs).
        """
        def check(row: Row) -> None:
            if row.get("task") != task or row.get("mode") != mode:
                raise ValueError(f"{self.path} holds results of task {row.get('task')} in mode "
                                 f"{row.get('mode')}, not {task} in mode {mode}; pass another "
                                 f"output file")
            if ("exact" in row) != compare:
                raise ValueError(f"{self.path} holds results {'without' if compare else 'with'} "
                                 f"the comparison against exact attention, unlike this run; "
                                 f"pass another output file")

        return self.read_rows("id", check)

    def read_rows(self, key: str, check: Any = None,
                  what: str = "sample ids") -> tuple[list[Row], str | None]:
        """The rows already written (each a JSON object holding ``key``, its value unique, or
        ValueError naming the ``what`` found twice;
        ``check(row)`` raises ValueError for a row of another run), and a note when a
        half-written last line was cut off (the file is truncated before it)."""
        if not self.path.exists():
            return [], None
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        tail = lines.pop()  # the bytes after the last newline: b"" unless cut mid-write
        rows: list[Row] = []
        kept = 0
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict) or key not in row:
                if number == len(lines) and not tail:
                    tail = line
                    break
                raise ValueError(f"{self.path} line {number} is not a result row; the file is "
                                 f"damaged (move it away to start over)")
            if check is not None:
                check(row)
            rows.append(row)
            kept += len(line) + 1
        ids = [r[key] for r in rows]
        if len(set(ids)) != len(ids):
            twice = sorted({str(i) for i in ids if ids.count(i) > 1})
            raise ValueError(f"{self.path} has {what} more than once: {', '.join(twice)}")
        if not tail:
            return rows, None
        os.truncate(self.path, kept)
        return rows, (f"dropped a half-written last line of {self.path} "
                      f"({len(data) - kept} bytes)")

    def append(self, row: Row) -> None:
        """Write one row as one line; it is on disk when this returns."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def rewrite(self, rows: Iterable[Row]) -> None:
        """Replace the file by ``rows`` (written to a temporary file, then renamed over it)."""
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def lock_path(out: str | os.PathLike[str]) -> Path:
    """``OUT.jsonl.lock`` next to the output file."""
    out = Path(out)
    return out.with_name(out.name + ".lock")


class OutputLock:
    """An exclusive, non-blocking ``flock`` on ``OUT.jsonl.lock`` while a run writes ``OUT``.

    :meth:`acquire` raises ValueError naming the lock file when another process holds it. The
    lock file is removed by :meth:`release` (and the kernel drops the lock when the process
    exits, however it exits). A run that takes the lock checks that the file it locked is still
    the one at the path, so a run racing a release never ends up with a lock of its own on a
    removed file.
    """

    def __init__(self, out: str | os.PathLike[str]):
        self.out = Path(out)
        self.path = lock_path(out)
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(10):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ValueError(f"another run is writing {self.out} (lock file {self.path} is "
                                 f"held); wait for it to end, or pass another --out") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self._fd = fd
                return
            os.close(fd)  # the holder released and removed it meanwhile: lock the new file
        raise ValueError(f"could not lock {self.path}: it keeps being replaced")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
