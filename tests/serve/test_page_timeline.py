"""The page's time bar (queue wait, time to first token, decode as separate parts) and its
second mode to compare with, read from the served page without ranks.

The page's own computations live in its ``<script id="logic">`` (no DOM): that script, as
served, runs in node on a response's ``apbv`` block; the parts must add up to the block's
``queue_wait_s``, ``ttft_s`` and decode seconds. The whole page script also runs in node on a
stubbed DOM and a stubbed streamed answer, asking in two modes. A real browser drives the
whole page in ``tests/serve/test_page.py`` where playwright and Chromium are installed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

pytest.importorskip("fastapi")

from apbv.modes import MODE_NAMES  # noqa: E402
from apbv.timing import STAGES, TTFT_STAGES  # noqa: E402

APBV_BLOCK = {"ttft_s": 1.5, "queue_wait_s": 0.25, "mode": "spava",
              "seconds": dict(zip(STAGES, (0.1, 0.2, 0.3, 0.4, 0.5, 2.0), strict=True))}
"""A response's ``apbv`` block: its stages' seconds, the first five adding up to ttft_s."""


@pytest.fixture(scope="module")
def served() -> str:
    from fastapi.testclient import TestClient

    from apbv.serve.app import Server, ServerOptions

    server = Server(None, [], None, ServerOptions("m"))  # type: ignore[arg-type]
    page = TestClient(server.app).get("/")  # no lifespan: no group is started
    assert page.status_code == 200
    return page.text


def _logic(html: str) -> str:
    found = re.search(r'<script id="logic">(.*?)</script>', html, re.S)
    assert found is not None, "the page has no <script id=\"logic\"> with its computations"
    return found.group(1)


def _node(program: str) -> object:
    """What ``program`` writes to stdout, run by node, as JSON."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the page's script cannot run without a browser")
    done = subprocess.run([node, "-e", program], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _run_logic(html: str, expression: str) -> object:
    """``expression`` evaluated in node after the page's logic script, as JSON."""
    return _node(_logic(html) + f"\nprocess.stdout.write(JSON.stringify({expression}));\n")


def test_the_served_page_knows_the_modes_and_the_ttft_stages(served: str):
    logic = _logic(served)
    assert f"const MODES = {json.dumps(list(MODE_NAMES))};" in logic
    assert f"const TTFT_STAGES = {json.dumps(list(TTFT_STAGES))};" in logic
    for piece in ('id="mode"', 'id="compare"', 'id="answer-b"', 'id="stages-b"',
                  'id="run-b" hidden'):
        assert piece in served, piece


def test_the_bar_splits_queue_ttft_and_decode(served: str):
    segments = _run_logic(served, f"timeline({json.dumps(APBV_BLOCK)})")
    assert [s["name"] for s in segments] == ["queue", *STAGES]
    assert [s["part"] for s in segments] == \
        ["queue"] + ["ttft"] * len(TTFT_STAGES) + ["decode"] * (len(STAGES) - len(TTFT_STAGES))
    parts = _run_logic(served, f"partSeconds(timeline({json.dumps(APBV_BLOCK)}))")
    assert parts == pytest.approx({"queue": 0.25, "ttft": APBV_BLOCK["ttft_s"], "decode": 2.0})
    no_queue = _run_logic(served, 'partSeconds(timeline({seconds: {"prefill": 1}}))')
    assert no_queue == {"queue": 0, "ttft": 1, "decode": 0}


def test_a_second_mode_asks_the_same_question_again(served: str):
    assert _run_logic(served, 'runModes("", "")') == [""]
    assert _run_logic(served, 'runModes("spava", "spava")') == ["spava"]
    assert _run_logic(served, 'runModes("spava", "exact")') == ["spava", "exact"]
    bodies = _run_logic(served, '["spava", "exact"].map(m => chatBody("file:///v.mp4", "Q?", '
                                '8, ["red", "blue"], m))')
    assert [b.pop("mode") for b in bodies] == ["spava", "exact"]
    assert bodies[0] == bodies[1] == {
        "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "file:///v.mp4"}},
            {"type": "text", "text": "Q?"}]}],
        "stream": True, "max_tokens": 8, "choice_set": ["red", "blue"]}
    plain = _run_logic(served, 'chatBody("file:///v.mp4", "Q?", NaN, [], "")')
    assert "mode" not in plain and "max_tokens" not in plain and "choice_set" not in plain


def test_every_script_of_the_page_compiles(served: str):
    scripts = re.findall(r"<script[^>]*>(.*?)</script>", served, re.S)
    assert len(scripts) == 2
    compiled = _run_logic(served, f"{json.dumps(scripts)}.map(s => typeof new Function(s))")
    assert compiled == ["function", "function"]


DOM_STUB = r"""
// Just enough of a DOM for the page's script, and a fetch answering each chat body with the
// streamed answer ANSWER in server-sent events split at awkward places.
const els = {};
function mk(tag) {
  return {tag, children: [], dataset: {}, style: {}, hidden: false, disabled: false, value: "",
    _t: "",
    get textContent() { return this._t + this.children.map(c => c.textContent || "").join(""); },
    set textContent(v) { this._t = v; this.children = []; },
    appendChild(c) { this.children.push(c); return c; }, addEventListener() {},
    insertRow() {
      const row = mk("tr");
      row.cells = [];
      row.insertCell = () => { const c = mk("td"); row.cells.push(c); row.children.push(c);
                               return c; };
      this.children.push(row);
      return row;
    }};
}
globalThis.document = {getElementById: (id) => els[id] || (els[id] = mk(id)),
                       createElement: mk, createTextNode: (t) => ({textContent: t})};
const sent = [];
globalThis.fetch = async (url, opts) => {
  if (!opts || !opts.body) return {ok: true, json: async () => ({data: []})};
  const body = JSON.parse(opts.body);
  sent.push(body);
  const ev = (o) => "data: " + JSON.stringify(o) + "\n\n";
  const block = Object.assign({}, APBV, {mode: body.mode || "spava"});
  const bytes = new TextEncoder().encode(
    ev({choices: [{delta: {role: "assistant", content: ""}}]}) +
    ANSWER.map(piece => ev({choices: [{delta: {content: piece}}]})).join("") +
    ev({choices: [{delta: {}, finish_reason: "stop"}], apbv: block}) + "data: [DONE]\n\n");
  const parts = [bytes.slice(0, 37), bytes.slice(37, 150), bytes.slice(150)];
  return {ok: true, body: {getReader() {
    let i = 0;
    return {read: async () => i < parts.length ? {done: false, value: parts[i++]}
                                                : {done: true}};
  }}};
};
"""


def test_the_page_shows_two_modes_side_by_side(served: str):
    """The page's whole script, on a stubbed DOM, asks in the chosen mode and in the one to
    compare with, one after the other, and shows each streamed answer with its own bar."""
    scripts = re.findall(r"<script[^>]*>(.*?)</script>", served, re.S)
    ask = """
    (async () => {
      const $ = (id) => document.getElementById(id);
      $("video").value = "file:///v.mp4"; $("question").value = "Q?";
      $("maxtokens").value = "8"; $("mode").value = ""; $("compare").value = "exact";
      await ask();
      return {status: $("status").dataset.state, hidden: $("run-b").hidden,
              modes: sent.map(b => b.mode || ""),
              panels: ["", "-b"].map(p => ({
                answer: $("answer" + p).textContent, mode: $("mode-shown" + p).textContent,
                bar: $("stages" + p).children.map(c => [c.dataset.stage, c.dataset.part])}))};
    })()"""
    program = (f"const APBV = {json.dumps(APBV_BLOCK)}; const ANSWER = ['mag', 'enta'];\n"
               + DOM_STUB + scripts[0] + scripts[1]
               + f"\n{ask}.then(r => process.stdout.write(JSON.stringify(r)));\n")
    shown = _node(program)
    bar = [["queue", "queue"]] + [[s, "ttft" if s in TTFT_STAGES else "decode"] for s in STAGES]
    assert shown == {"status": "done", "hidden": False, "modes": ["", "exact"], "panels": [
        {"answer": "magenta", "mode": "mode spava", "bar": bar},
        {"answer": "magenta", "mode": "mode exact", "bar": bar}]}
