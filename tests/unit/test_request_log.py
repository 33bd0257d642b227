"""X-Request-Id (a client's usable id echoed, any other replaced by a new one, the id seen by
the handler and its log lines), the log's text and JSON formats, and what /v1/models says of
the model (max_model_len, created), without a server."""

from __future__ import annotations

import io
import json
import logging
import re

import pytest

from apbv.openai import request_id
from apbv.openai.policy import Limits
from apbv.serve import log_format
from apbv.serve.model_card import checkpoint_positions, max_model_len, model_card

NEW_ID = re.compile(r"[0-9a-f]{32}\Z")


@pytest.fixture()
def client():
    """An app with the middleware whose route logs a line and answers the id it saw; its
    second route fails after logging."""
    fastapi = pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    app = fastapi.FastAPI()
    app.add_middleware(request_id.RequestIdMiddleware)
    log = logging.getLogger("apbv.test.request_id")

    @app.get("/seen")
    async def seen() -> dict:
        log.warning("handling")
        return {"id": request_id.current()}

    @app.get("/refused")
    async def refused() -> None:
        raise fastapi.HTTPException(400, "no")

    return TestClient(app)


@pytest.fixture()
def captured():
    """What the logger of :func:`client` writes through a JSON handler."""
    out = io.StringIO()
    handler = log_format.handler("json")
    handler.setStream(out)  # type: ignore[attr-defined]
    logger = logging.getLogger("apbv.test.request_id")
    logger.addHandler(handler)
    yield out
    logger.removeHandler(handler)


def test_a_usable_id_is_echoed_and_logged(client, captured):
    given = "trace-1.2:abc=/+@_X"
    response = client.get("/seen", headers={"X-Request-Id": given})
    assert response.headers["x-request-id"] == given and response.json()["id"] == given
    line = json.loads(captured.getvalue().splitlines()[-1])
    assert line["request_id"] == given and line["message"] == "handling"
    assert request_id.current() is None  # reset once the request is answered
    refused = client.get("/refused", headers={"X-Request-Id": "r1"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "r1"


@pytest.mark.parametrize("bad", ["a" * (request_id.MAX_LENGTH + 1), "two words", 'q"uote',
                                 "semi;colon", "<tag>", "", "ünï"])
def test_any_other_id_is_replaced(client, bad):
    response = client.get("/seen", headers={"X-Request-Id": bad.encode()})
    made = response.headers["x-request-id"]
    assert NEW_ID.match(made) and made != bad and response.json()["id"] == made
    assert request_id.accepted("a" * request_id.MAX_LENGTH) is not None


def test_without_a_header_each_request_gets_its_own(client):
    ids = {client.get("/seen").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3 and all(NEW_ID.match(i) for i in ids), ids


def _record(message: str, **extra) -> logging.LogRecord:
    record = logging.LogRecord("apbv.serve", logging.INFO, __file__, 1, message, (), None)
    record.__dict__.update(extra)
    return record


def test_json_lines():
    handler = log_format.handler("json")
    out = io.StringIO()
    handler.setStream(out)  # type: ignore[attr-defined]
    handler.handle(_record("two\nlines", request_id="r-9"))
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import sys

        failed = _record("failed")
        failed.exc_info = sys.exc_info()
        handler.handle(failed)
    handler.handle(_record("no request"))
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines  # one object per record, newlines escaped
    first, second, third = (json.loads(line) for line in lines)
    assert first["message"] == "two\nlines" and first["request_id"] == "r-9"
    assert first["level"] == "INFO" and first["logger"] == "apbv.serve"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["timestamp"]), first
    assert isinstance(first["process"], int)
    assert "RuntimeError: boom" in second["exception"]
    assert "request_id" not in third


def test_text_lines_name_the_request_after_the_level():
    handler = log_format.handler("text")
    out = io.StringIO()
    handler.setStream(out)  # type: ignore[attr-defined]
    handler.handle(_record("chatcmpl-1 on replica 0: ok", request_id="r-9"))
    handler.handle(_record("replica 0 ready"))
    tagged, plain = out.getvalue().splitlines()
    assert tagged.endswith(" INFO [request_id=r-9] apbv.serve: chatcmpl-1 on replica 0: ok")
    assert plain.endswith("INFO apbv.serve: replica 0 ready")
    with pytest.raises(ValueError, match="--log-format must be one of text, json, got 'xml'"):
        log_format.handler("xml")


def test_model_card(tmp_path):
    limits = Limits(max_prompt_tokens=1000, max_tokens=24)
    assert max_model_len(limits, None) == 1024
    assert max_model_len(limits, 512) == 512
    assert checkpoint_positions(str(tmp_path)) is None  # no config.json
    (tmp_path / "config.json").write_text(json.dumps(
        {"max_position_embeddings": 4096, "text_config": {"max_position_embeddings": 2048}}))
    assert checkpoint_positions(str(tmp_path)) == 2048
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    assert checkpoint_positions(str(tmp_path)) == 4096
    card = model_card("m", 1700000000, 1024, "Qwen2.5-VL")
    assert card == {"id": "m", "object": "model", "created": 1700000000, "owned_by": "apbv",
                    "root": "m", "parent": None, "max_model_len": 1024, "family": "Qwen2.5-VL"}
