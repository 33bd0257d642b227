"""The server's metrics without a server: vLLM's bucket lists kept (finer bounds only added
below them), the prefix rule, which endpoint and finished reason a replica job counts under,
one job's times and tokens observed from its own clock readings, the scrape-time gauges (KV
reserved against the stream budget, streams, watches) and count of held pushes, and every
name under one prefix."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from apbv.serve.front.metric_rules import (  # noqa: E402
    ITL_BUCKETS,
    REQUEST_BUCKETS,
    TTFT_BUCKETS,
    check_prefix,
    endpoint_of,
    finished_reason,
    one_two_five,
)
from apbv.serve.front.metrics import Metrics, StreamLoad  # noqa: E402
from apbv.serve.ranks.ops import Append, Generate  # noqa: E402

VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
             7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0]


def _bounds(text: str, name: str) -> list[float]:
    """The ``le`` bounds of histogram ``name``'s first series in exposition ``text``."""
    for family in text_string_to_metric_families(text):
        if family.name == name:
            first = family.samples[0].labels
            same = [s for s in family.samples if s.name == name + "_bucket" and
                    {k: v for k, v in s.labels.items() if k != "le"} ==
                    {k: v for k, v in first.items() if k != "le"}]
            return [float(s.labels["le"]) for s in same if s.labels["le"] != "+Inf"]
    raise AssertionError(f"{name} not exported")


def test_vllm_bounds_kept_finer_ones_only_below():
    assert list(TTFT_BUCKETS) == VLLM_TTFT
    for ours, vllm in ((REQUEST_BUCKETS, VLLM_REQUEST), (ITL_BUCKETS, VLLM_ITL)):
        assert list(ours[-len(vllm):]) == vllm, ours
        assert all(b < vllm[0] for b in ours[:-len(vllm)]), ours
        assert list(ours) == sorted(set(ours)), ours
    text = generate_latest(Metrics("m", "vllm").registry).decode()
    assert _bounds(text, "vllm:time_to_first_token_seconds") == VLLM_TTFT
    assert _bounds(text, "vllm:e2e_request_latency_seconds")[0] == 0.001
    assert _bounds(text, "vllm:capture_to_event_seconds")[0] == 0.001


def test_one_two_five():
    assert one_two_five(100) == (1, 2, 5, 10, 20, 50, 100)
    assert one_two_five(131072)[-3:] == (50000, 100000, 131072)
    assert one_two_five(1) == (1,)
    with pytest.raises(ValueError, match=">= 1, got 0"):
        one_two_five(0)


@pytest.mark.parametrize("bad", ["", "vllm:", "1abc", "a-b", "a" * 33, "a b"])
def test_prefix_rule(bad):
    with pytest.raises(ValueError, match=r"--metrics-prefix must be 1 to 32 letters"):
        check_prefix(bad)
    with pytest.raises(ValueError, match="--metrics-prefix"):
        Metrics("m", bad)
    assert check_prefix("vllm") == "vllm" and check_prefix("_a1") == "_a1"


def _job(call=None, op=None, evaluates=None, *, queued=0.5, ttft=0.25, gaps=(0.01, 0.02)):
    """A finished job whose clock readings are ``queued`` s in the queue, its first token
    ``ttft`` s after its start, then tokens ``gaps`` apart."""
    now = time.monotonic()
    enqueued = now - queued - ttft - sum(gaps) - 1e-3
    started = enqueued + queued
    times = [started + ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return SimpleNamespace(call=call, op=op if op is not None else Generate(None),  # type: ignore[arg-type]
                           evaluates=evaluates, enqueued=enqueued, started=started,
                           token_times=times if gaps else [])


def _result(reason="stop", tokens=3, ttft=0.25, hit=False):
    return SimpleNamespace(ttft_s=ttft, context_len=100, query_len=7, token_ids=[1] * tokens,
                           finish_reason=reason, vision_cache_hit=hit)


def test_endpoint_and_finished_reason():
    assert endpoint_of(_job(call=object())) == "chat"
    assert endpoint_of(_job()) == "stream_ask"
    assert endpoint_of(_job(evaluates=12.0)) == "watch"
    assert endpoint_of(_job(op=Append("s", None, None))) is None  # type: ignore[arg-type]
    assert finished_reason("ok", _result("stop")) == "stop"
    assert finished_reason("ok", _result("length")) == "length"
    assert finished_reason("cancelled", _result("cancelled")) == "abort"
    assert finished_reason("disconnected", None) == "abort"
    assert finished_reason("cancelled", None) == "abort"
    for failed in ("rank_lost", "error", "deadline_missed", "refused_410", "rejected"):
        assert finished_reason(failed, None) == "error"


def _value(m: Metrics, name: str, **labels) -> float:
    value = m.registry.get_sample_value(name, labels)
    assert value is not None, f"no sample {name}{labels}"
    return value


def test_a_job_observed_from_its_own_clock():
    m = Metrics("tiny", "vllm", vision_cache=True, max_model_len=1000)
    chat = dict(model_name="tiny", endpoint="chat")
    m.finished(_job(call=object()), "ok", _result(hit=True))
    assert _value(m, "vllm:request_success_total", **chat, finished_reason="stop") == 1
    # queue 0.5 s, TTFT from admission 0.75 s: buckets count them where they fall
    assert _value(m, "vllm:request_queue_time_seconds_bucket", **chat, le="0.5") == 1
    assert _value(m, "vllm:time_to_first_token_seconds_bucket", **chat, le="0.5") == 0
    assert _value(m, "vllm:time_to_first_token_seconds_bucket", **chat, le="0.75") == 1
    ttft = _value(m, "vllm:time_to_first_token_seconds_sum", **chat)
    assert abs(ttft - 0.75) < 0.01, f"TTFT observed {ttft:.4f} s, the job's clock says 0.75 s"
    itl = _value(m, "vllm:inter_token_latency_seconds_sum", **chat)
    assert abs(itl - 0.03) < 1e-9 and \
        _value(m, "vllm:inter_token_latency_seconds_count", **chat) == 2, itl
    assert _value(m, "vllm:prompt_tokens_total", **chat) == 107
    assert _value(m, "vllm:generation_tokens_total", **chat) == 3
    assert _value(m, "vllm:request_prompt_tokens_bucket", **chat, le="100.0") == 0
    assert _value(m, "vllm:request_prompt_tokens_bucket", **chat, le="200.0") == 1
    assert _value(m, "vllm:mm_cache_queries_total", model_name="tiny") == 1
    assert _value(m, "vllm:mm_cache_hits_total", model_name="tiny") == 1
    # a stream ask (no token times kept: its first token is start + TTFT) and a watch
    m.finished(_job(gaps=()), "stream", _result(tokens=1))
    m.finished(_job(evaluates=3.0, gaps=()), "stream", _result(tokens=0))
    for endpoint in ("stream_ask", "watch"):
        assert _value(m, "vllm:time_to_first_token_seconds_count", model_name="tiny",
                      endpoint=endpoint) == 1
        assert _value(m, "vllm:request_success_total", model_name="tiny", endpoint=endpoint,
                      finished_reason="stop") == 1
    assert _value(m, "vllm:mm_cache_queries_total", model_name="tiny") == 1  # chat only
    # a client gone while queued, a rank lost, a stream's append (not a request)
    m.finished(_job(call=object()), "disconnected")
    m.finished(_job(), "rank_lost")
    m.finished(_job(op=Append("s", None, None)), "stream", None)  # type: ignore[arg-type]
    assert _value(m, "vllm:request_success_total", **chat, finished_reason="abort") == 1
    assert _value(m, "vllm:request_success_total", model_name="tiny", endpoint="stream_ask",
                  finished_reason="error") == 1
    assert _value(m, "vllm:requests_total", outcome="stream") == 3
    assert _value(m, "vllm:time_to_first_token_seconds_count", **chat) == 1


class _Queue:
    """A replica's admission as the gauges read it: its running job and its length."""

    def __init__(self, running: object, waiting: int):
        self.running, self.waiting = running, waiting

    def __len__(self) -> int:
        return self.waiting


def test_scrape_gauges_and_one_naming_style():
    m = Metrics("tiny", "vllm")
    replicas = [SimpleNamespace(index=0, admission=_Queue(object(), 2)),
                SimpleNamespace(index=1, admission=_Queue(None, 0))]
    streams = StreamLoad(open=2, watches=3, budget_bytes=4 << 20, held=(3 << 20, 0))
    m.count_load(replicas, streams)  # type: ignore[arg-type]
    assert _value(m, "vllm:kv_cache_usage_perc", model_name="tiny", engine="0") == 0.75
    assert _value(m, "vllm:kv_cache_usage_perc", model_name="tiny", engine="1") == 0
    assert _value(m, "vllm:num_requests_running", model_name="tiny") == 1
    assert _value(m, "vllm:num_requests_waiting", model_name="tiny") == 2
    assert _value(m, "vllm:streams_open", model_name="tiny") == 2
    assert _value(m, "vllm:watches", model_name="tiny") == 3
    for held in (5, 7):  # the registry's running count, counted at each scrape
        m.count_load(replicas, dataclasses.replace(streams, pushes_held=held))  # type: ignore
    assert _value(m, "vllm:stream_pushes_held_total", model_name="tiny") == 7
    m.count_load(replicas)  # type: ignore[arg-type]  # streams not served
    assert _value(m, "vllm:kv_cache_usage_perc", model_name="tiny", engine="0") == 0
    names = [f.name for f in text_string_to_metric_families(generate_latest(m.registry).decode())]
    assert names and all(n.startswith("vllm:") and ":" not in n[5:] for n in names), names


def test_every_metric_is_documented():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    m = Metrics("m", "apbv")
    names = {f.name.removeprefix("apbv:") + ("_total" if f.type == "counter" else "")
             for f in m.registry.collect()}
    assert len(names) >= 30, names
    undocumented = sorted(n for n in names if f"| `{n}` |" not in doc)
    assert not undocumented, f"not in docs/metrics.md's tables: {undocumented}"
