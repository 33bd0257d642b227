"""The real server with two replicas of one CPU rank each (--replicas 2 --world-size 1) and remote
media from a local http.server (--allow-media-domain 127.0.0.1): concurrent requests on two
replicas, cache-affinity routing, per-replica health and metrics, downloads under a limit and
kept by content and asked for again conditionally (a repeat is a 304 and a vision-cache hit);
the store's budget, holds and conditions without a server."""

from __future__ import annotations

import hashlib
import http.server
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from tests.serve.server import serving  # noqa: E402
from tests.serve.test_server import KEY, _client, _messages, _metric  # noqa: E402

MODEL = "tiny-qwen2.5-vl"
LIMIT_MB = 1


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Files of the media directory (with Last-Modified, and 304 to an If-Modified-Since they
    have not passed), plus /redirect (to another host) and /endless (2 MiB without a
    Content-Length); every answer's (path, status) is appended to the server's ``answers``."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_port}/a.mp4")
            self.end_headers()
        elif self.path == "/endless.mp4":
            self.send_response(200)
            self.send_header("Content-Type", "video/mp4")
            self.end_headers()
            for _ in range(32):
                self.wfile.write(b"\0" * (1 << 16))
        else:
            super().do_GET()

    def log_request(self, code: object = "-", size: object = "-") -> None:
        self.server.answers.append((self.path, int(code)))

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory, short_video: Path) -> Path:
    root = tmp_path_factory.mktemp("media")
    shutil.copy(short_video, root / "a.mp4")
    shutil.copy(short_video, root / "b.mp4")
    (root / "big.mp4").write_bytes(b"\0" * ((LIMIT_MB << 20) + 1))
    return root


@pytest.fixture(scope="module")
def files(media: Path):
    """A local http.server on 127.0.0.1 serving ``media``: its base URL."""
    handler = lambda *a: _Handler(*a, directory=str(media))  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.answers = []
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}", httpd.answers
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, media: Path, tmp_path_factory: pytest.TempPathFactory):
    """(base URL, the directory holding the server's private download directory)."""
    downloads = tmp_path_factory.mktemp("downloads")
    with serving(tiny_model_dir, "--replicas", "2", "--world-size", "1", "--media-root",
                 str(media), "--api-key", KEY, "--max-frames", "16", "--vision-cache-gb", "0.25",
                 "--allow-media-domain", "127.0.0.1", "--max-download-mb", str(LIMIT_MB),
                 "--download-dir", str(downloads)) as srv:
        srv.wait_ready()
        yield srv.base, downloads
    assert list(downloads.iterdir()) == [], "the download directory was left behind"


def _ask(base: str, url: str) -> dict:
    out = _client(base).chat.completions.create(model=MODEL, messages=_messages(url),
                                                max_tokens=6)
    return out.model_extra["apbv"]


def test_two_replicas_serve_concurrently_and_repeats_follow_the_cache(server, media):
    base = server[0]
    health = httpx.get(base + "/health").json()
    assert health["status"] == "ready" and [r["replica"] for r in health["replicas"]] == [0, 1]
    assert [len(r["rank_pids"]) for r in health["replicas"]] == [1, 1]
    urls = [(media / "a.mp4").as_uri(), (media / "b.mp4").as_uri()]
    with ThreadPoolExecutor(2) as pool:
        first = list(pool.map(lambda u: _ask(base, u), urls))
    assert sorted(b["replica"] for b in first) == [0, 1]
    assert not any(b["vision_cache_hit"] for b in first)
    # Concurrent, not one after the other: neither waited for the other's prefill.
    assert max(b["queue_wait_s"] for b in first) < min(b["ttft_s"] for b in first), first
    # The least loaded replica would be 0 (both idle): the video replica 1 answered goes there.
    on_one = urls[[b["replica"] for b in first].index(1)]
    again = _ask(base, on_one)
    assert again["replica"] == 1 and again["vision_cache_hit"] is True
    assert again["token_ids"] == first[[b["replica"] for b in first].index(1)]["token_ids"]
    for replica in ("0", "1"):
        assert _metric(base, "apbv:replica_queue_depth", f'{{replica="{replica}"}}') == 0
        assert _metric(base, "apbv:replica_ready", f'{{replica="{replica}"}}') == 1


def test_remote_media(server, files, media):
    base, downloads = server
    files, answers = files
    client = _client(base)
    local = _ask(base, (media / "a.mp4").as_uri())
    remote = _ask(base, files + "/a.mp4")
    assert remote["token_ids"] == local["token_ids"] and remote["frames"] == local["frames"]
    # Kept by content, asked for again only if modified (304): the repeat names the same file,
    # so its replica's vision cache has it.
    again = _ask(base, files + "/a.mp4")
    assert again["vision_cache_hit"] and again["replica"] == remote["replica"], again
    assert again["token_ids"] == remote["token_ids"]
    assert [status for path, status in answers if path == "/a.mp4"] == [200, 304], answers
    digest = hashlib.sha256((media / "a.mp4").read_bytes()).hexdigest()
    stored = [[p.name for p in d.iterdir()] for d in downloads.iterdir()]
    assert stored == [[f"sha256-{digest}.mp4"]], stored
    port = files.rsplit(":", 1)[1]
    cases = [
        (f"http://localhost:{port}/a.mp4", 400,
         "host 'localhost' is not in --allow-media-domain (127.0.0.1)"),
        (files + "/redirect", 400, "redirects to another host are refused"),
        (files + "/big.mp4", 413,
         f"declares 1.00 MB, over the limit of {LIMIT_MB} MB (--max-download-mb)"),
        (files + "/endless.mp4", 413, f"over the limit of {LIMIT_MB} MB (--max-download-mb)"),
        (files + "/missing.mp4", 502, "HTTP 404"),
        ("ftp://127.0.0.1/a.mp4", 400, "unsupported video URL scheme 'ftp'"),
    ]
    for url, status, text in cases:
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model=MODEL, messages=_messages(url), max_tokens=2)
        assert err.value.status_code == status, (url, err.value.message)
        assert text in err.value.message, (text, err.value.message)
    assert [[p.name for p in d.iterdir()] for d in downloads.iterdir()] == stored


def _part(directory: Path, name: str, data: bytes) -> Path:
    """A finished download, as fetch_media leaves it before storing it."""
    part = directory / f"remote-{name}"
    part.write_bytes(data)
    return part


def test_media_store_keeps_content_under_its_budget_and_never_a_held_file(tmp_path):
    from apbv.openai.download import MediaStore, discard

    def download(name: str, data: bytes, store: MediaStore):
        return store.admit(str(_part(tmp_path, name, data)), hashlib.sha256(data).hexdigest(),
                           ".mp4")

    store = MediaStore(str(tmp_path), budget_bytes=2000)
    a1, a2 = download("1", b"a" * 1000, store), download("2", b"a" * 1000, store)
    assert a1.path == a2.path and store.held() == {Path(a1.path).name: 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == [Path(a1.path).name]  # one copy
    discard(a1)
    discard(a1)  # released once only
    assert store.held() == {Path(a1.path).name: 1}
    b = download("3", b"b" * 1000, store)
    discard(a2)
    discard(b)  # 2000 bytes: within the budget, both kept
    c = download("4", b"c" * 1000, store)  # over it: a, the least recently used, goes
    assert sorted(store.held()) == sorted([Path(b.path).name, Path(c.path).name])
    assert not Path(a1.path).exists()
    d = download("5", b"d" * 1000, store)  # b goes; c and d are held: kept over the budget
    e = download("6", b"e" * 1000, store)
    assert sorted(store.held()) == sorted(Path(x.path).name for x in (c, d, e))
    for x in (c, d, e):
        discard(x)
    assert sorted(store.held()) == sorted([Path(d.path).name, Path(e.path).name])
    url, seen = "http://host/e.mp4", {"If-Modified-Since": "Mon, 01 Jan 2024 00:00:00 GMT"}
    assert store.conditions(url) == {} and store.reuse(url) is None
    g = store.admit(str(_part(tmp_path, "8", b"g")), hashlib.sha256(b"g").hexdigest(), ".mp4",
                    url, seen)
    assert store.conditions(url) == seen
    again = store.reuse(url)
    assert again.path == g.path and store.held()[Path(g.path).name] == 2
    discard(g)
    discard(again)
    for name in "9ab":  # unheld g leaves the store: its URL asks unconditionally again
        discard(download(name, name.encode() * 3000, store))
    assert store.conditions(url) == {} and store.reuse(url) is None
    none = MediaStore(str(tmp_path / "none"), budget_bytes=0)
    (tmp_path / "none").mkdir()
    f = download("7", b"f", none)
    assert Path(f.path).exists()
    discard(f)  # budget 0: gone with its last request
    assert list((tmp_path / "none").iterdir()) == []
