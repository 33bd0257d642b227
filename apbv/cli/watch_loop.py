"""Watch a live video source and answer questions about it as it plays (``python -m apbv watch``).

Rank 0 runs the capture (:class:`apbv.capture.Capture` over a followed file, a segment
directory or a URL) and a thread reading questions from stdin, one per line. Each loop
iteration rank 0 takes the frames captured so far and the questions read so far, turns them
into a list of steps (append these frames, ask this question) and broadcasts it (one
:func:`apbv.comm.broadcast_object`); then every rank runs the steps alike on its part of the
:class:`apbv.engine.stream.Stream`. Questions are data: each line is a question, whatever it
says.

``ask_every`` asks ``question`` every ``ask_every`` seconds of video (counted from the first
frame, on the source's clock, so the answers do not depend on how fast the loop runs): the
frames before each mark are appended, then the question is asked; once more at the end of the
source when frames came after the last mark. A stdin question is asked after the frames taken
with it (as soon as the stream holds a whole temporal patch).

The loop ends when the source ends (pending questions answered first), at the end of stdin
with ``until_eof`` (once the questions read are answered), or on SIGINT / SIGTERM (Ctrl-C; a
second one interrupts at once): every iteration the ranks agree on a stop
(:func:`apbv.comm.any_rank`), so none is left waiting in a collective. Source errors are
printed as they come (a skipped corrupt segment: the stream goes on); a source that fails ends
the stream with that error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import torch

from apbv import comm
from apbv.cli.watch_standing import StandingWatch
from apbv.distributed import DistInfo
from apbv.modes import get_mode
from apbv.validate import integer, positive

if TYPE_CHECKING:
    from apbv.capture import Capture
    from apbv.engine.engine import Engine

WATCHED = "watched"
"""The id of the one stream the engine holds while watching."""

MAX_STEP_FRAMES = 32
"""Frames one loop iteration takes from the capture and broadcasts at most."""


@dataclass(frozen=True)
class WatchOptions:
    """What to watch and when to ask (checked at construction: ValueError)."""

    source: str
    """A URL (anything with ``://``), a segment directory, or a video file."""
    fps: float = 2.0
    window_s: float | None = None
    window_tokens: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    max_new_tokens: int = 8
    ask_every: float | None = None
    """Ask ``question`` every this many seconds of video (None: only stdin questions)."""
    question: str | None = None
    until_eof: bool = False
    """Stop at the end of stdin (else stdin ending changes nothing)."""
    follow: bool = True
    """A file: follow it as it grows (FollowFile: it ends ``end_after_s`` after it stops
    growing); False: read it to its end as a finished recording (UrlSource)."""
    end_after_s: float | None = 10.0
    """A followed file or a segment directory ends after this long without news."""
    buffer_frames: int = 256
    """Captured frames waiting for the model at most (then the oldest are dropped)."""
    as_json: bool = False
    standing: StandingWatch | None = None
    """A standing question asked after every appended batch (``--watch``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"source must be a non-empty path or URL, got {self.source!r}")
        positive("fps", self.fps)
        for name in ("window_s", "ask_every", "end_after_s"):
            if getattr(self, name) is not None:
                positive(name, getattr(self, name))
        for name, low in (("window_tokens", 1), ("min_pixels", 1), ("max_pixels", 1),
                          ("max_new_tokens", 1), ("buffer_frames", 2)):
            integer(name, getattr(self, name), low, optional=True)
        if (self.ask_every is None) != (self.question is None):
            raise ValueError("ask_every and question go together: give both or neither")
        if self.question is not None and not self.question.strip():
            raise ValueError("the question must be a non-empty string")


def open_source(options: WatchOptions) -> Any:
    """The :mod:`apbv.capture` source for ``options.source``: UrlSource for a URL, SegmentDir
    for a directory, FollowFile for a file (UrlSource for a finished one, ``follow=False``)."""
    from apbv.capture import UrlSource, local_source

    where = options.source
    if "://" in where:
        return UrlSource(where)
    if not (os.path.isdir(where) or os.path.isfile(where)):
        raise ValueError(f"source {where!r} is not a URL, a directory or an existing file")
    return local_source(where, end_after_s=options.end_after_s, follow=options.follow)


class _StopSignals:
    """SIGINT / SIGTERM set a flag (the loop stops at its next iteration); a second one
    raises KeyboardInterrupt. Only installed from the main thread."""

    def __init__(self) -> None:
        self.count = 0
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count > 1:
            raise KeyboardInterrupt

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _read_lines(stream: IO[str], out: queue.Queue, eof: threading.Event) -> None:
    try:
        for line in stream:
            if line.strip():
                out.put(line.rstrip("\r\n"))
    except (OSError, ValueError):
        pass
    finally:
        eof.set()


class _Planner:
    """Rank 0's side: the capture, the questions, and each iteration's steps."""

    def __init__(self, options: WatchOptions, capture: Capture,
                 questions: IO[str] | None) -> None:
        self.options, self.capture = options, capture
        self.lines: queue.Queue[str] = queue.Queue()
        self.eof = threading.Event()
        if questions is None:
            self.eof.set()
        else:
            threading.Thread(target=_read_lines, args=(questions, self.lines, self.eof),
                             name="apbv-watch-stdin", daemon=True).start()
        self.pending: list[str] = []
        self.t0: float | None = None
        self.next_mark = options.ask_every
        self.every = options.ask_every or 0.0
        self.appended = 0
        self.asked_patches = 0  # whole temporal patches held at the last periodic ask
        self.errors_seen = 0

    def step(self) -> dict[str, Any]:
        """The next message: {"steps": [...], "stop": why the loop ends (None: it goes on),
        "error": the source's error, "stats": the capture's stats (not broadcast)}."""
        opts = self.options
        ready = self.pending and self.appended >= 2  # questions to answer now: no waiting
        frames = self.capture.take(MAX_STEP_FRAMES, timeout=0.0 if ready else 0.2)
        while True:
            try:
                self.pending.append(self.lines.get_nowait())
            except queue.Empty:
                break
        stats = self.capture.stats()
        steps: list[tuple] = []
        batch: list[Any] = []

        def flush() -> None:
            if batch:
                steps.append(("append", torch.stack([f.image for f in batch]),
                              [f.timestamp for f in batch]))
                self.appended += len(batch)
                batch.clear()

        for frame in frames:
            if self.t0 is None:
                self.t0 = frame.timestamp
            while self.next_mark is not None and frame.timestamp - self.t0 >= self.next_mark:
                flush()
                if self.appended >= 2:
                    steps.append(("ask", opts.question, "every", self.next_mark))
                    self.asked_patches = self.appended // 2
                self.next_mark += self.every  # ask_every (set with next_mark)
            batch.append(frame)
        flush()
        if self.appended >= 2:
            steps += [("ask", q, "stdin", None) for q in self.pending]
            self.pending = []
        drained = stats["ended"] and not stats["buffered"] and not frames
        stop, error = None, None
        if drained:
            if opts.ask_every is not None and self.appended // 2 > self.asked_patches:
                steps.append(("ask", opts.question, "end", None))
                self.asked_patches = self.appended // 2
            stop = "the source failed" if stats["error"] else "the source ended"
            error = stats["error"]
        elif opts.until_eof and self.eof.is_set() and self.lines.empty() and \
                not self.pending:
            stop = "end of input"
        if stop is not None and self.pending:
            steps += [("unanswered", q) for q in self.pending]
            self.pending = []
        return {"steps": steps, "stop": stop, "error": error, "stats": stats}


class _Printer:
    def __init__(self, options: WatchOptions, out: IO[str]) -> None:
        self.as_json, self.out = options.as_json, out

    def emit(self, event: str, text: str, **fields: Any) -> None:
        if self.as_json:
            print(json.dumps({"event": event, **fields}), file=self.out, flush=True)
        else:
            print(text, file=self.out, flush=True)


def run_watch(engine: Engine, info: DistInfo, options: WatchOptions, *,
              questions: IO[str] | None = None, out: IO[str] | None = None,
              make_capture: Callable[[], Capture] | None = None) -> int:
    """Watch ``options.source`` on every rank alike (rank 0 captures, reads ``questions`` and
    prints to ``out``). Returns 0 when the stream ended normally, 1 when it ended with an
    error (printed). A source that cannot be opened is a ValueError before any work."""
    from apbv.engine.agree import agreement
    from apbv.engine.stream_plan import StreamSpec

    group, lead = info.group, info.rank == 0
    out = out or sys.stdout
    printer = _Printer(options, out)
    planner = None
    with agreement(group):
        if lead:
            if make_capture is None:
                from apbv.capture import Capture

                # frame sides in the family's multiples: patch x a merge of 2
                capture = Capture(open_source(options), fps=options.fps,
                                  min_pixels=options.min_pixels,
                                  max_pixels=options.max_pixels,
                                  capacity=options.buffer_frames,
                                  image_patch_size=engine.model.frame_multiple // 2)
            else:
                capture = make_capture()
            planner = _Planner(options, capture, questions)
    stream, code, reason, failure = None, 0, None, None
    try:
        with _StopSignals() as signals:
            while True:
                if comm.any_rank(signals.count > 0, group):
                    reason = "interrupted"
                    break
                taken = time.monotonic()  # when this iteration's frames left the capture
                if planner is not None:  # rank 0
                    message = planner.step()
                    comm.broadcast_object({k: v for k, v in message.items() if k != "stats"},
                                          src=0, group=group)
                else:
                    message = comm.broadcast_object(None, src=0, group=group)
                    message["stats"] = None
                stats = message["stats"]
                for step in message["steps"]:
                    if step[0] == "append":
                        _, frames, stamps = step
                        if stream is None:
                            stream = WATCHED
                            engine.open_stream(stream, StreamSpec(
                                int(frames.shape[2]), int(frames.shape[3]), fps=options.fps,
                                window_s=options.window_s,
                                window_tokens=options.window_tokens))
                        try:
                            engine.append(stream, frames, stamps)
                        except ValueError as exc:  # on every rank alike
                            if lead:
                                printer.emit("error", f"error: {exc}", message=str(exc))
                            code, reason = 1, "the stream could not take more frames"
                            break
                        if options.standing is not None:
                            _standing(engine, stream, options.standing, stamps, taken,
                                      printer if lead else None)
                    elif step[0] == "ask":
                        _, question, why, mark = step
                        assert stream is not None  # asked only after frames were appended
                        _ask(engine, stream, question, why, mark, options,
                             printer if lead else None, stats)
                    elif lead:
                        printer.emit("unanswered", f"not answered (no frames): {step[1]!r}",
                                     question=step[1])
                if planner is not None:
                    _report_source_errors(planner, stats, printer)
                if code or message["stop"]:
                    reason = reason or message["stop"]
                    failure = message["error"]
                    break
    finally:
        if lead and planner is not None:
            planner.capture.close()
    described = {} if stream is None else dataclasses.asdict(engine.describe_stream(stream))
    if stream is not None:
        engine.close_stream(stream)
    if failure is not None and not described.get("frames_appended"):
        raise ValueError(f"the source failed before any frame: {failure}")
    if failure is not None:
        code = 1
    if planner is not None:  # rank 0
        stats = planner.capture.stats()
        _report_source_errors(planner, stats, printer)
        fields = {"reason": reason, "source_error": failure,
                  "frames_appended": described.get("frames_appended", 0),
                  "frames_held": described.get("frames_held", 0),
                  "frames_dropped": stats["frames_dropped"],
                  "chunks_evicted": described.get("chunks_evicted", 0),
                  "capture": _jsonable(stats), "stream": described}
        text = (f"stream ended ({reason}): {fields['frames_appended']} frames appended, "
                f"{fields['frames_held']} held, {fields['frames_dropped']} dropped, "
                f"{fields['chunks_evicted']} chunks evicted")
        if failure:
            text += f"; source error: {failure}"
        printer.emit("end", text, **fields)
    return code


def _jsonable(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in stats.items() if k != "errors"} | {"errors": list(stats["errors"])}


def _report_source_errors(planner: _Planner, stats: dict[str, Any], printer: _Printer) -> None:
    errors = stats["errors"]
    for text in errors[planner.errors_seen:]:
        printer.emit("source_error", f"source error: {text} (segments done "
                     f"{stats['segments_done']}, failed {stats['segments_failed']})",
                     message=text, segments_done=stats["segments_done"],
                     segments_failed=stats["segments_failed"])
    planner.errors_seen = len(errors)


def _standing(engine: Engine, stream: str, standing: StandingWatch, stamps: list[float],
              taken: float, printer: _Printer | None) -> None:
    try:
        standing.after_append(engine, stream, stamps, taken, printer)
    except ValueError as exc:  # raised on every rank alike (e.g. past the model's context)
        if printer is not None:
            printer.emit("error", f"error: {standing.question!r}: {exc}",
                         question=standing.question, message=str(exc))


def _ask(engine: Engine, stream: str, question: str, why: str, mark: float | None,
         options: WatchOptions, printer: _Printer | None, stats: dict[str, Any] | None) -> None:
    from apbv.engine.request import Request, StreamRef

    try:
        request = Request(video=StreamRef(stream), question=question, mode=get_mode("exact"),
                          max_new_tokens=options.max_new_tokens)
        result = engine.generate(request)
    except ValueError as exc:  # raised on every rank alike (e.g. past the model's context)
        if printer is not None:
            printer.emit("error", f"error: {question!r}: {exc}", question=question,
                         message=str(exc))
        return
    if printer is None:
        return
    described = engine.describe_stream(stream)
    video_s = described.seconds_held
    dropped = stats["frames_dropped"] if stats else 0
    lag = stats["ingest_lag_s"] if stats else 0.0
    at = f"at {mark:g} s" if mark is not None else why
    printer.emit(
        "answer",
        f"[{at}] Q: {question!r}\n  A: {result.answer!r}  (TTFT {result.ttft_s:.3f} s; "
        f"{result.frames} frames held = {video_s:.1f} s of video, {dropped} dropped, "
        f"lag {lag:.2f} s)",
        question=question, trigger=why, mark_s=mark, answer=result.answer,
        token_ids=result.token_ids, ttft_s=result.ttft_s, seconds=result.seconds,
        frames_held=result.frames, seconds_held=video_s, frames_dropped=dropped, lag_s=lag,
        kv_cache_bytes_max=result.kv_cache_bytes_max,
        tokens_per_rank=described.tokens_per_rank,
        frames_appended=described.frames_appended)
