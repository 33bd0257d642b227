"""``apbv batch``: an OpenAI batch file answered with one model load, killed with SIGKILL
halfway and resumed, gives exactly the rows of an uninterrupted run; a bad line is refused
before the model loads; changed settings are refused on resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _batch(model: Path, requests: Path, out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.Popen([sys.executable, "-m", "apbv", "batch", "-i", str(requests), "-o",
                             str(out), "--model", str(model), "--nframes", "8", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> str:
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    return err


def _answers(out: Path) -> list[tuple]:
    """What decides each row (no times): custom_id, status, text, tokens, usage."""
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return sorted((r["custom_id"], r["response"]["status_code"], r["id"],
                   json.dumps(r["response"]["body"].get("choices")),
                   r["response"]["body"]["apbv"]["token_ids"],
                   r["response"]["body"]["usage"]) for r in rows)


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory: pytest.TempPathFactory, short_video: Path) -> Path:
    from apbv.synthetic.videos import write_test_video

    root = tmp_path_factory.mktemp("batch")
    shutil.copy(short_video, root / "a.mp4")
    write_test_video(root / "b.mp4", num_frames=24, fps=4.0, width=112, height=112, seed=5)
    lines = []
    for i, (video, extra) in enumerate([("a", {}), ("b", {}), ("a", {"temperature": 1.0}),
                                        ("b", {"choice_set": ["red", "blue"]}),
                                        ("a", {"max_tokens": 3})]):
        body = {"messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": (root / f"{video}.mp4").as_uri()}},
            {"type": "text", "text": f"What is shown? ({i})"}]}], "max_tokens": 4, **extra}
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST",
                                 "url": "/v1/chat/completions", "body": body}))
    path = root / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_killed_and_resumed_gives_the_rows_of_one_run(tiny_model_dir: Path, requests_file: Path,
                                                      tmp_path: Path):
    killed = _batch(tiny_model_dir, requests_file, tmp_path / "resumed.jsonl")
    whole = tmp_path / "whole.jsonl"
    deadline = time.monotonic() + 180
    out = tmp_path / "resumed.jsonl"
    while not out.exists() or len(out.read_text().splitlines()) < 2:
        assert killed.poll() is None, killed.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no rows after 180 s"
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=30)
    before = len(out.read_text().splitlines())
    assert 2 <= before < 5, before
    err = _finish(_batch(tiny_model_dir, requests_file, out))
    assert f"{before} done before, {5 - before} to run" in err, err
    _finish(_batch(tiny_model_dir, requests_file, whole))
    assert _answers(out) == _answers(whole)
    assert [a[1] for a in _answers(whole)] == [200] * 5
    # Other settings on the same output are refused before any request runs.
    refused = _batch(tiny_model_dir, requests_file, whole, "--set", "attention.mode='exact'")
    _, err = refused.communicate(timeout=240)
    assert refused.returncode != 0 and "other settings (attention differ)" in err, err[-2000:]


def test_a_bad_line_is_refused_before_the_model_loads(tmp_path: Path):
    from apbv.cli.batch_run import read_requests

    path = tmp_path / "in.jsonl"
    path.write_text('{"custom_id": "a", "body": {}}\n{"custom_id": "a", "body": {}}\n')
    with pytest.raises(ValueError, match="line 2: custom_id 'a' was given on line 1"):
        read_requests(path)
    path.write_text('{"custom_id": "a", "url": "/v1/embeddings", "body": {}}\n')
    with pytest.raises(ValueError, match="only POST /v1/chat/completions"):
        read_requests(path)
    path.write_text("not json\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        read_requests(path)


def test_a_failed_row_exits_0_and_is_counted_unless_fail_on_error(tiny_model_dir: Path,
                                                                   requests_file: Path,
                                                                   tmp_path: Path):
    """Every row written, one of them failed: exit 0 with the count in the last line;
    ``--fail-on-error`` (here resuming: the 404 row is the request's own answer and stays, so
    nothing runs) exits 1."""
    lines = requests_file.read_text().splitlines()[:1]
    gone = json.loads(lines[0])
    gone["custom_id"] = "gone"
    gone["body"]["messages"][0]["content"][0]["video_url"]["url"] = \
        (requests_file.parent / "gone.mp4").as_uri()
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join([*lines, json.dumps(gone)]) + "\n")
    out = tmp_path / "out.jsonl"
    err = _finish(_batch(tiny_model_dir, requests, out, "--media-root",
                         str(requests_file.parent)))
    assert err.strip().splitlines()[-1] == f"batch: done: 2 rows in {out}, 1 failed", err[-2000:]
    codes = {r["custom_id"]: r["response"]["status_code"]
             for r in map(json.loads, out.read_text().splitlines())}
    assert codes == {"req-0": 200, "gone": 404}, codes
    strict = _batch(tiny_model_dir, requests, out, "--media-root", str(requests_file.parent),
                    "--fail-on-error")
    _, err = strict.communicate(timeout=240)
    assert strict.returncode == 1, err[-3000:]
    assert "2 done before, 0 to run" in err and err.strip().endswith("1 failed"), err[-2000:]
