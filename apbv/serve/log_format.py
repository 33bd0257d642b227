"""The server's log lines on stderr (``--log-format``): ``text``, one readable line per record,
or ``json``, one JSON object per line with the standard fields ``timestamp`` (UTC, ISO 8601,
milliseconds), ``level``, ``logger``, ``message``, ``process``, and when there is one
``request_id`` (:mod:`apbv.openai.request_id`), ``exception`` (the formatted traceback).

A record logged while an HTTP request is handled names that request's id; one logged elsewhere
about a request (a replica finishing its job) names it through ``extra={"request_id": ...}``.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

from apbv.openai import request_id

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s%(request_tag)s %(name)s: %(message)s"
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


class RequestIdFilter(logging.Filter):
    """Gives every record a ``request_id`` (its own ``extra``, else the request being handled,
    else None) and the text format's ``request_tag`` (`` [request_id=ID]`` after the level, or
    nothing)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = getattr(record, "request_id", None) or request_id.current()
        record.request_id = rid
        record.request_tag = "" if rid is None else f" [request_id={rid}]"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in a message are escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
            "process": record.process}
        rid = getattr(record, "request_id", None)
        if rid is not None:
            out["request_id"] = rid
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out)


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def handler(fmt: str) -> logging.Handler:
    """A stderr handler writing ``fmt`` (:data:`FORMATS`) lines, request ids included."""
    out = logging.StreamHandler(sys.stderr)
    out.addFilter(RequestIdFilter())
    out.setFormatter(JsonFormatter() if check_format(fmt) == "json" else
                     logging.Formatter(TEXT_FORMAT))
    return out


def configure(level: str, fmt: str = "text") -> None:
    """The root logger writes ``fmt`` lines at ``level`` and above to stderr."""
    logging.basicConfig(level=level.upper(), handlers=[handler(fmt)], force=True)


def adopt_uvicorn() -> None:
    """uvicorn's loggers (configured by uvicorn with its own handlers when it starts) write
    through the root logger's handler instead, so every line has the same format."""
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
