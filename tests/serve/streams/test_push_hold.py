"""apbv.serve.streams.hold on one in-process rank (the tiny Qwen2.5-VL, 2 frames a temporal
patch, and InternVL3, 1 frame with its ``FrameN:``): the same pushes of a static scene with
two changes, odd frame counts among them, go to one stream as they come and to another
through the server's judge. The judge holds exactly the pushes whose patches the ranks drop
(no op reaches the engine for them) and answers them as the ranks did; after a held backlog
the engines' two streams are identical (chunks, positions and frame numbers, counts) and
answer alike, bit for bit; a full backlog is sent anyway, a push the queue refuses leaves
the judgement as it was, a push that fails on the ranks after its held pushes stops the
judging and the backlog's resend is skipped there; threshold 0 makes no judge."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from apbv.config import load_config
from apbv.distributed import DistInfo
from apbv.engine.engine import Engine
from apbv.engine.request import Request, StreamRef
from apbv.engine.stream_plan import Appended, StreamSpec
from apbv.openai.policy import ClientError
from apbv.serve.ranks.ops import Append, apply
from apbv.serve.streams.hold import PushHold
from apbv.serve.streams.hold import append as held_append
from tests.families import tiny_dir

THRESHOLD, FPS = 8.0, 2.0
CHANGES = (5, 9)
"""Temporal patches where the scene changes (a white square appears; a corner turns black)."""
PATCHES = 12
PUSHES = {2: (3, 1, 2, 5, 1, 3, 1, 2, 3, 3), 1: (2, 1, 1, 1, 1, 1, 1, 1, 2, 1)}
"""Frames per push by frames per patch (odd counts: a frame waits for the next push)."""


def _footage(unit: int, side: int) -> torch.Tensor:
    """uint8 (PATCHES x unit, 3, side, side): a fixed scene with +-3 levels of noise."""
    g = torch.Generator().manual_seed(5)
    scene = torch.randint(40, 200, (3, side, side), generator=g)
    frames = []
    for i in range(PATCHES * unit):
        frame = scene + torch.randint(-3, 4, scene.shape, generator=g)
        if i // unit >= CHANGES[0]:
            frame[:, :side // 2, :side // 2] = 255
        if i // unit >= CHANGES[1]:
            frame[:, side // 2:, side // 2:] = 0
        frames.append(frame.clamp(0, 255).to(torch.uint8))
    return torch.stack(frames)


class _Ranks:
    """``admit`` of one rank's ``engine``: each op is applied as the replica would, the ops
    recorded; ``refuse``/``fail``: the next op is refused by the queue / fails on the rank
    once it took its held pushes."""

    def __init__(self, engine: Engine):
        self.engine, self.ops = engine, []
        self.refuse = self.fail = False

    def admit(self, op: Append) -> SimpleNamespace:
        if self.refuse:
            self.refuse = False
            raise ClientError(429, "the queue is full")
        future = asyncio.get_running_loop().create_future()
        if self.fail:  # the held pushes taken, then the push fails
            self.fail = False
            apply(Append(op.stream_id, *op.held[-1], held=op.held[:-1]), self.engine)
            future.set_exception(ClientError(400, "the push failed on the ranks"))
        else:
            future.set_result((apply(op, self.engine), 0.0))
            self.ops.append(op)
        return SimpleNamespace(future=future, started=0.0)


def _bare(done: Appended) -> Appended:
    return dataclasses.replace(done, seconds={})


def _state(engine: Engine, sid: str) -> tuple:
    s = engine.streams[sid]
    info = dataclasses.replace(engine.describe_stream(sid), seconds={})
    return ([dataclasses.astuple(c) for c in s.chunks], s.tokens, s.max_position,
            s._frames_fed, s._next_patch, s._last_ts, s.pruner.last.tolist(), info)


def _answer(engine: Engine, sid: str) -> tuple:
    said = engine.generate(Request(video=StreamRef(sid), question="What changed?",
                                   mode="exact", max_new_tokens=3))
    scored = engine.generate(Request(video=StreamRef(sid), question="What changed?",
                                     mode="exact", choices=("yes", "no")))
    assert scored.choices is not None
    return said.token_ids, [c["logprob"] for c in scored.choices]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> dict:
    info = DistInfo(0, 1, 0, torch.device("cpu"), None)
    internvl = tiny_dir(tmp_path_factory, "internvl")
    return {f: Engine(load_config("tiny_cpu", [f"model.path={str(d)!r}"]), info)
            for f, d in (("qwen2_5_vl", tiny_model_dir), ("internvl", internvl))}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl"])
def test_held_pushes_cost_the_ranks_nothing_and_change_nothing(engines, family) -> None:
    engine = engines[family]
    side = 28
    unit = engine.model.temporal_patch_size
    frames = _footage(unit, side)
    stamps = [i / FPS for i in range(len(frames))]
    spec = StreamSpec(height=side, width=side, fps=FPS, static_threshold=THRESHOLD)
    engine.open_stream("direct", spec)
    judged = engine.open_stream("judged", spec)
    hold = PushHold.of(judged, limit=2 * unit)  # a backlog of 2 patches at most
    assert hold is not None and hold.pruner.cells == engine.streams["judged"].pruner.cells
    assert PushHold.of(engine.open_stream("off", dataclasses.replace(
        spec, static_threshold=0.0)), 2) is None  # threshold 0: no judge, pushes as today
    engine.close_stream("off")
    ranks = _Ranks(engine)
    said: list[tuple[Appended, Appended, bool]] = []

    async def push(at: int, count: int) -> None:
        part, times = frames[at:at + count], stamps[at:at + count]
        want = engine.append("direct", part, times)
        before = len(ranks.ops)
        got, wait = await held_append(hold, ranks.admit, "judged", part, times)
        said.append((_bare(want), _bare(got), wait is None))
        assert (len(ranks.ops) == before) == (wait is None), "a held push reached the ranks"

    async def run() -> None:
        at = 0
        for count in PUSHES[unit]:
            if at <= (CHANGES[1] + 1) * unit - 1 < at + count:  # the second change's push:
                ranks.refuse = True  # the queue refuses it, nothing changes, it comes again
                with pytest.raises(ClientError, match="queue is full"):
                    await held_append(hold, ranks.admit, "judged", frames[at:at + count],
                                      stamps[at:at + count])
            await push(at, count)
            at += count
        assert at == len(frames)

    asyncio.run(run())
    assert [w for w, _, _ in said] == [g for _, g, _ in said], said
    kept = [w.kept > 0 for w, _, _ in said]
    first = kept.index(True)
    # held: exactly the pushes after the first kept patch that keep none, but for those the
    # backlog's limit sent (their answer is the ranks' own)
    held = [h for _, _, h in said]
    assert all(not (h and k) for h, k in zip(held, kept)) and not any(held[:first + 1])
    assert sum(held) >= 3 and sum(not h and not k for h, k in zip(held, kept)) >= 1, said
    assert sum(held) == hold.pushes_held
    # the backlog (the last pushes, none kept) counted as the ranks will count it
    assert hold.counted(engine.describe_stream("judged")).frames_appended == len(frames)
    assert hold.counted(engine.describe_stream("judged")).patches_pruned == \
        engine.describe_stream("direct").patches_pruned
    asyncio.run(_last(engine, hold, ranks, frames, stamps, side))
    assert _state(engine, "judged") == _state(engine, "direct")
    assert _answer(engine, "judged") == _answer(engine, "direct")
    for sid in ("direct", "judged"):
        engine.close_stream(sid)


async def _last(engine: Engine, hold: PushHold, ranks: _Ranks, frames: torch.Tensor,
                stamps: list[float], side: int) -> None:
    """A last change sent after the backlog: first failing on the rank once its held pushes
    were taken (the judging stops), then again (the backlog resent, skipped there); the
    same push with a frame of the wrong size is refused whole (its held pushes too)."""
    unit = engine.model.temporal_patch_size
    black = torch.zeros(unit, 3, side, side, dtype=torch.uint8)
    times = [stamps[-1] + (i + 1) / FPS for i in range(unit)]
    want = engine.append("direct", black, times)
    backlog = len(hold.backlog)
    assert backlog >= 1
    before = engine.describe_stream("judged")
    with pytest.raises(ValueError, match="frames are"):  # checked with its held pushes
        apply(Append("judged", black[:, :, :-2], tuple(times), tuple(hold.backlog)), engine)
    assert engine.describe_stream("judged") == before
    ranks.fail = True
    with pytest.raises(ClientError, match="failed on the ranks"):
        await held_append(hold, ranks.admit, "judged", black, times)
    assert not hold.judging and len(hold.backlog) == backlog
    got, wait = await held_append(hold, ranks.admit, "judged", black, times)
    assert wait is not None and _bare(got) == _bare(want) and want.kept == 1
    assert hold.backlog == [] and len(ranks.ops[-1].held) == backlog
