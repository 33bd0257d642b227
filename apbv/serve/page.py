"""A page for a person (``GET /``) and the media listing it picks videos from (``GET /v1/media``).

The page is one self-contained HTML file (no external assets) shipped in ``static/``: it lists
the videos under the media roots, sends a question (and optional choices) to
``/v1/chat/completions`` with ``stream: true`` and the API key typed into it as a Bearer token,
and shows the answer as it streams, the choice probabilities and the time of the response's
``apbv`` block as one horizontal bar in three parts: the queue wait, the stages up to the first
token (:data:`apbv.timing.TTFT_STAGES`) and the decode after it. A second mode may be chosen to
compare with: the same question is then asked in that mode after the first, and the two
answers are shown side by side.

``GET /v1/media`` needs the API key like every ``/v1`` route and lists only what a request
could name: regular video files under a root whose real path (symlinks followed) stays under a
root, as paths relative to their root, each with the ``file://`` URL a request sends.
"""

from __future__ import annotations

import asyncio
import json
import os
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from apbv.openai.policy import VIDEO_SUFFIXES, ClientError, MediaPolicy, resolve_media

if TYPE_CHECKING:
    from apbv.serve.front.front import Front

MAX_LISTED = 1000
"""Entries of one listing at most (``truncated`` says when more exist)."""
MAX_DEPTH = 8
"""Directory levels below a root that are walked."""


def list_media(policy: MediaPolicy, limit: int = MAX_LISTED) -> dict[str, Any]:
    """The videos a request may name, by root: ``{"object": "list", "data": [{"name", "root",
    "url"}], "truncated"}``; each entry passed :func:`resolve_media` as a request's would."""
    entries: list[dict[str, Any]] = []
    truncated = False
    for index, root in enumerate(policy.roots):
        for folder, dirs, files in os.walk(root):  # symlinked folders are not followed
            rel_folder = os.path.relpath(folder, root)
            depth = 0 if rel_folder == "." else rel_folder.count(os.sep) + 1
            dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if depth < MAX_DEPTH \
                else []
            for name in sorted(files):
                if name.startswith(".") or not name.lower().endswith(VIDEO_SUFFIXES):
                    continue
                path = os.path.join(folder, name)
                url = Path(path).as_uri()
                try:
                    resolve_media(url, policy)
                except ClientError:  # e.g. a symlink out of the roots: not listed
                    continue
                if len(entries) >= limit:
                    truncated = True
                    break
                entries.append({"name": os.path.relpath(path, root), "root": index, "url": url})
            if truncated:
                break
        if truncated:
            break
    return {"object": "list", "data": entries, "truncated": truncated}


def page_html() -> str:
    """The page, with the runtime's mode names and TTFT stages filled into its script."""
    from apbv.modes import MODE_NAMES
    from apbv.timing import TTFT_STAGES

    html = resources.files("apbv.serve").joinpath("static/index.html").read_text("utf-8")
    for name, values in (("MODES", MODE_NAMES), ("TTFT_STAGES", TTFT_STAGES)):
        mark = f"/*APBV:{name}*/[]"
        assert html.count(mark) == 1, f"the page's script lacks {mark}"
        html = html.replace(mark, json.dumps(list(values)))
    return html


def register(app: FastAPI, front: Front) -> None:
    """Add ``GET /`` and ``GET /v1/media`` to the server's app."""
    html = page_html()

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(html, headers={
            "Content-Security-Policy": "default-src 'self'; style-src 'unsafe-inline'; "
                                       "script-src 'unsafe-inline'",
            "Cache-Control": "no-store"})

    @app.get("/v1/media")
    async def media(request: Request) -> dict:
        front.authorize(request)
        return await asyncio.to_thread(list_media, front.policy)
