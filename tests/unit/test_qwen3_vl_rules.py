"""Qwen3-VL's weight-free rules (apbv.model.qwen3_vl.prompt) against the stock processor, and
the refusal of its MoE variant from config.json alone.

- Timestamps: the prompt's ``<t seconds>`` text comes from the frame indices and the file's
  exact fps, as the stock processor computes it: 29.97 and 30 fps give different prompts, each
  equal to the stock processor's ids on the same frames and metadata.
- Sampling: the frame indices of a count or an fps equal the stock ``sample_frames``'s, the
  size equals the stock ``smart_resize`` with the clip's pixel budget, an odd count is padded
  with the last frame; a count below a temporal patch is refused naming the setting.
- ``qwen3_vl_moe`` is refused in well under a second, naming the dense family.
- On a transformers whose processor lays a video out otherwise (before 5.10.1), the rules and
  the stream prompt refuse, naming the needed version; the stock comparisons are skipped there.
- The cost model's prompt geometry (video_start, text between patches) is the engine's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from packaging.version import Version

from apbv import cost
from apbv.cost.qwen3_vl import QWEN3_VL_VIDEO_START, qwen3_vl_video_start
from apbv.model.common import hf_compat
from apbv.model.families import family_of, load_adapter
from apbv.model.qwen3_vl.prompt import Qwen3VLRules, qwen3_vl_sampling
from apbv.video import Sampling, VideoMeta, VideoSpec

STOCK_LAYOUT = pytest.mark.skipif(
    hf_compat.TRANSFORMERS_VERSION < Version(hf_compat.QWEN3_VL_TRANSFORMERS),
    reason=f"transformers {hf_compat.TRANSFORMERS_VERSION} lays Qwen3-VL's video out "
           f"otherwise; Qwen3-VL needs >= {hf_compat.QWEN3_VL_TRANSFORMERS}")

QUESTION = "What happens at the end?"


@pytest.fixture(scope="module")
def processor(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from apbv.model.qwen3_vl.tiny import tiny_processor

    return tiny_processor(tmp_path_factory.mktemp("qwen3-processor"))


def _stock_ids(processor: Any, frames: torch.Tensor, indices: list[int], fps: float,
               ) -> torch.Tensor:
    from transformers.video_utils import VideoMetadata

    messages = [{"role": "user", "content": [{"type": "video"},
                                             {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    metadata = VideoMetadata(total_num_frames=3000, fps=fps, frames_indices=indices)
    out = processor(text=[text], videos=[frames], video_metadata=[metadata],
                    do_sample_frames=False, return_tensors="pt")
    return out["input_ids"][0]


@STOCK_LAYOUT
def test_timestamps_follow_the_files_fps(processor: Any) -> None:
    """Frames 0, 1, 2996, 2998 (two temporal patches) of a 29.97 fps and a 30 fps file: the
    second patch is at 100.0 s and at 99.9 s; apbv's ids equal the stock processor's."""
    indices = [0, 1, 2996, 2998]
    frames = torch.randint(0, 256, (4, 3, 64, 96), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    rules = Qwen3VLRules(processor)
    got = {}
    for fps in (29.97, 30.0):
        sampling = Sampling(tuple(indices), 4 / 3000 * fps, 64, 96, 16, video_fps=fps,
                            processor_resize=True)
        context, query = rules.prompt(QUESTION, rules.video_grid(sampling), sampling=sampling)
        got[fps] = torch.cat([context, query])
        assert torch.equal(got[fps], _stock_ids(processor, frames, indices, fps)), fps
    decode = processor.tokenizer.decode
    assert "<0.0 seconds>" in decode(got[30.0]) and "<0.0 seconds>" in decode(got[29.97])
    assert "<100.0 seconds>" in decode(got[29.97]) and "<99.9 seconds>" in decode(got[30.0])
    assert not torch.equal(got[29.97], got[30.0])
    with pytest.raises(ValueError, match="timestamps"):  # no sampling: no timestamps
        rules.prompt(QUESTION, rules.video_grid(sampling))


@pytest.mark.parametrize(("total", "native_fps", "spec"), [
    (300, 30.0, {"nframes": 8}),
    (301, 29.97, {"nframes": 7}),            # odd: padded with the last frame
    (300, 30.0, {"fps": 2.0}),               # int(300 / 30 * 2) = 20 frames
    (95, 29.97, {"fps": 1.0}),               # int(3.17) = 3, raised to min_frames 4
    (1000, 25.0, {"fps": 2.0, "max_frames": 9}),
])
def test_sampling_is_the_stock_rule(processor: Any, total: int, native_fps: float,
                                    spec: dict) -> None:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
    from transformers.video_utils import VideoMetadata

    vp = processor.video_processor
    meta = VideoMeta(total_frames=total, fps=native_fps, height=480, width=854)
    sampling = qwen3_vl_sampling(VideoSpec("clip.mp4", **spec), meta, vp)
    stock_meta = VideoMetadata(total_num_frames=total, fps=native_fps)
    if "nframes" in spec:
        want = vp.sample_frames(stock_meta, num_frames=spec["nframes"], fps=None).tolist()
    elif "max_frames" in spec:  # the stock rule with the cap as the processor's max_frames
        vp_max, vp.max_frames = vp.max_frames, spec["max_frames"]
        try:
            want = vp.sample_frames(stock_meta, fps=spec["fps"]).tolist()
        finally:
            vp.max_frames = vp_max
    else:
        want = vp.sample_frames(stock_meta, fps=spec["fps"]).tolist()
    padded = want + want[-1:] * (len(want) % 2)
    assert list(sampling.indices) == padded
    assert (sampling.resized_height, sampling.resized_width) == smart_resize(
        len(want), 480, 854, temporal_factor=2, factor=32, min_pixels=vp.size["shortest_edge"],
        max_pixels=vp.size["longest_edge"])
    assert sampling.video_fps == native_fps and sampling.temporal_patch_size == 2


def test_budget_is_for_the_whole_clip(processor: Any) -> None:
    """More frames of a large video get smaller frames: the budget is frames x pixels."""
    vp = processor.video_processor
    meta = VideoMeta(total_frames=20000, fps=30.0, height=1080, width=1920)
    few = qwen3_vl_sampling(VideoSpec("clip.mp4", nframes=16), meta, vp)
    many = qwen3_vl_sampling(VideoSpec("clip.mp4", nframes=512), meta, vp)
    assert many.resized_height * many.resized_width < few.resized_height * few.resized_width
    assert 512 * many.resized_height * many.resized_width <= vp.size["longest_edge"]


def test_frames_beyond_the_file_and_qwen25_settings_are_refused(processor: Any) -> None:
    vp = processor.video_processor
    meta = VideoMeta(total_frames=100, fps=30.0, height=240, width=320)
    with pytest.raises(ValueError, match=r"nframes=101 gives 101 frames; Qwen3-VL samples 2 "
                                         r"\.\. 100 \(the file's frames at 30 fps\)"):
        qwen3_vl_sampling(VideoSpec("clip.mp4", nframes=101), meta, vp)
    with pytest.raises(ValueError, match="resized_height, resized_width are not used by Qwen3-VL"):
        qwen3_vl_sampling(VideoSpec("clip.mp4", nframes=4, resized_height=224,
                                    resized_width=224), meta, vp)


def test_moe_variant_is_refused_from_config_alone(tmp_path: Path) -> None:
    """A Qwen3-VL MoE checkpoint (config.json only, no weights) is refused at once."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_vl_moe", "vision_config": {"depth": 27},
        "text_config": {"model_type": "qwen3_vl_moe_text", "num_experts": 128}}))
    start = time.monotonic()
    for attempt in (lambda: family_of(tmp_path),
                    lambda: load_adapter(tmp_path, device=torch.device("cpu"),
                                         dtype=torch.float32)):
        with pytest.raises(ValueError) as info:
            attempt()
        message = str(info.value)
        assert "mixture-of-experts" in message and "'qwen3_vl_moe'" in message, message
        assert "'qwen3_vl' (Qwen3-VL)" in message, message  # the supported list
    assert time.monotonic() - start < 1.0


@STOCK_LAYOUT
def test_prompt_geometry_is_the_engines(processor: Any) -> None:
    """video_start and the context length of a prompt with timestamps 0.0, 10.0 and 20.0 s
    (the 2-digit ones of a typical clip between patches), as the engine builds the prompt."""
    assert qwen3_vl_video_start(processor) == QWEN3_VL_VIDEO_START
    dims = cost.preset_dims("qwen3-vl-8b")
    rules = Qwen3VLRules(processor)
    sampling = Sampling((0, 1, 300, 301, 600, 601), 0.2, 128, 160, 16, video_fps=30.0,
                        processor_resize=True)
    context, _ = rules.prompt("What happens?", rules.video_grid(sampling), sampling=sampling)
    assert cost.video_context_len(dims, 3, (4, 5)) == len(context)
    video = context.tolist().index(processor.video_token_id)
    assert video == dims.video_start


@pytest.mark.parametrize("version", ["4.57.6", "5.0.0", "5.9.0"])
def test_qwen3_vl_is_refused_where_the_stock_layout_differs(processor: Any, monkeypatch,
                                                            version: str) -> None:
    """4.57.6 (inside the package's range) expanded the template's video markers whole: the
    timestamps test above failed there; Qwen3-VL now says so instead of differing."""
    from apbv.model.qwen3_vl.prompt import Qwen3VLStreamPrompt

    monkeypatch.setattr(hf_compat, "TRANSFORMERS_VERSION", Version(version))
    for make in (lambda: Qwen3VLRules(processor), lambda: Qwen3VLStreamPrompt(processor, (2, 3))):
        with pytest.raises(ValueError, match=f"Qwen3-VL needs transformers>=5.10.1 \\(this is "
                                             f"{version}"):
            make()
    monkeypatch.setattr(hf_compat, "TRANSFORMERS_VERSION", Version("5.10.1"))
    Qwen3VLRules(processor)
