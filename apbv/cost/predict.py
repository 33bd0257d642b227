"""Predicted work and stage times of one request (:func:`predict`), as :class:`Prediction`
with one :class:`RankCost` per rank (:mod:`apbv.cost.table` prints them).

For one mode, per rank and per stage of the engine (:data:`apbv.timing.TTFT_STAGES`), the
FLOPs, bytes moved and KV memory, and from the hardware constants the seconds. Stage times are
reported the way the engine times them: every stage ends with a barrier, so each is the
slowest rank's time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from apbv.cost.decode import GraphDecode, decode_s, graph_decode
from apbv.cost.hardware import Hardware, Machine
from apbv.cost.schedule import full_layer, layer_events, simulate, vision_cost
from apbv.cost.work import ModelDims, _flops, attention_flops, full_pairs, squarest_grid
from apbv.modes import get_mode
from apbv.ownership import VideoSpan, embedding_routes, needed_video_tokens, owned_local_index
from apbv.plan import Plan, patch_ranges
from apbv.timing import TTFT_STAGES
from apbv.video.patches import PIPELINE_CHUNK_ROWS, patches_per_chunk


@dataclass(frozen=True)
class RankCost:
    """One rank's work for the whole request (every layer), and its own stage times."""

    rank: int
    tokens: int
    """Prompt tokens in the rank's local sequence (anchor, its blocks, query)."""
    cached_tokens: int
    """Prompt tokens whose KV the rank keeps for decode."""
    temporal_patches: int
    """Temporal patches the rank runs the vision tower on."""
    attention_pairs: int
    """Query-key pairs of one decoder layer (:func:`rank_pairs` / :func:`full_pairs`)."""
    attention_flops: float
    linear_flops: float
    """Decoder matmuls of every layer, and the lm_head on the last row."""
    vision_flops: float
    """Vision tower: matmuls and attention."""
    prefill_bytes: int
    """Bytes received in the prefill's collectives (passing blocks and query partials)."""
    transfer_bytes: int
    """Video-embedding bytes received from other ranks."""
    kv_bytes: int
    seconds: dict[str, float] = field(default_factory=dict)
    """Per stage, this rank's time (prefill: its layers, waits on collectives included)."""


@dataclass(frozen=True)
class Prediction:
    """The predicted cost of one request in one mode (:func:`predict`)."""

    mode: str
    hardware: str
    world_size: int
    """H of the comparison (``full`` runs as one process on the resources described by the
    hardware's ``full_uses_all_ranks``)."""
    plan: Plan
    seconds: dict[str, float]
    """Per stage, as the engine times it: the slowest rank's time and the closing barrier."""
    ranks: tuple[RankCost, ...]
    answer_tokens: int = 1
    """Tokens of the answer (the first included) whose decode ``seconds["decode"]`` holds."""
    decode_token_s: float = 0.0
    """Seconds per decoded token after the first (:mod:`apbv.cost.decode`), averaged over the
    answer's steps (the first step's for a one-token answer)."""
    graphs: GraphDecode | None = None
    """The decode stage with ``decode.graphs`` (:func:`apbv.cost.decode.graph_decode`; its
    stage seconds with the closing barrier); None where the hardware has no CUDA graphs."""

    @property
    def ttft_s(self) -> float:
        return sum(self.seconds[s] for s in TTFT_STAGES)

    @property
    def last_token_s(self) -> float:
        """Seconds to the answer's last token: TTFT and the decode stage."""
        return self.ttft_s + self.seconds["decode"]

    @property
    def last_token_graphs_s(self) -> float | None:
        """:attr:`last_token_s` with ``decode.graphs`` (the request that captures)."""
        return None if self.graphs is None else self.ttft_s + self.graphs.first_s

    @property
    def device_ttft_s(self) -> float:
        """TTFT without preprocessing (what the reference's speed test times)."""
        return self.ttft_s - self.seconds["preprocess"]

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "hardware": self.hardware, "world_size": self.world_size,
            "context_len": self.plan.context_len, "query_len": self.plan.query_len,
            "anchor_len": self.plan.anchor_len, "passing_len": self.plan.passing_len,
            "ttft_s": self.ttft_s, "seconds": self.seconds,
            "answer_tokens": self.answer_tokens, "decode_token_s": self.decode_token_s,
            "last_token_s": self.last_token_s,
            "graphs": None if self.graphs is None else dataclasses.asdict(self.graphs),
            "last_token_graphs_s": self.last_token_graphs_s,
            "ranks": [dataclasses.asdict(r) for r in self.ranks],
        }


def _video_span(dims: ModelDims, context_len: int, video_start: int, patches: int,
                tokens_per_patch: int) -> VideoSpan:
    """The video tokens in the context: one run, or one per temporal patch with
    ``dims.unit_text_tokens`` text tokens between runs (InternVL3's per-frame prompt)."""
    stride = tokens_per_patch + dims.unit_text_tokens
    length = patches * stride - dims.unit_text_tokens
    start = min(video_start, context_len - length)
    if not dims.unit_text_tokens:
        return VideoSpan.contiguous(start, length, tokens_per_patch)
    return VideoSpan(tuple((start + u * stride, start + u * stride + tokens_per_patch)
                           for u in range(patches)), tokens_per_patch)


def _embedding_rows(plan: Plan, span: VideoSpan | None, patch_ranges: list[tuple[int, int]],
                    ) -> list[tuple[int, int, int]]:
    """Per rank: the video rows it sends to other ranks, receives from them, and holds."""
    if span is None:
        return [(0, 0, 0)] * plan.world_size
    routes = embedding_routes(plan, span, patch_ranges)
    world = len(routes)

    def count(ranges: list[tuple[int, int]]) -> int:
        return sum(e - s for s, e in ranges)

    return [(sum(count(routes[r][d]) for d in range(world) if d != r),
             sum(count(routes[s][r]) for s in range(world) if s != r),
             count(needed_video_tokens(plan, span, r))) for r in range(world)]


def walk_s(hw: Hardware, walked: int, sampled: int, pixels: int) -> float:
    """Host seconds of the coded frames a decoder walks past on the way to ``sampled`` frames
    (``walked`` counts both) of ``pixels`` each: ``hw.coded_frame_s_per_pixel`` apiece."""
    return max(walked - sampled, 0) * hw.coded_frame_s_per_pixel * pixels


def footage_frame_s(hw: Hardware, walked: int, sampled: int, pixels: int,
                    intervals: int = 0) -> float:
    """Host seconds to decode and resize ``sampled`` frames of ``pixels`` source pixels each
    when the decoder walks ``walked`` coded frames to them in ``intervals`` keyframe
    intervals (the sampled ones included; the frames nothing refers to skipped, as
    ``video.decode=needed`` does): the decoder's work, ``walked`` x
    ``hw.coded_frame_s_per_pixel`` plus ``intervals`` x ``hw.keyframe_s_per_pixel`` (each
    interval's seek and keyframe), plus each sampled frame's conversion,
    ``hw.convert_s_per_pixel``, per source pixel. Without a measured conversion rate
    (``convert_s_per_pixel`` 0.0) the earlier rule: the sampled frames at
    ``decode_s_per_pixel`` and the frames walked past them at :func:`walk_s`. The video
    processor's work per resized pixel is not included."""
    if not hw.convert_s_per_pixel:
        return sampled * hw.decode_s_per_pixel * pixels + walk_s(hw, walked, sampled, pixels)
    return (max(walked, sampled) * hw.coded_frame_s_per_pixel
            + intervals * hw.keyframe_s_per_pixel
            + sampled * hw.convert_s_per_pixel) * pixels


def predict(
    mode: str,
    dims: ModelDims,
    *,
    context_len: int,
    query_len: int,
    world_size: int,
    frames: int,
    tokens_per_patch: int | None = None,
    hw: Hardware,
    grid: tuple[int, int] | None = None,
    source_pixels: int | None = None,
    dtype_bytes: int | None = None,
    video_start: int | None = None,
    anchor_len: int | None = None,
    passing_len: int | None = None,
    vision_attention: str = "grouped",
    pipeline: bool = False,
    answer_tokens: int = 1,
    walked_frames: Sequence[int] | None = None,
    walked_intervals: Sequence[int] | None = None,
) -> Prediction:
    """Predicted work and stage times of one request in ``mode`` on ``world_size`` ranks.

    Args:
        mode: one of :data:`apbv.modes.MODE_NAMES`.
        context_len, query_len, world_size, frames: N, Q, H and the sampled frames, as
            :class:`apbv.engine.request.Result` reports them. ``full`` is predicted as one
            process, ``world_size`` being the H it is compared with. ``frames`` 0: no video.
        tokens_per_patch: LLM tokens per temporal patch (2 frames): the context's video tokens
            / (frames / 2). Not needed when ``grid`` is given.
        hw: the hardware constants.
        grid: merged-token (rows, cols) of a frame; default :func:`squarest_grid` of
            ``tokens_per_patch`` (only the vision windows depend on the shape).
        source_pixels: pixels decoded per sampled frame; default the resized frame's.
        dtype_bytes: element size; default ``hw.dtype_bytes``.
        video_start: context tokens before the video; default ``dims.video_start`` (the
            chat template's, :func:`apbv.cost.work.template_video_start`).
        anchor_len, passing_len: override the mode's defaults, as the runtime's flags do.
        vision_attention: ``grouped`` or ``per_window``, as ``vision.attention``.
        pipeline: as ``vision.pipeline``: the frames are decoded and processed in the vision
            stage, chunk by chunk (:data:`apbv.video.patches.PIPELINE_CHUNK_ROWS` patch rows);
            where host work overlaps the device (GPUs), a rank's frame work F and tower V
            take max(F, V) + min(F, V) / chunks (the first chunk's frames and the last
            chunk's tower do not overlap), elsewhere F + V.
        answer_tokens: tokens of the answer, the first included: the ``decode`` stage holds
            the greedy steps after the first token (:func:`apbv.cost.decode.decode_s`).
        walked_frames: per rank, the coded frames its decoder walks to reach its sampled
            frames (:func:`apbv.video.gop.rank_walks` of the file's keyframes, the sampled
            ones included; ``plan --video``): the rank's frames are then priced by
            :func:`footage_frame_s` (the walk and the conversions) plus the processor's work.
            None: the sampled frames only, at ``hw.decode_s_per_pixel`` each.
        walked_intervals: per rank, the keyframe intervals of that walk (each a seek and a
            keyframe; :class:`apbv.video.gop.Walk`); None: not priced apart.
    """
    spec = get_mode(mode)
    unit = dims.temporal_patch_size  # frames per temporal patch (InternVL3: 1)
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 0 or frames % unit:
        raise ValueError(f"frames must be an {'even ' if unit == 2 else ''}integer >= 0 "
                         f"({unit} frames per temporal patch), got {frames!r}")
    if grid is None:
        if frames and tokens_per_patch is None:
            raise ValueError("a prompt with video needs tokens_per_patch or grid")
        grid = squarest_grid(tokens_per_patch) if frames else (0, 0)
    elif tokens_per_patch is not None and tokens_per_patch != grid[0] * grid[1]:
        raise ValueError(f"tokens_per_patch ({tokens_per_patch}) differs from grid {grid}")
    tokens_per_patch = grid[0] * grid[1]
    ranks = 1 if spec.single_process else world_size
    plan = spec.plan(context_len, query_len, ranks, anchor_len=anchor_len,
                     passing_len=passing_len)
    patches = frames // unit
    video_tokens = patches * tokens_per_patch
    if video_tokens > context_len:
        raise ValueError(f"the video's {video_tokens} tokens do not fit in a context of "
                         f"{context_len} tokens")
    if not patches:
        ranges = [(0, 0)] * ranks
    elif spec.vit_split:
        ranges = list(patch_ranges(patches, ranks))  # ValueError when a rank gets none
    else:
        ranges = [(0, patches)] * ranks
    pooled = spec.single_process and hw.full_uses_all_ranks
    m = Machine(hw, hw.dtype_bytes if dtype_bytes is None else dtype_bytes,
                 max(1.0, world_size * hw.thread_efficiency) if pooled else 1.0)
    dt = m.dtype

    # Preprocess and vision: rank r takes a contiguous share of the temporal patches.
    shares = [e - s for s, e in ranges]
    resized = tokens_per_patch * (dims.patch_size * dims.spatial_merge_size) ** 2
    per_frame = (hw.decode_s_per_pixel * (source_pixels or resized)
                 + hw.process_s_per_pixel * resized)
    tokenize = hw.tokenize_s_per_token * plan.total_len
    frame_work = [unit * n * per_frame / m.scale for n in shares]
    if walked_frames is not None:
        if len(walked_frames) != ranks:
            raise ValueError(f"walked_frames must give one count per rank ({ranks}), got "
                             f"{len(walked_frames)}")
        intervals = walked_intervals or [0] * ranks
        if len(intervals) != ranks:
            raise ValueError(f"walked_intervals must give one count per rank ({ranks}), got "
                             f"{len(intervals)}")
        for r, (n, walked) in enumerate(zip(shares, walked_frames)):
            frame_work[r] = (footage_frame_s(hw, walked, unit * n, source_pixels or resized,
                                             intervals[r])
                             + unit * n * hw.process_s_per_pixel * resized) / m.scale
    preprocess = [hw.preprocess_fixed_s + tokenize + work for work in frame_work]
    if vision_attention not in ("grouped", "per_window"):
        raise ValueError(f"vision_attention must be grouped or per_window, got "
                         f"{vision_attention!r}")
    vision = [vision_cost(dims, n, grid, m, vision_attention == "grouped") for n in shares]
    vision_s = [v[0] for v in vision]
    if pipeline and patches:
        per_chunk = patches_per_chunk(tokens_per_patch * dims.spatial_merge_size ** 2,
                                      PIPELINE_CHUNK_ROWS)
        for r, (n, work) in enumerate(zip(shares, frame_work)):
            preprocess[r] -= work
            if hw.host_overlaps_device and n:
                chunks = -(-n // per_chunk)
                vision_s[r] = max(work, vision_s[r]) + min(work, vision_s[r]) / chunks
            else:
                vision_s[r] += work

    # Transfer: every rank's video embeddings to the ranks whose tokens they are.
    if video_start is None:
        video_start = dims.video_start
    if video_tokens and video_start is None:
        raise ValueError("a prompt with video needs video_start (the context tokens before the "
                         "video): pass it, or dims from checkpoint_dims() or a preset")
    span = _video_span(dims, context_len, video_start, patches, tokens_per_patch) \
        if video_tokens else None
    rows = _embedding_rows(plan, span, ranges)
    if not spec.vit_split:  # every rank encoded everything: it only takes its own rows
        rows = [(0, 0, held) for _, _, held in rows]
    row_bytes = dims.embedding_width * dt
    transfer = [(m.collective(row_bytes * max(sent, got), ranks) if spec.vit_split else 0.0)
                + m.mem(2 * row_bytes * held) for sent, got, held in rows]

    # Prefill: each layer simulated on all ranks together (they meet in its collectives).
    if spec.single_process:
        pairs = [full_pairs(plan)]
        layer = [m.host(full_layer(plan, dims, m), hw.layer_overhead_s)]
        received = 0
    else:
        built = [layer_events(plan, r, dims, m, spec.overlap) for r in range(ranks)]
        pairs = [p for _, p in built]
        kv_buffer = 2 * plan.passing_capacity * dims.kv_heads * dims.head_dim * dt
        query_buffer = plan.query_len * dims.heads * (dims.head_dim + 1) * 4  # fp32 partials
        durations = ([m.collective((ranks - 1) * kv_buffer, ranks)] * plan.blocks_per_rank
                     + [m.collective((ranks - 1) * query_buffer, ranks)])
        layer = [m.host(t, hw.layer_overhead_s) for t in simulate([e for e, _ in built],
                                                                   durations)]
        received = dims.layers * (ranks - 1) * (plan.blocks_per_rank * kv_buffer + query_buffer)
    lm_head = m.matmuls(1, [(dims.hidden, dims.vocab)])
    local = [plan.total_len if spec.single_process else plan.local_len(r) for r in range(ranks)]
    prefill = [dims.layers * t + m.mem(2 * dt * dims.hidden * n) + lm_head
               for t, n in zip(layer, local)]
    prefill_stage = dims.layers * max(layer) + m.mem(2 * dt * dims.hidden * max(local)) + lm_head
    first_token = m.mem(4 * dims.vocab) + m.collective(8, ranks)

    kv_token = 2 * dims.layers * dims.kv_heads * dims.head_dim * dt
    linear = dims.layers * _flops(dims.text_linears())
    costs = []
    for r in range(ranks):
        cached = local[r] if spec.single_process else len(owned_local_index(plan, r))
        costs.append(RankCost(
            rank=r,
            tokens=local[r],
            cached_tokens=cached,
            temporal_patches=shares[r],
            attention_pairs=pairs[r],
            attention_flops=dims.layers * attention_flops(pairs[r], dims.heads, dims.head_dim),
            linear_flops=float(local[r] * linear + 2 * dims.hidden * dims.vocab),
            vision_flops=vision[r][1],
            prefill_bytes=received,
            transfer_bytes=rows[r][1] * row_bytes,
            kv_bytes=cached * kv_token,
            seconds={"preprocess": preprocess[r], "vision": vision_s[r],
                     "transfer": transfer[r], "prefill": prefill[r],
                     "first_token": first_token},
        ))
    # apbv.timing ends every stage with a barrier: the slowest rank's time, plus the barrier.
    barrier = m.collective(0, ranks)
    cached = [c.cached_tokens for c in costs]
    decode = decode_s(dims, m, cached, answer_tokens, ranks)
    steps = max(1, answer_tokens - 1)
    per_token = (decode / steps if answer_tokens > 1
                 else decode_s(dims, m, cached, 2, ranks))
    graphs = None
    if hw.graph_capture_s > 0:  # CUDA graphs: the decode stage as decode.graphs runs it
        g = graph_decode(dims, m, cached, answer_tokens, ranks, owner_pass="kernel")
        graphs = dataclasses.replace(g, first_s=g.first_s + barrier,
                                     reused_s=g.reused_s + barrier)
    seconds = {"preprocess": max(preprocess) + barrier, "vision": max(vision_s) + barrier,
               "transfer": max(transfer) + barrier, "prefill": prefill_stage + barrier,
               "first_token": first_token + barrier, "decode": decode + barrier}
    return Prediction(mode=mode, hardware=hw.name, world_size=world_size, plan=plan,
                      seconds=seconds, ranks=tuple(costs), answer_tokens=answer_tokens,
                      decode_token_s=per_token, graphs=graphs)
