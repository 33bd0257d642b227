"""The page (``GET /``) and the media listing (``GET /v1/media``).

The listing and the page's route are checked on the FastAPI app without ranks; the page itself
is driven headless by playwright in a system Chromium against the real server (2 CPU rank
actors, the tiny model): its streamed answer must equal the API's answer to the same request,
and its time bar must name the queue and the response's stages; a second mode asked beside
the first shows its own answer and bar. That test skips, saying why, where
playwright or a Chromium binary is missing (``APBV_CHROMIUM`` names one explicitly).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from apbv.openai.policy import MediaPolicy  # noqa: E402
from apbv.serve.page import list_media  # noqa: E402
from tests.serve.server import serving  # noqa: E402

KEY = "page-key-456"
QUESTION = "What colour is the square?"


def _chromium() -> str | None:
    explicit = os.environ.get("APBV_CHROMIUM")
    if explicit:
        return explicit if os.path.isfile(explicit) else None
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory, short_video: Path) -> Path:
    root = tmp_path_factory.mktemp("media")
    shutil.copy(short_video, root / "clip.mp4")
    (root / "sub").mkdir()
    shutil.copy(short_video, root / "sub" / "other clip.mp4")
    (root / "notes.txt").write_text("not a video")
    outside = tmp_path_factory.mktemp("outside")
    shutil.copy(short_video, outside / "secret.mp4")
    os.symlink(outside / "secret.mp4", root / "escape.mp4")
    os.symlink(outside, root / "linked")
    return root


def test_listing_names_only_what_a_request_may_name(media: Path):
    listed = list_media(MediaPolicy((str(media),)))
    assert [e["name"] for e in listed["data"]] == ["clip.mp4", "sub/other clip.mp4"]
    assert listed["data"][1]["url"] == (media / "sub" / "other clip.mp4").resolve().as_uri()
    assert "%20" in listed["data"][1]["url"] and not listed["truncated"]
    assert list_media(MediaPolicy())["data"] == []
    assert list_media(MediaPolicy((str(media),)), limit=1)["truncated"]


def test_routes_on_the_app(media: Path):
    from fastapi.testclient import TestClient

    from apbv.serve.app import Server, ServerOptions

    server = Server(None, [], None, ServerOptions("m", policy=MediaPolicy((str(media),)),
                                                    api_key=KEY))
    client = TestClient(server.app)  # no lifespan: no group is started
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="stages"' in page.text and "src=" not in page.text and "href=" not in page.text
    assert client.get("/v1/media").status_code == 401
    listed = client.get("/v1/media", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [e["name"] for e in listed["data"]] == ["clip.mp4", "sub/other clip.mp4"]


@pytest.fixture(scope="module")
def browser_server(request: pytest.FixtureRequest, media: Path):
    pytest.importorskip("playwright.sync_api", reason="the python playwright package is not "
                                                       "installed")
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no Chromium binary (install chromium or set APBV_CHROMIUM)")
    pytest.importorskip("ray")
    tiny_model_dir = request.getfixturevalue("tiny_model_dir")  # only once nothing is missing
    with serving(tiny_model_dir, "--world-size", "2", "--media-root", str(media), "--api-key",
                 KEY, "--max-frames", "16", "--set", "parallel.timeout_s=20") as srv:
        srv.wait_ready()
        yield srv.base, chromium


def _api(base: str, url: str, choices: list[str] | None = None) -> dict:
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)
    extra = {"choices": choices} if choices else {}
    out = client.chat.completions.create(
        messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                               {"type": "text", "text": QUESTION}]}],
        model="tiny-qwen2.5-vl", max_tokens=8, extra_body=extra)
    return {"answer": out.choices[0].message.content, "apbv": out.model_extra["apbv"]}


def _ask(page: Any, state: str) -> None:
    """Press the page's Ask button and wait until its status reaches ``state``."""
    page.click("#ask")
    page.wait_for_selector(f'#status[data-state="{state}"]')


def test_page_asks_and_shows_answer_choices_and_stages(browser_server, media: Path):
    from playwright.sync_api import sync_playwright

    base, chromium = browser_server
    url = (media / "clip.mp4").as_uri()
    plain = _api(base, url)
    picked = _api(base, url, ["red", "blue"])
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.set_default_timeout(30_000)
            page.goto(base + "/")
            assert page.locator("#status").get_attribute("data-state") in ("idle", "error")
            page.fill("#key", KEY)
            page.click("#reload")
            page.wait_for_selector("#video option", state="attached")
            names = page.locator("#video option").all_text_contents()
            assert names == ["clip.mp4", "sub/other clip.mp4"]  # no symlink out, no .txt
            page.select_option("#video", label="clip.mp4")
            page.fill("#question", QUESTION)
            page.fill("#maxtokens", "8")
            _ask(page, "done")
            assert page.text_content("#answer") == plain["answer"]
            stages = page.locator("#stages .stage").evaluate_all(
                "segs => segs.map(s => s.dataset.stage)")
            assert stages == ["queue", *plain["apbv"]["seconds"]] and len(stages) >= 3
            assert page.locator("#legend").text_content().startswith(stages[0])

            page.fill("#choices", "red, blue")
            _ask(page, "done")
            assert page.text_content("#answer") == picked["answer"]
            rows = page.locator("#probtable tr").evaluate_all(
                "rows => rows.map(r => [r.dataset.choice, r.cells[2].textContent])")
            assert rows == [[c["text"], f"{100 * c['prob']:.1f} %"]
                            for c in picked["apbv"]["choices"]]

            page.fill("#choices", "")
            page.select_option("#compare", label="exact")  # the same question in a second mode
            _ask(page, "done")
            assert page.is_visible("#run-b") and page.text_content("#mode-shown-b") == \
                "mode exact"
            parts = page.locator("#stages-b .stage").evaluate_all(
                "segs => segs.map(s => s.dataset.part)")
            assert parts[0] == "queue" and parts[-1] == "decode" and "ttft" in parts
            page.select_option("#compare", label="none")

            page.fill("#key", "wrong")
            _ask(page, "error")
            assert "API key" in page.text_content("#status")
        finally:
            browser.close()
