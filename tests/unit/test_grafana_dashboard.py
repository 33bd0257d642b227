"""deploy/grafana/apbv.json: valid JSON, a Grafana dashboard whose every query names its metric
as ``${prefix}:name`` (the prefix a variable offering apbv and vllm), and every metric it
queries is in the server's ``/metrics`` output, under either prefix (here the exporter of a
server with two replicas; tests/serve/test_metrics_server.py checks a real server's)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from apbv.serve.front.metrics import Metrics, StreamLoad  # noqa: E402
from apbv.serve.scheduler.admission import Admission  # noqa: E402
from apbv.serve.scheduler.replicas import Replica  # noqa: E402

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "apbv.json"
QUERIED = re.compile(r"\$\{prefix\}:([A-Za-z_][A-Za-z0-9_]*)")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queried(board: dict) -> set[str]:
    """Every metric name (sample name: ``_bucket``, ``_total`` included) the dashboard reads,
    without its prefix."""
    return set(QUERIED.findall(json.dumps(board)))


def exported(text: str) -> set[str]:
    """Every sample name of a Prometheus exposition ``text``."""
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def missing(text: str, prefix: str) -> set[str]:
    """The dashboard's metrics that ``text`` (a ``/metrics`` page) does not export."""
    return {f"{prefix}:{n}" for n in queried(dashboard())} - exported(text)


def test_dashboard_shape():
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert {o["value"] for o in variables["prefix"]["options"]} == {"apbv", "vllm"}
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    assert exprs and all(QUERIED.search(e) for e in exprs), exprs
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    titles = " ".join(p["title"] for p in board["panels"]).lower()
    for view in ("time to first token", "capture to event", "queue", "replicas", "streams",
                 "watches", "kv"):
        assert view in titles, view
    names = queried(board)
    for wanted in ("time_to_first_token_seconds_bucket", "capture_to_event_seconds_bucket",
                   "kv_cache_usage_perc", "num_requests_waiting", "replica_ready",
                   "streams_open", "watches"):
        assert wanted in names, wanted


@pytest.mark.parametrize("prefix", ["apbv", "vllm"])
def test_every_queried_metric_is_exported(prefix):
    metrics = Metrics("tiny", prefix)
    group = SimpleNamespace(pids=[], world_size=1)
    replicas = [Replica(i, group, Admission(2), metrics, lambda _: None) for i in range(2)]
    metrics.count_load(replicas, StreamLoad(open=0, watches=0, budget_bytes=1 << 30,
                                            held=(0, 0)))
    text = generate_latest(metrics.registry).decode()
    assert not missing(text, prefix), f"queried, not exported: {sorted(missing(text, prefix))}"
