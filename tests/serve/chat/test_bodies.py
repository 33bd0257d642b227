"""Malformed request bodies are 4xx errors naming the problem, without a server: the strict
JSON reader (nesting, surrogates, overflow, Content-Type), the chat body's fields checked by
type, the Host rule, and the ASGI guard's body deadline and shutdown answers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from apbv.openai.bodies import (  # noqa: E402
    MAX_DEPTH,
    check_content_type,
    check_url,
    decode_json,
)
from apbv.openai.policy import ClientError, Limits, MediaPolicy  # noqa: E402
from apbv.serve.http_guard import SHUTDOWN_MESSAGE, HostRule, HttpGuard  # noqa: E402


def _refused(fn, *args, status: int = 400, **kwargs) -> str:
    with pytest.raises(ClientError) as info:
        fn(*args, **kwargs)
    assert info.value.status == status, info.value.message
    return info.value.message


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 200, 100_000])
def test_nesting_deeper_than_the_limit_is_a_400(depth: int):
    body = ("[" * depth + "]" * depth).encode()
    assert f"nested deeper than {MAX_DEPTH} levels" in _refused(decode_json, body)
    nested = ('{"a":' * depth + "1" + "}" * depth).encode()
    assert f"nested deeper than {MAX_DEPTH}" in _refused(decode_json, nested)


def test_nesting_at_the_limit_is_read():
    value = decode_json(("[" * MAX_DEPTH + "]" * MAX_DEPTH).encode())
    for _ in range(MAX_DEPTH - 1):
        value = value[0]
    assert value == []


@pytest.mark.parametrize("body, where", [
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\ud800b"}]}]}',
     "'messages[0].content[0].text'"),
    (b'{"question": "\\udfff"}', "'question'"),
    (b'{"\\ud83d": 1}', "a key of the top level"),
])
def test_a_lone_surrogate_is_a_400_naming_where(body: bytes, where: str):
    message = _refused(decode_json, body)
    assert "lone surrogate" in message and where in message, message


def test_a_surrogate_pair_is_one_character():
    assert decode_json(b'{"q": "\\ud83d\\ude00"}') == {"q": "\U0001F600"}


@pytest.mark.parametrize("body, text", [
    (b'{"deadline_ms": 1e400}', "1e400 overflows a double"),
    (b'{"fps": -1e999}', "overflows a double"),
    (b'{"fps": NaN}', "NaN is not a JSON number"),
    (b'{"fps": Infinity}', "Infinity is not a JSON number"),
    (b'{"max_tokens": 1' + b"0" * 400 + b"}", "has 401 digits, more than 19"),
    (b'{"max_tokens": 1' + b"0" * 5000 + b"}", "has 5001 digits"),
    (b'\xff\xfe{"a": 1}', "not JSON"),
    (b'{"a": 1', "not JSON"),
])
def test_numbers_out_of_range_and_bad_bytes_are_400s(body: bytes, text: str):
    assert text in _refused(decode_json, body)


def test_content_type_must_be_json():
    check_content_type("application/json")
    check_content_type("Application/JSON; charset=utf-8")
    for value in (None, "text/plain", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x", "application/jsonp"):
        assert "Content-Type: application/json" in _refused(check_content_type, value,
                                                            status=415)


def test_control_characters_in_a_url_are_a_400():
    assert check_url("file:///media/a%0Ab.mp4", "video_url.url") == "file:///media/a%0Ab.mp4"
    for url, code in (("http://h/a\nb.mp4", "U+000A"), ("file:///a\x00.mp4", "U+0000"),
                      ("http://h/\x7f", "U+007F"), ("http://h/\x85", "U+0085")):
        message = _refused(check_url, url, "video_url.url")
        assert "video_url.url" in message and code in message
    assert "non-empty string" in _refused(check_url, 5, "source")


# --- the chat body's fields, by type ---------------------------------------------------------
@pytest.fixture
def chat(tmp_path: Path):
    from apbv.config import load_config
    from apbv.openai.chat import parse_chat

    (tmp_path / "clip.mp4").write_bytes(b"x")  # parse_chat does not open it
    url = (tmp_path / "clip.mp4").as_uri()
    cfg, policy = load_config("tiny_cpu"), MediaPolicy((str(tmp_path),))

    def parse(video_url: object = url, messages: object = None, **fields):
        if messages is None:
            messages = [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": video_url}},
                {"type": "text", "text": "what?"}]}]
        return parse_chat({"messages": messages, **fields}, cfg, Limits(), policy, "m")
    return parse


@pytest.mark.parametrize("fields, text", [
    ({"stream": "false"}, "stream must be true or false, got 'false'"),
    ({"stream": 1}, "stream must be true or false"),
    ({"temperature": False}, "temperature must be a finite number"),
    ({"temperature": "0"}, "temperature must be a finite number"),
    ({"n": True}, "n must be an integer"),
    ({"model": ["m"]}, "model must be a string"),
    ({"top_p": "1"}, "top_p must be a finite number"),
    ({"user": 7}, "user must be a string"),
    ({"stream_options": "yes"}, "stream_options must be an object"),
    ({"max_tokens": True}, "max_tokens must be an integer"),
    ({"deadline_ms": "100"}, "deadline_ms must be a finite number"),
])
def test_chat_fields_are_checked_by_type(chat, fields: dict, text: str):
    assert text in _refused(chat, **fields)


@pytest.mark.parametrize("fields, param, text", [
    ({"static_threshold": -1}, "static_threshold", "static_threshold must be a finite number >= 0"),
    ({"static_threshold": 300}, "static_threshold", "static_threshold must be in [0, 255]"),
    ({"mm_processor_kwargs": {"video_pruning_rate": 1.0}}, "video_pruning_rate",
     "video_pruning_rate must be in [0, 1)"),
    ({"video_pruning_rate": -0.5}, "video_pruning_rate", "video_pruning_rate must be a finite"),
    ({"video_pruning_rate": 1.5}, "video_pruning_rate", "video_pruning_rate must be in [0, 1)"),
])
def test_chat_pruning_settings_are_checked(chat, fields: dict, param: str, text: str):
    with pytest.raises(ClientError) as info:
        chat(**fields)
    assert info.value.status == 400 and text in info.value.message, info.value.message
    assert param in (info.value.param or ""), info.value.param


def test_chat_pruning_settings_reach_the_request(chat):
    call = chat(static_threshold=6, mm_processor_kwargs={"video_pruning_rate": 0})
    assert call.request.static_threshold == 6.0 and call.request.pruning_rate == 0.0
    assert "mm_processor_kwargs.video_pruning_rate" not in call.ignored
    assert chat().request.static_threshold == 0.0  # the server's default: off
    assert chat(mm_processor_kwargs={"video_pruning_rate": 0.5}).request.pruning_rate == 0.5
    assert chat(video_pruning_rate=0.75).request.pruning_rate == 0.75
    assert chat().request.pruning_rate == 0.0


def test_chat_stream_is_a_boolean(chat):
    assert chat(stream=True).sse is True
    assert chat(stream=False).sse is False and chat().sse is False
    assert chat(temperature=0.0, n=1, model="m", top_p=1, user="u").request is not None


def test_chat_messages_and_url_are_checked(chat):
    assert "messages[0] must be an object" in _refused(chat, messages=["hello"])
    assert "messages[1] must be an object with a string role" in _refused(
        chat, messages=[{"role": "system", "content": "x"}, {"role": 3}])
    message = _refused(chat, video_url="file:///tmp/a\x01.mp4")
    assert "video_url.url holds the control character U+0001" in message
    assert "video_url.url must be a non-empty string" in _refused(chat, video_url=12)


# --- the Host rule ---------------------------------------------------------------------------
@pytest.mark.parametrize("bound, allowed, header, ok", [
    ("127.0.0.1", (), "127.0.0.1:8000", True),
    ("127.0.0.1", (), "localhost:8000", True),
    ("127.0.0.1", (), "[::1]:8000", True),
    ("127.0.0.1", (), "127.0.0.1:8001", False),
    ("127.0.0.1", (), "127.0.0.1", False),  # port 80 implied
    ("127.0.0.1", (), "evil.example:8000", False),
    ("127.0.0.1", (), "localhost.evil.example:8000", False),
    ("127.0.0.1", (), None, False),
    ("127.0.0.1", (), "", False),
    ("127.0.0.1", (), "127.0.0.1:80x", False),
    ("127.0.0.1", ("api.example",), "api.example:443", True),
    ("127.0.0.1", ("api.example:8000",), "api.example:8000", True),
    ("127.0.0.1", ("api.example:8000",), "api.example:9000", False),
    ("127.0.0.1", ("*",), "anything", True),
    ("0.0.0.0", (), "10.1.2.3:8000", True),
    ("0.0.0.0", (), "[fe80::1]:8000", True),
    ("0.0.0.0", (), "localhost:8000", True),
    ("0.0.0.0", (), "rebind.example:8000", False),
    ("10.1.2.3", (), "10.1.2.3:8000", True),
    ("10.1.2.3", (), "10.9.9.9:8000", False),
    ("::1", (), "[::1]:8000", True),
])
def test_host_rule(bound: str, allowed: tuple, header: str | None, ok: bool):
    assert HostRule(bound, 8000, allowed).allows(header) is ok


def test_host_rule_refuses_a_malformed_allow_host():
    with pytest.raises(ValueError, match="not a number"):
        HostRule("127.0.0.1", 8000, ("api.example:https",))


# --- the ASGI guard --------------------------------------------------------------------------
def _scope(host: str = "127.0.0.1:8000") -> dict:
    return {"type": "http", "method": "POST", "path": "/", "headers": [(b"host", host.encode())]}


async def _call(guard: HttpGuard, scope: dict, messages: list[dict], during=None) -> list[dict]:
    """Run ``guard`` on one request whose body is ``messages`` (then nothing more arrives);
    ``during``: called once the app runs. Returns what was sent."""
    sent: list[dict] = []
    queue = list(messages)

    async def receive() -> dict:
        if queue:
            return queue.pop(0)
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    task = asyncio.ensure_future(guard(scope, receive, send))
    if during is not None:
        await asyncio.sleep(0.05)
        during()
    await asyncio.wait_for(task, 5)
    return sent


def _json_of(sent: list[dict]) -> tuple[int, dict, dict]:
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), json.loads(body)


async def _echo_body(scope: dict, receive, send) -> None:
    from apbv.openai.policy import ClientError

    try:
        while (await receive()).get("more_body"):
            pass
        status, out = 200, b"{}"
    except ClientError as exc:
        status, out = exc.status, json.dumps({"error": {"message": exc.message}}).encode()
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": out})


def test_guard_refuses_a_foreign_host_with_421():
    guard = HttpGuard(_echo_body, HostRule("127.0.0.1", 8000))
    status, headers, body = _json_of(asyncio.run(_call(guard, _scope("evil.example:8000"), [])))
    assert status == 421 and headers[b"content-type"] == b"application/json"
    assert "Host 'evil.example:8000' is not this server's" in body["error"]["message"]
    assert "--allow-host" in body["error"]["message"]
    ok = asyncio.run(_call(guard, _scope(), [{"type": "http.request", "body": b"{}"}]))
    assert ok[0]["status"] == 200


def test_guard_times_out_a_slow_body_and_closes():
    guard = HttpGuard(_echo_body, read_timeout_s=0.2)
    first = {"type": "http.request", "body": b"{", "more_body": True}
    status, headers, body = _json_of(asyncio.run(_call(guard, _scope(), [first])))
    assert status == 408 and headers[b"connection"] == b"close"
    assert "within 0.2 s" in body["error"]["message"]
    assert "--read-timeout-s" in body["error"]["message"]


def test_guard_answers_requests_in_flight_503_at_shutdown():
    async def forever(scope, receive, send) -> None:
        await asyncio.sleep(3600)

    guard = HttpGuard(forever)
    sent = asyncio.run(_call(guard, _scope(), [], during=guard.shut))
    status, headers, body = _json_of(sent)
    assert status == 503 and body["error"]["message"] == SHUTDOWN_MESSAGE
    status, _, _ = _json_of(asyncio.run(_call(guard, _scope(), [])))  # and any that comes late
    assert status == 503


def test_guard_ends_an_event_stream_with_the_shutdown_error():
    async def events(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await asyncio.sleep(3600)

    guard = HttpGuard(events)
    sent = asyncio.run(_call(guard, _scope(), [], during=guard.shut))
    assert sent[0]["status"] == 200 and sent[-1]["more_body"] is False
    last = sent[-1]["body"].decode().split("\n\n")
    assert json.loads(last[0].removeprefix("data: "))["error"] == {
        "message": SHUTDOWN_MESSAGE, "code": 503}
    assert last[1] == "data: [DONE]"


def test_a_stream_window_whose_frame_count_overflows_is_a_400():

    from apbv.serve.app import live_streams
    from apbv.serve.front.front import Front
    from apbv.serve.front.metrics import Metrics
    from apbv.serve.streams.routes import StreamOptions

    front = Front(None, Limits(), MediaPolicy(), "m", Metrics(), None)
    streams, _ = live_streams(front, [], StreamOptions(budget_bytes=1 << 30))
    assert "window_s x fps (1e+308 x 2) overflows" in _refused(
        streams._spec, {"fps": 2, "window_s": 1e308})
    assert "overflows" in _refused(streams._spec, {"fps": 1e10, "window_s": 1e300})
    assert streams._spec({"fps": 2, "window_s": 60})[0].window_s == 60
