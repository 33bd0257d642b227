"""The embedded default job: the whole pipeline on local CPU ranks, spava next to exact.

By default it asks the tiny Qwen2.5-VL trained on synthetic needle videos (shipped in
``apbv/assets/needle-tiny``; :mod:`apbv.synthetic.train_tiny`) about a generated held-out needle
video of about 8k prompt tokens (:mod:`apbv.synthetic.needles`; frames made in memory and handed to
the engine already decoded), starts ``world_size`` gloo ranks, loads the engine on each, and answers
in spava and in exact mode. It prints the question, the right answer, each mode's answer (marked
right or wrong) with its TTFT breakdown, and whether the two modes agree. With ``--json`` that
report goes to stderr and stdout holds only one JSON line (as ``generate --json``).

With ``--video FILE`` it answers a question about that file instead, with the configured model
(by default the tiny random checkpoint, written once under .cache/, whose answers are noise:
that run shows the machinery and the agreement only).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apbv.config import RuntimeConfig
from apbv.distributed import DistInfo, spawn_local
from apbv.modes import get_mode

if TYPE_CHECKING:
    from apbv.synthetic.needles import NeedleSample

CACHE = Path(".cache")
DEMO_VIDEO = CACHE / "demo-40s.mp4"
DEMO_MODES = ("spava", "exact")
FILE_QUESTION = "What colour is the square at the end?"
NEEDLE = {"kind": "retrieval", "tokens": 8192, "seed": 2026, "index": 0, "depth": 0.3}
"""The default job's video: a held-out retrieval sample (the trainer never sees seed 2026)."""


def needle_sample(job: dict[str, Any] = NEEDLE) -> NeedleSample:
    from apbv.synthetic.needles import make_sample, patches_for_tokens

    return make_sample(job["kind"], patches=patches_for_tokens(job["tokens"]), seed=job["seed"],
                       index=job["index"], depth=job["depth"])


def _ensure_inputs(cfg: RuntimeConfig, video: str | None) -> str:
    model_dir = Path(cfg.model.path)
    if not model_dir.exists():
        from apbv.model.qwen2_5_vl.tiny import write_tiny_checkpoint

        print(f"[apbv] writing the tiny test checkpoint to {model_dir} ...", file=sys.stderr)
        write_tiny_checkpoint(model_dir)
    if video is not None:
        return video
    if not DEMO_VIDEO.exists():
        from apbv.synthetic.videos import write_test_video

        print(f"[apbv] writing a 40 s test video to {DEMO_VIDEO} ...", file=sys.stderr)
        DEMO_VIDEO.parent.mkdir(parents=True, exist_ok=True)
        write_test_video(DEMO_VIDEO, num_frames=160, fps=4.0, width=224, height=224)
    return str(DEMO_VIDEO)


def _rank_job(info: DistInfo, cfg: RuntimeConfig, video: str | None,
              question: str) -> list[dict]:
    from apbv.engine.engine import Engine
    from apbv.engine.request import Request

    engine = Engine(cfg, info)
    results = []
    for mode in DEMO_MODES:
        if video is None:  # the needle video, made on every rank alike
            request = Request(video=needle_sample().video(), question=question,
                              mode=get_mode(mode),
                              max_new_tokens=cfg.generate.max_new_tokens)
        else:
            request = engine.request(video, question, mode=mode)
        results.append(engine.generate(request).to_json())
        if info.rank == 0:
            print(f"[apbv] {mode}: done", file=sys.stderr, flush=True)
    return results


def run_pipeline_demo(
    cfg: RuntimeConfig, *, world_size: int, video: str | None, question: str | None,
    as_json: bool, model_given: bool = False,
) -> bool:
    """Run the demo and print its report (to stderr with ``as_json``: stdout then holds only
    the JSON line); returns whether spava and exact gave the same tokens (spava is approximate:
    they may differ, which is not an error).

    Without ``video``: the needle video, and the trained tiny checkpoint unless
    ``model_given``. With ``video``: that file and ``cfg``'s model."""
    expected = None
    if video is None:
        sample = needle_sample()
        question, expected = question or sample.question, sample.answer
        if not model_given:
            import dataclasses

            from apbv.assets import needle_tiny

            cfg = dataclasses.replace(
                cfg, model=dataclasses.replace(cfg.model, path=str(needle_tiny())))
        where = ", ".join(f"second {t}" for t, _ in sample.needles)
        shown = (f"generated needle video, {sample.frames.shape[0]} frames of "
                 f"{sample.frames.shape[-1]}x{sample.frames.shape[-2]} at {sample.fps:g} fps "
                 f"(in memory), noise with a {sample.answer} flash at {where}")
    else:
        video = _ensure_inputs(cfg, video)
        question, shown = question or FILE_QUESTION, video
    print(f"[apbv] {world_size} gloo rank(s), model {cfg.model.path}, video {shown}",
          file=sys.stderr, flush=True)
    results: list[dict[str, Any]] = spawn_local(
        _rank_job, world_size, (cfg, video, question),
        timeout_s=1800, collective_timeout_s=cfg.parallel.timeout_s,
    )[0]
    first = results[0]
    say = functools.partial(print, file=sys.stderr if as_json else sys.stdout)
    say(f"question: {question!r}")
    if expected is not None:
        say(f"video: {shown}\nright answer: {expected!r}")
    say(f"prompt: {first['context_len']} context + {first['query_len']} query tokens from "
        f"{first['frames']} frames; anchor {first['anchor_len']}, passing "
        f"{first['passing_len']} per block; {world_size} ranks")
    stages = list(first["seconds"])
    say(f"\n{'mode':<7} {'TTFT s':>7} " + " ".join(f"{s:>11}" for s in stages) + "  answer")
    for r in results:
        times = " ".join(f"{r['seconds'][s]:>11.3f}" for s in stages)
        mark = "" if expected is None else (
            "  (right)" if r["answer"].strip() == expected else "  (WRONG)")
        say(f"{r['mode']:<7} {r['ttft_s']:>7.3f} {times}  {r['answer']!r}{mark}")
    spava, exact = results
    agree = spava["token_ids"] == exact["token_ids"]
    same = next((i for i, (a, b) in enumerate(zip(spava["token_ids"], exact["token_ids"]))
                 if a != b), min(len(spava["token_ids"]), len(exact["token_ids"])))
    say(f"\nvideo embeddings moved between ranks: {first['embedding_bytes']} bytes "
        f"(an all-gather would move {first['allgather_bytes']})")
    say(f"spava tokens: {spava['token_ids']}\nexact tokens: {exact['token_ids']}")
    if agree:
        say("spava and exact agree on every token")
    else:
        note = ("this checkpoint has random weights, which amplify any approximation"
                if expected is None else "spava's attention is approximate")
        say(f"spava and exact agree on the first {same} token(s); {note} (exact mode is the "
            "one that must match full attention, and the tests check that it does)")
    if as_json:
        print(json.dumps({"question": question, "expected": expected, "results": results,
                          "agree": agree}))
    return agree
