"""Requests as vLLM and OpenAI clients send them, without a server: unknown fields accepted and
reported, sampling and logprobs settings, vLLM's aliases, the closed-vocabulary field's name,
``n``, ``stream_options``, ``data:`` videos, OpenAI's error ``param``; seeded sampling itself
(:class:`apbv.engine.sampling.Sampling`) and the incremental detokenizer of streamed text."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")

from apbv.engine.sampling import GREEDY, Sampling  # noqa: E402
from apbv.openai.policy import ClientError, Limits, MediaPolicy  # noqa: E402

ASSET = Path(__file__).resolve().parents[3] / "apbv" / "assets" / "needle-tiny"


def _refused(fn, *args, status: int = 400, **kwargs) -> ClientError:
    with pytest.raises(ClientError) as info:
        fn(*args, **kwargs)
    assert info.value.status == status, info.value.message
    return info.value


@pytest.fixture
def chat(tmp_path: Path):
    from apbv.config import load_config
    from apbv.openai.chat import parse_chat
    from apbv.openai.download import MediaStore

    (tmp_path / "clip.mp4").write_bytes(b"x")  # parse_chat does not open it
    url = (tmp_path / "clip.mp4").as_uri()
    store = tmp_path / "store"
    store.mkdir()
    cfg = load_config("tiny_cpu")
    policy = MediaPolicy((str(tmp_path),), store=MediaStore(str(store), 1 << 20),
                         max_download_bytes=4096)

    def parse(video_url: object = url, **fields):
        messages = [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": video_url}},
            {"type": "text", "text": "what?"}]}]
        return parse_chat({"messages": messages, **fields}, cfg, Limits(), policy, "m")
    parse.store = store
    return parse


def test_unknown_fields_are_answered_and_reported_not_acted_on(chat):
    call = chat(user="u", foo=1, max_tokens=3,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
                mm_processor_kwargs={"fps": 1, "min_pixels": 4})
    assert call.ignored == ("foo", "user",
                            "stream_options.continuous_usage_stats",
                            "mm_processor_kwargs.min_pixels")
    assert call.include_usage is True and call.request.max_new_tokens == 3
    assert chat().ignored == () and chat().include_usage is False


def test_sampling_fields_make_the_request_sampling(chat):
    assert chat().request.sampling == GREEDY
    sampled = chat(temperature=0.7, top_p=0.9, top_k=5, seed=11).request.sampling
    assert sampled == Sampling(0.7, 0.9, 5, 11)
    unseeded = chat(temperature=0.7).request.sampling  # a fresh seed, in range
    assert 0 <= unseeded.seed < 2**63 and not unseeded.greedy
    assert chat(logprobs=True, top_logprobs=3).request.sampling.logprobs == 3
    assert chat(logprobs=True).request.sampling.logprobs == 0
    assert chat(logprobs=False).request.sampling.logprobs is None


@pytest.mark.parametrize("fields, param, text", [
    ({"n": 9}, "n", "n=9 is over the limit of 8 answers"),
    ({"n": 2, "stream": True}, "n", "n=2 is not streamed"),
    ({"n": 2, "choice_set": ["a", "b"]}, None, "n > 1 does not go with choices"),
    ({"temperature": 2.5}, "temperature", "temperature must be a number in 0 .. 2"),
    ({"top_p": 0}, "top_p", "top_p must be"),
    ({"top_k": -2}, "top_k", "top_k must be"),
    ({"seed": -1}, "seed", "seed must be an integer >= 0"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be"),
    ({"mm_processor_kwargs": {"fps": "2"}}, "mm_processor_kwargs.fps", "fps must be"),
    ({"fps": 1, "mm_processor_kwargs": {"fps": 2}}, "mm_processor_kwargs.fps", "differ"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "cannot be followed"),
    ({"choice_set": ["a", "b"], "guided_choice": ["a", "c"]}, "guided_choice", "differ"),
    ({"guided_choice": "a"}, "guided_choice", "non-empty list of strings"),
])
def test_refusals_name_the_field_as_openai_param(chat, fields: dict, param: str, text: str):
    error = _refused(chat, **fields)
    assert error.param == param and text in error.message, (error.param, error.message)


def test_error_body_has_openai_param():
    from apbv.openai.policy import error_body

    assert error_body(400, "bad", "n")["error"] == {"message": "bad", "type": "invalid_request",
                                                    "param": "n", "code": 400}
    assert error_body(503, "busy")["error"]["param"] is None


def test_vllm_spellings_are_aliases(chat):
    for spelling in ({"choice_set": ["yes", "no"]}, {"choices": ["yes", "no"]},
                     {"guided_choice": ["yes", "no"]},
                     {"structured_outputs": {"choice": ["yes", "no"]}}):
        assert chat(**spelling).request.choices == ("yes", "no"), spelling
    video = chat(mm_processor_kwargs={"fps": 1, "max_pixels": 3136}).request.video
    assert (video.fps, video.max_pixels) == (1, 3136)
    assert chat(media_io_kwargs={"video": {"num_frames": 8}}).request.video.nframes == 8
    assert chat(nframes=8, mm_processor_kwargs={"nframes": 8}).request.video.nframes == 8


def test_data_urls_are_stored_like_downloads(chat):
    payload = b"not really a video, but bytes"
    url = "data:video/mp4;base64," + base64.b64encode(payload).decode()
    call = chat(url)
    stored = Path(call.request.video.path)
    assert stored.parent == chat.store and stored.suffix == ".mp4"
    assert stored.read_bytes() == payload and call.downloaded is not None
    assert call.request.video.follow_symlinks is True  # the server's own directory
    assert "data:<type>;base64" in _refused(chat, "data:text/plain;base64,AAAA").message
    assert "malformed" in _refused(chat, "data:video/mp4;base64,!!!").message
    big = "data:video/mp4;base64," + base64.b64encode(b"x" * 5000).decode()
    assert "--max-download-mb" in _refused(chat, big, status=413).message


def test_seeded_sampling_is_a_function_of_seed_and_step():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    s = Sampling(temperature=1.0, seed=7)
    draws = [int(s.pick(logits, step)) for step in range(40)]
    assert draws == [int(Sampling(temperature=1.0, seed=7).pick(logits, k)) for k in range(40)]
    assert draws != [int(Sampling(temperature=1.0, seed=8).pick(logits, k)) for k in range(40)]
    assert len(set(draws)) > 3  # it samples
    best = int(torch.argmax(logits))
    assert int(GREEDY.pick(logits, 3)) == best
    assert {int(Sampling(1.0, top_k=1, seed=k).pick(logits, 0)) for k in range(20)} == {best}
    assert {int(Sampling(1.0, top_p=1e-6, seed=k).pick(logits, 0)) for k in range(20)} == {best}
    top3 = set(torch.topk(logits, 3).indices.tolist())
    assert {int(Sampling(1.0, top_k=3, seed=k).pick(logits, 0)) for k in range(60)} <= top3


def test_record_is_the_log_softmax_and_its_top():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    out = Sampling(logprobs=2).record(logits, 2)
    logp = torch.log_softmax(logits, dim=0)
    assert out["id"] == 2 and out["logprob"] == pytest.approx(float(logp[2]))
    assert [i for i, _ in out["top"]] == [1, 2]
    assert out["top"][0][1] == pytest.approx(float(logp[1]))


def test_openai_logprobs_shape():
    from types import SimpleNamespace

    from apbv.openai.responses import logprobs

    class Tok:
        def decode(self, ids):
            return "".join(chr(ord("a") + i) for i in ids)

    result = SimpleNamespace(logprobs=[{"id": 1, "logprob": -0.5, "top": [[1, -0.5], [0, -1]]}])
    assert logprobs(result.logprobs, Tok()) == {"content": [{
        "token": "b", "logprob": -0.5, "bytes": [98],
        "top_logprobs": [{"token": "b", "logprob": -0.5, "bytes": [98]},
                         {"token": "a", "logprob": -1, "bytes": [97]}]}]}
    assert logprobs(None, Tok()) is None


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ASSET), local_files_only=True)


TEXT = "A magenta square, then 日本語 and émigré: done. STOP here, and more after."


@pytest.mark.parametrize("fast", [True, False])
def test_incremental_text_equals_the_whole_decode(tokenizer, fast: bool):
    from apbv.openai import detok

    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    text = detok.IncrementalText(tokenizer)
    if not fast:  # the tail decoder, for tokenizers without a DecodeStream
        text.decoder = detok._TailDecoder(tokenizer)
    pieces = [text.add(i) for i in ids]
    joined = "".join(pieces) + text.pending
    assert joined == tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    cut = detok.IncrementalText(tokenizer, ("STOP",))
    if not fast:
        cut.decoder = detok._TailDecoder(tokenizer)
    assert "".join(cut.add(i) for i in ids) == TEXT[:TEXT.index("STOP")]
    assert cut.stopped


def test_a_client_leaving_mid_answer_leaves_no_task_pending(tokenizer):
    """The SSE writer's token reader closed while it waits for the next token (the client
    left): its waiting task is cancelled, so asyncio has nothing to log as destroyed while
    pending; tokens that came before the outcome are still read when the answer ends."""
    import asyncio
    from types import SimpleNamespace

    from apbv.serve.front.sse import deltas as read_deltas

    ids = tokenizer.encode("magenta", add_special_tokens=False)

    async def leave_early() -> list:
        job = SimpleNamespace(tokens=asyncio.Queue())
        waiter = asyncio.get_running_loop().create_future()
        deltas = read_deltas(job, waiter, tokenizer, ())
        job.tokens.put_nowait(ids[0])
        first = await deltas.__anext__()
        reading = asyncio.ensure_future(deltas.__anext__())
        for _ in range(3):  # the reader now waits for the next token
            await asyncio.sleep(0)
        reading.cancel()  # the client left: the server cancels what streams its answer
        with pytest.raises(asyncio.CancelledError):
            await reading
        await deltas.aclose()
        for _ in range(3):
            await asyncio.sleep(0)
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        waiter.cancel()
        return [first, pending]

    first, pending = asyncio.run(leave_early())
    assert first == tokenizer.decode(ids[:1]) and pending == []

    async def answer_ends() -> str:
        job = SimpleNamespace(tokens=asyncio.Queue())
        waiter = asyncio.get_running_loop().create_future()
        for token in ids:
            job.tokens.put_nowait(token)
        waiter.set_result(None)
        return "".join([piece async for piece in read_deltas(job, waiter, tokenizer, ())])

    assert asyncio.run(answer_ends()) == "magenta"
