"""Model-load progress on rank 0: plain stderr lines (a Slurm log's kind) while the checkpoint
loads, so a stuck load and a slow one look different.

What is measured, and why this way: transformers 5 maps every safetensors shard into memory
(``safe_open(..., backend="mmap")``) and copies the tensors out of the mappings, so the bytes
come in as page faults that no ``read()`` counter (``/proc/self/io`` ``rchar``) sees, that no
per-shard event marks, and whose pages safetensors does not keep mapped (``/proc/self/smaps``
misses them). What does grow with every byte fetched from storage, whichever way it is read,
is the shard file's share of the page cache: a background thread asks ``mincore`` for each
shard every 2 s and logs a line every ``every_s`` s, against the shard sizes on disk (the
index's ``weight_map``, no hub). The largest value seen counts; a shard counts as read at 99%.
A checkpoint already in the page cache (read by another rank of the node, or a warm cache)
shows as read at once: its load is then memory-bound, not storage-bound. Where ``mincore``
cannot be asked the lines give the elapsed time and the shard count alone.

Per-rank completion comes from the start-up barrier's keys in the rendezvous store
(:func:`apbv.distributed.ranks_arrived`): each rank sets its key when it reaches
``ranks_ready("model loaded")``, and rank 0 counts them in its lines. Once rank 0 itself waits
at that barrier, the barrier's own lines (every 30 s) name the late ranks.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

READ_FRACTION = 0.99
"""A shard counts as read once this fraction of its bytes were seen in the page cache."""

MAX_NAMED = 8
"""At most this many waiting ranks are named in one line (then "...")."""


def checkpoint_shards(path: str | Path) -> dict[str, int]:
    """Each safetensors file of the checkpoint directory ``path`` (its real path) -> its size
    in bytes on disk: the shards the index's ``weight_map`` lists, or ``model.safetensors``.
    Empty when there are none or the index cannot be read (the load's own checks then name
    the problem)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
            names = sorted(set(weight_map.values()))
        else:
            names = ["model.safetensors"] if (path / "model.safetensors").is_file() else []
        return {os.path.realpath(path / name): (path / name).stat().st_size for name in names}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_IN_CORE = bytes(b & 1 for b in range(256))
"""``mincore``'s byte per page -> 1 when the page is in memory (the low bit; macOS sets more)."""


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    return libc


def _cached(libc: Any, path: str) -> int:
    """Bytes of the file ``path`` in the page cache (``mincore`` over a fresh mapping of it,
    which reads nothing)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (ctypes.c_ubyte * ((size + _PAGE - 1) // _PAGE))()
            if libc.mincore(ctypes.c_void_p(addr), size, pages) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return min(size, bytes(pages).translate(_IN_CORE).count(1) * _PAGE)
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def cached_bytes(files: set[str]) -> dict[str, int] | None:
    """Bytes of each of ``files`` in the page cache so far (read from storage by some process
    of this machine); None where that cannot be asked (no ``mincore``: not Linux or macOS)."""
    try:
        libc = _libc()
        return {name: _cached(libc, name) for name in files}
    except (OSError, AttributeError, ValueError):
        return None


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def ranks_text(arrived: list[int], world_size: int) -> str:
    """``ranks loaded: 3/8 (waiting for 0, 5, ...)`` from the ranks that have loaded."""
    waiting = [r for r in range(world_size) if r not in set(arrived)]
    text = f"ranks loaded: {world_size - len(waiting)}/{world_size}"
    if waiting:
        named = ", ".join(map(str, waiting[:MAX_NAMED]))
        text += f" (waiting for {named}{', ...' if len(waiting) > MAX_NAMED else ''})"
    return text


class LoadProgress:
    """The lines of one load on rank ``rank``: :meth:`start`, :meth:`tick` (a line at most
    every ``every_s`` seconds, else None) and :meth:`finish`, each with the time ``now`` (s).

    ``shards``: shard path -> size (:func:`checkpoint_shards`); ``cached``: the bytes read of
    each shard so far (:func:`cached_bytes`; None: unknown); ``arrived``: the ranks that
    have loaded (None: a single rank, or no store)."""

    def __init__(self, rank: int, world_size: int, shards: dict[str, int], *,
                 cached: Callable[[], dict[str, int] | None],
                 arrived: Callable[[], list[int] | None] = lambda: None,
                 every_s: float = 5.0):
        self.rank = rank
        self.world_size = world_size
        self.shards = shards
        self.cached = cached
        self.arrived = arrived
        self.every_s = every_s
        self.seen: dict[str, int] = {}
        """The most bytes seen per shard (the page cache may drop some later)."""
        self.measured = False
        self.started = 0.0
        self.last = 0.0

    def _measure(self) -> None:
        cached = self.cached()
        if cached is None:
            return
        self.measured = True
        for name, n in cached.items():
            if name in self.shards:
                self.seen[name] = max(self.seen.get(name, 0), min(n, self.shards[name]))

    def _shards_text(self) -> str:
        total = sum(self.shards.values())
        if not self.measured:
            return f"{len(self.shards)} shard(s), {_size(total)} (bytes read not measurable here)"
        done = sum(self.seen.get(name, 0) >= READ_FRACTION * size
                   for name, size in self.shards.items())
        return (f"{done}/{len(self.shards)} shard(s), "
                f"{_size(sum(self.seen.values()))}/{_size(total)} read")

    def _ranks_suffix(self, loaded_self: bool) -> str:
        try:
            arrived = self.arrived() if self.world_size > 1 else None
        except Exception as exc:  # a store problem must not fail the load: the barrier reports
            return f"; ranks loaded: unknown ({type(exc).__name__})"
        if arrived is None:
            return ""
        return "; " + ranks_text(sorted(set(arrived) | ({self.rank} if loaded_self else set())),
                                 self.world_size)

    def start(self, now: float) -> str:
        self.started = self.last = now
        return (f"rank {self.rank}: loading the model: {len(self.shards)} safetensors shard(s), "
                f"{_size(sum(self.shards.values()))}")

    def tick(self, now: float) -> str | None:
        """Measure (the thread calls this every 2 s) and return a line if ``every_s`` has
        passed since the last one."""
        self._measure()
        if now - self.last < self.every_s:
            return None
        self.last = now
        return (f"rank {self.rank}: loading the model: {self._shards_text()}, "
                f"{now - self.started:.0f} s{self._ranks_suffix(False)}")

    def finish(self, now: float, failed: BaseException | None = None) -> str:
        """The end line: after a load the checkpoint's size (the model needs no more of it:
        tied or unused tensors are never read, so the measure may stay short of it); after a
        failure what was seen, and the error's type (its message is the caller's to report)."""
        if failed is not None:
            self._measure()
            return (f"rank {self.rank}: the model load failed after {now - self.started:.0f} s "
                    f"({self._shards_text()}): {type(failed).__name__}")
        return (f"rank {self.rank}: model loaded in {now - self.started:.1f} s "
                f"({len(self.shards)} shard(s), {_size(sum(self.shards.values()))})"
                f"{self._ranks_suffix(True)}")


def _checks_pass(path: str | Path) -> bool:
    """Whether the checkpoint passes the checks made before any weight is read (milliseconds):
    a wrong directory gets no progress lines, only the load's one error line."""
    from apbv.model.families import family_of

    try:
        family_of(path)
    except ValueError:
        return False
    return True


@contextmanager
def load_progress(path: str | Path, rank: int, world_size: int, *, every_s: float = 5.0,
                  log: Callable[[str], None] | None = None,
                  arrived: Callable[[], list[int] | None] | None = None,
                  group: Any = None) -> Iterator[None]:
    """Around a model load on every rank: rank 0 logs :class:`LoadProgress` lines (the start,
    one at most every ``every_s`` s from a background thread, the end); other ranks nothing,
    nor a checkpoint that fails the checks before loading (the load then raises naming it).
    ``arrived`` defaults to the ranks of ``group`` (the engine's process group) at its next
    ``ranks_ready("model loaded")``."""
    if rank != 0 or not _checks_pass(path):
        yield
        return
    log = log or _stderr
    if arrived is None:
        from apbv.distributed import ranks_arrived

        def arrived() -> list[int] | None:
            return ranks_arrived("model loaded", group)
    shards = checkpoint_shards(path)
    files = set(shards)
    progress = LoadProgress(rank, world_size, shards, cached=lambda: cached_bytes(files),
                            arrived=arrived, every_s=every_s)
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(min(2.0, every_s)):
            line = progress.tick(time.monotonic())
            if line is not None:
                log(line)

    log(progress.start(time.monotonic()))
    thread = threading.Thread(target=report, name="apbv-load-progress", daemon=True)
    thread.start()
    try:
        yield
    except BaseException as exc:
        stop.set()
        thread.join()
        log(progress.finish(time.monotonic(), failed=exc))
        raise
    stop.set()
    thread.join()  # before the caller's barrier uses the store again
    log(progress.finish(time.monotonic()))
