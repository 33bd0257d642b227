"""Remote media: http(s) videos from the hosts of ``--allow-media-domain``, fetched by the driver.

:func:`fetch_media` downloads one URL whose host :func:`apbv.serve.policy.remote_url` allowed
into the server's private download directory (mode 0700), streaming, under a byte limit (413
naming ``--max-download-mb`` once the declared length or the bytes received pass it) and a
whole-download time limit. Redirects are followed only to the same host (and http or https);
any other redirect is refused. The file is then an ordinary local file for the limits that
probe it, and the caller deletes it when the request is over (:func:`discard`).
"""

from __future__ import annotations

import os
import tempfile
import time
from urllib.parse import urljoin, urlsplit

from apbv.serve.policy import ClientError, MediaPolicy

MAX_REDIRECTS = 3
CHUNK = 1 << 16


def _limit_error(size: float, policy: MediaPolicy, what: str) -> ClientError:
    mb = policy.max_download_bytes / 2**20
    return ClientError(413, f"the remote video {what} {size / 2**20:.2f} MB, over the limit of "
                            f"{mb:g} MB (--max-download-mb)")


def fetch_media(url: str, policy: MediaPolicy) -> str:
    """Download ``url`` (already allowed by the policy) and return the local file's path."""
    import httpx

    if not policy.download_dir:
        raise ClientError(400, "remote media is off: the server has no download directory")
    host = (urlsplit(url).hostname or "").lower()
    suffix = os.path.splitext(urlsplit(url).path)[1][:16]
    fd, path = tempfile.mkstemp(prefix="remote-", suffix=suffix, dir=policy.download_dir)
    started = time.monotonic()
    timeout = policy.download_timeout_s
    try:
        with os.fdopen(fd, "wb") as out, httpx.Client(
                follow_redirects=False, timeout=httpx.Timeout(timeout)) as client:
            for _ in range(MAX_REDIRECTS + 1):
                with client.stream("GET", url) as response:
                    if response.is_redirect:
                        target = urljoin(url, response.headers.get("location", ""))
                        parts = urlsplit(target)
                        if parts.scheme.lower() not in ("http", "https") or \
                                (parts.hostname or "").lower() != host:
                            raise ClientError(400, f"the remote video at host {host!r} "
                                                   f"redirects to {target[:200]!r}: redirects "
                                                   "to another host are refused")
                        url = target
                        continue
                    if response.status_code != 200:
                        raise ClientError(502, f"the remote video at {url[:200]!r} could not "
                                               f"be fetched: HTTP {response.status_code}")
                    declared = response.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > policy.max_download_bytes:
                        raise _limit_error(int(declared), policy, "declares")
                    received = 0
                    for piece in response.iter_bytes(CHUNK):
                        received += len(piece)
                        if received > policy.max_download_bytes:
                            raise _limit_error(received, policy, "sent more than")
                        if time.monotonic() - started > timeout:
                            raise httpx.ReadTimeout("download time limit")
                        out.write(piece)
                    return path
            raise ClientError(400, f"the remote video at host {host!r} redirects more than "
                                   f"{MAX_REDIRECTS} times")
    except ClientError:
        discard(path)
        raise
    except httpx.TimeoutException:
        discard(path)
        raise ClientError(504, f"downloading the remote video took over {timeout:g} s "
                               "(--download-timeout-s)") from None
    except (httpx.HTTPError, OSError) as exc:
        discard(path)
        raise ClientError(502, f"the remote video at host {host!r} could not be fetched: "
                               f"{type(exc).__name__}: {exc}") from None


def discard(path: str | None) -> None:
    """Delete a downloaded file (nothing when ``path`` is None or already gone)."""
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
