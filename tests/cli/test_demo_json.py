"""``apbv demo --json`` writes only JSON to stdout (its report goes to stderr), as
``generate --json`` does; the ranks are replaced by their results here (the demo itself runs
in tests/cli/test_cli.py)."""

from __future__ import annotations

import json

from apbv.cli import demo_pipeline
from apbv.config import load_config


def _result(mode: str, tokens: list[int]) -> dict:
    return {"mode": mode, "answer": "red", "token_ids": tokens, "ttft_s": 0.5,
            "seconds": {"prefill": 0.4, "first_token": 0.1}, "context_len": 100,
            "query_len": 10, "frames": 8, "anchor_len": 2, "passing_len": 1,
            "embedding_bytes": 10, "allgather_bytes": 20}


def test_demo_json_writes_only_json_to_stdout(monkeypatch, capsys):
    results = [_result("spava", [1, 2]), _result("exact", [1, 3])]
    monkeypatch.setattr(demo_pipeline, "_ensure_inputs", lambda cfg, video: video)
    monkeypatch.setattr(demo_pipeline, "spawn_local", lambda *a, **k: [results, results])
    cfg = load_config("tiny_cpu")
    agree = demo_pipeline.run_pipeline_demo(cfg, world_size=2, video="clip.mp4",
                                            question="Which colour?", as_json=True)
    out = capsys.readouterr()
    assert json.loads(out.out) == {"question": "Which colour?", "expected": None,
                                   "results": results, "agree": False}
    assert "agree on the first 1 token(s)" in out.err and "question: 'Which colour?'" in out.err
    assert not agree

    demo_pipeline.run_pipeline_demo(cfg, world_size=2, video="clip.mp4", question="Q?",
                                    as_json=False)
    out = capsys.readouterr()
    assert "question: 'Q?'" in out.out and "{" not in out.out  # the report, no JSON
