"""The command line and the benchmark run on tiny inputs and emit what they promise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from apbv.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


def test_plan_command(capsys) -> None:
    assert main(["plan", "--context-len", "1000", "--query-len", "9", "--world-size", "3"]) == 0
    out = capsys.readouterr().out
    assert "N=1000" in out and "H=3" in out and "A=16" in out and "P=8" in out


def test_bad_arguments_exit_2_with_message(capsys) -> None:
    assert main(["plan", "--world-size", "0"]) == 2
    assert "world_size must be >= 1, got 0" in capsys.readouterr().err
    assert main(["attention-demo", "--heads", "6", "--kv-heads", "4"]) == 2
    assert "heads (6) must be a multiple of kv_heads (4)" in capsys.readouterr().err
    assert main(["attention-demo", "--anchor-len", "5000", "--context-len", "100"]) == 2
    assert "anchor_len (5000) must not exceed context_len (100)" in capsys.readouterr().err


def test_attention_demo_checks_pass_and_json(capsys) -> None:
    args = ["attention-demo", "--context-len", "300", "--query-len", "8", "--heads", "4",
            "--kv-heads", "2", "--head-dim", "16", "--json"]
    assert main(args) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["checks"] == {
        "exact equals causal attention": True,
        "spava query rows are exact": True,
        "no_overlap equals spava": True,
    }
    assert report["modes"]["exact"]["max_err_context_rows"] <= 1e-5
    assert report["modes"]["spava"]["max_err_context_rows"] > 1e-3  # spava is approximate
    assert "PASS  exact equals causal attention" in out


def test_attention_benchmark_emits_json() -> None:
    cmd = [sys.executable, "benchmarks/bench_attention.py", "--context-lens", "256,512",
           "--query-len", "8", "--warmup", "0", "--repeats", "1"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["benchmark"] == "bench_attention"
    assert [row["context_len"] for row in report["rows"]] == [256, 512]
    for row in report["rows"]:
        for key in ("spava_s", "exact_s", "full_s"):
            assert row[key] > 0, (key, row)
        assert 0 < row["predicted_spava_over_exact"] < 1
