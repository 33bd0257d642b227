"""The real server (python -m apbv serve, 1 CPU rank, the tiny model) against malformed and
hostile HTTP: every malformed body is a 4xx JSON error (deep nesting, lone surrogates,
control characters, overflow, a string for a boolean, a body not sent as JSON), a foreign Host
is refused, slowloris heads and bodies are cut at --read-timeout-s, and SIGINT answers the
requests in flight with a 503 JSON error (last: it stops the server). The server takes its
settings from a --config-file whose read_timeout_s an APBV_SERVE_* variable overrides."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("ray")
pytest.importorskip("fastapi")

from tests.serve.server import serving  # noqa: E402

READ_TIMEOUT_S = 2.0
TRUSTED = "trusted.example"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, short_video: Path):
    media = tmp_path_factory.mktemp("media")
    (media / "clip.mp4").write_bytes(short_video.read_bytes())
    settings = tmp_path_factory.mktemp("settings") / "serve.toml"
    settings.write_text(f"media_root = [{json.dumps(str(media))}]\nread_timeout_s = 30\n"
                        f'allow_host = ["{TRUSTED}"]\nmax_queue = 4\n')
    with serving(tiny_model_dir, "--world-size", "1", "--config-file", str(settings),
                 env={"APBV_SERVE_READ_TIMEOUT_S": str(READ_TIMEOUT_S)}) as srv:
        srv.wait_ready()
        srv.clip = (media / "clip.mp4").as_uri()
        yield srv


def _body(url: str, text: str = "What colour is the square?", **fields: Any) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}]}],
        **fields}


def _post(server, content: bytes, content_type: str | None = "application/json",
          path: str = "/v1/chat/completions", **headers: str) -> httpx.Response:
    if content_type is not None:
        headers["Content-Type"] = content_type
    return httpx.post(server.base + path, content=content, headers=headers, timeout=30)


def _refusal(response: httpx.Response, status: int, *texts: str) -> None:
    """``response`` is a ``status`` JSON error whose message holds each of ``texts``."""
    assert response.status_code == status, response.text[:300]
    assert response.headers["content-type"] == "application/json", response.text[:300]
    message = response.json()["error"]["message"]
    for text in texts:
        assert text in message, message


def test_settings_came_from_the_file_and_the_environment(server):
    """The file's media root and Host names serve (the other tests use them), and the
    environment's read_timeout_s beat the file's 30 s (the slowloris tests are cut at 2 s)."""
    line = next((x for x in server.log if "settings from outside the command line" in x), "")
    for text in ("allow_host (file ", "media_root (file ", "max_queue (file ",
                 "read_timeout_s (environment APBV_SERVE_READ_TIMEOUT_S)"):
        assert text in line, line or server.tail()


def test_deep_nesting_is_a_400(server):
    _refusal(_post(server, b"[" * 100_000 + b"]" * 100_000), 400, "nested deeper than 64")
    deep = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
            "user": None}
    inner: Any = 1
    for _ in range(100):  # under the decoder's recursion limit: the walk finds it
        inner = {"a": inner}
    deep["stream_options"] = inner
    _refusal(_post(server, json.dumps(deep).encode()), 400, "nested deeper than 64",
             "stream_options.a.a")


def test_lone_surrogates_are_a_400_naming_the_field(server):
    body = json.dumps(_body(server.clip, "what \ud800 colour?")).encode()  # escaped: \\ud800
    _refusal(_post(server, body), 400, "'messages[0].content[1].text'", "lone surrogate")
    body = json.dumps(_body(server.clip + "\udc80")).encode()
    _refusal(_post(server, body), 400, "'messages[0].content[0].video_url.url'")


def test_control_characters_in_a_video_url_are_a_400(server):
    body = json.dumps(_body(server.clip.replace("clip", "cl\x01ip"))).encode()
    _refusal(_post(server, body), 400, "video_url.url holds the control character U+0001")
    body = json.dumps({"source": "file:///x/\nseg"}).encode()
    _refusal(_post(server, body, path="/v1/streams"), 400, "source holds the control character")


def test_numeric_overflow_is_a_400(server):
    big = json.dumps(_body(server.clip)).encode()[:-1] + b', "max_tokens": 1' + b"0" * 400 + b"}"
    _refusal(_post(server, big), 400, "has 401 digits")
    inf = json.dumps(_body(server.clip)).encode()[:-1] + b', "deadline_ms": 1e400}'
    _refusal(_post(server, inf), 400, "1e400 overflows a double")


def test_wrong_types_are_400s_not_truthiness(server):
    body = json.dumps(_body(server.clip, max_tokens=2, stream="false")).encode()
    _refusal(_post(server, body), 400, "stream must be true or false, got 'false'")
    body = json.dumps(_body(server.clip, max_tokens=2, temperature=False)).encode()
    _refusal(_post(server, body), 400, "temperature must be a finite number")
    ok = _post(server, json.dumps(_body(server.clip, max_tokens=2, stream=False)).encode())
    assert ok.status_code == 200 and ok.json()["object"] == "chat.completion", ok.text[:300]


def test_a_body_not_sent_as_json_is_a_415(server):
    body = json.dumps(_body(server.clip, max_tokens=2)).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        _refusal(_post(server, body, content_type), 415, "Content-Type: application/json")
    _refusal(_post(server, b"{}", "text/plain", path="/v1/streams"), 415)


def test_a_foreign_host_is_refused(server):
    port = server.base.rsplit(":", 1)[1]
    _refusal(httpx.get(server.base + "/health", headers={"Host": f"rebind.example:{port}"}),
             421, "Host 'rebind.example:", "--allow-host")
    body = json.dumps(_body(server.clip, max_tokens=2)).encode()
    _refusal(_post(server, body, Host=f"rebind.example:{port}"), 421)
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"{TRUSTED}:{port}", TRUSTED):
        assert httpx.get(server.base + "/health", headers={"Host": host}).status_code == 200
    page = httpx.get(server.base + "/")  # the page is same-origin and sends JSON as JSON
    assert page.status_code == 200 and '"Content-Type": "application/json"' in page.text


def _read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    data = b""
    while time.monotonic() < deadline:
        try:
            piece = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:  # closed while our last bytes were on the way
            return data
        if not piece:
            return data
        data += piece
    raise AssertionError(f"the server did not close the connection; got {data[:200]!r}")


def _trickle(server, head: bytes, trickle: bytes) -> tuple[float, bytes]:
    """Send ``head`` then one byte of ``trickle`` every 0.25 s; (seconds until the server
    closed the connection, what it answered)."""
    port = int(server.base.rsplit(":", 1)[1])
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=0.25) as sock:
        sock.sendall(head)
        for byte in trickle:
            try:
                sock.sendall(bytes([byte]))
            except OSError:  # closed under us
                break
            try:
                sock.recv(1, socket.MSG_PEEK)
                break  # the server answered or closed
            except TimeoutError:
                pass
            if time.monotonic() - start > READ_TIMEOUT_S + 5:
                break
        answer = _read_until_closed(sock, start + READ_TIMEOUT_S + 8)
    return time.monotonic() - start, answer


def test_a_slowloris_head_is_cut_at_the_read_timeout(server):
    port = server.base.rsplit(":", 1)[1]
    took, answer = _trickle(server, b"POST /v1/chat/completions HTTP/1.1\r\n",
                            f"Host: 127.0.0.1:{port}\r\nX-Slow: ".encode() + b"a" * 200)
    assert took < READ_TIMEOUT_S + 2, took
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"--read-timeout-s" in answer


def test_a_slowloris_body_is_cut_at_the_read_timeout(server):
    port = server.base.rsplit(":", 1)[1]
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Content-Type: application/json\r\nContent-Length: 500\r\n\r\n").encode()
    took, answer = _trickle(server, head, b'{"messages": ' + b" " * 400)
    assert took < READ_TIMEOUT_S + 2, took
    status, _, rest = answer.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"application/json" in rest and b"did not arrive within 2 s" in rest


def test_sigint_answers_requests_in_flight_with_503_json(server):
    """Last (it stops the server): one streamed answer running and two queued when SIGINT
    comes; every one of them is answered "shutting down" at once, none with a 500."""
    url = server.base + "/v1/chat/completions"
    results: dict[str, Any] = {}

    def streamed() -> None:
        with httpx.stream("POST", url, json=_body(server.clip, max_tokens=1024, stream=True),
                          timeout=60) as response:
            results["stream_status"] = response.status_code
            results["events"] = [line for line in response.iter_lines() if line]

    def queued(name: str) -> None:
        response = httpx.post(url, json=_body(server.clip, max_tokens=1024), timeout=60)
        results[name] = (response.status_code, response.headers.get("content-type"),
                         response.text, time.monotonic())

    threads = [threading.Thread(target=streamed)]
    threads[0].start()
    deadline = time.monotonic() + 30
    while not httpx.get(server.base + "/health").json()["replicas"][0]["running"]:
        assert time.monotonic() < deadline, "the streamed request never started"
        time.sleep(0.1)
    threads += [threading.Thread(target=queued, args=(f"q{i}",)) for i in range(2)]
    for t in threads[1:]:
        t.start()
    while httpx.get(server.base + "/health").json()["queued"] < 2:
        assert time.monotonic() < deadline, "the requests were not queued"
        time.sleep(0.1)
    sigint = time.monotonic()
    server.stop()  # exits 0 with its whole process group (checked there)
    for t in threads:
        t.join(timeout=30)
    for name in ("q0", "q1"):
        status, content_type, text, at = results[name]
        assert (status, content_type) == (503, "application/json"), text[:300]
        assert json.loads(text)["error"]["message"].startswith("the server is shutting down")
        assert at - sigint < 3, at - sigint
    assert results["stream_status"] == 200
    events = results["events"]
    assert events[-1] == "data: [DONE]", events[-3:]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 503, events[-3:]
