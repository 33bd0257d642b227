"""Where watch events go, without a server (:mod:`apbv.serve.watches.events`): subscribers take what
their filter takes, a full queue drops and counts, the event stream's wire format; a webhook
retries a failing receiver and counts what it could not queue."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("httpx")

from apbv.serve.watches import events  # noqa: E402
from apbv.serve.watches.events import EventHub, Webhook  # noqa: E402


def _event(i: int, stream: str = "s1", watch: str = "w1") -> dict:
    return {"stream": stream, "watch": watch, "n": i}


def test_subscribers_take_what_their_filter_takes_and_count_drops():
    async def main():
        hub = EventHub()
        every, one_stream, one_watch = hub.subscribe(), hub.subscribe("s2"), \
            hub.subscribe(watch="w1")
        for i in range(events.QUEUE_SIZE + 5):
            hub.publish(_event(i))
        hub.publish(_event(-1, stream="s2", watch="w9"))
        assert every.queue.qsize() == events.QUEUE_SIZE and every.dropped == 6
        assert one_watch.dropped == 5 and one_stream.queue.qsize() == 1
        assert hub.published == events.QUEUE_SIZE + 6 and hub.dropped == 11
        assert one_stream.queue.get_nowait()["n"] == -1
        assert every.queue.get_nowait()["n"] == 0  # the oldest kept, the newest dropped
    asyncio.run(main())


def test_event_streams_open_at_once_are_bounded():
    from apbv.openai.policy import ClientError

    hub = EventHub()
    subs = [hub.subscribe() for _ in range(events.MAX_SUBSCRIBERS)]
    with pytest.raises(ClientError, match="64 event streams are open, the limit is 64"):
        hub.subscribe("s1")
    hub.subscribers.discard(subs[0])  # one left
    hub.subscribe("s1")


def test_the_event_stream_is_server_sent_events_and_unsubscribes():
    async def main():
        hub = EventHub()
        sub = hub.subscribe("s1")
        wire = hub.stream(sub)
        assert await wire.__anext__() == b": subscribed\n\n"
        hub.publish(_event(7))
        line = await wire.__anext__()
        assert line.startswith(b"event: watch\ndata: ") and line.endswith(b"\n\n")
        assert json.loads(line.split(b"data: ", 1)[1]) == _event(7)
        await wire.aclose()  # the client left
        assert sub not in hub.subscribers
    asyncio.run(main())


class _Flaky(BaseHTTPRequestHandler):
    calls: list[int] = []

    def do_POST(self) -> None:  # noqa: N802  # http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).calls.append(1)
        self.send_response(503 if len(type(self).calls) == 1 else 204)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_a_webhook_retries_and_counts_what_its_queue_drops():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    async def main():
        hook = Webhook(f"http://127.0.0.1:{httpd.server_address[1]}/hook", ("127.0.0.1",))
        for i in range(events.QUEUE_SIZE + 2):
            hook.put(_event(i))
        assert hook.dropped == 2 and hook.queue.qsize() == events.QUEUE_SIZE
        while not hook.queue.empty() and hook.queue.qsize() > 1:
            hook.queue.get_nowait()  # keep one event to send
        task = asyncio.ensure_future(hook.run())
        for _ in range(100):  # the first POST is a 503, the retry 1 s later a 204
            await asyncio.sleep(0.05)
            if hook.sent:
                break
        task.cancel()
        return hook.stats()
    try:
        stats = asyncio.run(main())
    finally:
        httpd.shutdown()
    assert stats["sent"] == 1 and stats["failed"] == 0 and stats["dropped"] == 2, stats
    assert len(_Flaky.calls) == 2
