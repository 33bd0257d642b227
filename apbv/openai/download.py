"""Remote media: http(s) videos from the hosts of ``--allow-media-domain``, fetched by the driver.

:func:`fetch_media` downloads one URL whose host :func:`apbv.openai.policy.remote_url` allowed
into the server's private download directory (mode 0700), streaming, under a byte limit (413
naming ``--max-download-mb`` once the declared length or the bytes received pass it) and a
wall-clock deadline for the whole download, connect, headers and body (504 naming
``--download-timeout-s``). Downloads run on the event loop (an async client, no thread), at
most ``--max-downloads`` at once (one more is a 429), so a request about a local file never
waits behind one, and a download cancelled at shutdown ends at once. Redirects are followed
only to the same host (and http or https); any other redirect is refused. The file is then an
ordinary local file for the limits that probe it.

Downloads are kept by content in a :class:`MediaStore`: a repeat question on the same remote
video names the same file, so the ranks' vision cache and the replicas' routing find it as
they find a local one. Each request holds its file until :func:`discard` releases it. A URL
whose download is still stored is asked for again conditionally (its ``ETag`` and
``Last-Modified``): a 304 reuses the stored file without fetching the bytes again. No file
name holds client text: a download is written to ``part-<random>`` (removed on every
failure, cancellation included) and stored as ``sha256-<hex>`` plus the URL's suffix only
when it is a known video suffix (:data:`apbv.openai.policy.VIDEO_SUFFIXES`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import hashlib
import os
import ssl
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import urljoin, urlsplit

from apbv.openai.policy import VIDEO_SUFFIXES, ClientError, MediaPolicy

MAX_REDIRECTS = 3
CHUNK = 1 << 16


def _limit_error(size: float, policy: MediaPolicy, what: str) -> ClientError:
    mb = policy.max_download_bytes / 2**20
    return ClientError(413, f"the remote video {what} {size / 2**20:.2f} MB, over the limit of "
                            f"{mb:g} MB (--max-download-mb)")


def stored_suffix(url: str) -> str:
    """The suffix a download of ``url`` is stored with: its path's extension, lower case, when
    it is one of :data:`~apbv.openai.policy.VIDEO_SUFFIXES`, else none (the decoders read a
    file's content, not its name)."""
    suffix = os.path.splitext(urlsplit(url).path)[1].lower()
    return suffix if suffix in VIDEO_SUFFIXES else ""


def _store(policy: MediaPolicy) -> MediaStore | None:
    """The policy's store of downloads (None: downloads are off)."""
    store = policy.store
    assert store is None or isinstance(store, MediaStore), "the server's store is a MediaStore"
    return store


class MediaStore:
    """Downloaded videos in ``directory``, one file per content (``sha256-<hex>`` and a known
    video suffix or none) and kept under ``budget_bytes``.

    :meth:`admit` moves a finished download in (or drops it for the same bytes already there,
    whatever their suffix) and holds the stored file for one request. A file no request holds
    is deleted, least recently used first, while the store is over its budget (0: as soon as
    its last request is over); a held file never is. :meth:`slot` counts the downloads in
    flight into the directory. Thread-safe.
    """

    def __init__(self, directory: str, budget_bytes: int) -> None:
        self.directory, self.budget_bytes = directory, budget_bytes
        self._lock = threading.Lock()
        self._files: OrderedDict[str, list[int]] = OrderedDict()  # path -> [bytes, holders]
        self._digests: dict[str, str] = {}  # SHA-256 hex -> its stored path
        self._urls: dict[str, tuple[str, dict[str, str]]] = {}  # url -> (path, validators)
        self._downloading = 0

    @contextmanager
    def slot(self, limit: int) -> Iterator[None]:
        """Count one download in flight for the block; ClientError 429 when ``limit``
        (``--max-downloads``) are in flight already."""
        with self._lock:
            if self._downloading >= limit:
                raise ClientError(429, f"{self._downloading} remote videos are downloading, "
                                       f"the most at once (--max-downloads {limit}); try "
                                       "again later")
            self._downloading += 1
        try:
            yield
        finally:
            with self._lock:
                self._downloading -= 1

    def admit(self, download: str, digest: str, suffix: str, url: str | None = None,
              validators: dict[str, str] | None = None) -> Held:
        """Store the finished file ``download`` (its SHA-256 hex ``digest``; ``suffix`` from
        :func:`stored_suffix`) and hold it; ``url`` and its response's conditional-request
        headers are remembered for :meth:`conditions`."""
        assert suffix in VIDEO_SUFFIXES + ("",), suffix
        assert len(digest) == 64 and all(c in "0123456789abcdef" for c in digest), digest
        with self._lock:
            path = self._digests.get(digest)
            if path is not None:
                os.unlink(download)
            else:
                path = os.path.join(self.directory, f"sha256-{digest}{suffix}")
                size = os.path.getsize(download)
                os.replace(download, path)
                self._files[path] = [size, 0]
                self._digests[digest] = path
            if url is not None and validators:
                self._urls[url] = (path, validators)
            return self._hold(path)

    def conditions(self, url: str) -> dict[str, str]:
        """The headers that ask for ``url`` only if it changed since its stored download
        (none when that download is not stored)."""
        with self._lock:
            path, validators = self._urls.get(url, ("", {}))
            return dict(validators) if path in self._files else {}

    def reuse(self, url: str) -> Held | None:
        """Hold the stored download of ``url`` again (its server answered 304 to
        :meth:`conditions`); None when it was deleted meanwhile."""
        with self._lock:
            path, _ = self._urls.get(url, ("", {}))
            return self._hold(path) if path in self._files else None

    def _hold(self, path: str) -> Held:
        self._files[path][1] += 1
        self._files.move_to_end(path)
        self._evict()
        return Held(path, self)

    def release(self, path: str) -> None:
        with self._lock:
            self._files[path][1] -= 1
            self._evict()

    def held(self) -> dict[str, int]:
        """Each stored file's name and how many requests hold it."""
        with self._lock:
            return {os.path.basename(p): n for p, (_, n) in self._files.items()}

    def _evict(self) -> None:
        total = sum(size for size, _ in self._files.values())
        for path, (size, holders) in list(self._files.items()):
            if total <= self.budget_bytes:
                break
            if holders == 0:
                os.unlink(path)
                del self._files[path]
                total -= size
        self._digests = {d: p for d, p in self._digests.items() if p in self._files}
        self._urls = {u: v for u, v in self._urls.items() if v[0] in self._files}


@dataclass(eq=False)
class Held:
    """A stored download held for one request; :func:`discard` releases it (once)."""

    path: str
    store: MediaStore
    released: bool = False


@functools.cache
def _tls() -> ssl.SSLContext:
    """The client's TLS settings, made once (loading the CA bundle takes a while)."""
    import httpx

    return httpx.create_ssl_context()


async def fetch_media(url: str, policy: MediaPolicy) -> Held:
    """Download ``url`` (already allowed by the policy) into the policy's store and hold the
    stored file for the request: at most ``policy.max_downloads`` at once (429), the whole
    download within ``policy.download_timeout_s`` (504). Run on the server's event loop; its
    temporary file is removed whatever ends it (an error, the deadline, a cancellation)."""
    import httpx

    store = _store(policy)
    if store is None:
        raise ClientError(400, "remote media is off: the server has no download directory")
    host = (urlsplit(url).hostname or "").lower()
    timeout = policy.download_timeout_s
    with store.slot(policy.max_downloads):
        fd, path = tempfile.mkstemp(prefix="part-", dir=store.directory)
        try:
            with os.fdopen(fd, "wb") as out:
                async with asyncio.timeout(timeout):
                    return await _download(url, host, policy, path, out)
        except ClientError:
            raise
        except (TimeoutError, httpx.TimeoutException):
            raise ClientError(504, f"downloading the remote video took over {timeout:g} s "
                                   "(--download-timeout-s)") from None
        except httpx.InvalidURL as exc:
            raise ClientError(400, f"bad remote video URL {url[:200]!r}: {exc}") from None
        except (httpx.HTTPError, OSError) as exc:
            raise ClientError(502, f"the remote video at host {host!r} could not be fetched: "
                                   f"{type(exc).__name__}: {exc}") from None
        finally:
            _unlink(path)  # stored (moved away) or not: nothing of it stays under this name


async def _download(url: str, host: str, policy: MediaPolicy, path: str,
                    out: BinaryIO) -> Held:
    """:func:`fetch_media`'s transfer: the redirects, the size limit, the conditional request;
    the bytes go to ``out`` (the file at ``path``)."""
    import httpx

    store = _store(policy)
    assert store is not None, "downloads are stored in the policy's media store"
    digest = hashlib.sha256()
    asked, conditions = url, store.conditions(url)
    async with httpx.AsyncClient(follow_redirects=False, verify=_tls(),
                                 timeout=httpx.Timeout(policy.download_timeout_s)) as client:
        for _ in range(MAX_REDIRECTS + 1):
            async with client.stream("GET", url, headers=conditions) as response:
                if response.status_code == 304 and conditions:
                    held = store.reuse(asked)
                    if held is not None:
                        return held
                    conditions = {}  # deleted meanwhile: ask for the bytes
                    continue
                if response.is_redirect:
                    target = urljoin(url, response.headers.get("location", ""))
                    parts = urlsplit(target)
                    if parts.scheme.lower() not in ("http", "https") or \
                            (parts.hostname or "").lower() != host:
                        raise ClientError(400, f"the remote video at host {host!r} redirects "
                                               f"to {target[:200]!r}: redirects to another "
                                               "host are refused")
                    url = target
                    continue
                if response.status_code != 200:
                    raise ClientError(502, f"the remote video at {url[:200]!r} could not be "
                                           f"fetched: HTTP {response.status_code}")
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > policy.max_download_bytes:
                    raise _limit_error(int(declared), policy, "declares")
                received = 0
                async for piece in response.aiter_bytes(CHUNK):
                    received += len(piece)
                    if received > policy.max_download_bytes:
                        raise _limit_error(received, policy, "sent more than")
                    out.write(piece)
                    digest.update(piece)
                validators = {"If-None-Match": response.headers.get("etag", ""),
                              "If-Modified-Since": response.headers.get("last-modified", "")}
                break
        else:
            raise ClientError(400, f"the remote video at host {host!r} redirects more than "
                                   f"{MAX_REDIRECTS} times")
    out.flush()
    return store.admit(path, digest.hexdigest(), stored_suffix(asked), asked,
                       {k: v for k, v in validators.items() if v})


DATA_SUFFIXES = {"video/mp4": ".mp4", "video/x-matroska": ".mkv", "video/webm": ".webm",
                 "video/quicktime": ".mov", "video/x-msvideo": ".avi", "video/x-m4v": ".m4v"}
"""The media types a ``data:`` URL may carry, with the suffix its file is stored with."""


def store_data_url(url: str, policy: MediaPolicy) -> Held:
    """The video inlined in ``url`` (``data:video/<type>;base64,<bytes>``, one of
    :data:`DATA_SUFFIXES`), stored in the policy's store like a download (by content, the
    same byte limit: 413 naming ``--max-download-mb``) and held for the request; ClientError
    400 naming what is wrong. Its file then goes through the same checks as any video."""
    store = _store(policy)
    if store is None:
        raise ClientError(400, "data: URLs are off: the server has no download directory")
    head, comma, payload = url.partition(",")
    kind, _, encoding = head[len("data:"):].partition(";")
    if not comma or encoding.lower() != "base64" or kind.lower() not in DATA_SUFFIXES:
        raise ClientError(400, f"a data: URL must be data:<type>;base64,<bytes> with a type in "
                               f"{sorted(DATA_SUFFIXES)}, got {head[:80]!r}")
    if len(payload) * 3 // 4 > policy.max_download_bytes:
        raise _limit_error(len(payload) * 3 // 4, policy, "inlined in the data: URL is")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ClientError(400, f"the data: URL's base64 payload is malformed: {exc}") from None
    fd, path = tempfile.mkstemp(prefix="part-", dir=store.directory)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        return store.admit(path, hashlib.sha256(data).hexdigest(), DATA_SUFFIXES[kind.lower()])
    finally:
        _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:  # stored meanwhile, or never written
        pass


def discard(download: Held | None) -> None:
    """Release a request's downloaded file (nothing when None or released already)."""
    if download is not None and not download.released:
        download.released = True
        download.store.release(download.path)
