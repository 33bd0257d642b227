"""The long-lived per-rank engine: load the checkpoint once, then answer requests one by one.

Every client (the ``generate`` CLI, the demo, benchmarks, evaluation, a serving backend) drives
the same :class:`Engine` on every rank with the same request. A request is a video file and a
question; the answer comes back with its TTFT breakdown (max over ranks):

    preprocess   decode this rank's frames + the video processor + tokenization
    vision       the vision tower on this rank's temporal patches
    transfer     video embeddings to the ranks that own their tokens
    prefill      embeddings, positions, the decoder over the local shard
    first_token  greedy choice on rank 0 and its broadcast            -> TTFT ends here
    decode       the remaining greedy tokens (exact attention)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from apbv import comm
from apbv.config import RuntimeConfig
from apbv.distributed import DistInfo
from apbv.model.qwen2_5_vl import QwenVL, load
from apbv.modes import get_mode
from apbv.engine.runtime import PromptInputs, run_prompt
from apbv.sequence import prompt_ids, split_prompt
from apbv.timing import TTFT_STAGES, StageTimer
from apbv.plan import patch_ranges
from apbv.video import load_rank_frames



@dataclass
class GenerateResult:
    answer: str
    token_ids: list[int]
    ttft_s: float
    seconds: dict[str, float]
    """Per stage, max over ranks."""
    mode: str
    world_size: int
    frames: int
    context_len: int
    query_len: int
    anchor_len: int
    passing_len: int
    embedding_bytes: int
    """Video embedding bytes moved between ranks."""
    allgather_bytes: int
    """What an all-gather of every embedding to every rank would have moved."""
    kv_cache_bytes_max: int
    """The largest per-rank prompt KV cache."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class Engine:
    """One rank's model and process group; :meth:`generate` is called on every rank alike."""

    def __init__(
        self, cfg: RuntimeConfig, info: DistInfo, group: dist.ProcessGroup | None = None
    ):
        self.cfg = cfg
        self.info = info
        self.group = group
        self.qwen: QwenVL = load(cfg.model.path, device=info.device,
                                 dtype=_dtype(cfg.model.dtype, info.device))

    def _preprocess(
        self, video: str, question: str, mode: str = "spava"
    ) -> tuple[PromptInputs, int]:
        rank, world = self.info.rank, self.info.world_size
        split = get_mode(mode).vit_split
        frames = load_rank_frames(self.cfg.video.spec(video), rank if split else 0,
                                  world if split else 1)
        sampling = frames.sampling
        processed = self.qwen.processor.video_processor(
            videos=[frames.frames], do_resize=False, do_sample_frames=False,
            cap_pixels_per_frame=True, return_tensors="pt",
        )
        t, h, w = sampling.grid_thw
        local_grid = processed["video_grid_thw"][0].tolist()
        assert local_grid == [frames.patch_range[1] - frames.patch_range[0], h, w], local_grid
        merge = self.qwen.spatial_merge_size
        context_text, query_text = split_prompt(self.qwen.processor, question)
        context_ids, query_ids = prompt_ids(self.qwen.processor.tokenizer, context_text,
                                            query_text, t * (h // merge) * (w // merge))
        inputs = PromptInputs(
            context_ids=context_ids,
            query_ids=query_ids,
            video_grid=(t, h, w),
            second_per_grid_t=sampling.second_per_grid_t,
            patch_ranges=patch_ranges(t, world) if split else ((0, t),) * world,
            pixel_values=processed["pixel_values_videos"],
        )
        return inputs, sampling.num_frames

    def generate(
        self,
        video: str,
        question: str,
        *,
        mode: str | None = None,
        max_new_tokens: int | None = None,
    ) -> GenerateResult:
        """Answer ``question`` about the video file ``video``; call on every rank alike.

        Bad input (a missing or unreadable video, too few temporal patches for the ranks, an
        empty question) raises ValueError on every rank: ranks agree on failure before any
        collective of the model runs, so none is left waiting.
        """
        att = self.cfg.attention
        mode = att.mode if mode is None else mode
        max_new_tokens = self.cfg.generate.max_new_tokens if max_new_tokens is None \
            else max_new_tokens
        get_mode(mode)  # a bad name fails here, on every rank alike
        timer = StageTimer(self.info.device, self.group)
        error: ValueError | None = None
        with timer.stage("preprocess"):
            try:
                inputs, num_frames = self._preprocess(video, question, mode)
            except ValueError as exc:
                error = exc
        if comm.any_rank(error is not None, self.group):
            if error is not None:
                raise error
            raise ValueError("the request failed on another rank (its error names the problem)")
        result = run_prompt(
            self.qwen, inputs, timer,
            rank=self.info.rank, world_size=self.info.world_size, mode=mode, group=self.group,
            backend=att.kernel, anchor_len=att.anchor_len, passing_len=att.passing_len,
            max_new_tokens=max_new_tokens,
        )
        seconds = timer.max_over_ranks(self.group)
        tokenizer = self.qwen.processor.tokenizer
        plan = result.plan
        return GenerateResult(
            answer=tokenizer.decode(result.token_ids, skip_special_tokens=True),
            token_ids=result.token_ids,
            ttft_s=sum(seconds.get(s, 0.0) for s in TTFT_STAGES),
            seconds=seconds,
            mode=mode,
            world_size=self.info.world_size,
            frames=num_frames,
            context_len=plan.context_len,
            query_len=plan.query_len,
            anchor_len=plan.anchor_len,
            passing_len=plan.passing_len,
            embedding_bytes=result.embedding_bytes,
            allgather_bytes=result.allgather_bytes,
            kv_cache_bytes_max=int(comm.all_reduce_max(float(result.kv_cache_bytes), self.group)),
        )
