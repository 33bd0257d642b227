"""One webhook POST, bounded: the receiver's host on its own allow list, its addresses checked
when the POST is sent, a wall-clock deadline, and a capped read of the answer.

- :func:`webhook_url`: a watch's ``webhook`` must be an http(s) URL of a host given with
  ``--allow-webhook-host`` (a list of its own: the hosts video is downloaded from are not
  thereby trusted to receive events), else a 400 naming the flag.
- :func:`check_addresses`: before each POST the host is resolved; an address that is
  private, loopback, link-local, reserved, multicast or unspecified is refused unless it is
  itself listed by IP (``--allow-webhook-host 127.0.0.1``): a listed name that resolves into
  the server's own network is not followed there.
- :func:`post_event`: the whole POST (resolution, connection, headers, the answer) within
  ``timeout_s`` of wall-clock time (httpx's own timeout bounds each read, not the sum: a
  receiver trickling a byte every 2 s held a POST open for ever), and at most
  :data:`READ_BYTES` of the answer read (one network read at most) before the connection is
  closed: a receiver answering gigabytes costs nothing.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from apbv.openai.policy import ClientError

if TYPE_CHECKING:
    import httpx

READ_BYTES = 4096
"""Bytes of a receiver's answer read at most (its status decides; the body is discarded)."""

IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ip(text: str) -> IP | None:
    try:
        ip = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def internal(ip: IP) -> bool:
    """Whether ``ip`` is inside a private network or this machine (not a public address)."""
    return ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved or \
        ip.is_multicast or ip.is_unspecified


def webhook_url(url: str, hosts: tuple[str, ...]) -> str:
    """``url`` when it is an http(s) URL of a host in ``hosts`` (``--allow-webhook-host``;
    compared lower-case, IP addresses as addresses), else ClientError(400) naming the flag."""
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        _ = parts.port  # a bad port raises ValueError
    except ValueError as exc:
        raise ClientError(400, f"bad webhook URL {url[:200]!r}: {exc}", param="webhook") \
            from None
    if parts.scheme.lower() not in ("http", "https") or not host:
        raise ClientError(400, "webhook must be an http(s) URL with a host, got "
                               f"{url[:200]!r}", param="webhook")
    if not hosts:
        raise ClientError(400, "webhooks are off: no --allow-webhook-host is given "
                               f"(host {host!r} refused)", param="webhook")
    if not listed(host, hosts):
        raise ClientError(400, f"host {host!r} is not in --allow-webhook-host "
                               f"({', '.join(hosts)})", param="webhook")
    return url


def listed(host: str, hosts: tuple[str, ...]) -> bool:
    """Whether ``host`` (a name or an address) is one of ``hosts``."""
    ip = _ip(host)
    if ip is None:
        return host.lower() in (h.lower() for h in hosts)
    return any(_ip(h) == ip for h in hosts)


async def check_addresses(url: str, hosts: tuple[str, ...]) -> None:
    """PermissionError naming the address unless every address ``url``'s host resolves to is
    public or listed by IP in ``hosts``."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    allowed = {ip for ip in map(_ip, hosts) if ip is not None}
    for *_, address in found:
        ip = _ip(str(address[0]))
        if ip is not None and internal(ip) and ip not in allowed:
            raise PermissionError(f"{host} resolves to the internal address {ip}, which is "
                                  "not listed by IP in --allow-webhook-host")


async def post_event(client: httpx.AsyncClient, url: str, event: dict[str, Any],
                     hosts: tuple[str, ...], timeout_s: float) -> str | None:
    """POST ``event`` as JSON to ``url`` with the httpx ``client``: None when the receiver
    answered 2xx, else why not (HTTP status, error, deadline, refused address); never raises
    for the receiver's doing."""
    import httpx

    try:
        async with asyncio.timeout(timeout_s):
            await check_addresses(url, hosts)
            async with client.stream("POST", url, json=event) as response:
                read = 0
                async for chunk in response.aiter_raw():
                    read += len(chunk)
                    if read >= READ_BYTES:
                        break  # the rest is never read: the connection is closed
                return None if response.is_success else f"HTTP {response.status_code}"
    except TimeoutError:
        return f"no complete answer within {timeout_s:g} s"
    except PermissionError as exc:
        return str(exc)
    except (httpx.HTTPError, OSError) as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"
