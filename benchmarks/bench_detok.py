"""Streamed text per token: the incremental detokenizer against re-decoding the whole answer.

    python benchmarks/bench_detok.py                        # 100 and 1000 tokens
    python benchmarks/bench_detok.py --lengths 100 1000 4000 --stop "</answer>"

For each answer length, the same token ids (text of the tokenizer's own vocabulary, English,
accents and CJK) go through :class:`apbv.openai.detok.IncrementalText` (what the server's SSE
writer uses) and through the old way (decode every token so far, then cut at the stop texts),
each the best of ``--repeats`` runs; the seconds per token are printed, and the ratio of the
longest answer's per-token time to the shortest's (flat: about 1; the old way grows with the
length). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from apbv.engine.request import cut_at_stop
from apbv.openai.detok import IncrementalText

ASSET = Path(__file__).resolve().parents[1] / "apbv" / "assets" / "needle-tiny"
TEXT = ("The square in the video is magenta; it moves from the left edge to the centre. "
        "Café, naïve, 日本語のテキスト, and a few more words to vary the tokens. ")


def incremental(tokenizer, ids: list[int], stop: tuple[str, ...]) -> str:
    text = IncrementalText(tokenizer, stop)
    return "".join(text.add(i) for i in ids)


def whole(tokenizer, ids: list[int], stop: tuple[str, ...]) -> str:
    """The previous SSE writer: the whole answer decoded again for every token."""
    seen: list[int] = []
    sent = ""
    for i in ids:
        seen.append(i)
        text, _ = cut_at_stop(tokenizer.decode(seen, skip_special_tokens=True), stop)
        if text.startswith(sent) and not text.endswith("\ufffd"):
            sent = text
    return sent


def per_token(fn, tokenizer, ids: list[int], stop: tuple[str, ...], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(tokenizer, ids, stop)
        best = min(best, time.perf_counter() - start)
    return best / len(ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ASSET), help="a checkpoint with a tokenizer")
    p.add_argument("--lengths", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--stop", action="append", default=[], help="stop texts (none by default)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    base = tokenizer.encode(TEXT, add_special_tokens=False)
    stop = tuple(args.stop)
    rows = []
    for n in args.lengths:
        ids = (base * (n // len(base) + 1))[:n]
        rows.append({"tokens": n,
                     "incremental_s": per_token(incremental, tokenizer, ids, stop, args.repeats),
                     "whole_s": per_token(whole, tokenizer, ids, stop,
                                          max(1, args.repeats // 2))})
    print(f"{'tokens':>7} {'incremental us/token':>21} {'re-decode us/token':>19}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['incremental_s'] * 1e6:>21.1f} {r['whole_s'] * 1e6:>19.1f}")
    first, last = rows[0], rows[-1]
    ratio = {k: last[k] / first[k] for k in ("incremental_s", "whole_s")}
    print(f"per-token time at {last['tokens']} / at {first['tokens']} tokens: incremental "
          f"{ratio['incremental_s']:.2f}, re-decode {ratio['whole_s']:.2f}")
    print(json.dumps({"rows": rows, "ratio": ratio}))


if __name__ == "__main__":
    main()
