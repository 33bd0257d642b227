"""The real server (2 CPU rank actors, the trained tiny model with docs/serving.md's flags,
no cache flag) driven as a vLLM user would, with the official openai client: docs/serving.md's
needle video answered right, seeded sampling (identical twice, every rank agreeing),
logprobs, stream_options.include_usage, vLLM's mm_processor_kwargs and structured_outputs, a
data: URL, an unknown field answered and reported; a video sent as frames (lmms-eval's request:
text and 8 data:image/png parts) answered by the server and by ``apbv batch``, token for token
as the engine answers the same frames in exact mode; the vision cache on by default; vLLM's
metric names with model_name, /version, /docs, /openapi.json; a streaming client that leaves
early logs no error."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from tests.serve.server import serving  # noqa: E402

KEY = "vllm-key"
MODEL = "needle-tiny"
QUESTION = "What colour is the flash?"
NEEDLE_TINY = Path(__file__).resolve().parents[3] / "apbv" / "assets" / "needle-tiny"


@pytest.fixture(scope="module")
def server(short_video: Path, tmp_path_factory: pytest.TempPathFactory):
    """(base URL, the server process, the media directory), started as docs/serving.md's serving
    section starts it (the trained tiny model, 56x56 frames), without --vision-cache-gb."""
    from apbv.synthetic.needle_video import write_needle_video

    media = tmp_path_factory.mktemp("vllm-media")
    shutil.copy(short_video, media / "clip.mp4")
    write_needle_video(media / "needle.mp4", "magenta")
    with serving(NEEDLE_TINY, "--min-pixels", "3136", "--max-pixels", "3136", "--world-size",
                 "2", "--media-root", str(media), "--api-key", KEY, "--max-frames", "96",
                 "--set", "parallel.timeout_s=20") as srv:
        srv.wait_ready()
        yield srv.base, srv, media


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


def _ask(base: str, url: str, **kwargs):
    return _client(base).chat.completions.create(model=MODEL, messages=_messages(url),
                                                 **kwargs)


def test_the_readme_needle_video_is_answered_right(server):
    base, _, media = server
    out = _ask(base, (media / "needle.mp4").as_uri(), max_tokens=8)
    assert out.choices[0].message.content == "magenta", out


def test_requests_as_vllm_takes_them(server):
    base, srv, media = server
    url = (media / "clip.mp4").as_uri()
    plain = _ask(base, url, max_tokens=6, extra_body={"nframes": 8})
    again = _ask(base, url, max_tokens=6, extra_body={"nframes": 8})
    # No cache flag: the vision cache is on, and its default size was printed at start-up.
    assert not plain.model_extra["apbv"]["vision_cache_hit"]
    assert again.model_extra["apbv"]["vision_cache_hit"] is True
    assert again.model_extra["apbv"]["token_ids"] == plain.model_extra["apbv"]["token_ids"]
    assert any("GiB per rank by default" in line for line in srv.log), srv.tail()

    # Seeded sampling on 2 ranks: the same seed twice gives the same tokens (a rank that drew
    # another token would have failed the request), another seed other tokens.
    def sampled(seed: int) -> list[int]:
        out = _ask(base, url, max_tokens=12, temperature=2.0, seed=seed,
                   extra_body={"nframes": 8})
        return out.model_extra["apbv"]["token_ids"]
    first = sampled(5)
    assert sampled(5) == first
    assert any(sampled(seed) != first for seed in (6, 7)), first

    # logprobs in OpenAI's shape: one entry per token, greedy picks the likeliest.
    out = _ask(base, url, max_tokens=4, logprobs=True, top_logprobs=2,
               extra_body={"nframes": 8})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob

    # vLLM's spellings: mm_processor_kwargs as our fps, structured_outputs as choice_set.
    fps = _ask(base, url, max_tokens=2, extra_body={"mm_processor_kwargs": {"fps": 1}})
    assert fps.model_extra["apbv"]["frames"] == 6  # 6 s at 1 fps
    picked = _ask(base, url, extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert picked.choices[0].message.content in ("red", "blue")
    assert [c["text"] for c in picked.model_extra["apbv"]["choices"]] == ["red", "blue"]

    # A data: URL answers as the file it holds; an unknown field is answered and reported.
    data = base64.b64encode((media / "clip.mp4").read_bytes()).decode()
    inline = "data:video/mp4;base64," + data
    raw = _client(base).chat.completions.with_raw_response.create(
        model=MODEL, messages=_messages(inline), max_tokens=6,
        extra_body={"nframes": 8, "priority_hint": 3})
    assert raw.headers["x-ignored-fields"] == '["priority_hint"]'
    answer = raw.parse()
    assert answer.model_extra["apbv"]["token_ids"] == plain.model_extra["apbv"]["token_ids"]
    assert answer.model_extra["apbv"]["ignored_fields"] == ["priority_hint"]
    assert any("ignored the request field(s) ['priority_hint']" in line for line in srv.log)

    # OpenAI's error shape, with the field at fault.
    with pytest.raises(openai.BadRequestError) as info:
        _ask(base, url, n=9)
    assert info.value.body["param"] == "n" and "over the limit of 8" in info.value.message


def _png(frame) -> str:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(frame.permute(1, 2, 0).numpy()).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def test_frames_as_images_as_lmms_eval_sends_them(server, tmp_path: Path):
    """lmms-eval's openai_compatible body (model, one user message: a text part then one
    data:image/png part per frame, max_tokens, temperature 0), with apbv's ``mode: exact``:
    the server (2 ranks) and ``apbv batch`` (1 rank, the same body reader) give the tokens the
    engine gives on the same 8 frames as a DecodedVideo; one image is a one-frame video."""
    import torch

    from apbv.cli.batch_run import read_requests, run_batch
    from apbv.config import load_config
    from apbv.distributed import DistInfo
    from apbv.engine.engine import Engine
    from apbv.engine.request import Request
    from apbv.synthetic.needle_video import needle_sample_of
    from apbv.video import DecodedVideo

    base, _, media = server
    frames = needle_sample_of("magenta", 8.0).frames[4:12].contiguous()  # the flash inside
    images = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_png(f)}"}}
              for f in frames]
    body = {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": QUESTION}, *images]}], "max_tokens": 8, "temperature": 0,
        "mode": "exact"}
    served = httpx.post(base + "/v1/chat/completions", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {KEY}"})
    assert served.status_code == 200, served.text
    served_ids = served.json()["apbv"]["token_ids"]
    assert served.json()["apbv"]["frames"] == 8

    cfg = load_config("tiny_cpu", [f"model.path={str(NEEDLE_TINY)!r}", "video.min_pixels=3136",
                                   "video.max_pixels=3136"])
    engine = Engine(cfg, DistInfo(0, 1, 0, torch.device("cpu"), None))
    reference = engine.generate(Request(video=DecodedVideo(frames, 2.0), question=QUESTION,
                                        mode="exact", max_new_tokens=8))
    assert reference.answer == "magenta", reference.answer
    assert served_ids == reference.token_ids, (served.json()["choices"], reference.answer)

    lines = tmp_path / "requests.jsonl"
    lines.write_text(json.dumps({"custom_id": "lmms-eval", "method": "POST",
                                 "url": "/v1/chat/completions", "body": body}) + "\n")
    failed = run_batch(cfg, DistInfo(0, 1, 0, torch.device("cpu"), None), engine,
                       read_requests(lines), tmp_path / "out.jsonl", (str(media),),
                       progress=io.StringIO())
    row = json.loads((tmp_path / "out.jsonl").read_text())
    assert failed == 0, row
    assert row["response"]["body"]["apbv"]["token_ids"] == reference.token_ids, row

    # One image: one temporal patch (the frame twice), which 2 ranks cannot split among them
    # (a 400 saying so before any work) but a mode in which each rank encodes every frame
    # answers.
    single = dict(body, messages=[{"role": "user", "content": [
        {"type": "text", "text": QUESTION}, images[6]]}], mode="spava")
    split = httpx.post(base + "/v1/chat/completions", json=single, timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"})
    assert split.status_code == 400 and "send at least 4" in split.text, split.text
    one = httpx.post(base + "/v1/chat/completions", json=dict(single, mode="no_vit_split"),
                     timeout=60, headers={"Authorization": f"Bearer {KEY}"})
    assert one.status_code == 200 and one.json()["apbv"]["frames"] == 2, one.text


def test_usage_chunk_only_when_asked(server):
    base, _, media = server
    url = (media / "clip.mp4").as_uri()
    chunks = list(_ask(base, url, max_tokens=3, stream=True, extra_body={"nframes": 8},
                       stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(_ask(base, url, max_tokens=3, stream=True, extra_body={"nframes": 8}))
    assert all(c.usage is None and c.choices for c in plain)
    assert "".join(c.choices[0].delta.content or "" for c in plain) == \
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_client_leaving_a_stream_logs_no_error(server):
    base, srv, media = server
    url = (media / "clip.mp4").as_uri()
    stream = _ask(base, url, max_tokens=400, stream=True, temperature=1.0, seed=3,
                  extra_body={"nframes": 8})
    events = iter(stream)
    cid = next(events).id
    next(events)  # the first token's text: the client leaves while the answer decodes
    stream.close()
    deadline = time.monotonic() + 60
    while not any(f"{cid} on replica" in line for line in srv.log):
        assert time.monotonic() < deadline, "the request never ended:\n" + srv.tail()
        time.sleep(0.2)
    time.sleep(0.5)  # an unretrieved task's error would be logged when it is collected
    errors = [line for line in srv.log if " ERROR " in line or "Traceback" in line
              or "never retrieved" in line]
    assert not errors, "".join(errors)


def test_metrics_and_endpoints(server):
    base = server[0]
    text = httpx.get(base + "/metrics").text  # open: no API key
    label = f'model_name="{MODEL}"'
    for name in ("apbv:time_to_first_token_seconds_count",
                 "apbv:e2e_request_latency_seconds_count",
                 "apbv:request_queue_time_seconds_count",
                 "apbv:inter_token_latency_seconds_count", "apbv:prompt_tokens_total",
                 "apbv:generation_tokens_total"):
        chat = f'endpoint="chat",{label}'  # the per-request ones: a chat request's
        match = re.search(rf"^{re.escape(name)}{{{re.escape(chat)}}} ([0-9.e+]+)$", text, re.M)
        assert match and float(match.group(1)) > 0, name
    assert re.search(rf"^apbv:num_requests_waiting{{{re.escape(label)}}} 0.0$", text, re.M)
    assert "apbv:stage_seconds_count" in text
    assert httpx.get(base + "/version").json()["version"]
    docs = httpx.get(base + "/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    schema = httpx.get(base + "/openapi.json").json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    fields = body["content"]["application/json"]["schema"]["properties"]
    assert {"messages", "seed", "logprobs", "choice_set", "mm_processor_kwargs"} <= set(fields)
