"""The command line and the benchmark run on tiny inputs and emit what they promise."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from apbv.__main__ import main

ROOT = Path(__file__).resolve().parents[2]


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


def test_plan_with_model_prints_memory(capsys, tiny_model_dir) -> None:
    assert main(["plan", "--context-len", "5000", "--world-size", "2",
                 "--model", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    assert "memory per rank (2 layers, 2 KV heads x 16" in out
    assert out.count("prompt KV cache") == 2


def test_generate_single_process_json(capsys, tiny_model_dir, short_video) -> None:
    args = ["generate", "--config", "tiny_cpu", "--model", str(tiny_model_dir),
            "--video", str(short_video), "--question", "What is shown?",
            "--max-new-tokens", "3", "--mode", "exact", "--json"]
    assert main(args) == 0
    captured = capsys.readouterr()
    out = captured.out  # --json: the JSON line only, the human lines on stderr
    result = json.loads(out)
    assert result["mode"] == "exact" and result["world_size"] == 1
    assert 1 <= len(result["token_ids"]) <= 3 and isinstance(result["answer"], str)
    assert result["ttft_s"] == pytest.approx(sum(
        result["seconds"][s] for s in ("preprocess", "vision", "transfer", "prefill",
                                       "first_token")))
    assert "TTFT" in captured.err and "answer:" in captured.err


def test_generate_errors_exit_2(capsys, tmp_path, short_video) -> None:
    assert main(["generate", "--video", str(short_video), "--question", "q"]) == 2
    assert "no model: pass --model DIR" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "absent"), "--video",
                 str(short_video), "--question", "q"]) == 2
    assert "absent' does not exist" in capsys.readouterr().err
    assert main(["generate", "--config", "nope", "--video", "v", "--question", "q"]) == 2
    assert "config 'nope' not found; presets:" in capsys.readouterr().err


def test_generate_max_pixels_below_the_default_floor(tiny_model_dir, short_video) -> None:
    """--max-pixels 50176 is below qwen-vl-utils' default min_pixels (100352): the cap wins."""
    cmd = [sys.executable, "-m", "apbv", "generate", "--config", "tiny_cpu", "--model",
           str(tiny_model_dir), "--video", str(short_video), "--question", "What is shown?",
           "--max-pixels", "50176", "--max-new-tokens", "1", "--json"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["frames"] == 12 and len(report["token_ids"]) == 1


@pytest.mark.parametrize("flags, message", [
    (["--fps", "nan"], "error: video.fps must be a finite number (> 0), got nan"),
    (["--set", "parallel.timeout_s=nan"],
     "error: parallel.timeout_s must be a finite number (> 0 and <= 86400), got nan"),
    (["--set", "generate.max_new_tokens=8.5"],
     "error: generate.max_new_tokens must be an integer in 1 .. 32768, got 8.5 (float)"),
    (["--set", "video.nframes=8.0"], "error: video.nframes must be an integer >= 2, got 8.0 "
                                     "(float)"),
    (["--min-pixels", "1000", "--max-pixels", "999"],
     "error: video.max_pixels must be >= video.min_pixels (1000), got 999"),
])
def test_bad_config_numbers_exit_2_one_line(capsys, short_video, flags, message) -> None:
    args = ["generate", "--config", "tiny_cpu", "--model", "m", "--video", str(short_video),
            "--question", "q", *flags]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [message], err


def test_nccl_without_cuda_exits_2(capsys, short_video, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ["generate", "--config", "tiny_cpu", "--model", "m", "--video", str(short_video),
            "--question", "q", "--set", "parallel.backend=nccl"]
    assert main(args) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: parallel.backend=nccl needs CUDA, which is not available; use gloo or auto"]


def test_generate_under_torchrun(tiny_model_dir, short_video) -> None:
    env = dict(os.environ, NPROC="2", PYTHON=sys.executable, LOG_RANK="all")  # both ranks' logs
    cmd = ["bash", "launch/generate.sh", "--model", str(tiny_model_dir), "--video",
           str(short_video), "--question", "What is shown?", "--max-new-tokens", "2", "--json"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["world_size"] == 2 and report["mode"] == "spava"
    assert 0 < report["embedding_bytes"] < report["allgather_bytes"]
    # The model load's progress: on rank 0's stderr (start, end, ranks loaded), no other rank's.
    lines = result.stderr.splitlines()
    size = f"{(tiny_model_dir / 'model.safetensors').stat().st_size / 1e6:.1f} MB"
    assert f"rank 0: loading the model: 1 safetensors shard(s), {size}" in lines, lines
    end = [line for line in lines if line.startswith("rank 0: model loaded in ")]
    assert len(end) == 1 and re.search(rf"\(1 shard\(s\), {re.escape(size)}\); "
                                       r"ranks loaded: (2/2|1/2 \(waiting for 1\))$", end[0]), lines
    assert not [line for line in lines if line.startswith("rank 1: ") and "load" in line], lines


def test_pipeline_demo(capsys, tiny_model_dir, short_video) -> None:
    args = ["demo", "--set", f"model.path={str(tiny_model_dir)!r}", "--video",
            str(short_video), "--max-new-tokens", "2", "--json"]
    assert main(args) == 0
    captured = capsys.readouterr()  # --json: the JSON alone on stdout, the report on stderr
    report = json.loads(captured.out)
    assert [r["mode"] for r in report["results"]] == ["spava", "exact"]
    assert report["agree"] == (report["results"][0]["token_ids"]
                               == report["results"][1]["token_ids"])
    assert "spava and exact" in captured.err


def test_ttft_benchmark_emits_json_table_and_plot(tmp_path) -> None:
    stem = tmp_path / "ttft"
    cmd = [sys.executable, "benchmarks/bench_ttft.py", "--frames", "8", "--resolutions",
           "112x112", "--modes", "spava,exact,full", "--old-modes", "spava",
           "--pipelined-modes", "spava", "--repeats", "1", "--out", str(stem)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["benchmark"] == "bench_ttft" and summary["rows"] == 5
    rows = [json.loads(line) for line in stem.with_suffix(".jsonl").read_text().splitlines()]
    assert [(r["mode"], r["variant"]) for r in rows] == [
        ("spava", "new"), ("spava", "old"), ("spava", "pipelined"), ("exact", "new"),
        ("full", "new")]
    # The three paths take turns on one engine (Engine.set_vision) and give the same tokens.
    assert rows[0]["token_ids"] == rows[1]["token_ids"] == rows[2]["token_ids"]
    assert all(r["rss_peak_mib_max"] > 0 for r in rows)
    side = stem.with_suffix(".md").read_text()
    assert "vision" in side and "(new/old" in side and "(pipelined/new" in side, side
    rows = [r for r in rows if r["variant"] == "new"]
    for r in rows:
        assert r["ttft_s"] > 0 and r["ttft_over_full"] > 0
        assert isinstance(r["first_token_agrees_with_exact"], bool)
    assert rows[1]["first_token_agrees_with_exact"]  # exact agrees with itself
    assert rows[2]["world_size"] == 1 and rows[0]["world_size"] == 2
    table = stem.with_suffix(".md").read_text().splitlines()
    assert len([line for line in table if line.startswith("| ")]) == 6  # header + 5 rows
    assert stem.with_suffix(".png").stat().st_size > 1000


def test_vision_benchmark_times_every_variant_and_they_agree(tmp_path) -> None:
    stem = tmp_path / "vision"
    cmd = [sys.executable, "benchmarks/bench_vision.py", "--temporal-patches", "3", "--grid",
           "8x12", "--chunk-rows", "96", "--repeats", "2", "--parts", "--out", str(stem)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(stem.with_suffix(".json").read_text())
    rows = {r["variant"]: r for r in report["rows"]}
    assert list(rows) == ["old", "+ grouped, linear", "+ fused rotary", "+ chunks",
                          "+ pixel levels = new", "chunks only"]
    assert rows["old"]["over_old"] == 1.0 and all(r["median_s"] > 0 for r in rows.values())
    # Exact variants: only the linear patch embedding's fp32 rounding separates them.
    scale = report["output_scale"]
    assert rows["chunks only"]["max_abs_diff"] == 0.0, rows["chunks only"]
    for r in rows.values():
        assert r["max_abs_diff"] <= 1e-5 * scale, (r, scale)
    assert "| + pixel levels = new |" in stem.with_suffix(".md").read_text()
    # --parts: both towers attend through SDPA and embed patches; every part is a time.
    for variant, parts in report["parts_ms"].items():
        assert parts["attention kernels (SDPA)"] > 0 and parts["patch embedding"] > 0, parts
        assert all(ms >= 0 for ms in parts.values()), (variant, parts)
        assert sum(ms for p, ms in parts.items() if p != "total") == pytest.approx(
            parts["total"], rel=1e-6), parts
    assert "Half of old is" in stem.with_suffix(".md").read_text()
    bad = subprocess.run([sys.executable, "benchmarks/bench_vision.py", "--grid", "7x8"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--grid sides must be even" in bad.stderr


def test_gpu_calibration_dry_run_writes_the_calibration_form(tmp_path) -> None:
    """scripts/gpu_check.sh's calibration, on CPU at toy sizes: the file calibrate_cpu.py's
    form and Hardware.from_json read, with the device-resize measurement (CPU vs CPU: 0)."""
    from apbv.cost import Hardware

    out = tmp_path / "dry.json"
    result = subprocess.run([sys.executable, "benchmarks/calibrate_gpu.py", "--dry-run",
                             "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    hw = Hardware.from_json(report["hardware"])
    assert hw.matmul_flops > 0 and hw.vision_layer_overhead_s > 0
    resize = report["measurements"]["device_resize"]
    assert resize["max_abs_diff_levels"] == 0 and resize["s_per_resized_pixel"] > 0, resize
    assert report["setup"]["device"] == "cpu (dry run)"


def test_memory_benchmark_measures_and_estimates(tmp_path) -> None:
    out = tmp_path / "memory.md"
    cmd = [sys.executable, "benchmarks/bench_memory.py", "--sizes", "tiny", "--frames", "8",
           "--set", "vision.pipeline=true", "--out", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    text = out.read_text()
    assert "with vision.pipeline=true" in text
    row = [line for line in text.splitlines() if line.startswith("| tiny | 8 |")]
    assert len(row) == 1, text
    measured, estimated, ratio = (float(x) for x in row[0].split("|")[4:7])
    assert measured > 0 and estimated > 0 and ratio == pytest.approx(estimated / measured,
                                                                     abs=0.02)
