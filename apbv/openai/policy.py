"""Media policy and request limits of the server: pure checks, default deny.

Nothing here touches a rank. :func:`remote_url` decides whether an http(s) URL may be
downloaded (:mod:`apbv.openai.download` does that), :func:`resolve_media` turns a client's
``file://`` URL into a local path or refuses it; :class:`Limits` holds the numbers a request
must stay within, each with a default and a ``serve`` flag. Every refusal is a
:class:`ClientError` (an HTTP status and a message that names the problem, the limit and the
value).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

VIDEO_SUFFIXES = (".mp4", ".mkv", ".webm", ".mov", ".avi", ".m4v")
"""File name suffixes taken for videos: the media listing's, and the only ones a download is
stored with."""


class ClientError(Exception):
    """A request the server refuses: ``status`` (4xx, or 503 for admission), the message, and
    the request field at fault (``param``, OpenAI's name; None when no one field is)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (the serve flags of the same names set them)."""

    max_body_bytes: int = 1 << 20
    """Request body size in bytes (--max-body-bytes), not counting its ``data:`` URLs."""
    max_data_bytes: int = 64 << 20
    """The ``data:`` URLs of one chat request (inline videos and images, base64 text), in
    bytes all together (--max-data-bytes); a chat body may hold this much beyond
    ``max_body_bytes``."""
    max_video_seconds: float = 3600.0
    """Duration of the video (or of its clip) in seconds, probed without decoding."""
    max_frames: int = 768
    """Frames sampled from the video (plan_sampling)."""
    max_pixels_per_frame: int = 768 * 28 * 28
    """Pixels of one sampled frame after resizing."""
    max_prompt_tokens: int = 131072
    """Prompt tokens (video placeholders included)."""
    max_question_chars: int = 8192
    """Characters of the question."""
    max_tokens: int = 1024
    """max_tokens of one request."""
    max_frames_per_push: int = 64
    """Frames in one push to a live stream (POST /v1/streams/{id}/frames)."""
    max_push_frame_pixels: int = 3840 * 2160
    """Pixels of one pushed image at its native size (read from its header before decoding)."""
    max_native_pixels: int = 4096 * 2160
    """Pixels of a video file's frames at their native size (files, downloads and ``data:``
    URLs; read from the container's header before any frame is decoded): DCI and UHD 4K pass,
    8192x8192 does not."""

    def check(self, name: str, value: float, limit: float, flag: str, what: str = "") -> None:
        """ClientError naming ``what`` (or ``name``), its value, the limit and its ``flag``
        when ``value`` is over ``limit``: 413 for sizes in bytes (``name`` "body" or "data",
        printed in MiB), else 400."""
        if value > limit:
            sized = name in ("body", "data")
            raise ClientError(413 if sized else 400,
                              f"{what or name} is {_amount(value, sized)}, over the limit of "
                              f"{_amount(limit, sized)} (--{flag})")


def _amount(value: float, size: bool) -> str:
    """``value`` as the limits print it: a size in bytes in MiB (``2.31 MiB``), an integer
    in full, another number in ``%g``."""
    if size:
        return f"{value / 2**20:.2f} MiB"
    return str(value) if isinstance(value, int) else f"{value:g}"


class Store(Protocol):
    """Where downloads are kept, as the policy names it (the store itself is
    :class:`apbv.openai.download.MediaStore`, which uses this module's errors)."""

    directory: str
    budget_bytes: int


@dataclass(frozen=True)
class MediaPolicy:
    """Which videos a request may name: local files under ``roots`` (real paths), and http(s)
    URLs of the hosts in ``allow_domains``, downloaded into ``store``
    (:class:`apbv.openai.download.MediaStore`) under ``max_download_bytes`` and
    ``download_timeout_s``, at most ``max_downloads`` at once."""

    roots: tuple[str, ...] = ()
    allow_domains: tuple[str, ...] = field(default=())
    store: Store | None = field(default=None, compare=False)
    max_download_bytes: int = 512 << 20
    download_timeout_s: float = 120.0
    """Wall-clock seconds of one whole download: connect, headers and body."""
    max_downloads: int = 4
    """Downloads in flight at once (--max-downloads); one more is a 429."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "roots", tuple(os.path.realpath(r) for r in self.roots))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def remote_url(url: object, policy: MediaPolicy) -> str | None:
    """``url`` when it is an http(s) URL of an allowed host (to download), None when it is not
    an http(s) URL; ClientError for an http(s) URL of any other host (or with no host). A
    client's URL comes here after :func:`apbv.openai.bodies.check_url` refused control
    characters (which ``urlsplit`` would drop silently)."""
    if not isinstance(url, str) or not url:
        raise ClientError(400, f"video_url.url must be a non-empty string, got {url!r}")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed [IPv6] host
        raise ClientError(400, f"bad URL {url[:200]!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        return None
    try:
        host = (parts.hostname or "").lower()
        _ = parts.port  # a bad port raises ValueError
    except ValueError as exc:
        raise ClientError(400, f"bad {scheme} URL {url[:200]!r}: {exc}") from None
    if not policy.allow_domains:
        raise ClientError(400, f"remote media is off: {scheme} URL of host {host!r} refused "
                               "(--allow-media-domain HOST allows a host)")
    if host not in policy.allow_domains:
        raise ClientError(400, f"host {host!r} is not in --allow-media-domain "
                               f"({', '.join(policy.allow_domains)}): {scheme} URL refused")
    return url


def resolve_media(url: object, policy: MediaPolicy, *, directory: bool = False) -> str:
    """The real local path of a ``file://`` URL under one of the media roots, or ClientError.

    Refused: anything but a string, schemes other than file (http(s) is :func:`remote_url`'s),
    a host in a file URL, a path with a ``..`` component, a path whose real path (symlinks
    followed) leaves every root, and a path that is not a regular file (or, with
    ``directory``, a directory: a live stream's segment directory, whose own symbolic links
    its reader does not follow).
    """
    if not isinstance(url, str) or not url:
        raise ClientError(400, f"video_url.url must be a non-empty string, got {url!r}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme != "file":
        raise ClientError(400, f"unsupported video URL scheme {parts.scheme or '(none)'!r} in "
                               f"{url[:200]!r}: only file:// URLs under a --media-root "
                               "(and http(s) URLs of --allow-media-domain hosts)")
    if parts.netloc not in ("", "localhost"):
        raise ClientError(400, f"file URL with host {parts.netloc!r} refused: use file:///PATH")
    path = unquote(parts.path)
    if "\x00" in path or not os.path.isabs(path):
        raise ClientError(400, f"the video path {path[:200]!r} must be absolute")
    if ".." in path.split("/"):
        raise ClientError(400, f"the video path {path[:200]!r} holds '..', which is refused")
    if not policy.roots:
        raise ClientError(403, "no --media-root is configured, so no local video is allowed")
    if not any(_under(os.path.normpath(path), root) for root in policy.roots):
        raise ClientError(403, f"the video path {path[:200]!r} is outside the media roots "
                               f"({', '.join(policy.roots)})")
    real = os.path.realpath(path)
    if not any(_under(real, root) for root in policy.roots):
        raise ClientError(403, f"the video path {path[:200]!r} resolves (symlinks followed) to "
                               f"{real!r}, outside the media roots ({', '.join(policy.roots)})")
    if directory and os.path.isdir(real):
        return real
    if not os.path.isfile(real):
        raise ClientError(404, f"no video file{' or segment directory' if directory else ''} "
                               f"at {path[:200]!r}")
    return real


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The JSON error every refusal answers with (OpenAI's shape; ``param``: the request
    field at fault, or None)."""
    return {"error": {"message": message, "type": "invalid_request" if status < 500
                      else "server_error", "param": param, "code": status}}
