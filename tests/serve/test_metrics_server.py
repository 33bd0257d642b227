"""The real server (one start, 1 CPU rank, the tiny model) with ``--metrics-prefix vllm
--log-format json``: vLLM's TTFT histogram under its own name with a 1 ms first bucket, moved
by an ask on a live stream (endpoint ``stream_ask``), with the stream's KV reservation and its
finished reason; every metric the Grafana dashboard queries exported; X-Request-Id echoed (a
client's usable id kept, another replaced) and named in the JSON log line of the request's
job; every Python log line JSON; /v1/models with max_model_len and created."""

from __future__ import annotations

import base64
import io
import json
import re
import time
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("ray")
pytest.importorskip("fastapi")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.serve.server import serving  # noqa: E402
from tests.unit.test_grafana_dashboard import missing  # noqa: E402

KEY = "metrics-key"
OPEN = {"fps": 2.0, "width": 56, "height": 56, "max_pixels": 56 * 56, "window_tokens": 64}
TEXT_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ")
"""The start of a line in the text format (would be a log line that is not JSON)."""


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    started = time.time()
    with serving(tiny_model_dir, "--world-size", "1", "--api-key", KEY, "--metrics-prefix",
                 "vllm", "--log-format", "json", "--set", "parallel.timeout_s=20") as srv:
        srv.wait_ready()
        yield srv, started


def _call(method: str, url: str, rid: str | None = None, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    if rid is not None:
        headers["X-Request-Id"] = rid
    return httpx.request(method, url, timeout=60, headers=headers, **kwargs)


def _samples(base: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(base + "/metrics").text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _png(seed: int) -> str:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (56, 56, 3), generator=g, dtype=torch.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_vllm_ttft_from_1_ms_moved_by_a_stream_ask(server, tiny_model_dir):
    srv, _ = server
    base = srv.base
    ask = {"model_name": tiny_model_dir.name, "endpoint": "stream_ask"}
    ttft = "vllm:time_to_first_token_seconds"
    before = _samples(base)
    bounds = sorted(float(dict(labels)["le"]) for (name, labels) in before
                    if name == ttft + "_bucket" and dict(labels).items() > ask.items())
    assert bounds[0] == 0.001 and bounds[-1] == float("inf"), bounds
    count = (ttft + "_count", frozenset(ask.items()))
    assert before[count] == 0
    opened = _call("POST", base + "/v1/streams", json=OPEN)
    assert opened.status_code == 201, opened.text
    url = f"{base}/v1/streams/{opened.json()['id']}"
    pushed = _call("POST", url + "/frames", json={"frames": [_png(s) for s in range(4)]})
    assert pushed.status_code == 200, pushed.text
    rid = "ask-7f3a:trace=1"
    answer = _call("POST", url + "/ask", rid, json={"question": "What is shown?",
                                                   "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-request-id"] == rid
    after = _samples(base)
    assert after[count] == 1, {k: v for k, v in after.items() if k[0] == count[0]}
    reason = answer.json()["choices"][0]["finish_reason"]
    success = ("vllm:request_success_total",
               frozenset({**ask, "finished_reason": reason}.items()))
    assert after[success] == before[success] + 1, reason
    kv = after[("vllm:kv_cache_usage_perc",
                frozenset({"model_name": ask["model_name"], "engine": "0"}.items()))]
    assert 0 < kv <= 1, kv
    assert after[("vllm:streams_open", frozenset({"model_name": ask["model_name"]}.items()))] == 1
    text = httpx.get(base + "/metrics").text
    assert not missing(text, "vllm"), f"queried, not exported: {sorted(missing(text, 'vllm'))}"
    assert not re.search(r"^apbv[:_]", text, re.M), "a name without the prefix asked for"
    # the ask's job, finished by the replica's worker, is logged under the ask's request id
    deadline = time.monotonic() + 10
    while not any(rid in line and "generate on replica 0" in line for line in srv.log):
        assert time.monotonic() < deadline, srv.tail()
        time.sleep(0.1)
    line = next(json.loads(line) for line in srv.log
                if rid in line and "generate on replica 0" in line)
    assert line["request_id"] == rid and line["logger"] == "apbv.serve", line
    assert _call("DELETE", url).status_code == 200
    seconds = after[(ttft + "_sum", frozenset(ask.items()))]
    print(f"stream ask: TTFT from admission {seconds * 1000:.1f} ms (count 0 -> 1, first "
          f"bucket {bounds[0]} s), finished {reason!r}, the stream's KV {kv:.2e} of the budget")


def test_request_ids_models_and_json_lines(server, tiny_model_dir):
    srv, started = server
    base = srv.base
    kept = _call("GET", base + "/v1/models", "client-id-1")
    assert kept.headers["x-request-id"] == "client-id-1"
    for bad in ("x" * 129, "with space", "quote\"d"):
        made = _call("GET", base + "/v1/models", bad).headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", made), made
    refused = _call("GET", base + "/v1/streams/nope", "r-404")
    assert refused.status_code == 404 and refused.headers["x-request-id"] == "r-404"
    card = kept.json()["data"][0]
    config = json.loads((tiny_model_dir / "config.json").read_text())
    positions = (config.get("text_config") or {}).get("max_position_embeddings") or \
        config["max_position_embeddings"]
    assert card["max_model_len"] == min(positions, 131072 + 1024), card
    assert started - 1 <= card["created"] <= time.time(), (started, card)
    assert card["id"] == card["root"] == tiny_model_dir.name and card["parent"] is None
    records = [json.loads(line) for line in srv.log if line.startswith("{")]
    assert any(r["logger"] == "apbv.serve" and "serving" in r["message"] for r in records)
    assert all({"timestamp", "level", "logger", "message"} <= set(r) for r in records)
    assert not [line for line in srv.log if TEXT_LOG_LINE.match(line)], srv.tail()
