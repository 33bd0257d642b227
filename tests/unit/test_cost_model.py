"""apbv.cost's model: hand-counted FLOPs and bytes, the schedule, config parsing, presets,
the predicted ordering of the modes, and the ``plan`` command's prediction table."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from apbv import cost
from apbv.__main__ import main
from apbv.cost import Hardware, ModelDims, predict
from apbv.modes import MODE_NAMES, get_mode
from apbv.ownership import VideoSpan, embedding_routes, transfer_bytes
from tests.cases import Case
from tests.oracle import visible_keys

ROOT = Path(__file__).resolve().parents[2]

# A model small enough to count by hand: q 8, k 4, v 4 per token; MLP 8 -> 16 -> 8.
SMALL = ModelDims(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16,
                  vocab=10, vision_depth=2, vision_hidden=8, vision_intermediate=16,
                  vision_heads=2, fullatt_blocks=1, video_start=cost.RELEASED_VIDEO_START)
UNIT = Hardware(name="unit", matmul_flops=1e9, conv_flops=1e9, attention_flops=1e9,
                attention_pair_s=0.0, memory_bw=1e9, link_bw=1e9, link_latency_s=1e-5,
                decode_s_per_pixel=1e-9, process_s_per_pixel=1e-9, preprocess_fixed_s=0.01,
                tokenize_s_per_token=1e-7, layer_overhead_s=1e-4, vision_layer_overhead_s=1e-4,
                call_overhead_s=1e-5)
H200 = cost.hardware("h200")
QWEN_7B = cost.preset_dims("qwen2.5-vl-7b")

# Qwen2.5-VL-7B-Instruct's config.json as released (flat form, abridged to what is read).
RELEASED_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "hidden_size": 3584,
    "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "vocab_size": 152064, "model_type": "qwen2_5_vl",
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
                      "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
                      "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                      "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                      "temporal_patch_size": 2},
}


def _video_prediction(mode: str, patches: int, tokens_per_patch: int, *, world_size: int = 8,
                      dims: ModelDims = QWEN_7B, hw: Hardware = H200) -> cost.Prediction:
    context = dims.video_start + patches * tokens_per_patch + 1
    return predict(mode, dims, context_len=context, query_len=64, world_size=world_size,
                   frames=2 * patches, tokens_per_patch=tokens_per_patch, hw=hw)


def test_presets_and_both_config_forms() -> None:
    from apbv.model.qwen2_5_vl.tiny import tiny_config

    assert cost.model_dims(RELEASED_7B, video_start=cost.RELEASED_VIDEO_START) == QWEN_7B
    assert (QWEN_7B.layers, QWEN_7B.hidden, QWEN_7B.heads, QWEN_7B.kv_heads,
            QWEN_7B.head_dim, QWEN_7B.intermediate) == (28, 3584, 28, 4, 128, 18944)
    small = cost.preset_dims("qwen2.5-vl-3b")
    assert (small.layers, small.hidden, small.heads, small.kv_heads, small.head_dim,
            small.intermediate, small.vocab) == (36, 2048, 16, 2, 128, 11008, 151936)
    for dims in (small, QWEN_7B):
        assert (dims.vision_depth, dims.vision_hidden, dims.vision_intermediate,
                dims.vision_heads, dims.fullatt_blocks, dims.window_tokens) == \
            (32, 1280, 3420, 16, 4, 4)
    # transformers v5's nested form, as the tiny checkpoint's config.json is written.
    nested = tiny_config("medium").to_dict()
    assert "text_config" in nested and "num_hidden_layers" not in nested
    medium = cost.model_dims(nested)
    assert (medium.layers, medium.hidden, medium.heads, medium.kv_heads, medium.head_dim,
            medium.intermediate, medium.vocab) == (4, 256, 4, 2, 64, 768, 151936)
    assert (medium.vision_depth, medium.vision_hidden, medium.vision_heads,
            medium.fullatt_blocks) == (2, 32, 2, 1)
    with pytest.raises(ValueError, match="no vision_config: not a Qwen2.5-VL checkpoint"):
        cost.model_dims({k: v for k, v in RELEASED_7B.items() if k != "vision_config"})
    with pytest.raises(ValueError, match="no intermediate_size in the top level"):
        cost.model_dims({k: v for k, v in RELEASED_7B.items() if k != "intermediate_size"})
    with pytest.raises(ValueError, match="unknown model preset 'qwen9'; allowed: qwen2.5-vl-3b"):
        cost.preset_dims("qwen9")


def test_linear_and_vision_flops_by_hand() -> None:
    # 2 temporal patches of 2x2 merged tokens (4x4 ViT patches), one per rank.
    p = predict("spava", SMALL, context_len=40, query_len=4, world_size=2, frames=4,
                tokens_per_patch=4, hw=UNIT)
    per_token_layer = 2 * (8 * 8 + 8 * 4 + 8 * 4 + 8 * 8 + 8 * 16 + 8 * 16 + 16 * 8)
    assert per_token_layer == 1152
    embed = 16 * 2 * (3 * 2 * 14 * 14) * 8  # conv patch embedding of 16 patches
    merger = 4 * 2 * (32 * 32 + 32 * 8)  # 4 merged tokens: 32 -> 32 -> 8
    blocks = 2 * 16 * 2 * (8 * 24 + 8 * 8 + 8 * 16 + 8 * 16 + 16 * 8)
    attention = 4 * 4 * 2 * (16 * 16 + 16 * 16)  # one window of 16 patches, one full block
    for r, rank in enumerate(p.ranks):
        assert rank.tokens == p.plan.local_len(r)
        assert rank.linear_flops == rank.tokens * 2 * per_token_layer + 2 * 8 * 10
        assert rank.temporal_patches == 1
        assert rank.vision_flops == embed + merger + blocks + attention == 368640
        assert rank.kv_bytes == rank.cached_tokens * 2 * 2 * 1 * 4 * 2  # K, V; 2 layers; bf16
    full = predict("full", SMALL, context_len=40, query_len=4, world_size=2, frames=4,
                   tokens_per_patch=4, hw=UNIT)
    assert len(full.ranks) == 1 and full.ranks[0].temporal_patches == 2
    assert full.ranks[0].vision_flops == 2 * 368640
    assert full.ranks[0].linear_flops == 44 * 2 * per_token_layer + 160


def test_grouped_vision_attention_counts_calls_per_window_size() -> None:
    """A 6x10 merged grid has windows of 4 and 2 rows by 4, 4 and 2 columns: 6 windows of 4
    sizes. Stock path: 6 calls per windowed block and temporal patch, plus one per full block
    and patch; grouped: 4 per windowed block and 1 per full block, for all patches."""
    def vision(attn: str) -> float:
        return predict("full", SMALL, context_len=300, query_len=4, world_size=1, frames=8,
                       grid=(6, 10), hw=UNIT, vision_attention=attn).ranks[0].seconds["vision"]

    calls = (vision("per_window") - vision("grouped")) / UNIT.call_overhead_s
    assert calls == pytest.approx(4 * (6 + 1) - (4 + 1))
    with pytest.raises(ValueError, match="grouped or per_window"):
        vision("windowed")


def test_pipeline_moves_the_frames_into_vision_and_overlaps_them_on_gpus() -> None:
    """vision.pipeline: the frame work F leaves preprocess; on a CPU (no host/device overlap)
    vision becomes F + V, on a GPU max(F, V) + min(F, V) / chunks, chunks of
    PIPELINE_CHUNK_ROWS // (tokens per patch * 4) temporal patches (here 4 per rank)."""
    from apbv.video.patches import PIPELINE_CHUNK_ROWS

    tokens = PIPELINE_CHUNK_ROWS // 4 // 3  # 3 temporal patches per chunk
    for hw in (UNIT, H200):
        plain, piped = (predict("spava", QWEN_7B, context_len=QWEN_7B.video_start + 20 * tokens
                                + 1, query_len=64, world_size=2, frames=40,
                                tokens_per_patch=tokens, hw=hw, pipeline=p)
                        for p in (False, True))
        for a, b in zip(plain.ranks, piped.ranks):
            frames = a.seconds["preprocess"] - b.seconds["preprocess"]
            assert frames > 0 and a.temporal_patches == 10
            vision = a.seconds["vision"]
            if hw.host_overlaps_device:
                want = max(frames, vision) + min(frames, vision) / 4  # ceil(10 / 3) chunks
            else:
                want = frames + vision
            assert b.seconds["vision"] == pytest.approx(want), hw.name
        assert piped.seconds["prefill"] == plain.seconds["prefill"]
    assert piped.ttft_s < plain.ttft_s  # on H200 the shorter of the two is mostly hidden


def test_each_frame_and_each_rank_s_open_of_the_video_by_hand() -> None:
    """``decode_frame_s`` per frame a rank decodes, ``video_open_s`` once per rank with
    video, both in preprocess; a prompt without video pays neither."""
    priced = dataclasses.replace(UNIT, decode_frame_s=1e-3, video_open_s=5e-3)
    tokens = 64
    for world in (1, 2):
        plain, more = (_video_prediction("spava", 8, tokens, world_size=world, dims=SMALL,
                                         hw=hw) for hw in (UNIT, priced))
        for a, b in zip(plain.ranks, more.ranks):
            frames = 2 * a.temporal_patches  # 16 frames over the ranks
            assert b.seconds["preprocess"] - a.seconds["preprocess"] == pytest.approx(
                5e-3 + frames * 1e-3), (world, a.seconds, b.seconds)
    text = [predict("spava", SMALL, context_len=512, query_len=64, world_size=2, frames=0,
                    hw=hw).seconds["preprocess"] for hw in (UNIT, priced)]
    assert text[0] == text[1], text


@pytest.mark.parametrize("mode", MODE_NAMES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_attention_work_is_the_counted_pairs(mode: str, world_size: int) -> None:
    if mode == "full" and world_size > 1:
        world_size = 1
    p = predict(mode, SMALL, context_len=997, query_len=13, world_size=world_size, frames=0,
                hw=UNIT)
    plan = get_mode(mode).plan(997, 13, world_size)
    assert p.plan == plan
    for r, rank in enumerate(p.ranks):
        pairs = cost.full_pairs(plan) if mode == "full" else cost.rank_pairs(plan, r)
        assert rank.attention_pairs == pairs
        assert rank.attention_flops == 2 * 4 * 4 * 2 * pairs  # layers * 4 * D * Hq


def test_attention_pairs_agree_with_the_oracle_masks() -> None:
    """Summed over ranks, the predicted pairs are the oracle's visible pairs plus the anchor
    rows every rank but one recomputes (the oracle itself is tested against the op)."""
    case = Case(97, 5, anchor_len=6, passing_len=4, kv_heads=1, heads=1)
    q, k, _ = case.inputs()
    dims = dataclasses.replace(SMALL, heads=1, kv_heads=1)
    for world_size in (2, 3):
        plan = case.plan(world_size)
        p = predict("spava", dims, context_len=97, query_len=5, world_size=world_size,
                    frames=0, hw=UNIT, anchor_len=6, passing_len=4)
        visible = int(visible_keys(q, k, plan)[0].sum())
        repeats = (world_size - 1) * 6 * 7 // 2
        assert sum(r.attention_pairs for r in p.ranks) == visible + repeats


def test_collective_bytes_by_hand() -> None:
    # N=100: A=2, P=1; 2H blocks of 24-25 tokens, so every passing buffer holds 1 row.
    for world_size in (2, 3):
        p = predict("spava", SMALL, context_len=100, query_len=4, world_size=world_size,
                    frames=0, hw=UNIT, dtype_bytes=2)
        assert p.plan.passing_capacity == 1
        kv_buffer = 2 * 1 * 1 * 4 * 2  # K and V, 1 row, 1 KV head, D=4, bf16
        query_buffer = 4 * 2 * (4 + 1) * 4  # Q=4 rows, 2 heads, D + lse, fp32
        per_layer = (world_size - 1) * (2 * kv_buffer + query_buffer)
        assert per_layer == (world_size - 1) * 192
        assert all(r.prefill_bytes == 2 * per_layer for r in p.ranks)
    assert predict("full", SMALL, context_len=100, query_len=4, world_size=2, frames=0,
                   hw=UNIT).ranks[0].prefill_bytes == 0


def test_embedding_transfer_bytes() -> None:
    # N=20 with 4 one-token patches at [15, 19): all in block 3, which rank 0 owns; rank 1
    # encoded patches 2 and 3, so it sends rank 0 two rows of hidden 8, bf16.
    p = predict("spava", SMALL, context_len=20, query_len=4, world_size=2, frames=8,
                tokens_per_patch=1, hw=UNIT, dtype_bytes=2)
    assert p.plan.blocks[3] == (15, 20)
    assert [r.transfer_bytes for r in p.ranks] == [2 * 8 * 2, 0]
    # Larger: the sum over ranks is what apbv.engine.routing reports as moved.
    p = _video_prediction("spava", 24, 30, world_size=3, dims=SMALL, hw=UNIT)
    span = VideoSpan.contiguous(SMALL.video_start, 24 * 30, 30)
    routes = embedding_routes(p.plan, span, [(0, 8), (8, 16), (16, 24)])
    moved, _ = transfer_bytes(routes, span.num_tokens, 8 * UNIT.dtype_bytes)
    assert sum(r.transfer_bytes for r in p.ranks) == moved > 0
    for mode in ("no_vit_split", "full"):
        assert all(r.transfer_bytes == 0 for r in _video_prediction(
            mode, 24, 30, world_size=3, dims=SMALL, hw=UNIT).ranks)


def test_schedule_simulation_by_hand() -> None:
    # Rank 0 starts the collective at 1, rank 1 at 3: it ends at 3 + 2 = 5.
    events = [[("compute", 1.0), ("start", 0), ("compute", 2.0), ("wait", 0), ("compute", 1.0)],
              [("compute", 3.0), ("start", 0), ("wait", 0), ("compute", 1.0)]]
    assert cost.simulate(events, [2.0]) == [6.0, 6.0]
    # Two collectives on one communicator run in order: the second ends at max(5, 1) + 4.
    events = [[("start", 0), ("start", 1), ("wait", 1)], [("compute", 3.0), ("start", 0),
                                                         ("start", 1), ("wait", 1)]]
    assert cost.simulate(events, [2.0, 4.0]) == [9.0, 9.0]
    # Overlap hides the transfer behind compute; waiting at once does not.
    hidden = [[("start", 0), ("compute", 5.0), ("wait", 0)]]
    exposed = [[("start", 0), ("wait", 0), ("compute", 5.0)]]
    assert cost.simulate(hidden, [3.0]) == [5.0]
    assert cost.simulate(exposed, [3.0]) == [8.0]


def test_overlap_hides_the_second_blocks_gather() -> None:
    slow_link = dataclasses.replace(UNIT, link_bw=1e6)
    spava = predict("spava", SMALL, context_len=20000, query_len=8, world_size=4, frames=0,
                    hw=slow_link)
    waiting = predict("no_overlap", SMALL, context_len=20000, query_len=8, world_size=4,
                      frames=0, hw=slow_link)
    assert spava.plan == waiting.plan
    assert spava.seconds["prefill"] < waiting.seconds["prefill"]
    assert spava.ranks[0].prefill_bytes == waiting.ranks[0].prefill_bytes


@pytest.mark.parametrize("tokens_per_patch", [720, 4641])
def test_spava_is_fastest_at_long_prompts_on_8_h200(tokens_per_patch: int) -> None:
    """Qwen2.5-VL-7B, 256 frames (1440p by the runtime's rules, then uncapped as in the
    reference's speed test), 8 ranks: spava beats exact, full and zigzag_ring."""
    got = {m: _video_prediction(m, 128, tokens_per_patch)
           for m in ("spava", "exact", "full", "zigzag_ring", "apb")}
    spava = got.pop("spava")
    for mode, other in got.items():
        assert spava.ttft_s < other.ttft_s, mode
        assert spava.seconds["prefill"] < other.seconds["prefill"], mode
    assert got["full"].ttft_s > 5 * spava.ttft_s
    kv = max(r.kv_bytes for r in spava.ranks)
    assert kv < got["full"].ranks[0].kv_bytes / 6  # the prompt's KV spread over 8 ranks


def test_more_tokens_take_longer() -> None:
    for mode in MODE_NAMES:
        times = [_video_prediction(mode, patches, 720).ttft_s for patches in (16, 64, 128)]
        assert times == sorted(times) and times[0] < times[-1], (mode, times)
        prefill = [_video_prediction(mode, 64, tpp).seconds["prefill"] for tpp in (256, 1024)]
        assert prefill[0] < prefill[1], mode
    for name in cost.HARDWARE_PRESETS:
        hw = cost.hardware(name)
        assert (_video_prediction("spava", 64, 256, world_size=2, dims=SMALL, hw=hw).ttft_s
                < _video_prediction("spava", 128, 256, world_size=2, dims=SMALL, hw=hw).ttft_s)


def test_prediction_inputs_and_errors() -> None:
    assert cost.video_grid(256, 1440, 2560) == (128, 20, 36)  # the 768-token frame cap
    assert cost.squarest_grid(4641) == (51, 91) and cost.squarest_grid(7) == (1, 7)
    assert cost.split_window(10, 4) == [4, 4, 2]
    args = dict(context_len=40, query_len=4, world_size=2, hw=UNIT)
    with pytest.raises(ValueError, match="frames must be an even integer >= 0"):
        predict("spava", SMALL, frames=3, tokens_per_patch=1, **args)
    with pytest.raises(ValueError, match="unknown mode 'fast'; allowed: spava"):
        predict("fast", SMALL, frames=0, **args)
    with pytest.raises(ValueError, match="2 ranks need at least one each"):
        predict("spava", SMALL, frames=2, tokens_per_patch=1, **args)
    with pytest.raises(ValueError, match="the video's 60 tokens do not fit in a context of 40"):
        predict("spava", SMALL, frames=4, tokens_per_patch=30, **args)
    with pytest.raises(ValueError, match="needs tokens_per_patch or grid"):
        predict("spava", SMALL, frames=4, **args)


def test_hardware_json(tmp_path: Path) -> None:
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"hardware": UNIT.to_json(), "measurements": {}}))
    assert Hardware.from_json(path) == UNIT == cost.hardware(str(path))
    with pytest.raises(ValueError, match=r"unknown hardware field\(s\) \['flops'\]; allowed: "):
        Hardware.from_json({**UNIT.to_json(), "flops": 1.0})
    with pytest.raises(ValueError,
                       match="unknown hardware 'tpu'; allowed: h200, h200-ib, h100, cpu"):
        cost.hardware("tpu")
    # The cpu preset holds the committed calibration of this machine.
    committed = Hardware.from_json(ROOT / "benchmarks" / "results" / "cpu_calibration.json")
    assert committed == cost.CPU
    assert cost.CPU.full_uses_all_ranks and cost.CPU.dtype_bytes == 4
    # The h200 preset holds the device constants measured on one H200 (the link and the
    # host's frame work are not measurable there and keep their derivations).
    measured = Hardware.from_json(ROOT / "benchmarks" / "results" / "h200_calibration.json")
    h200 = cost.hardware("h200").to_json()
    assert {k: h200[k] for k in cost.H200_MEASURED} == {
        k: measured.to_json()[k] for k in cost.H200_MEASURED}
    assert measured == cost.hardware("h200")


def test_plan_command_prints_predictions(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    assert main(["plan", "--preset", "qwen2.5-vl-7b", "--hardware", "h200", "--frames", "256",
                 "--height", "1440", "--width", "2560", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "N=92176 Q=64 H=8" in out and "predicted on h200" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in MODE_NAMES}
    assert set(rows) == set(MODE_NAMES)
    assert float(rows["full"][-3]) == 1.0 and float(rows["zigzag_ring"][-2]) == 1.0
    assert float(rows["spava"][-3]) > 5 and float(rows["spava"][-2]) > 1
    assert "spava's speedup without preprocessing" in out
    assert main(["plan", "--preset", "qwen2.5-vl-7b", "--hardware", "h200", "--frames", "256",
                 "--height", "1440", "--width", "2560", "--world-size", "8", "--modes",
                 "spava", "--pipeline"]) == 0
    piped = [line.split() for line in capsys.readouterr().out.splitlines()
             if line.startswith("spava ")][0]
    assert float(piped[1]) < float(rows["spava"][1])  # TTFT: the frames overlap the tower
    assert float(piped[2]) < float(rows["spava"][2]) / 10  # preprocess: no frames left
    # A checkpoint directory: config.json gives the memory estimate and the sizes.
    (tmp_path / "config.json").write_text(json.dumps(RELEASED_7B))
    assert main(["plan", "--model", str(tmp_path), "--hardware", "cpu", "--context-len",
                 "4000", "--world-size", "2", "--modes", "spava,full"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank (28 layers" in out and "predicted on cpu" in out
    assert "no video" in out and out.count("\nspava ") == 1
    assert main(["plan", "--frames", "64", "--preset", "qwen2.5-vl-3b", "--height", "448"]) == 2
    assert "--frames needs both --height and --width" in capsys.readouterr().err
    assert main(["plan", "--frames", "64", "--preset", "qwen2.5-vl-3b"]) == 0
    assert "frames of 448x448 pixels assumed" in capsys.readouterr().out
    assert main(["plan", "--hardware", "h200"]) == 2
    assert "pass --model DIR or --preset" in capsys.readouterr().err


def test_video_start_comes_from_the_chat_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The tiny checkpoint ships the released Qwen2.5-VL chat template: the presets' stored
    video_start is what rendering and tokenizing it gives, and checkpoint_dims reads it."""
    from apbv.model.qwen2_5_vl.tiny import tiny_config

    assert cost.template_video_start(tiny_model_dir) == cost.RELEASED_VIDEO_START
    for name in cost.MODEL_PRESETS:
        if name.startswith("qwen2"):  # the others: test_internvl_cost.py, test_qwen3_vl_rules.py
            assert cost.preset_dims(name).video_start == cost.RELEASED_VIDEO_START
    dims = cost.checkpoint_dims(tiny_model_dir)
    assert dims == cost.model_dims(tiny_config().to_dict(), video_start=cost.RELEASED_VIDEO_START)
    # A config.json without processor files: a clear error, not a guessed number.
    (tmp_path / "config.json").write_text(json.dumps(RELEASED_7B))
    with pytest.raises(ValueError, match="cannot load the processor"):
        cost.checkpoint_dims(tmp_path)
    # Predicting a video without knowing where it starts is refused.
    no_template = dataclasses.replace(SMALL, video_start=None)
    with pytest.raises(ValueError, match="needs video_start"):
        predict("spava", no_template, context_len=40, query_len=4, world_size=2, frames=4,
                tokens_per_patch=1, hw=UNIT)
    assert predict("spava", no_template, context_len=40, query_len=4, world_size=2, frames=4,
                   tokens_per_patch=1, hw=UNIT, video_start=15).ttft_s > 0


def test_num_key_value_heads_defaults_to_the_attention_heads() -> None:
    mha = {k: v for k, v in RELEASED_7B.items() if k != "num_key_value_heads"}
    assert cost.model_dims(mha).kv_heads == 28
