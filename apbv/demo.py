"""The embedded default job: the whole pipeline on local CPU ranks, spava next to exact.

It writes (once, under .cache/) the tiny random Qwen2.5-VL checkpoint and a synthetic test
video, starts ``world_size`` gloo ranks, loads the engine on each, and answers one question in
spava and in exact mode. It prints each answer with its TTFT breakdown and whether the two
modes agree. The tiny model's weights are random, so the answer is not meaningful text; what
the demo shows is the machinery and the agreement.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from apbv.config import RuntimeConfig
from apbv.distributed import DistInfo, spawn_local

CACHE = Path(".cache")
DEMO_VIDEO = CACHE / "demo-40s.mp4"
DEMO_MODES = ("spava", "exact")


def _ensure_inputs(cfg: RuntimeConfig, video: str | None) -> str:
    model_dir = Path(cfg.model.path)
    if not model_dir.exists():
        from apbv.model.tiny import write_tiny_checkpoint

        print(f"[apbv] writing the tiny test checkpoint to {model_dir} ...", file=sys.stderr)
        write_tiny_checkpoint(model_dir)
    if video is not None:
        return video
    if not DEMO_VIDEO.exists():
        from apbv.synthetic import write_test_video

        print(f"[apbv] writing a 40 s test video to {DEMO_VIDEO} ...", file=sys.stderr)
        DEMO_VIDEO.parent.mkdir(parents=True, exist_ok=True)
        write_test_video(DEMO_VIDEO, num_frames=160, fps=4.0, width=224, height=224)
    return str(DEMO_VIDEO)


def _rank_job(info: DistInfo, cfg: RuntimeConfig, video: str, question: str) -> list[dict]:
    from apbv.engine.engine import Engine

    engine = Engine(cfg, info)
    results = []
    for mode in DEMO_MODES:
        results.append(engine.generate(engine.request(video, question, mode=mode)).to_json())
        if info.rank == 0:
            print(f"[apbv] {mode}: done", file=sys.stderr, flush=True)
    return results


def run_pipeline_demo(
    cfg: RuntimeConfig, *, world_size: int, video: str | None, question: str, as_json: bool
) -> bool:
    """Run the demo and print its report; returns whether spava and exact gave the same tokens
    (spava is approximate: on a random tiny model they may differ, which is not an error)."""
    video = _ensure_inputs(cfg, video)
    print(f"[apbv] {world_size} gloo rank(s), model {cfg.model.path}, video {video}",
          file=sys.stderr, flush=True)
    results: list[dict[str, Any]] = spawn_local(
        _rank_job, world_size, (cfg, video, question),
        timeout_s=1800, collective_timeout_s=cfg.parallel.timeout_s,
    )[0]
    first = results[0]
    print(f"question: {question!r}")
    print(f"prompt: {first['context_len']} context + {first['query_len']} query tokens from "
          f"{first['frames']} frames; anchor {first['anchor_len']}, passing "
          f"{first['passing_len']} per block; {world_size} ranks")
    stages = list(first["seconds"])
    print(f"\n{'mode':<7} {'TTFT s':>7} " + " ".join(f"{s:>11}" for s in stages) + "  answer")
    for r in results:
        times = " ".join(f"{r['seconds'][s]:>11.3f}" for s in stages)
        print(f"{r['mode']:<7} {r['ttft_s']:>7.3f} {times}  {r['answer']!r}")
    spava, exact = results
    agree = spava["token_ids"] == exact["token_ids"]
    same = next((i for i, (a, b) in enumerate(zip(spava["token_ids"], exact["token_ids"]))
                 if a != b), min(len(spava["token_ids"]), len(exact["token_ids"])))
    print(f"\nvideo embeddings moved between ranks: {first['embedding_bytes']} bytes "
          f"(an all-gather would move {first['allgather_bytes']})")
    print(f"spava tokens: {spava['token_ids']}\nexact tokens: {exact['token_ids']}")
    if agree:
        print("spava and exact agree on every token")
    else:
        print(f"spava and exact agree on the first {same} token(s); this checkpoint has random "
              "weights, which amplify any approximation (exact mode is the one that must match "
              "full attention, and the tests check that it does)")
    if as_json:
        print(json.dumps({"question": question, "results": results, "agree": agree}))
    return agree
