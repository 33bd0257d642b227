"""Model-load progress on rank 0: plain stderr lines (a Slurm log's kind) while the checkpoint
loads, so a stuck load and a slow one look different.

What is measured, and why this way: transformers 5 maps every safetensors shard into memory
(``safe_open(..., backend="mmap")``) and copies the tensors out of the mappings one by one, so
the bytes come in as page faults that no ``read()`` counter (``/proc/self/io`` ``rchar``) sees
and no per-shard event marks. The pages of each shard this process has touched are its
mapping's resident size in ``/proc/self/smaps``: a background thread reads that every 2 s
and logs a line every ``every_s`` s (the largest size seen per shard counts, as the mappings go
away when the load ends) against the shard sizes on disk (the index's ``weight_map``, no
hub). A shard counts as read once 99% of its bytes were seen. Where ``/proc/self/smaps`` does
not exist the lines give the elapsed time and the shard count alone.

Per-rank completion comes from the start-up barrier's keys in the rendezvous store
(:func:`apbv.distributed.ranks_arrived`): each rank sets its key when it reaches
``ranks_ready("model loaded")``, and rank 0 counts them in its lines. Once rank 0 itself waits
at that barrier, the barrier's own lines (every 30 s) name the late ranks.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

READ_FRACTION = 0.99
"""A shard counts as read once this fraction of its bytes were seen resident."""

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


def mapped_resident(files: set[str], smaps: str = "/proc/self/smaps") -> dict[str, int] | None:
    """Bytes of each of ``files`` resident in this process's memory mappings (pages touched
    so far), from ``smaps``; None where it cannot be read (not Linux)."""
    resident: dict[str, int] = {}
    current: str | None = None
    try:
        with open(smaps, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if fields and "-" in fields[0] and not fields[0].endswith(":"):
                    current = fields[5].rstrip("\n") if len(fields) == 6 else None
                    current = current if current in files else None
                elif current is not None and fields and fields[0] == "Rss:":
                    resident[current] = resident.get(current, 0) + int(fields[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return resident


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

    ``shards``: shard path -> size (:func:`checkpoint_shards`); ``resident``: the bytes seen of
    each shard so far (:func:`mapped_resident`; None: unknown); ``arrived``: the ranks that
    have loaded (None: a single rank, or no store)."""

    def __init__(self, rank: int, world_size: int, shards: dict[str, int], *,
                 resident: Callable[[], dict[str, int] | None],
                 arrived: Callable[[], list[int] | None] = lambda: None,
                 every_s: float = 5.0):
        self.rank = rank
        self.world_size = world_size
        self.shards = shards
        self.resident = resident
        self.arrived = arrived
        self.every_s = every_s
        self.seen: dict[str, int] = {}
        """The largest resident size seen per shard."""
        self.measured = False
        self.started = 0.0
        self.last = 0.0

    def _measure(self) -> None:
        resident = self.resident()
        if resident is None:
            return
        self.measured = True
        for name, n in resident.items():
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
        arrived = self.arrived() if self.world_size > 1 else None
        if arrived is None:
            return ""
        return "; " + ranks_text(sorted(set(arrived) | ({self.rank} if loaded_self else set())),
                                 self.world_size)

    def start(self, now: float) -> str:
        self.started = self.last = now
        return (f"rank {self.rank}: loading the model: {len(self.shards)} safetensors shard(s), "
                f"{_size(sum(self.shards.values()))}")

    def tick(self, now: float) -> str | None:
        """Measure (the thread calls this every 2 s: a shard's pages are only seen while it
        is mapped) and return a line if ``every_s`` has passed since the last one."""
        self._measure()
        if now - self.last < self.every_s:
            return None
        self.last = now
        return (f"rank {self.rank}: loading the model: {self._shards_text()}, "
                f"{now - self.started:.0f} s{self._ranks_suffix(False)}")

    def finish(self, now: float, failed: BaseException | None = None) -> str:
        """The end line: after a load every shard was read (the mappings are gone by now, so
        the total is stated, not measured); after a failure what was seen, and the error's
        type (its message is the caller's to report)."""
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
                  arrived: Callable[[], list[int] | None] | None = None) -> Iterator[None]:
    """Around a model load on every rank: rank 0 logs :class:`LoadProgress` lines (the start,
    one at most every ``every_s`` s from a background thread, the end); other ranks nothing,
    nor a checkpoint that fails the checks before loading (the load then raises naming it).
    ``arrived`` defaults to the ranks at the next ``ranks_ready("model loaded")``."""
    if rank != 0 or not _checks_pass(path):
        yield
        return
    log = log or _stderr
    if arrived is None:
        from apbv.distributed import ranks_arrived

        def arrived() -> list[int] | None:
            return ranks_arrived("model loaded")
    shards = checkpoint_shards(path)
    files = set(shards)
    progress = LoadProgress(rank, world_size, shards, resident=lambda: mapped_resident(files),
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
