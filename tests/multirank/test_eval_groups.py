"""``groups=2`` on 2 gloo ranks (two groups of one rank, each with its own process group and
query rank) writes the same rows as ``groups=1`` (one group of two ranks) in exact mode: same
order, same answers, same error rows; both groups answered samples."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

from apbv.config import RuntimeConfig
from apbv.distributed import DistInfo, rank_groups, spawn_local
from apbv.engine.engine import Engine
from apbv.eval.harness import EvalSpec, run_eval
from tests.multirank.test_eval_harness import PIXELS, lvb  # noqa: F401 (a fixture)


class Counting:
    """The engine, counting its generate calls."""

    def __init__(self, engine: Engine):
        self.engine, self.calls = engine, 0

    def generate(self, *args, **kwargs):
        self.calls += 1
        return self.engine.generate(*args, **kwargs)

    def request(self, *args, **kwargs):
        return self.engine.request(*args, **kwargs)


def _rank_job(info: DistInfo, cfg: RuntimeConfig, data: str, out: str) -> dict:
    report: dict = {}
    stream = io.StringIO()
    for groups in (1, 2):
        index, group = rank_groups(info, groups)
        engine = Counting(Engine(cfg, group))
        spec = EvalSpec("longvideobench", data, f"{out}/g{groups}.jsonl", mode="exact",
                        max_new_tokens=4, skip_missing=True, groups=groups)
        run_eval(spec, cfg, lambda e=engine: e, progress=stream)
        report[groups] = (index, group.rank, group.world_size, engine.calls)
    report["progress"] = stream.getvalue()
    # resume: the finished output runs only its failed rows again; another G is refused
    again = EvalSpec("longvideobench", data, f"{out}/g2.jsonl", mode="exact",
                     max_new_tokens=4, skip_missing=True, groups=2)
    run_eval(again, cfg, lambda e=engine: e, progress=stream)
    try:
        run_eval(dataclasses.replace(again, out=f"{out}/g1.jsonl"), cfg, lambda e=engine: e)
    except ValueError as exc:
        report["refused"] = str(exc)
    report["resumed"] = stream.getvalue()[len(report["progress"]):]
    return report


def test_two_groups_write_the_rows_of_one(tiny_config: RuntimeConfig, lvb: Path,  # noqa: F811
                                          tmp_path: Path) -> None:
    cfg = dataclasses.replace(tiny_config, video=dataclasses.replace(
        tiny_config.video, min_pixels=PIXELS, max_pixels=PIXELS))
    reports = spawn_local(_rank_job, 2, (cfg, str(lvb), str(tmp_path)), timeout_s=400,
                          collective_timeout_s=120)
    rows = {g: [json.loads(line) for line in (tmp_path / f"g{g}.jsonl").read_text().splitlines()]
            for g in (1, 2)}
    strip = {g: [{k: v for k, v in r.items() if k != "timing"} for r in rows[g]] for g in rows}
    assert strip[2] == strip[1], "groups=2 rows differ from groups=1"
    assert [r["id"] for r in rows[2]][:2] == ["lvbfix000_0", "garbage_0"]
    assert sum(r["error"] is None for r in rows[2]) >= 3, rows[2]
    # one group of 2 ranks: both call the engine for every sample; two groups of 1 rank:
    # each calls it only for its own samples, and both have some
    every = reports[0][1][3]
    assert [r[1] for r in reports] == [(0, 0, 2, every), (0, 1, 2, every)]
    assert [r[2][:3] for r in reports] == [(0, 0, 1), (1, 0, 1)]
    calls = [r[2][3] for r in reports]
    assert min(calls) >= 1 and sum(calls) == every, calls
    assert "2 groups of 1 rank(s)" in reports[0]["progress"]
    after = [{k: v for k, v in json.loads(line).items() if k != "timing"}
             for line in (tmp_path / "g2.jsonl").read_text().splitlines()]
    assert after == strip[1], "the resumed groups=2 output differs"
    failed = sum(r["error"] is not None for r in rows[2])
    assert f"{failed} failed before and run again" in reports[0]["resumed"], reports[0]
    assert "groups stored null, now 2" in reports[0]["refused"], reports[0]["refused"]
    settings = json.loads((tmp_path / "g2_settings.json").read_text())["apbv_eval_settings"]
    assert settings["groups"] == 2 and settings["world_size"] == 2


def _batch_job(info: DistInfo, cfg: RuntimeConfig, requests: str, out: str) -> None:
    from apbv.cli.batch_run import read_requests, run_batch

    for groups in (1, 2):
        _, group = rank_groups(info, groups)
        run_batch(cfg, info, Engine(cfg, group), read_requests(requests),
                  Path(out) / f"b{groups}.jsonl", (str(Path(requests).parent),),
                  progress=io.StringIO(), groups=groups)


def test_batch_with_two_groups_writes_the_rows_of_one(tiny_config: RuntimeConfig, lvb: Path,  # noqa: F811
                                                      tmp_path: Path) -> None:
    cfg = dataclasses.replace(
        tiny_config, attention=dataclasses.replace(tiny_config.attention, mode="exact"),
        video=dataclasses.replace(tiny_config.video, min_pixels=PIXELS, max_pixels=PIXELS))
    videos = sorted((lvb / "videos").glob("lvbfix*.mp4")) + [lvb / "videos" / "gone.mp4"]
    lines = [json.dumps({"custom_id": f"r{i}", "body": {"max_tokens": 3, "messages": [
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": v.as_uri()}},
                                     {"type": "text", "text": f"What is shown? ({i})"}]}]}})
             for i, v in enumerate(videos)]
    requests = lvb / "requests.jsonl"
    requests.write_text("\n".join(lines) + "\n")
    spawn_local(_batch_job, 2, (cfg, str(requests), str(tmp_path)), timeout_s=400,
                collective_timeout_s=120)

    def rows(name: str) -> list[tuple]:
        return [(r["custom_id"], r["response"]["status_code"],
                 r["response"]["body"].get("choices"))
                for r in map(json.loads, (tmp_path / name).read_text().splitlines())]

    assert rows("b2.jsonl") == rows("b1.jsonl")
    assert len(videos) == 3  # two videos of the fixture and a missing one
    assert [r[:2] for r in rows("b2.jsonl")] == [("r0", 200), ("r1", 200), ("r2", 404)]
