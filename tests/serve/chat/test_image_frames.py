"""Frames sent as images, read without a server: N ``image_url`` parts (``data:`` PNG/JPEG,
``file://`` under a media root) become one DecodedVideo at the request's fps or the default, an
odd count padded by the last frame, frames of another size resized as the one-shot path
resizes; the refusals (mixed with a video, text only, remote images, sizes that differ,
``nframes``, too many frames, other formats) name the problem; ``data:`` URLs have their own
limit and sizes are printed in MiB."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")

from apbv.openai.policy import ClientError, Limits, MediaPolicy  # noqa: E402

QUESTION = "What colour is the flash?"


def _encoded(frame: torch.Tensor, fmt: str = "PNG") -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(frame.permute(1, 2, 0).numpy()).save(out, format=fmt)
    return out.getvalue()


def _url(frame: torch.Tensor, fmt: str = "PNG") -> str:
    kind = "png" if fmt == "PNG" else "jpeg"
    return f"data:image/{kind};base64," + base64.b64encode(_encoded(frame, fmt)).decode()


def _frames(n: int, size: int = 56, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=generator)


def _body(urls: list[str], **fields) -> dict:
    """lmms-eval's openai_compatible shape: one user message, the text first, then the
    frames; model, max_tokens and temperature."""
    content = [{"type": "text", "text": QUESTION}] + [
        {"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "m", "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, "temperature": 0, **fields}


@pytest.fixture
def parse(tmp_path: Path):
    from apbv.config import load_config
    from apbv.openai.chat import parse_chat

    cfg = load_config("tiny_cpu", ["video.min_pixels=3136", "video.max_pixels=3136"])
    policy = MediaPolicy((str(tmp_path),))

    def run(body: dict, limits: Limits | None = None, body_bytes: int | None = None):
        return parse_chat(body, cfg, limits or Limits(), policy, "m", body_bytes=body_bytes)
    return run


def _refused(fn, *args, status: int = 400, **kwargs) -> ClientError:
    with pytest.raises(ClientError) as info:
        fn(*args, **kwargs)
    assert info.value.status == status, info.value.message
    return info.value


def test_png_frames_are_the_video_at_the_default_or_given_fps(parse):
    from apbv.openai.image_parts import DEFAULT_FPS
    from apbv.video import DecodedVideo

    frames = _frames(8)
    call = parse(_body([_url(f) for f in frames]))
    video = call.request.video
    assert isinstance(video, DecodedVideo) and torch.equal(video.frames, frames)
    assert video.fps == DEFAULT_FPS == 2.0 and call.ignored == ()
    assert call.request.max_new_tokens == 4 and call.downloaded is None
    given = parse(_body([_url(f) for f in frames], mm_processor_kwargs={"fps": 0.5}))
    assert given.request.video.fps == 0.5
    assert parse(_body([_url(f) for f in frames], fps=1.0)).request.video.fps == 1.0


def test_one_image_is_a_one_frame_video_padded_to_a_temporal_patch(parse):
    frames = _frames(3)
    one = parse(_body([_url(frames[0])])).request.video.frames
    assert one.shape == (2, 3, 56, 56) and torch.equal(one[0], frames[0])
    assert torch.equal(one[1], frames[0])
    three = parse(_body([_url(f) for f in frames])).request.video.frames
    assert three.shape[0] == 4 and torch.equal(three[:3], frames)
    assert torch.equal(three[3], frames[2])


def test_jpeg_and_file_images_and_the_one_shot_resize(parse, tmp_path: Path):
    from apbv.video.load import resize_frames

    big = _frames(2, size=112, seed=1)
    (tmp_path / "f0.png").write_bytes(_encoded(big[0]))
    urls = [(tmp_path / "f0.png").as_uri(), _url(big[1])]
    video = parse(_body(urls)).request.video
    # 112x112 at max_pixels 3136: 56x56, exactly as the one-shot path resizes decoded frames.
    assert video.frames.shape == (2, 3, 56, 56)
    assert torch.equal(video.frames, resize_frames(big, (56, 56)))
    jpeg = parse(_body([_url(f, "JPEG") for f in _frames(2)])).request.video
    assert jpeg.frames.shape == (2, 3, 56, 56)
    detail = _body([_url(f) for f in _frames(2)])
    for part in detail["messages"][0]["content"][1:]:
        part["image_url"]["detail"] = "low"
    assert parse(detail).ignored == ("image_url.detail",)


@pytest.mark.parametrize(("change", "status", "message"), [
    (lambda b, f: b["messages"][0]["content"].append(
        {"type": "video_url", "video_url": {"url": "file:///x.mp4"}}), 400,
     "one video per request: one video_url part or image_url parts"),
    (lambda b, f: b["messages"][0].update(content=[{"type": "text", "text": "hi"}]), 400,
     "text-only requests are not supported"),
    (lambda b, f: b["messages"][0]["content"].append(
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}), 400,
     "image 2: remote image URLs are not fetched"),
    (lambda b, f: b["messages"][0]["content"].append(
        {"type": "image_url", "image_url": {"url": _url(_frames(1, size=84)[0])}}), 400,
     "image 2 is 84x84, but image 0 is 56x56"),
    (lambda b, f: b.update(nframes=8), 400, "frames sent as image_url parts are all taken"),
    (lambda b, f: b["messages"][0]["content"].append(
        {"type": "image_url", "image_url": {"url": "data:image/gif;base64,R0lG"}}), 400,
     "image 2: a data: image URL must be data:<type>;base64,<bytes>"),
    (lambda b, f: b["messages"][0]["content"].append({"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(_encoded(f[0], "BMP")).decode()}}),
     400, "image 2 is a BMP image; only PNG and JPEG"),
    (lambda b, f: b["messages"][0]["content"].append(
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}), 400,
     "image 2: the data: URL's base64 payload is malformed"),
    (lambda b, f: b.update(fps=0), 400, "fps must be > 0"),
])
def test_refusals_name_the_problem(parse, change, status, message):
    frames = _frames(2)
    body = _body([_url(f) for f in frames])
    change(body, frames)
    assert message in _refused(parse, body, status=status).message


def test_frame_count_and_data_limits_in_mib(parse):
    frames = _frames(5)
    urls = [_url(f) for f in frames]
    err = _refused(parse, _body(urls), Limits(max_frames=4))
    assert "frames sent as images (an odd count padded by one) is 6, over the limit of 4 " \
           "(--max-frames)" in err.message
    size = sum(len(u) for u in urls)
    err = _refused(parse, _body(urls), Limits(max_data_bytes=size - 1), status=413)
    assert err.message == (f"the request's 5 data: URL(s) together is {size / 2**20:.2f} MiB, "
                           f"over the limit of {(size - 1) / 2**20:.2f} MiB (--max-data-bytes)")
    # The body outside its data: URLs stays within --max-body-bytes; its data: URLs do not
    # count against it (a body of 3 MiB of frames is taken with the default 1 MiB).
    assert parse(_body(urls), Limits(max_body_bytes=1000), body_bytes=size + 900)
    err = _refused(parse, _body(urls), body_bytes=size + (3 << 20), status=413)
    assert "the request body without its data: URLs is 3.00 MiB, over the limit of 1.00 MiB " \
           "(--max-body-bytes)" in err.message
