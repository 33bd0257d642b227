"""Local live sources: a file still being written (:class:`FollowFile`), a directory of
segment files (:class:`SegmentDir`), and :func:`local_source`, which picks one for a path.

Both follow the source protocol of :mod:`apbv.capture.sources` (``frames(stop)`` yields
``(image, timestamp)`` or ``None``; timestamps start at 0.0, segments continue where the previous
one ended). PyAV is imported only when a file is opened.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Any

from apbv.capture.sources import (
    RawFrame,
    Source,
    UrlSource,
    _error_text,
    _frame_step,
    _from_start,
)
from apbv.validate import positive
from apbv.video.nofollow import open_nofollow
from apbv.video.sampling import _import

SEGMENT_EXTENSIONS = (".mp4", ".ts", ".mkv")
"""The file types :class:`SegmentDir` takes by default."""

SEGMENT_ORDERS = ("name", "mtime")
"""The orders :class:`SegmentDir` takes segments in."""


PROBE_BYTES = 8 << 20
"""The most :meth:`FollowFile.probe` reads of a file (bytes)."""

class _TailReader:
    """A read-only, unseekable file object over a growing file: at the current end of the file
    ``read`` waits for more bytes, and returns b"" (end of stream) once ``stop`` or
    ``finished`` is set, ``max_bytes`` (None: no limit) have been read, or no byte has come for
    ``end_after_s`` seconds since the last one read (or since the reader was made): not since
    the read call began, so a slow decoder between two reads, or a demuxer that asks again
    after an end, never stretches the wait."""

    def __init__(self, fd: int, stop: threading.Event, finished: threading.Event,
                 poll_s: float, end_after_s: float | None, max_bytes: int | None = None) -> None:
        self._file = os.fdopen(fd, "rb")  # closed by close()
        self._stop = stop
        self._finished = finished
        self._poll_s = poll_s
        self._end_after_s = end_after_s
        self._left = max_bytes
        self.last_byte = time.monotonic()
        """time.monotonic() when the last byte was read (when made, before the first)."""

    def read(self, size: int = -1) -> bytes:
        if self._left is not None:
            if self._left <= 0:
                return b""
            size = self._left if size is None or size < 0 else min(size, self._left)
        data = b""
        while not self._stop.is_set():
            data = self._file.read(size)
            if data:
                break
            if self._finished.is_set():  # what was written before finish(), then the end
                data = self._file.read(size)
                break
            if self._end_after_s is not None and \
                    time.monotonic() - self.last_byte >= self._end_after_s:
                break
            self._stop.wait(self._poll_s)
        if data:
            self.last_byte = time.monotonic()
            if self._left is not None:
                self._left -= len(data)
        return data

    def close(self) -> None:
        self._file.close()


class FollowFile(Source):
    """A video file that is still being written, followed like ``tail -f``.

    The file is read as one unseekable byte stream: at its current end the reader waits
    (checking every ``poll_s`` seconds) for the writer to append more, so frames come out as
    soon as they can be decoded (with B-frames, a few frames wait for the packets after them;
    the decoder uses slice threads only, as frame threads would hold back more). The last
    frames come out when the source ends: after :meth:`finish` (the writer has finished: the
    file is decoded to its end), or when no byte has come for ``end_after_s`` seconds since
    the last one read (None: never; the capture's ``give_up_s`` can still end it).

    What can be followed: streamable containers, whose index is not at the end of the file:
    MPEG-TS (what recorders and HLS write; frames come out a packet at a time), fragmented MP4
    (a fragment at a time) and Matroska/WebM (a cluster at a time). A plain MP4 whose ``moov``
    atom is written at the end cannot be followed: nothing decodes before the writer has
    finished, and a file larger than FFmpeg's read buffer then fails, since an unseekable read
    cannot go back from the index to the frames; take such files with :class:`SegmentDir`.

    ``options`` are FFmpeg format options (defaults: probesize 32768 bytes, analyzeduration
    0.2 s, so the first frames come out at once; raise them for a high-bitrate stream whose
    codec parameters come later). The file must exist when the source starts (ValueError
    otherwise, in the capture's stats); data it cannot open or decode ends the source with
    the decoder's error naming the file; :meth:`probe` looks at the file's first bytes at
    once (the server probes before a stream opens). With ``follow_symlinks=False`` (the
    server's choice) the file is opened without following a link anywhere on its path (see
    :func:`~apbv.video.nofollow.open_nofollow`): a link is an error naming it.
    """

    def __init__(self, path: str | os.PathLike[str], *, poll_s: float = 0.05,
                 end_after_s: float | None = None, options: dict[str, str] | None = None,
                 follow_symlinks: bool = True) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.follow_symlinks = follow_symlinks
        self.poll_s = positive("poll_s", poll_s, unit="seconds")
        self.end_after_s = positive("end_after_s", end_after_s, allow_none=True, unit="seconds")
        # Small probe sizes: decoding starts from the first packets, not after 5 s of video.
        self.options = {"probesize": "32768", "analyzeduration": "200000", **(options or {})}
        self._finished = threading.Event()

    def finish(self) -> None:
        """The writer has finished the file: decode it to its end, then end the source."""
        self._finished.set()

    def _open(self) -> int:
        """A read-only descriptor of the file (without following links when so made)."""
        if not self.follow_symlinks:
            return open_nofollow(self.path, "followed video")
        if not os.path.isfile(self.path):
            raise ValueError(f"followed video {self.path!r} does not exist or is not a file")
        return os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)

    def probe(self) -> None:
        """ValueError unless the bytes the file holds now (at most ``PROBE_BYTES``, read once,
        without waiting for more) open as a video: a streamable container with a video
        stream. An empty file, text, audio only, or a plain MP4 whose index is not written
        yet are refused, so a client hears it when opening the stream, not when the source
        ends."""
        av = _import("av", "av", "following a video file")
        fd = self._open()
        done = threading.Event()
        done.set()
        reader = _TailReader(fd, threading.Event(), done, self.poll_s, None, PROBE_BYTES)
        where = f"followed video {self.path!r}"
        try:
            if os.fstat(fd).st_size == 0:
                raise ValueError(f"{where} is empty: nothing to probe yet (open the stream once "
                                 "the writer has written the file's first packets)")
            try:
                with av.open(reader, options=self.options) as container:
                    if not container.streams.video:
                        raise ValueError(f"{where} has no video stream")
            except (av.FFmpegError, OSError) as err:
                raise ValueError(
                    f"{where} is not a video that can be followed: its first bytes (up to "
                    f"{PROBE_BYTES} read) do not open as a streamable video format (MPEG-TS, "
                    f"fragmented MP4, Matroska/WebM): {_error_text(err)}") from err
        finally:
            reader.close()

    def frames(self, stop: threading.Event) -> Iterator[RawFrame | None]:
        av = _import("av", "av", "following a video file")
        fd = self._open()
        reader = _TailReader(fd, stop, self._finished, self.poll_s, self.end_after_s)
        try:
            try:
                container = av.open(reader, options=self.options)
            except av.FFmpegError as err:
                if stop.is_set():
                    return
                raise ValueError(f"followed video {self.path!r} cannot be opened by PyAV "
                                 f"(not a streamable video format?): {err}") from err
            with container:
                try:
                    yield from _from_start(container, stop, f"followed video {self.path!r}")
                except av.FFmpegError as err:
                    raise ValueError(f"followed video {self.path!r} failed while decoding: "
                                     f"{_error_text(err)}") from err
        finally:
            reader.close()


class SegmentDir(Source):
    """Segment files (``extensions``) in a directory, as a recorder writes them, one after
    another as one stream.

    Segments are taken in ``order``: ``"name"`` (sorted file names; recorders number them with
    zero padding) or ``"mtime"`` (modification time, then name). A segment is taken when a later
    one exists, or when its size has been the same for ``settle_s`` seconds (the last segment,
    once the recorder has finished it); every segment is taken once. Timestamps continue across
    segments: a segment's frames are offset by the durations of the segments before it (the
    last frame's time plus one frame period). A segment that cannot be opened or decoded is
    skipped: ``segments_failed`` grows and ``errors`` gets "name: error" (frames it yielded
    before failing stay, and its duration is what they covered); the stream goes on with the
    next segment. The source ends when no segment is pending and none has appeared for
    ``end_after_s`` seconds (None: never). The directory must exist (ValueError). With
    ``follow_symlinks=False`` (the server's choice, so that a segment cannot lead outside the
    media roots) a segment that is a symbolic link is skipped and reported in ``errors``, and
    neither the directory nor a segment is opened through a link: the directory is opened once
    when reading starts, without a link anywhere on its path
    (:func:`~apbv.video.nofollow.open_nofollow`), and every segment is listed and opened
    relative to it, without following a link (``O_NOFOLLOW``). A writer who swaps a listed
    segment, or the directory or one above it, for a link meanwhile gets a failed segment or a
    refused directory, not the link's target.
    """

    def __init__(self, path: str | os.PathLike[str], *, order: str = "name",
                 settle_s: float = 1.0, poll_s: float = 0.05, end_after_s: float | None = None,
                 extensions: Sequence[str] = SEGMENT_EXTENSIONS,
                 follow_symlinks: bool = True) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.follow_symlinks = follow_symlinks
        self._links: set[str] = set()
        if order not in SEGMENT_ORDERS:
            raise ValueError(f"order must be one of {SEGMENT_ORDERS}, got {order!r}")
        if not os.path.isdir(self.path):
            raise ValueError(f"segment directory {self.path!r} does not exist or is not a "
                             "directory")
        self.order = order
        self.settle_s = positive("settle_s", settle_s, allow_zero=True, unit="seconds")
        self.poll_s = positive("poll_s", poll_s, unit="seconds")
        self.end_after_s = positive("end_after_s", end_after_s, allow_none=True, unit="seconds")
        if isinstance(extensions, str) or not extensions or not all(
                isinstance(e, str) and e.startswith(".") for e in extensions):
            raise ValueError(f"extensions must be a sequence of suffixes like '.ts', got "
                             f"{extensions!r}")
        self.extensions = tuple(e.lower() for e in extensions)

    def _listing(self, directory: int) -> list[tuple[str, int]]:
        """(name, size) of the segment files in the open ``directory``, in the source's
        order."""
        found = []
        with os.scandir(directory) as entries:
            for entry in entries:
                if not entry.name.lower().endswith(self.extensions):
                    continue
                try:
                    if not self.follow_symlinks and entry.is_symlink():
                        if entry.name not in self._links:
                            self._links.add(entry.name)
                            self.errors.append(f"{entry.name}: a symbolic link, not followed "
                                               "(skipped)")
                        continue
                    if not entry.is_file():
                        continue
                    st = entry.stat()
                except FileNotFoundError:  # removed meanwhile (a recorder's rolling window)
                    continue
                found.append((st.st_mtime_ns, entry.name, st.st_size))
        if self.order == "name":
            found.sort(key=lambda f: f[1])
        else:
            found.sort()
        return [(name, size) for _, name, size in found]

    def _open_flags(self) -> int:
        return os.O_RDONLY | (0 if self.follow_symlinks else os.O_NOFOLLOW)

    def _open(self) -> int:
        """A descriptor of the directory (without following links when so made)."""
        if not self.follow_symlinks:
            return open_nofollow(self.path, "segment directory", directory=True)
        try:
            return os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as err:
            raise ValueError(f"segment directory {self.path!r} cannot be opened: "
                             f"{_error_text(err)}") from err

    def probe(self) -> None:
        """ValueError unless the directory opens as :meth:`frames` will open it (its segments
        are not looked into: the newest may still be being written; one that fails is
        reported and skipped)."""
        os.close(self._open())

    def frames(self, stop: threading.Event) -> Iterator[RawFrame | None]:
        av = _import("av", "av", "reading video segments")
        directory = self._open()
        try:
            yield from self._follow(av, directory, stop)
        finally:
            os.close(directory)

    def _follow(self, av: Any, directory: int,
                stop: threading.Event) -> Iterator[RawFrame | None]:
        done: set[str] = set()
        sizes: dict[str, tuple[int, float]] = {}  # name -> (size, when it was first seen)
        offset = 0.0
        idle_since = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            pending = [(n, s) for n, s in self._listing(directory) if n not in done]
            ready = None
            if pending:
                name, size = pending[0]
                if sizes.get(name, (None,))[0] != size:
                    sizes[name] = (size, now)
                if len(pending) > 1 or now - sizes[name][1] >= self.settle_s:
                    ready = name
            if ready is None:
                if not pending and self.end_after_s is not None \
                        and now - idle_since >= self.end_after_s:
                    return
                yield None
                stop.wait(self.poll_s)
                continue
            done.add(ready)
            sizes.pop(ready, None)
            offset = yield from self._segment(av, directory, ready, offset, stop)
            idle_since = time.monotonic()

    def _segment(self, av: Any, directory: int, name: str, offset: float,
                 stop: threading.Event) -> Generator[RawFrame | None, None, float]:
        """Yield the frames of segment ``name`` of the open ``directory`` at ``offset``;
        returns the next segment's offset."""
        last: float | None = None
        step = 0.0
        try:
            with os.fdopen(os.open(name, self._open_flags(), dir_fd=directory), "rb") as file, \
                    av.open(file) as container:
                if container.streams.video:
                    step = _frame_step(container)
                for image, t in _from_start(container, stop, f"segment {name!r}"):
                    if last is not None and t <= last:
                        continue  # not after the previous frame: never out of order
                    last = t
                    yield image, offset + t
        except (av.FFmpegError, OSError, ValueError) as err:
            self.segments_failed += 1
            self.errors.append(f"{name}: {_error_text(err)}")
        else:
            if not stop.is_set():
                self.segments_done += 1
        return offset if last is None else offset + last + step


def local_source(path: str, *, end_after_s: float | None = None, follow: bool = True,
                 follow_symlinks: bool = True) -> Source:
    """The source for an existing local ``path``: a directory is a :class:`SegmentDir`, a
    file is followed as it grows (:class:`FollowFile`; ``follow_symlinks`` as there) or,
    with ``follow=False``, read once to its end as a finished recording (:class:`UrlSource`).
    Followed files and segment directories end ``end_after_s`` after their last news."""
    if os.path.isdir(path):
        return SegmentDir(path, end_after_s=end_after_s, follow_symlinks=follow_symlinks)
    if follow:
        return FollowFile(path, end_after_s=end_after_s, follow_symlinks=follow_symlinks)
    return UrlSource(path)
