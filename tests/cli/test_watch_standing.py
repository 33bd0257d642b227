"""``apbv watch --watch QUESTION --choices ...``: the standing question's loop without a server,
on the trained tiny model asked "Is there a flash?" (yes / no) over needle footage fed 4 frames
(2 s) at a time: the baseline, then one event in the batch that holds the first flash, none
after, none on flash-free footage; bad flags refused."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

NEEDLE_TINY = Path(__file__).resolve().parents[2] / "apbv" / "assets" / "needle-tiny"


class _Batches:
    """A capture that gives ``frames`` 4 at a time, then ends."""

    def __init__(self, frames: list):
        self.frames = frames

    def take(self, limit: int | None = None, timeout: float = 0.0) -> list:
        out, self.frames = self.frames[:4], self.frames[4:]
        return out

    def stats(self) -> dict:
        return {"ended": not self.frames, "buffered": len(self.frames), "error": None,
                "errors": [], "frames_dropped": 0, "ingest_lag_s": 0.0, "segments_done": 0,
                "segments_failed": 0}

    def close(self) -> None:
        pass


def _presence_sample(answer: str):
    """The first presence sample (seed 5) of 24 temporal patches (12 s), its first flash
    halfway, answering ``answer``."""
    from apbv.synthetic.needles import answer_of, make_sample

    index = next(i for i in range(100)
                 if answer_of("presence", patches=24, seed=5, index=i, depth=0.5) == answer)
    return make_sample("presence", patches=24, seed=5, index=index, depth=0.5)


def test_watch_prints_one_event_in_the_batch_of_the_flash() -> None:
    """The presence question ("Is there a flash?", yes / no): "no" until the batch that holds
    the first flash, one "yes" event then, none after; on the same length of flash-free
    footage only the baseline."""
    from apbv.capture.sources import Frame
    from apbv.cli.watch_loop import WatchOptions, run_watch
    from apbv.cli.watch_standing import StandingWatch
    from apbv.config import load_config
    from apbv.distributed import init_distributed
    from apbv.engine.engine import Engine
    from apbv.synthetic.needles import FPS, PRESENCE_ANSWERS, QUESTIONS

    cfg = load_config("tiny_cpu", [f"model.path={str(NEEDLE_TINY)!r}"])
    engine = Engine(cfg, init_distributed(backend="gloo"))

    def watch(sample) -> tuple[list[dict], StandingWatch]:
        frames = [Frame(image, i / FPS) for i, image in enumerate(sample.frames)]
        standing = StandingWatch(QUESTIONS["presence"], PRESENCE_ANSWERS)
        out = io.StringIO()
        options = WatchOptions(source="fake", as_json=True, standing=standing)
        assert run_watch(engine, engine.info, options, out=out,
                         make_capture=lambda: _Batches(frames)) == 0
        assert standing.evaluations == len(frames) // 4  # one per batch
        return [json.loads(line) for line in out.getvalue().splitlines()], standing

    flashed = _presence_sample("yes")
    events, _ = watch(flashed)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "baseline" and kinds.count("watch") == 1 and kinds[-1] == "end", events
    assert events[0]["answer"] == "no", events[0]
    event = next(e for e in events if e["event"] == "watch")
    assert event["answer"] == "yes" and event["previous"] == "no", event
    flash_s = min(slot for slot, _ in flashed.needles) * 2 / FPS  # the first flash's frame
    # the first batch (4 frames, 2 s) that holds the flash: its last frame's timestamp
    assert flash_s <= event["footage_ts"] < flash_s + 2.0, (flash_s, event)
    assert event["probs"]["yes"] > 0.5 and event["ttft_s"] > 0
    events, _ = watch(_presence_sample("no"))
    assert [e["event"] for e in events] == ["baseline", "end"], events
    assert events[0]["answer"] == "no", events[0]


@pytest.mark.parametrize("args, text", [
    (("--watch", "Is there a flash?"), "--watch and --choices go together"),
    (("--watch", "Is there a flash?", "--choices", "yes,,no"), "--choices must be a comma"),
    (("--watch", "Q?", "--choices", "yes,no", "--rule", "threshold", "--choice", "maybe"),
     "the rule's choice 'maybe' is not one of the choices"),
    (("--watch", "Q?", "--choices", "yes,no", "--hold", "0"), "hold must be an integer"),
])
def test_watch_flags_are_checked_before_any_work(tmp_path, args, text) -> None:
    import argparse

    from apbv.cli import watch

    parser = argparse.ArgumentParser()
    watch.register(parser.add_subparsers())
    parsed = parser.parse_args(["watch", "--config", "tiny_cpu", "--model", str(NEEDLE_TINY),
                                "--source", str(tmp_path), *args])
    with pytest.raises(ValueError, match=None) as info:
        watch.run(parsed)
    assert text in str(info.value)
