"""``apbv batch``: a line whose body the server would refuse, or whose request fails, is an
error row shaped like the server's error body, and the run goes on; a resume runs no 4xx row
again (its line is refused the same way), only the 5xx ones. Lines that are no request at all
are still refused before the model loads. In-process, with an engine that records its calls
(nothing here reaches a model)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from apbv.cli.batch_lines import envelope, read_requests  # noqa: E402
from apbv.cli.batch_run import run_batch  # noqa: E402

ONE = SimpleNamespace(rank=0, world_size=1, group=None)


def _line(cid: str, body_text: str) -> str:
    return (f'{{"custom_id": "{cid}", "method": "POST", "url": "/v1/chat/completions", '
            f'"body": {body_text}}}')


def _body(tmp: Path, question: str = "What colour?", **fields) -> str:
    (tmp / "clip.mp4").write_bytes(b"x")  # never opened: the lines fail before
    return json.dumps({"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": (tmp / "clip.mp4").as_uri()}},
        {"type": "text", "text": question}]}], "max_tokens": 4, **fields})


@pytest.fixture
def setup(tmp_path: Path):
    from apbv.config import load_config

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = load_config("tiny_cpu", [f"model.path={str(model)!r}"])
    calls: list[str] = []

    def generate(request):
        calls.append(request.question)
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")

    engine = SimpleNamespace(model=SimpleNamespace(processor=None), generate=generate)
    return cfg, engine, calls


def _run(setup, path: Path, out: Path) -> tuple[int, str]:
    cfg, engine, _ = setup
    progress = io.StringIO()
    failed = run_batch(cfg, ONE, engine, read_requests(path), out, (str(path.parent),),
                       progress=progress)
    return failed, progress.getvalue()


def _rows(out: Path) -> dict[str, dict]:
    return {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}


def test_three_bad_lines_are_three_error_rows_and_a_resume_runs_nothing(setup, tmp_path):
    deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([
        _line("surrogate", _body(tmp_path, "\ud800 What colour is the flash?")),
        _line("tiny-temperature", _body(tmp_path, temperature=1e-300)),
        _line("deep", deep)]) + "\n")
    out = tmp_path / "out.jsonl"
    failed, progress = _run(setup, path, out)
    rows = _rows(out)
    assert failed == 3 and len(rows) == 3, progress
    for cid, where in (("surrogate", "messages[0].content[1].text"),
                       ("tiny-temperature", "temperature"), ("deep", "nested deeper than 64")):
        response = rows[cid]["response"]
        error = response["body"]["error"]
        assert response["status_code"] == 400 and error["code"] == 400, rows[cid]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert where in error["message"], error
    assert rows["tiny-temperature"]["response"]["body"]["error"]["param"] == "temperature"
    assert setup[2] == [], "no bad line may reach the engine"
    failed, progress = _run(setup, path, out)
    assert "3 done before, 0 to run" in progress and failed == 3, progress
    assert len(out.read_text().splitlines()) == 3


def test_a_failed_request_is_a_500_row_the_run_goes_on_and_a_resume_retries_it(
        setup, tmp_path, monkeypatch):
    from apbv.openai import chat as api

    monkeypatch.setattr(api, "check_request", lambda *a, **k: {})
    path = tmp_path / "in.jsonl"
    path.write_text(_line("a", _body(tmp_path, "first?")) + "\n" +
                    _line("b", _body(tmp_path, "second?")) + "\n")
    out = tmp_path / "out.jsonl"
    failed, progress = _run(setup, path, out)
    rows = _rows(out)
    assert failed == 2 and setup[2] == ["first?", "second?"], progress
    error = rows["a"]["response"]["body"]["error"]
    assert rows["a"]["response"]["status_code"] == 500 and error["type"] == "server_error"
    assert error["message"].startswith("RuntimeError: probability tensor"), error
    failed, progress = _run(setup, path, out)  # a 5xx may pass next time: run again
    assert "0 done before, 2 to run" in progress and len(setup[2]) == 4, progress


def test_lines_that_are_no_request_are_refused_before_the_run(tmp_path):
    path = tmp_path / "in.jsonl"
    for text, match in (("[" * 100_000, "line 1 is not"), ("[1, 2]", "must be an object"),
                        ('{"custom_id": "\\ud800", "body": {}}', "must be an object"),
                        ('{"custom_id": "a", "body": {}} trailing', "line 1 is not JSON"),
                        ('{"custom_id": "a", "body": 5}', "an object body")):
        path.write_text(text + "\n")
        with pytest.raises(ValueError, match=match):
            read_requests(path)
    path.write_bytes(b'{"custom_id": "a", "body": {"q": "\xff"}}\n')  # not UTF-8: a 400 row
    (item,) = read_requests(path)
    assert item["refused"].status == 400 and "not JSON" in item["refused"].message


def test_the_envelope_is_read_without_descending():
    text = '{"custom_id": "x", "body": {"a": "]}\\"[", "b": [[1]]}, "url": "/v1/chat/completions"}'
    found = envelope(text)
    assert found is not None and found["custom_id"] == "x"
    assert json.loads(found["body"].text) == {"a": ']}"[', "b": [[1]]}
    assert found["url"] == "/v1/chat/completions"
    assert envelope('{"a": [1, 2}') is None and envelope("{}") == {} and envelope('"x"') is None
