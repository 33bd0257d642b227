"""apbv.eval.harness in one process with a scripted engine: injected answers give the expected
scores, failures become error rows, the JSONL resumes losslessly, and every misuse is a
ValueError naming the problem. (Settings, the lock, retries and the missing-video preflight:
test_eval_resume.py; the real engine on 2 ranks: tests/multirank/test_eval_harness.py.)
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from apbv.config import load_config
from apbv.eval.data import load_samples
from apbv.eval.harness import EvalSpec, run_eval, summary
from apbv.eval.store import ResultLog
from apbv.synthetic.eval_fixtures import make_eval_fixtures

CFG = load_config("tiny_cpu", [])


class ScriptedEngine:
    """Answers from a table {mode: {(video, prompt): answer}}; a video that is not a real video
    (the fixture's "bad" one) fails like the engine does (ValueError); ``interrupt_at`` raises
    KeyboardInterrupt on that call (1-based), as Ctrl-C during a sample would. ``calls`` records
    every call's arguments."""

    def __init__(self, answers: dict[str, dict[tuple[str, str], str]],
                 interrupt_at: int | None = None):
        self.answers = answers
        self.interrupt_at = interrupt_at
        self.calls: list[tuple[str, str, str, int]] = []

    @staticmethod
    def request(video: str, question: str, *, mode: str, max_new_tokens: int):
        return (video, question, mode, max_new_tokens)

    def generate(self, request: tuple[str, str, str, int]):
        video, question, mode, max_new_tokens = request
        self.calls.append(request)
        if len(self.calls) == self.interrupt_at:
            raise KeyboardInterrupt
        if Path(video).read_bytes().startswith(b"not a video"):
            raise ValueError(f"video file {video!r} cannot be decoded")
        answer = self.answers[mode][(video, question)]
        return SimpleNamespace(answer=answer, token_ids=[ord(c) for c in answer][:max_new_tokens],
                               ttft_s=0.25, seconds={"prefill": 0.25}, frames=16,
                               context_len=1000, query_len=40)


def vnbench_fixture(root: Path) -> Path:
    """2 VNBench questions (8 samples) and a third whose video is corrupt (4 more)."""
    root = make_eval_fixtures("vnbench", root, types=("ret_insert1", "cnt_edit1")).parent
    (root / "VNBench" / "bad_ord_insert1.mp4").write_bytes(b"not a video")
    return add_vnbench_tries(root, "bad_ord_insert1.mp4", "ord_insert1")


def add_vnbench_tries(root: Path, video: str, kind: str) -> Path:
    """Add to the VNBench fixture under ``root`` the 4 tries of its first question again, on
    ``VNBench/video`` as a question of type ``kind``; ``root``."""
    path = root / "VNBench-main-4try.json"
    entries = json.loads(path.read_text())
    entries += [{**e, "video": f"./VNBench/{video}", "type": kind} for e in entries[:4]]
    path.write_text(json.dumps(entries))
    return root


@pytest.fixture(scope="module")
def vnb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vnbench_fixture(tmp_path_factory.mktemp("vnb"))


def scripted_engine(root: Path, interrupt_at: int | None = None) -> ScriptedEngine:
    """The ret question: right on all 4 tries, in 4 answer styles; the cnt question: the same
    but unparseable on try 2. Exact attention answers "Z" (unparseable) where spava answered
    "(X)", so it disagrees on the ret question's try 2."""
    styles = ["{}", "The answer is {}.", "({})", "{}. whatever"]
    spava, exact = {}, {}
    for s in load_samples("vnbench", root)[:8]:
        t = s.fields["try"]
        text = styles[t].format(s.gt)
        if s.fields["type"] == "cnt_edit1" and t == 2:
            text = "the answer is " + s.gt.lower()
        spava[(s.video_path, s.prompt)] = text
        exact[(s.video_path, s.prompt)] = "Z" if text.startswith("(") else text
    return ScriptedEngine({"spava": spava, "exact": exact}, interrupt_at)


def _spec(root: Path, out: Path, **kw) -> EvalSpec:
    return EvalSpec(bench="vnbench", data_dir=str(root), out=str(out), **kw)


def _strip(path: Path) -> list[str]:
    """The JSONL's lines without the timing field (the only one that differs between runs)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [json.dumps({k: v for k, v in r.items() if k != "timing"}) for r in rows]


def test_scores_error_rows_and_progress(vnb: Path, tmp_path: Path) -> None:
    stream = io.StringIO()
    out = tmp_path / "run.jsonl"
    results = run_eval(_spec(vnb, out, compare="exact"), CFG, lambda: scripted_engine(vnb),
                       progress=stream)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["try"] for r in rows] == [0, 1, 2, 3] * 3
    good, failed = rows[:8], rows[8:]
    assert all(r["error"] is None and r["timing"]["ttft_s"] == 0.25 for r in good)
    assert [r["parsed_pred"] == r["gt"] for r in good] == [True] * 6 + [False, True]
    assert all(r["error"] == f"video file {str(vnb / 'VNBench' / 'bad_ord_insert1.mp4')!r} "
               f"cannot be decoded" and r["pred"] == "" and r["correct"] is False
               and r["exact"] is None and r["timing"] is None for r in failed)
    s = results["apbv"]["scores"]
    assert s["types"] == {"cnt_edit1": {"questions": 1, "correct": 0, "acc": 0.0},
                          "ord_insert1": {"questions": 1, "correct": 0, "acc": 0.0},
                          "ret_insert1": {"questions": 1, "correct": 1, "acc": 1.0}}
    assert results["results"]["vnbench"]["vnbench_acc,none"] == pytest.approx(1 / 3)
    assert (s["errors"], s["unparsed"], s["try_acc"]) == (4, 1, 7 / 12)
    c = results["apbv"]["compare_exact"]
    # ret try 2: spava "(X)", exact "Z" (no letter); cnt try 2: neither has a letter. Both
    # pairs are unparsed, not agreement and not disagreement.
    assert c["compared"] == 8 and c["letter_pairs"] == 6 and c["letter_agreement"] == 1.0
    assert c["unparsed_pairs"] == {"total": 2, "mode_unparsed": 0, "exact_unparsed": 1,
                                   "both_unparsed": 1}
    assert c["token_agreement"] == 7 / 8
    assert [r["exact"]["same_letter"] for r in good] == [True, True, None, True, True, True,
                                                         None, True]
    assert c["exact_scores"]["types"]["ret_insert1"]["acc"] == 0.0
    assert json.loads((tmp_path / "run_results.json").read_text())["apbv"] == results["apbv"]
    lines = stream.getvalue().splitlines()
    assert lines[0] == (f"[apbv eval] vnbench, mode spava on 1 rank(s): 12 samples, 0 already "
                        f"in {out}, 12 to run")
    assert re.fullmatch(r"\[1/12\] 8\.3%  eta \d+:\d\d:\d\d  acc 1\.000  agree 1\.000",
                        lines[1])
    assert lines[12].startswith("[12/12] 100.0%  eta 0:00:00  acc 0.583  errors 4  agree 1.000")
    text = summary(results)
    assert "vnbench: vnbench_acc 0.3333" in text and "4 failed, 1 unparsed" in text
    assert ("letters 1.0000 (over 6 pairs with both letters; 2 pairs unparsed: 0 mode only, "
            "1 exact only, 1 both), tokens 0.8750") in text


def test_interrupted_then_resumed_equals_uninterrupted(vnb: Path, tmp_path: Path) -> None:
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    expected = run_eval(_spec(vnb, whole), CFG, lambda: scripted_engine(vnb), progress=None)
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C during the 4th sample
        run_eval(_spec(vnb, cut), CFG, lambda: scripted_engine(vnb, interrupt_at=4),
                 progress=None)
    assert len(cut.read_text().splitlines()) == 3  # only the sample in flight is lost
    half = '{"id": "vnfix000_ret_insert1_ret_insert1_3", "task": "vnb'
    with open(cut, "a") as f:  # and a crash in the middle of writing the next line
        f.write(half)
    stream = io.StringIO()
    resumed = run_eval(_spec(vnb, cut), CFG, lambda: scripted_engine(vnb), progress=stream)
    assert f"dropped a half-written last line of {cut} ({len(half)} bytes)" in stream.getvalue()
    assert "12 samples, 3 already in" in stream.getvalue()
    assert _strip(cut) == _strip(whole)
    assert resumed["results"] == expected["results"] and resumed["apbv"] == expected["apbv"]

    def no_engine():
        raise AssertionError("a finished run must not load the model")

    again = run_eval(_spec(vnb, cut, retry_failed=False), CFG, no_engine, progress=None)
    assert again["apbv"] == expected["apbv"] and _strip(cut) == _strip(whole)  # only rescored
    engine = scripted_engine(vnb)
    retried = run_eval(_spec(vnb, cut), CFG, lambda: engine, progress=None)
    assert [c[0] for c in engine.calls] == [str(vnb / "VNBench" / "bad_ord_insert1.mp4")] * 4
    assert retried["apbv"] == expected["apbv"] and _strip(cut) == _strip(whole)


def test_limit_then_more(vnb: Path, tmp_path: Path) -> None:
    out = tmp_path / "limit.jsonl"
    first = run_eval(_spec(vnb, out, limit=6), CFG, lambda: scripted_engine(vnb), progress=None)
    assert first["n-samples"] == {"vnbench": {"original": 12, "effective": 6}}
    assert first["apbv"]["scores"]["incomplete_questions"] == 1
    assert first["results"]["vnbench"]["vnbench_cnt,none"] is None  # nothing complete yet
    full = run_eval(_spec(vnb, out), CFG, lambda: scripted_engine(vnb), progress=None)
    assert full["n-samples"]["vnbench"]["effective"] == 12
    assert len({json.loads(line)["id"] for line in out.read_text().splitlines()}) == 12


def test_result_log_refuses_damage_and_foreign_runs(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log = ResultLog(path)
    assert log.read("vnbench", "spava", False) == ([], None)
    row = {"id": "a", "task": "vnbench", "mode": "spava"}
    log.append(row)
    log.append({**row, "id": "b"})
    log.close()
    assert log.read("vnbench", "spava", False) == ([row, {**row, "id": "b"}], None)
    cases = {
        ("vnbench", "exact", False): "holds results of task vnbench in mode spava, not vnbench "
                                     "in mode exact; pass another output file",
        ("longvideobench_val_v", "spava", False): "not longvideobench_val_v in mode spava",
        ("vnbench", "spava", True): "holds results without the comparison against exact",
    }
    for args, message in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            log.read(*args)
    good = path.read_bytes()
    path.write_bytes(good + good.splitlines(keepends=True)[0])
    with pytest.raises(ValueError, match="sample ids more than once: a"):
        log.read("vnbench", "spava", False)
    path.write_bytes(b"{not json\n" + good)
    with pytest.raises(ValueError, match="line 1 is not a result row; the file is damaged"):
        log.read("vnbench", "spava", False)
    path.write_bytes(good + b"\x00\x00\x00\n")  # a complete but garbled last line: dropped
    rows, note = log.read("vnbench", "spava", False)
    assert len(rows) == 2 and "(4 bytes)" in note and path.read_bytes() == good


def test_spec_and_run_errors(vnb: Path, tmp_path: Path) -> None:
    cases = {
        "unknown benchmark 'mmlu'; allowed: longvideobench, vnbench": {"bench": "mmlu"},
        "attention.mode must be one of spava": {"mode": "ring"},
        "compare must be one of exact; got 'star'": {"compare": "star"},
        "compare=exact with mode exact compares a mode with itself": {"mode": "exact",
                                                                     "compare": "exact"},
        "limit must be an integer >= 1, got 0": {"limit": 0},
        "max_new_tokens must be an integer >= 1, got -1": {"max_new_tokens": -1},
    }
    for message, kw in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            EvalSpec(**{"bench": "vnbench", "data_dir": str(vnb), "out": "x.jsonl", **kw})
    assert EvalSpec("vnbench", "d", "r/x.jsonl").results_path == Path("r/x_results.json")
    assert EvalSpec("vnbench", "d", "x").new_tokens == 5
    assert EvalSpec("longvideobench", "d", "x").new_tokens == 32
    with pytest.raises(ValueError, match="annotation file .*nope.json' does not exist"):
        run_eval(_spec(vnb, tmp_path / "o.jsonl", annotation="nope.json"), CFG,
                 lambda: scripted_engine(vnb), progress=None)
    assert not (tmp_path / "o.jsonl").exists()
