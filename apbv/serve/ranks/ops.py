"""The one typed operation that crosses Ray: what the front end asks every rank of a group.

Each operation is a frozen dataclass handed to every rank alike, generic in its outcome
(``Op[T]``: :meth:`RankGroup.submit <apbv.serve.ranks.group.RankGroup.submit>` answers a T);
:func:`apply` runs it on one rank's :class:`~apbv.engine.engine.Engine`. A chat request and
a question about a live stream are both :class:`Generate` (the stream is the request's video);
the others open, feed, describe and close a live stream by id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, TypeAlias, TypeVar

if TYPE_CHECKING:
    import torch

    from apbv.engine.engine import Engine
    from apbv.engine.request import Request, Result
    from apbv.engine.stream_plan import Appended, StreamInfo, StreamSpec

    Outcome: TypeAlias = Result | Appended | StreamInfo | None
    """What an op returns (:func:`apply`)."""

T = TypeVar("T", covariant=True)


class Op(Generic[T]):
    """An operation whose outcome on every rank is a ``T``."""

    answers: ClassVar[bool] = False
    """Rank 0 streams its tokens as they come and takes a cancel."""
    what: ClassVar[str]
    """What the server's log calls it."""

    @property
    def max_tokens(self) -> int:
        """Tokens it may generate (admission's decode time)."""
        return 0


@dataclass(frozen=True)
class Generate(Op["Result"]):
    """Answer ``request`` (a one-shot video or a live stream's)."""

    request: Request
    answers: ClassVar[bool] = True
    """Rank 0 streams its tokens as they come and takes a cancel."""
    what: ClassVar[str] = "generate"
    """What the server's log calls it."""

    @property
    def max_tokens(self) -> int:
        """Tokens it may generate (admission's decode time)."""
        return self.request.max_new_tokens


@dataclass(frozen=True)
class OpenStream(Op["StreamInfo"]):
    stream_id: str
    spec: StreamSpec
    what: ClassVar[str] = "open"


@dataclass(frozen=True)
class Append(Op["Appended"]):
    """Frames (uint8 (F, 3, H, W) at the stream's size) and their timestamps (seconds);
    ``held``: earlier pushes the server held (:mod:`apbv.serve.streams.hold`: it judged they
    keep no patch), appended first, each alone and in order, as they would have been
    (:meth:`apbv.engine.stream.Stream.append`)."""

    stream_id: str
    frames: torch.Tensor
    timestamps: tuple[float, ...]
    held: tuple[tuple[torch.Tensor, tuple[float, ...]], ...] = ()
    what: ClassVar[str] = "append"


@dataclass(frozen=True)
class CloseStream(Op[None]):
    stream_id: str
    what: ClassVar[str] = "close"


@dataclass(frozen=True)
class DescribeStream(Op["StreamInfo"]):
    stream_id: str
    what: ClassVar[str] = "describe"


def apply(op: Op[object], engine: Engine, on_token: Callable[[int], None] | None = None,
          stop: Callable[[], bool] | None = None) -> Outcome:
    """Run ``op`` on this rank's ``engine`` (every rank alike): a Result (Generate), the
    Appended record (Append), the StreamInfo (OpenStream, DescribeStream) or None
    (CloseStream). ``on_token`` and ``stop`` as in
    :meth:`Engine.generate <apbv.engine.engine.Engine.generate>` (Generate only)."""
    match op:
        case Generate(request):
            return engine.generate(request, on_token=on_token, stop=stop)
        case OpenStream(stream_id, spec):
            return engine.open_stream(stream_id, spec)
        case Append(stream_id, frames, timestamps, held):
            return engine.append(stream_id, frames, timestamps, held)
        case CloseStream(stream_id):
            engine.close_stream(stream_id)
            return None
        case DescribeStream(stream_id):
            return engine.describe_stream(stream_id)
    raise ValueError(f"unknown operation {type(op).__name__}; allowed: Generate, OpenStream, "
                     "Append, CloseStream, DescribeStream")
