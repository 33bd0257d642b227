"""Downloads without a server, from a local origin: the whole download (headers and body) within
its deadline, at most --max-downloads at once, temporary files removed on every failure and on
cancellation, stored files named by content and a known suffix only, and URLs with control
characters refused before anything is created."""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("httpx")

from apbv.openai.download import MediaStore, discard, fetch_media, stored_suffix  # noqa: E402
from apbv.openai.policy import ClientError, MediaPolicy  # noqa: E402
from tests.serve.origin import TRICKLE_BODY, TRICKLE_HEADERS, serving_origin  # noqa: E402

STORED = re.compile(r"sha256-[0-9a-f]{64}(\.mp4|\.mkv|\.webm|\.mov|\.avi|\.m4v)?")
PART = re.compile(r"part-[a-z0-9_]{8}")


def _policy(directory: Path, timeout_s: float = 30.0, max_downloads: int = 4) -> MediaPolicy:
    return MediaPolicy((), ("127.0.0.1",), MediaStore(str(directory), 1 << 30), 1 << 20,
                       timeout_s, max_downloads)


@pytest.mark.parametrize("path", [TRICKLE_BODY, TRICKLE_HEADERS])
def test_a_trickling_download_fails_at_its_deadline_and_leaves_nothing(tmp_path, path):
    """One byte every 0.3 s never trips a per-read timeout: only a deadline on the whole
    download ends it (the origin would go on for 30 s)."""
    with serving_origin(interval_s=0.3, trickle_s=30) as origin:
        started = time.monotonic()
        with pytest.raises(ClientError) as err:
            asyncio.run(fetch_media(origin.base + path, _policy(tmp_path, timeout_s=1.5)))
        elapsed = time.monotonic() - started
    assert err.value.status == 504 and "1.5 s (--download-timeout-s)" in err.value.message
    assert elapsed < 1.5 + 2, elapsed
    assert list(tmp_path.iterdir()) == []


def test_at_most_max_downloads_at_once_and_a_cancelled_one_leaves_nothing(tmp_path):
    policy = _policy(tmp_path, max_downloads=2)

    async def scenario(origin) -> tuple[ClientError, list[str]]:
        slow = [asyncio.ensure_future(fetch_media(origin.base + p, policy))
                for p in (TRICKLE_BODY, TRICKLE_HEADERS)]
        await asyncio.to_thread(origin.wait_trickles, 2)
        parts = sorted(p.name for p in tmp_path.iterdir())
        with pytest.raises(ClientError) as err:
            await fetch_media(origin.base + "/a.mp4", policy)
        for task in slow:  # as at shutdown
            task.cancel()
        await asyncio.gather(*slow, return_exceptions=True)
        return err.value, parts

    with serving_origin({"/a.mp4": b"video"}, interval_s=0.2) as origin:
        refused, parts = asyncio.run(scenario(origin))
        assert refused.status == 429, refused.message
        assert "2 remote videos are downloading, the most at once (--max-downloads 2)" in \
            refused.message
        assert len(parts) == 2 and all(PART.fullmatch(p) for p in parts), parts
        assert list(tmp_path.iterdir()) == []  # the cancelled downloads' files are gone
        held = asyncio.run(fetch_media(origin.base + "/a.mp4", policy))  # the slots are free
    assert Path(held.path).read_bytes() == b"video"
    discard(held)


def test_one_stored_file_per_content_with_a_known_suffix_only(tmp_path, short_video):
    from apbv.video.load import probe
    from apbv.video.sampling import VideoSpec

    video = short_video.read_bytes()
    files = {"/Clip.MP4": video, "/clip.mkv": video, "/clip": video, "/other.bin": b"other",
             "/x.mp4;rm%20-rf": b"x", "/y.exe": b"y"}
    with serving_origin(files) as origin:
        policy = _policy(tmp_path)
        held = {p: asyncio.run(fetch_media(origin.base + p + "?name=z.mp4", policy))
                for p in files}
    digest = hashlib.sha256(video).hexdigest()
    # The same bytes under three URL suffixes: one file, with the first one's suffix.
    assert {held[p].path for p in ("/Clip.MP4", "/clip.mkv", "/clip")} == \
        {str(tmp_path / f"sha256-{digest}.mp4")}
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 4 and all(STORED.fullmatch(n) for n in names), names
    assert Path(held["/other.bin"].path).name == "sha256-" + hashlib.sha256(b"other").hexdigest()
    assert Path(held["/x.mp4;rm%20-rf"].path).suffix == ""
    for p in files:
        discard(held[p])
    assert [stored_suffix(u) for u in ("http://h/a.WebM", "http://h/a.mp4/", "http://h/.mp4",
                                       "http://h/a.mp4#x.mkv", "http://h/a.ts")] == \
        [".webm", "", "", ".mp4", ""]
    # A video stored without a suffix still opens (the decoders read the content).
    plain = tmp_path / "plain"
    plain.write_bytes(video)
    for backend in ("decord", "pyav"):
        meta = probe(VideoSpec(path=str(plain), backend=backend))
        assert meta.total_frames == 24, (backend, meta)


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/a\n.mp4", "http://127.0.0.1:9/a\r\nX: 1",
                                 "http://127.0.0.1:9/\x00.mp4", "http://127.0.0.1:9/a\x7f.mp4",
                                 "\thttp://127.0.0.1:9/a.mp4"])
def test_a_url_with_control_characters_is_refused_before_anything_is_made(tmp_path, url):
    from apbv.config import load_config
    from apbv.openai.chat import parse_chat

    body = {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "q"}]}]}
    with pytest.raises(ClientError) as err:
        parse_chat(body, load_config("tiny_cpu"), _limits(), _policy(tmp_path), "m")
    assert err.value.status == 400 and "control character" in err.value.message, \
        err.value.message
    assert list(tmp_path.iterdir()) == []


def _limits():
    from apbv.openai.policy import Limits

    return Limits()
