"""The cost model's predicted TTFT and stages next to bench_ttft's measurements (markdown table).

    python benchmarks/cost_vs_measured.py benchmarks/results/ttft_cpu_medium.jsonl \
        --size medium --hardware benchmarks/results/cpu_calibration.json --min-tokens 16000
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from apbv import cost
from apbv.model.qwen2_5_vl.tiny import write_tiny_checkpoint

STAGES = ("preprocess", "vision", "prefill")
"""Stage columns: measured / predicted seconds."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jsonl", help="bench_ttft output")
    parser.add_argument("--size", default="medium", choices=("tiny", "medium"),
                        help="the random model the benchmark ran")
    parser.add_argument("--model", help="the checkpoint the benchmark ran (config.json and chat "
                        "template); default: the random model of --size, written to a "
                        "temporary directory")
    parser.add_argument("--hardware", default="benchmarks/results/cpu_calibration.json")
    parser.add_argument("--min-tokens", type=int, default=16000)
    args = parser.parse_args(argv)
    if args.model:
        dims = cost.checkpoint_dims(args.model)
    else:
        with tempfile.TemporaryDirectory(prefix="apbv-cost-") as tmp:
            dims = cost.checkpoint_dims(write_tiny_checkpoint(Path(tmp) / "m", size=args.size))
    hw = cost.hardware(args.hardware)
    print("| mode | prompt tokens | measured TTFT s | predicted s | error | "
          + " | ".join(STAGES) + " |")
    print("|---|---:|---:|---:|---:|" + "---|" * len(STAGES))
    with open(args.jsonl) as f:
        rows = [json.loads(line) for line in f]
    for r in rows:
        tokens = r["context_len"] + r["query_len"]
        if tokens < args.min_tokens or r.get("variant", "new") != "new":
            continue  # the model predicts the runtime's default path
        video = r["video"]
        predicted = cost.predict(
            r["mode"], dims, context_len=r["context_len"], query_len=r["query_len"],
            world_size=r["ranks"], frames=r["frames"],
            grid=(video["height"] // 28, video["width"] // 28), hw=hw,
            source_pixels=video["height"] * video["width"],
        )
        error = (predicted.ttft_s - r["ttft_s"]) / r["ttft_s"]
        stages = " | ".join(f"{r['seconds'][s]:.2f} / {predicted.seconds[s]:.2f}" for s in STAGES)
        print(f"| {r['mode']} | {tokens} | {r['ttft_s']:.2f} | {predicted.ttft_s:.2f} | "
              f"{error:+.0%} | {stages} |")


if __name__ == "__main__":
    main()
