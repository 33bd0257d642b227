"""Attention kernels side by side on one GPU: torch's bundled flash kernel against the paths it
replaces (docs/kernels.md).

    python benchmarks/bench_kernels.py                  # CUDA, Qwen2.5-VL-7B heads (28/4, D 128)
    python benchmarks/bench_kernels.py --dry-run        # CPU, toy sizes: the plumbing only

Rows:
- ``attention`` (the ``sdpa`` backend) on a rank's share of a 92k-token prompt on 8 ranks
  (11.5k rows), bottom-right causal with fewer rows than keys, and one decode row: the bundled
  kernel against the SDPA kernels it falls back to (one call per query-head group when causal,
  a prefix split), and flash-attn when installed;
- the captured decode's owner attention (``attention_upto``) over a reserved buffer of 11.5k
  and 74k rows (92k and 594k tokens on 8 ranks), all rows valid or an eighth of them: the
  bundled kernel with ``seqused_k`` against the fp32 einsum over the whole buffer.

Each time is the best of ``--repeats`` runs of ``--calls`` back-to-back calls, divided by
``--calls`` (the device synchronised around each run). Prints a table with the ratios, then
one JSON line. In a dry run the bundled kernel is refused (CPU tensors), so both columns time
the same fallback and no ratio means anything.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch

from apbv.attention import bundled_flash, kernels

HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128
SIZES = {
    "gpu": {"rows": 11_520, "split": (4_096, 16_384), "buffers": (11_520, 73_728)},
    "dry": {"rows": 64, "split": (16, 64), "buffers": (64, 256)},
}


@contextmanager
def _bundled_refused():
    """kernels.attention/attention_upto as on a device that refuses the bundled kernel."""
    real = bundled_flash.refusal_for
    bundled_flash.refusal_for = lambda q: "refused for the comparison"  # type: ignore[assignment]
    try:
        yield
    finally:
        bundled_flash.refusal_for = real  # type: ignore[assignment]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], Any], device: torch.device, calls: int, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _qkv(tq: int, tk: int, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(1, t, h, HEAD_DIM, device=device, dtype=dtype)
            for t, h in ((tq, HEADS), (tk, KV_HEADS), (tk, KV_HEADS))]


def run(device: torch.device, dtype: torch.dtype, sizes: dict, calls: int,
        repeats: int) -> list[dict[str, Any]]:
    rows = []
    n, (sq, sk) = sizes["rows"], sizes["split"]
    with_flash = device.type == "cuda" and kernels.flash_available()
    for name, (tq, tk) in {f"causal {n} x {n}": (n, n), f"causal {sq} x {sk}": (sq, sk),
                           f"decode row x {n}": (1, n)}.items():
        q, k, v = _qkv(tq, tk, device, dtype)

        def call(backend: str = "sdpa", q=q, k=k, v=v) -> Any:
            return kernels.attention(q, k, v, causal=True, backend=backend)

        row = {"call": f"attention, {name}", "new": _time(call, device, calls, repeats)}
        with _bundled_refused():
            row["old"] = _time(call, device, calls, repeats)
        if with_flash:
            row["flash-attn"] = _time(lambda: call("flash"), device, calls, repeats)
        rows.append(row)
    for c in sizes["buffers"]:
        q, k, v = _qkv(1, c, device, dtype)
        for valid in (c, c // 8):
            length = torch.tensor([valid], device=device)
            row = {"call": f"owner, {valid} of {c} rows valid",
                   "new": _time(lambda q=q, k=k, v=v, n=length: kernels.attention_upto(
                       q, k, v, n, HEAD_DIM**-0.5), device, calls, repeats),
                   "old": _time(lambda q=q, k=k, v=v, n=length: kernels.attention_upto_einsum(
                       q, k, v, n, HEAD_DIM**-0.5), device, calls, repeats)}
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, toy sizes")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.dry_run:
        device, dtype, sizes = torch.device("cpu"), torch.float32, SIZES["dry"]
    elif not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA device (or --dry-run)", file=sys.stderr)
        return 2
    else:
        device, dtype, sizes = torch.device("cuda"), torch.bfloat16, SIZES["gpu"]
    probe = torch.empty(1, 1, HEADS, HEAD_DIM, device=device, dtype=dtype)
    why = bundled_flash.refusal_for(probe)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    print(f"# {where}, torch {torch.__version__}, {dtype}, heads {HEADS}/{KV_HEADS}, "
          f"D {HEAD_DIM}; bundled kernel: {why or 'used'}")
    print("new = torch's bundled flash kernel; old = SDPA kernels (attention) or the fp32 "
          "einsum (owner)")
    rows = run(device, dtype, sizes, args.calls, args.repeats)
    flash = any("flash-attn" in r for r in rows)
    print("| call | new ms | old ms | old / new |" + (" flash-attn ms |" if flash else ""))
    print("|---|---:|---:|---:|" + ("---:|" if flash else ""))
    for r in rows:
        extra = f" {r['flash-attn'] * 1e3:.3f} |" if "flash-attn" in r else ""
        ratio = "-" if why else f"{r['old'] / r['new']:.2f}"  # refused: the same path twice
        print(f"| {r['call']} | {r['new'] * 1e3:.3f} | {r['old'] * 1e3:.3f} | {ratio} |{extra}")
    print(json.dumps({"device": where, "torch": torch.__version__, "bundled": why or "used",
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
