"""Where standing questions' events go: server-sent event subscribers and webhooks.

:class:`EventHub` hands each event (a JSON-able dict with ``stream`` and ``watch`` ids) to
every subscriber whose filter takes it; a subscriber's queue is bounded (``queue_size``
events): an event that does not fit is dropped for that subscriber and counted (its
``dropped``, and the hub's). A stream's end is a ``stream.closed`` event
(:mod:`apbv.serve.streams.end`, naming the watches that ended with it): the last event of every
subscriber filtered to that stream or one of its watches, whose event stream then ends (never
dropped: it waits behind the queued ones); an unfiltered subscriber sees it and goes on.
:class:`Webhook` posts each event of one watch as JSON to its URL (a host of
``--allow-webhook-host``, :mod:`apbv.serve.watches.webhook`), one at a time, each POST bounded in
time and in what it reads, with retries; its queue is bounded too, drops counted. One client
(address) holds at most :data:`MAX_SUBSCRIBERS_PER_CLIENT` event streams.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from apbv.openai.policy import ClientError
from apbv.serve.watches.webhook import post_event

log = logging.getLogger("apbv.serve")

QUEUE_SIZE = 256
"""Events one subscriber's (or one webhook's) queue holds at most."""
MAX_SUBSCRIBERS = 64
"""Event streams open at once; one more is a 429."""
KEEPALIVE_S = 15.0
"""An idle event stream sends a comment line this often (proxies keep it open)."""
MAX_SUBSCRIBERS_PER_CLIENT = 8
"""Event streams one client (address) holds open at once; one more is a 429."""
WEBHOOK_TIMEOUT_S = 5.0
"""Wall-clock seconds of one webhook POST (:func:`apbv.serve.watches.webhook.post_event`)."""
WEBHOOK_RETRIES = 3
"""Tries of one webhook POST after the first failed (1 s, 2 s, 4 s apart)."""


@dataclass(eq=False)
class Subscriber:
    """One event stream's client: the events it takes (``stream`` / ``watch`` id: None takes
    every one) and its bounded queue."""

    stream: str | None = None
    watch: str | None = None
    client: str | None = None
    """The client's address (:data:`MAX_SUBSCRIBERS_PER_CLIENT` each)."""
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(QUEUE_SIZE))
    dropped: int = 0
    ending: bool = False
    """Its event stream ends once its queue is sent (and then :attr:`final`, if any)."""
    final: dict[str, Any] | None = None

    def takes(self, event: dict[str, Any]) -> bool:
        return (self.stream is None or event["stream"] == self.stream) and \
            (self.watch is None or event.get("watch") == self.watch or
             self.watch in event.get("watches", ()))

    def ends_with(self, event: dict[str, Any]) -> bool:
        """Whether ``event`` (one it takes) is its last: its stream's (or its watch's
        stream's) ``stream.closed``."""
        return event.get("object") == "stream.closed" and \
            (self.stream is not None or self.watch is not None)


class EventHub:
    """The event stream subscribers of one server."""

    def __init__(self) -> None:
        self.subscribers: set[Subscriber] = set()
        self.published = 0
        self.dropped = 0

    def subscribe(self, stream: str | None = None, watch: str | None = None,
                  client: str | None = None) -> Subscriber:
        """A new subscriber taking the events of ``stream`` and ``watch`` (None: any), or
        ClientError(429) when :data:`MAX_SUBSCRIBERS` are subscribed, or
        :data:`MAX_SUBSCRIBERS_PER_CLIENT` by ``client`` (its address; None: not counted)."""
        if len(self.subscribers) >= MAX_SUBSCRIBERS:
            raise ClientError(429, f"{len(self.subscribers)} event streams are open, the limit "
                                   f"is {MAX_SUBSCRIBERS}: close one first")
        held = sum(s.client == client for s in self.subscribers) if client is not None else 0
        if held >= MAX_SUBSCRIBERS_PER_CLIENT:
            raise ClientError(429, f"this client holds {held} event streams, the limit per "
                                   f"client is {MAX_SUBSCRIBERS_PER_CLIENT}: close one first")
        sub = Subscriber(stream, watch, client)
        self.subscribers.add(sub)
        return sub

    def publish(self, event: dict[str, Any]) -> None:
        """``event`` to every subscriber that takes it (dropped, and counted, where its queue
        is full)."""
        self.published += 1
        for sub in self.subscribers:
            if sub.ending or not sub.takes(event):
                continue
            if sub.ends_with(event):
                self.end(sub, event)
            else:
                try:
                    sub.queue.put_nowait(event)
                except asyncio.QueueFull:
                    sub.dropped += 1
                    self.dropped += 1

    def end(self, sub: Subscriber, final: dict[str, Any] | None = None) -> None:
        """End ``sub``'s event stream once its queued events are sent, ``final`` last."""
        sub.ending, sub.final = True, final
        try:
            sub.queue.put_nowait(None)  # wakes its stream (a full queue wakes it anyway)
        except asyncio.QueueFull:
            pass

    def close(self) -> None:
        """The server stops: every event stream ends once its queued events are sent."""
        for sub in self.subscribers:
            if not sub.ending:
                self.end(sub)

    async def stream(self, sub: Subscriber) -> AsyncIterator[bytes]:
        """``sub``'s events as server-sent events (``event: watch``, or ``event:
        stream.closed``), a keep-alive comment when none came for :data:`KEEPALIVE_S`;
        unsubscribed when the client leaves or the stream ends (:meth:`end`)."""
        try:
            yield b": subscribed\n\n"
            while True:
                if sub.ending and sub.queue.empty():
                    if sub.final is not None:
                        yield _sse(sub.final)
                    return
                try:
                    event = await asyncio.wait_for(sub.queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                if event is not None:
                    yield _sse(event)
        finally:
            self.subscribers.discard(sub)


def _sse(event: dict[str, Any]) -> bytes:
    """One server-sent event: ``event: stream.closed`` for a stream's end, else ``watch``."""
    name = "stream.closed" if event.get("object") == "stream.closed" else "watch"
    return f"event: {name}\ndata: {json.dumps(event)}\n\n".encode()


@dataclass(eq=False)
class Webhook:
    """Posts one watch's events to ``url`` in order (:meth:`run`, a task per watch), each POST
    bounded (:func:`apbv.serve.watches.webhook.post_event`: ``hosts`` the --allow-webhook-host list
    its addresses are checked against, ``timeout_s`` its wall-clock deadline)."""

    url: str
    hosts: tuple[str, ...] = ()
    timeout_s: float = WEBHOOK_TIMEOUT_S
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(QUEUE_SIZE))
    sent: int = 0
    failed: int = 0
    """Events given up after every retry failed."""
    dropped: int = 0
    """Events that found the queue full."""

    def finish(self) -> bool:
        """No event follows the queued ones: :meth:`run` returns once they are sent; False
        when the queue is full (the caller stops it instead)."""
        try:
            self.queue.put_nowait(None)
        except asyncio.QueueFull:
            return False
        return True

    def put(self, event: dict[str, Any]) -> None:
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped += 1
            log.warning("webhook %s: queue full (%d events), an event was dropped", self.url,
                        QUEUE_SIZE)

    async def run(self) -> None:
        """Post the queued events until cancelled (each with :data:`WEBHOOK_RETRIES` retries;
        an answer other than 2xx counts as a failure; redirects are not followed)."""
        import httpx

        async with httpx.AsyncClient(timeout=self.timeout_s,
                                     follow_redirects=False) as client:
            while True:
                event = await self.queue.get()
                if event is None:  # finish(): the last event was sent
                    return
                for attempt in range(WEBHOOK_RETRIES + 1):
                    why = await post_event(client, self.url, event, self.hosts, self.timeout_s)
                    if why is None:
                        self.sent += 1
                        break
                    if attempt == WEBHOOK_RETRIES:
                        self.failed += 1
                        log.warning("webhook %s: gave up on an event after %d tries (%s)",
                                    self.url, attempt + 1, why)
                    else:
                        await asyncio.sleep(2.0 ** attempt)

    def stats(self) -> dict[str, Any]:
        return {"url": self.url, "sent": self.sent, "failed": self.failed,
                "dropped": self.dropped, "queued": self.queue.qsize()}
