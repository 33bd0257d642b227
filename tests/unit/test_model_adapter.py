"""apbv.model.qwen2_5_vl.adapter: checkpoint checks before loading, and the adapter's small methods.

The broken checkpoints are the tiny one (written once per session by apbv.model.qwen2_5_vl.tiny)
linked
file by file into a fresh directory, with one file removed, truncated or rewritten.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from apbv.config import VisionConfig
from apbv.model.checkpoint import WEIGHT_FILES, validate_checkpoint
from apbv.model.common import hf_compat, hook, patch_embed, tower
from apbv.model.common.hf_compat import video_processor_kwargs
from apbv.model.families import SUPPORTED
from apbv.model.qwen2_5_vl import adapter as qwen2_5_vl
from apbv.model.qwen2_5_vl.adapter import QwenVL, load
from apbv.video.patches import levels_to_rows

ROOT = Path(__file__).resolve().parents[2]
VIDEO_PAD = 151656
CPU = torch.device("cpu")
REBATCHED_RTOL = 1e-5
"""fp32 bound, relative to the outputs' largest magnitude, for two tower runs that compute the
same sums in other batches (a temporal patch alone, chunks, the pipeline): the CPU's
matrix-product kernels may order a row's sums by the number of rows in the call, and the
tower carries that rounding through its blocks (measured up to 2.7e-6 on one machine, 0.0 on
another)."""

QWEN2_TEXT_CONFIG = {  # a text-only Qwen2 checkpoint's config.json (tiny sizes)
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "vocab_size": 151936, "rope_theta": 1000000.0,
}


def _copy(src: Path, dst: Path, *, drop: tuple[str, ...] = ()) -> Path:
    """``src`` linked file by file into ``dst`` (config.json copied, so it can be edited)."""
    dst.mkdir()
    for path in src.iterdir():
        if path.name in drop:
            continue
        if path.name == "config.json":
            (dst / path.name).write_bytes(path.read_bytes())
        else:
            (dst / path.name).symlink_to(path)
    return dst


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any weight, model or processor would be built."""

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before it was checked")

    monkeypatch.setattr(qwen2_5_vl.Qwen2_5_VLForConditionalGeneration, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", refuse)


def _refused(path: Path, *patterns: str) -> str:
    start = time.perf_counter()
    with pytest.raises(ValueError) as info:
        load(path, device=CPU, dtype=torch.float32)
    assert time.perf_counter() - start < 0.5
    message = str(info.value)
    for pattern in patterns:
        assert pattern in message, (pattern, message)
    return message


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> QwenVL:
    return load(tiny_model_dir, device=CPU, dtype=torch.float32)


def test_linked_copy_loads(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Positive control for the broken copies below: the unbroken copy loads."""
    model = load(_copy(tiny_model_dir, tmp_path / "ok"), device=CPU, dtype=torch.float32)
    assert model.num_layers == 2 and model.video_token_id == VIDEO_PAD
    assert type(model.processor.tokenizer).__name__ == hf_compat.TOKENIZER_CLASS
    assert model.model.config.text_config._attn_implementation == hook.ATTN_IMPLEMENTATION
    assert model.model.config.vision_config._attn_implementation == \
        hook.VISION_ATTN_IMPLEMENTATION


@pytest.mark.usefixtures("no_loading")
def test_config_missing_unreadable_or_truncated(tiny_model_dir: Path, tmp_path: Path) -> None:
    _refused(tmp_path / "nowhere", "nowhere", "does not exist")
    ckpt = _copy(tiny_model_dir, tmp_path / "ckpt", drop=("config.json",))
    _refused(ckpt, "has no config.json")
    config = ckpt / "config.json"
    text = (tiny_model_dir / "config.json").read_text()
    config.write_text(text[: len(text) // 2])  # a copy cut short
    _refused(ckpt, str(config), "not valid JSON", "line ")
    config.write_text("")
    _refused(ckpt, str(config), "Expecting value: line 1 column 1")
    config.write_bytes(b'{"model_type": "qwen2_5_vl\xff"}')
    _refused(ckpt, str(config), "not UTF-8")
    config.write_text("[1, 2]")
    _refused(ckpt, str(config), "JSON object")


@pytest.mark.usefixtures("no_loading")
def test_other_model_types_are_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    ckpt = _copy(tiny_model_dir, tmp_path / "ckpt")
    (ckpt / "config.json").write_text(json.dumps(QWEN2_TEXT_CONFIG))
    _refused(ckpt, "is a 'qwen2' checkpoint", "supported: 'qwen2_5_vl'")
    (ckpt / "config.json").write_text(json.dumps({"hidden_size": 64}))
    _refused(ckpt, "has no model_type", "supported: 'qwen2_5_vl'")
    config = json.loads((tiny_model_dir / "config.json").read_text())
    del config["vision_config"]
    (ckpt / "config.json").write_text(json.dumps(config))
    _refused(ckpt, "config.json has no vision_config")


@pytest.mark.usefixtures("no_loading")
def test_missing_weights_are_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    ckpt = _copy(tiny_model_dir, tmp_path / "ckpt", drop=("model.safetensors",))
    message = _refused(ckpt, "has no weights")
    assert all(name in message for name in WEIGHT_FILES)
    index = {"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                            "b.weight": "model-00002-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    (ckpt / "model-00001-of-00002.safetensors").symlink_to(tiny_model_dir / "model.safetensors")
    _refused(ckpt, "lacks 1 of the 2 weight shards", "model-00002-of-00002.safetensors")
    (ckpt / "model.safetensors.index.json").write_text('{"weight_map": {')
    _refused(ckpt, "model.safetensors.index.json is not valid JSON")


def test_sharded_and_bin_weights_pass_the_check(tiny_model_dir: Path, tmp_path: Path) -> None:
    ckpt = _copy(tiny_model_dir, tmp_path / "sharded", drop=("model.safetensors",))
    index = {"weight_map": {"a.weight": "model-00001-of-00001.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    (ckpt / "model-00001-of-00001.safetensors").symlink_to(tiny_model_dir / "model.safetensors")
    assert validate_checkpoint(ckpt, SUPPORTED) == ckpt
    ckpt = _copy(tiny_model_dir, tmp_path / "bin", drop=("model.safetensors",))
    (ckpt / "pytorch_model.bin").write_bytes(b"")
    assert validate_checkpoint(str(ckpt), SUPPORTED) == ckpt


@pytest.mark.usefixtures("no_loading")
def test_missing_tokenizer_or_processor_files_are_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    ckpt = _copy(tiny_model_dir, tmp_path / "a", drop=("tokenizer.json", "tokenizer_config.json"))
    _refused(ckpt, "tokenizer/processor files", "tokenizer_config.json, tokenizer.json")
    ckpt = _copy(tiny_model_dir, tmp_path / "b", drop=("preprocessor_config.json",))
    message = _refused(ckpt, "tokenizer/processor files: preprocessor_config.json")
    assert "tokenizer" not in message.split(":")[-1]


def test_cli_refuses_a_text_only_checkpoint(tmp_path: Path) -> None:
    model = tmp_path / "qwen2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN2_TEXT_CONFIG))
    cmd = [sys.executable, "-m", "apbv", "generate", "--model", str(model),
           "--video", str(tmp_path / "clip.mp4"), "--question", "What happens?"]
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                            check=False)
    elapsed = time.perf_counter() - start
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "'qwen2'" in lines[0] and "qwen2_5_vl" in lines[0], lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert elapsed < 30, f"took {elapsed:.1f} s"  # the imports; the check itself is instant


def _frames(num_frames: int, size: int = 56, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_frames, 3, size, size), dtype=torch.uint8,
                         generator=generator)


def test_process_frames_matches_the_processor(model: QwenVL) -> None:
    frames = _frames(8)
    pixels, grid = model.process_frames(frames)
    assert grid == (4, 4, 4) and isinstance(grid[0], int)
    assert pixels.shape == (64, 3 * 2 * 14 * 14) and pixels.dtype == torch.float32
    vp = model.processor.video_processor
    official = vp(videos=[frames], return_tensors="pt", **video_processor_kwargs(vp))
    assert official["video_grid_thw"].tolist() == [[4, 4, 4]]
    assert torch.equal(pixels, official["pixel_values_videos"])
    # An odd frame count is padded with the last frame; H != W is fine.
    wide = _frames(5)[:, :, :28]  # 5 frames of 28x56
    odd, grid = model.process_frames(wide)
    assert grid == (3, 2, 4) and odd.shape[0] == 3 * 2 * 4
    padded, _ = model.process_frames(torch.cat([wide, wide[-1:]]))
    assert torch.equal(odd, padded)
    # The fused path (several chunks on 2 threads) against the processor itself, bit for bit.
    fused = QwenVL(model.model, model.processor, preprocess_workers=2)
    stock = QwenVL(model.model, model.processor, preprocess="processor")
    frames = _frames(37, size=84)
    assert torch.equal(fused.process_frames(frames)[0], stock.process_frames(frames)[0])


def test_pixel_levels_are_the_processors_rows(model: QwenVL) -> None:
    """``preprocess="levels"`` (the default): the tower takes int8 pixel levels, a quarter of
    the bytes, and levels_to_rows makes the processor's float rows of them, bit for bit."""
    frames = _frames(37, size=84)
    levels, grid = model.tower_rows(frames)
    rows, official_grid = QwenVL(model.model, model.processor,
                                 preprocess="processor").process_frames(frames)
    assert levels.dtype == torch.int8 and levels.shape == rows.shape and grid == official_grid
    spec = model.model.model.visual.patch_embed.levels_spec
    assert torch.equal(levels_to_rows(levels, spec), rows)
    assert torch.equal(model.process_frames(frames)[0], rows)  # process_frames: float rows
    odd = model.tower_rows(frames[:5])[0]  # padded with the last frame, as the rows are
    assert torch.equal(odd, model.tower_rows(torch.cat([frames[:5], frames[4:5]]))[0])
    fused = QwenVL(model.model, model.processor, preprocess="fused")
    assert fused.tower_rows(frames)[0].dtype == torch.float32


@pytest.mark.parametrize("product", patch_embed.LEVELS_PRODUCTS)
def test_patch_embedding_on_levels_is_the_affine_map(model: QwenVL, product: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """On levels the linear patch embedding computes the processor rows' product from the
    folded kernel, as one integer product (int8) or as the levels in fp32 times the folded
    kernel (float, where the integer product is slow): within fp32 rounding of the exact
    affine map (fp64); the integer product closer to it than the float product of the rounded
    rows, the float one at most twice as far. A weight that is not fp32 takes the float rows
    made of the levels, bit-equal to those rows' product."""
    monkeypatch.setattr(patch_embed, "LEVELS_PRODUCT", product)
    embed = model.model.model.visual.patch_embed
    spec = embed.levels_spec
    levels = model.tower_rows(_frames(16, size=112, seed=7))[0]
    rows = levels_to_rows(levels, spec)
    mean, std = (t.double() for t in spec.scaled(CPU))
    weight = embed.proj.weight.detach().double()
    exact = (((levels.double() + 128).view(len(levels), 3, -1) - mean.view(1, 3, 1))
             / std.view(1, 3, 1)).reshape(len(levels), -1) @ weight.reshape(len(weight), -1).t()
    with torch.inference_mode():
        integer, floated = embed(levels), embed(rows)
        try:
            embed.double()
            assert torch.equal(embed(levels), embed(rows.double()))
        finally:
            embed.float()
    scale = exact.abs().max().item()
    err = (integer.double() - exact).abs().max().item()
    float_err = (floated.double() - exact).abs().max().item()
    assert integer.dtype == torch.float32 and integer.shape == floated.shape
    assert err <= 1e-6 * scale and err <= (1 if product == "int8" else 2) * float_err, (
        f"{product} product on levels max abs error {err:.3g}, float product of the rows "
        f"{float_err:.3g} (outputs up to {scale:.3g})")
    # A row of zeros folds to zeros (no division by its scale).
    zero = torch.zeros_like(embed.proj.weight[:1])
    kernel = patch_embed.fold_levels(torch.cat([zero, embed.proj.weight.detach()]), spec)
    assert kernel.q[:, 0].abs().sum() == 0 and kernel.combine.isfinite().all()


def test_vision_tower_on_levels(model: QwenVL) -> None:
    """The tower on levels equals the tower on the float rows: to fp32 rounding of the two
    products with the linear embedding, bit for bit with the stock Conv3d (which gets the
    rows made of the levels)."""
    levels, grid = model.tower_rows(_frames(8, size=112, seed=8))
    rows = levels_to_rows(levels, model.model.model.visual.patch_embed.levels_spec)
    try:
        with torch.inference_mode():
            linear = (model.vision_tower(levels, grid), model.vision_tower(rows, grid))
            model.set_vision(dataclasses.replace(VisionConfig(), patch_embed="conv"))
            conv = (model.vision_tower(levels, grid), model.vision_tower(rows, grid))
    finally:
        model.set_vision(VisionConfig())
    err, scale = (linear[0] - linear[1]).abs().max().item(), linear[1].abs().max().item()
    assert err <= 1e-5 * scale, f"fp32 max abs error {err:.3g} (outputs up to {scale:.3g})"
    assert torch.equal(*conv)


def test_process_frames_rejects_bad_frames(model: QwenVL) -> None:
    with pytest.raises(ValueError, match=r"uint8 tensor \(F, 3, H, W\).*torch.float32"):
        model.process_frames(_frames(2).float())
    with pytest.raises(ValueError, match=r"got torch.uint8 \(2, 56, 56\)"):
        model.process_frames(_frames(2)[:, 0])
    with pytest.raises(ValueError, match=r"got torch.uint8 \(0, 3, 56, 56\)"):
        model.process_frames(_frames(0))
    with pytest.raises(ValueError, match="frame size 56x42 is not a multiple of 28"):
        model.process_frames(_frames(2)[..., :42])


def test_video_span(model: QwenVL) -> None:
    ids = torch.tensor([1, 2, VIDEO_PAD, VIDEO_PAD, VIDEO_PAD, 3], dtype=torch.long)
    assert model.video_span(ids) == (2, 3)
    assert model.video_span(torch.full((4,), VIDEO_PAD)) == (0, 4)
    with pytest.raises(ValueError, match="found no video tokens"):
        model.video_span(torch.tensor([1, 2, 151655]))  # an image token is not a video
    with pytest.raises(ValueError, match=r"found 2 separate runs .* \[\(0, 1\), \(2, 4\)\]"):
        model.video_span(torch.tensor([VIDEO_PAD, 1, VIDEO_PAD, VIDEO_PAD]))
    with pytest.raises(ValueError, match=r"1-D tensor \(T,\), got \(1, 6\)"):
        model.video_span(ids.unsqueeze(0))


def test_vision_tower(model: QwenVL) -> None:
    assert not hasattr(model, "encode_video")  # renamed to vision_tower
    pixels, grid = model.process_frames(_frames(4))
    with torch.inference_mode():
        out = model.vision_tower(pixels, grid)
        again = model.vision_tower(pixels, torch.tensor([grid]))
        # Frame-parallel: each temporal patch alone gives its rows of the whole.
        first = model.vision_tower(pixels[:16], (1, 4, 4))
    assert isinstance(out, torch.Tensor) and out.shape == (2 * 4 * 4 // 4, 64)
    assert torch.equal(out, again)
    err, scale = (first - out[:4]).abs().max().item(), out.abs().max().item()
    assert err <= REBATCHED_RTOL * scale, \
        f"fp32 max abs error {err:.3g} (outputs up to {scale:.3g})"
    with pytest.raises(ValueError, match=r"do not match the grid \[\[2, 4, 4\]\] \(32 patch"):
        model.vision_tower(pixels[:20], grid)
    with pytest.raises(ValueError, match="grid_thw must be"):
        model.vision_tower(pixels, (2, 0, 4))


@pytest.mark.parametrize("grid", [(2, 12, 20), (2, 10, 6), (1, 16, 36), (2, 8, 8)])
def test_grouped_vision_attention_equals_the_stock_tower(
        model: QwenVL, grid: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows with right, bottom and corner edges (12x20 patches: merged 6x10, windows of
    4x4, 4x2, 2x4 and 2x2 units); fp32 output of the grouped path equals the stock per-window
    path (measured max abs error 0.0 for these grids), and every windowed block makes at
    most one SDPA call per window size."""
    t, h, w = grid
    pixels = torch.randn(t * h * w, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    visual = model.model.model.visual
    calls: list[int] = []
    block = [-1]
    hooks = [b.register_forward_pre_hook(lambda _m, _a, i=i: block.__setitem__(0, i))
             for i, b in enumerate(visual.blocks)]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(block[0])
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    try:
        with torch.inference_mode():
            tower.set_vision_attention(model.model, "per_window")
            stock = model.vision_tower(pixels, grid)
            stock_calls, calls[:] = list(calls), []
            tower.set_vision_attention(model.model, "grouped")
            grouped = model.vision_tower(pixels, grid)
    finally:
        for hook in hooks:
            hook.remove()
        tower.set_vision_attention(model.model, "grouped")
    error = (grouped - stock).abs().max().item()
    assert error <= 1e-5, error
    windowed = [i for i in range(len(visual.blocks)) if i not in visual.fullatt_block_indexes]
    merge, window = 2, 4  # merged units per window side (112 / 14 / 2)
    rows, cols = -(-h // merge // window), -(-w // merge // window)
    with pytest.raises(ValueError, match="vision.attention must be one of grouped, per_window"):
        tower.set_vision_attention(model.model, "windowed")
    for i in windowed:
        assert stock_calls.count(i) == t * rows * cols  # the stock path: one call per window
    if not hf_compat.V5:  # 4.x calls the attention function once per window (drift notes)
        assert calls == stock_calls
        return
    for i in windowed:
        assert 1 <= calls.count(i) <= 4  # interior, right, bottom, corner
    for i in visual.fullatt_block_indexes:
        assert calls.count(i) == 1  # every temporal patch has the same size: one batch


def test_version_helpers(model: QwenVL) -> None:
    assert hf_compat.rope_settings(model.text_config) == {
        "rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0}
    keys = hf_compat.rope_config([2, 3, 3], 10.0)
    assert set(keys) == ({"rope_parameters"} if hf_compat.V5 else {"rope_scaling", "rope_theta"})
    assert list(hf_compat.dtype_kwargs(torch.bfloat16).values()) == [torch.bfloat16]
    assert model.dtype == torch.float32


def test_rope_keys_of_the_other_major_version_load(
    tiny_model_dir: Path, tmp_path: Path, model: QwenVL
) -> None:
    """A config.json saved by transformers 5.x loads on 4.x and one saved by 4.x on 5.x, with
    the same M-RoPE (same logits on a video prompt)."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    text = config["text_config"]
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        text.pop(key, None)
    if hf_compat.V5:  # write what 4.x saves
        text.update(rope_scaling={"mrope_section": [2, 3, 3], "rope_type": "default"},
                    rope_theta=1000000.0)
    else:  # write what 5.x saves
        text.update(rope_parameters={"mrope_section": [2, 3, 3], "rope_type": "default",
                                     "rope_theta": 1000000.0})
    ckpt = _copy(tiny_model_dir, tmp_path / "other")
    (ckpt / "config.json").write_text(json.dumps(config))
    other = load(ckpt, device=CPU, dtype=torch.float32)
    assert hf_compat.rope_settings(other.text_config) == hf_compat.rope_settings(
        model.text_config)
    reference = qwen2_5_vl.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tiny_model_dir, local_files_only=True, attn_implementation="sdpa").eval()
    other.model.set_attn_implementation("sdpa")  # plain HF forward, outside an apbv step
    tower.set_patch_embed(other.model, "conv")  # bit-equal to the stock module
    ids = torch.tensor([[151652] + [VIDEO_PAD] * 8 + [151653, 3838]])
    pixels, grid = model.process_frames(_frames(4))
    with torch.inference_mode():
        logits = [m(input_ids=ids, pixel_values_videos=pixels,
                    video_grid_thw=torch.tensor([grid])).logits for m in (reference, other.model)]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


def test_linear_patch_embedding_equals_the_stock_conv(model: QwenVL) -> None:
    """The patch embedding as one matrix product equals the stock Conv3d (fp32: the same
    sums in another order, within 1e-5 of the outputs' scale; fp64: to rounding), on the
    embedding alone and through the tower."""
    pixels = torch.randn(2 * 8 * 12, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(2))
    embed = model.model.model.visual.patch_embed
    try:
        with torch.inference_mode():
            tower.set_patch_embed(model.model, "conv")
            assert "forward" not in embed.__dict__  # the stock module
            stock, stock_tower = embed(pixels), model.vision_tower(pixels, (2, 8, 12))
            tower.set_patch_embed(model.model, "linear")
            linear, linear_tower = embed(pixels), model.vision_tower(pixels, (2, 8, 12))
            linear64 = embed.double()(pixels.double())
            tower.set_patch_embed(model.model, "conv")
            stock64 = embed(pixels.double())
    finally:
        embed.float()
        tower.set_patch_embed(model.model, "linear")
    err, err64 = ((linear - stock).abs().max().item(), (linear64 - stock64).abs().max().item())
    tower_err = (linear_tower - stock_tower).abs().max().item()
    scale, tower_scale = stock.abs().max().item(), stock_tower.abs().max().item()
    # fp32 sums of 1176 products in another order: relative to the outputs' scale (the tiny
    # model's weights are large: measured 7.8e-5 on outputs up to 64, 3.7e-4 on up to 95).
    assert err <= 1e-5 * scale, f"fp32 max abs error {err:.3g} (outputs up to {scale:.3g})"
    assert err64 <= 1e-12 * scale, f"fp64 max abs error {err64:.3g}"
    assert tower_err <= 1e-5 * tower_scale, (
        f"tower fp32 max abs error {tower_err:.3g} (outputs up to {tower_scale:.3g})")
    with pytest.raises(ValueError, match="vision.patch_embed must be one of linear, conv"):
        tower.set_patch_embed(model.model, "matmul")


def test_linear_patch_embedding_in_row_blocks_equals_one_product(
        model: QwenVL, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the product runs in blocks of rows (the last one short): every output row is
    the same dot product as in one product, so the values match (bit-equal here)."""
    pixels = torch.randn(300, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(3))
    embed = model.model.model.visual.patch_embed
    with torch.inference_mode():
        whole = embed(pixels)  # 300 rows <= CPU_BLOCK_ROWS: one product
        monkeypatch.setattr(patch_embed, "CPU_BLOCK_ROWS", 64)
        blocked = embed(pixels)
    err, scale = (blocked - whole).abs().max().item(), whole.abs().max().item()
    assert blocked.shape == whole.shape == (300, model.vision_config.hidden_size)
    assert err <= 1e-6 * scale, f"fp32 max abs error {err:.3g} (outputs up to {scale:.3g})"


def test_fused_rotary_is_bit_equal_to_the_stock_one(model: QwenVL) -> None:
    """The vision rotary with q and k in one set of passes gives transformers' bits (the same
    products and sums, each rounded once), on the function (q and k cut out of one qkv
    product, and apart) and through the whole tower; the choice swaps the modeling module's
    function and back."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as modeling

    pixels = torch.randn(2 * 12 * 20, 3 * 2 * 14 * 14,
                         generator=torch.Generator().manual_seed(3))
    try:
        with torch.inference_mode():
            tower.set_vision_rotary("stock")
            stock_fn = modeling.apply_rotary_pos_emb_vision
            assert not hasattr(stock_fn, "stock")
            stock = model.vision_tower(pixels, (2, 12, 20))
            tower.set_vision_rotary("fused")
            tower.set_vision_rotary("fused")  # idempotent: wraps the stock one once
            fused_fn = modeling.apply_rotary_pos_emb_vision
            assert fused_fn.stock is stock_fn
            fused = model.vision_tower(pixels, (2, 12, 20))
    finally:
        tower.set_vision_rotary("fused")
    assert torch.equal(fused, stock), (fused - stock).abs().max().item()
    qkv = torch.randn(50, 3, 4, 16, generator=torch.Generator().manual_seed(4)).permute(1, 0, 2, 3)
    cos, sin = torch.randn(2, 50, 16, generator=torch.Generator().manual_seed(5))
    # One product's views, in order and reversed; apart; in bf16 and fp16 (upcast inside
    # the products, rounded back once) as in fp32.
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = qkv.to(dtype)
        for q, k in ((x[0], x[1]), (x[1], x[0]), (x[1].contiguous(), x[0])):
            for got, want in zip(fused_fn(q, k, cos, sin), stock_fn(q, k, cos, sin)):
                assert got.dtype == want.dtype == dtype
                assert torch.equal(got, want), (dtype, (got - want).abs().max().item())
    with pytest.raises(ValueError, match="vision.rotary must be one of fused, stock"):
        tower.set_vision_rotary("contiguous")


def test_padded_vision_mlp_gives_the_same_embeddings(model: QwenVL) -> None:
    """vision.mlp_pad: every block's MLP widened with zero units (64 -> 96 here) computes the
    same sums (fp32: within :data:`REBATCHED_RTOL` of the scale, the products' kernels may
    order them by width); padding to 0 gives back the checkpoint's weights, bit for bit."""
    from apbv.model.common.vision_blocks import pad_mlp

    visual = model.model.model.visual
    width = visual.config.intermediate_size
    weights = [p.detach().clone() for p in visual.blocks[0].mlp.parameters()]
    pixels = torch.randn(2 * 12 * 20, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(6))
    try:
        with torch.inference_mode():
            plain = model.vision_tower(pixels, (2, 12, 20))
            pad_mlp(visual, 48)
            mlp = visual.blocks[0].mlp
            assert (mlp.gate_proj.weight.shape[0], mlp.down_proj.weight.shape[1]) == (96, 96)
            assert not mlp.up_proj.weight[width:].any()
            assert not mlp.down_proj.weight[:, width:].any()
            padded = model.vision_tower(pixels, (2, 12, 20))
    finally:
        pad_mlp(visual, 0)
    assert all(torch.equal(a, b) for a, b in zip(weights, visual.blocks[0].mlp.parameters()))
    err, scale = (padded - plain).abs().max().item(), plain.abs().max().item()
    assert err <= REBATCHED_RTOL * scale, f"fp32 max abs error {err:.3g} (scale {scale:.3g})"
    with pytest.raises(ValueError, match="vision.mlp_pad must be >= 0"):
        pad_mlp(visual, -1)


def test_vision_norm_choice_installs_and_removes_the_fused_forward(model: QwenVL) -> None:
    """vision.norm=fused swaps the forward of every RMSNorm of the tower (the blocks' and the
    merger's); off CUDA it runs the stock forward, so the embeddings keep their bits; stock
    takes the swap back. (The CUDA kernel is checked in tests/gpu.)"""
    visual = model.model.model.visual
    norms = [visual.merger.ln_q] + [n for b in visual.blocks for n in (b.norm1, b.norm2)]
    pixels = torch.randn(2 * 8 * 12, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(7))
    try:
        with torch.inference_mode():
            tower.set_vision_norm(model.model, "stock")
            assert not any("forward" in n.__dict__ for n in norms)
            stock = model.vision_tower(pixels, (2, 8, 12))
            tower.set_vision_norm(model.model, "fused")
            assert all("forward" in n.__dict__ for n in norms)
            fused = model.vision_tower(pixels, (2, 8, 12))
    finally:
        tower.set_vision_norm(model.model, "fused")
    assert torch.equal(fused, stock), (fused - stock).abs().max().item()
    with pytest.raises(ValueError, match="vision.norm must be one of fused, stock"):
        tower.set_vision_norm(model.model, "layer")


def test_tower_chunks_cover_the_rows_in_whole_temporal_patches() -> None:
    grid = torch.tensor([[5, 4, 6], [1, 2, 2], [3, 8, 8]])
    calls = tower.tower_chunks(grid, 50)  # 50 rows: 2 temporal patches of 24, 1 of 64
    assert [(a, b, g.tolist()) for a, b, g in calls] == [
        (0, 48, [[2, 4, 6]]), (48, 96, [[2, 4, 6]]), (96, 120, [[1, 4, 6]]),
        (120, 124, [[1, 2, 2]]), (124, 188, [[1, 8, 8]]), (188, 252, [[1, 8, 8]]),
        (252, 316, [[1, 8, 8]])]
    assert tower.tower_chunks(grid, 0) == [(0, 316, grid)]


@pytest.mark.parametrize("chunk_rows", [1, 500, 1000])
def test_vision_tower_in_chunks_equals_one_call(model: QwenVL, chunk_rows: int) -> None:
    """Every vision block attends inside one temporal patch, so the tower on chunks of whole
    temporal patches gives the one-call embeddings (fp32: the same sums, batched differently
    in the linear layers: :data:`REBATCHED_RTOL`), on a grid of two videos."""
    grid = torch.tensor([[5, 12, 20], [2, 8, 8]])
    pixels = torch.randn(int(grid.prod(dim=1).sum()), 3 * 2 * 14 * 14,
                         generator=torch.Generator().manual_seed(4))
    try:
        with torch.inference_mode():
            model.chunk_rows = 0
            whole = model.vision_tower(pixels, grid)
            model.chunk_rows = chunk_rows
            chunked = model.vision_tower(pixels, grid)
    finally:
        model.chunk_rows = tower.CPU_CHUNK_ROWS
    err, scale = (chunked - whole).abs().max().item(), whole.abs().max().item()
    assert chunked.shape == whole.shape == ((5 * 12 * 20 + 2 * 8 * 8) // 4, 64)
    assert err <= REBATCHED_RTOL * scale, \
        f"fp32 max abs error {err:.3g} (outputs up to {scale:.3g})"


class _Chunks:
    """Frame chunks that can fail after ``fail_after`` chunks and record their close()."""

    def __init__(self, frames: torch.Tensor, size: int, fail_after: int | None = None):
        self.parts, self.fail_after, self.closed, self.taken = frames.split(size), fail_after, 0, 0

    def __iter__(self):
        for part in self.parts:
            if self.taken == self.fail_after:
                raise ValueError("video 'x.mp4' is truncated at frame 6")
            self.taken += 1
            yield part

    def close(self) -> None:
        self.closed += 1


def _no_worker_left() -> bool:
    import threading

    return not any(t.name == "apbv-frames" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("size", [2, 4, 6, 12])
def test_encode_frames_pipeline_equals_rows_then_tower(model: QwenVL, size: int,
                                                       overlap: bool) -> None:
    """Patch rows and tower by chunks of whole temporal patches, rows made in a worker thread
    (overlap) or in turn: the embeddings of the rows-then-tower path (fp32:
    :data:`REBATCHED_RTOL`)."""
    frames = _frames(12, size=112, seed=5)
    with torch.inference_mode():
        whole = model.vision_tower(*model.process_frames(frames))
        chunks = _Chunks(frames, size)
        piped = model.encode_frames(chunks, overlap=overlap)
    err, scale = (piped - whole).abs().max().item(), whole.abs().max().item()
    assert piped.shape == whole.shape and err <= REBATCHED_RTOL * scale, (err, scale)
    assert chunks.closed == 1 and _no_worker_left()
    assert model.frames_per_chunk(112, 112) == 2 * (tower.CPU_CHUNK_ROWS // 64)


@pytest.mark.parametrize("overlap", [True, False])
def test_encode_frames_stops_both_sides_on_an_error(model: QwenVL, overlap: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    frames = _frames(12, size=56, seed=6)
    failing = _Chunks(frames, 2, fail_after=3)  # the decoder fails while the tower works
    with torch.inference_mode(), pytest.raises(ValueError, match="truncated at frame 6"):
        model.encode_frames(failing, overlap=overlap)
    assert failing.closed == 1 and _no_worker_left()

    calls: list[int] = []
    real = model.vision_tower

    def tower_fails_second(*args: object) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory on the tower")
        return real(*args)

    monkeypatch.setattr(model, "vision_tower", tower_fails_second)
    chunks = _Chunks(frames, 2)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="out of memory"):
        model.encode_frames(chunks, overlap=overlap)
    # the worker stopped: it made at most the rows of two more chunks; the frames are closed
    assert len(calls) == 2 and chunks.taken <= 2 + 2 * overlap and chunks.closed == 1
    assert _no_worker_left()
    with pytest.raises(ValueError, match="no frames"):
        model.encode_frames([], overlap=overlap)
