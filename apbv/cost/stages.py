"""The stages of one request's predicted cost, each a pure function of a resolved
:class:`~apbv.modes.Mode`, the model's sizes, the :class:`~apbv.cost.workload.Workload` and a
:class:`~apbv.cost.hardware.Machine`: where the work lies (:func:`layout`), the frames and the
vision tower (:func:`vision_stage`, preprocessing included, as the pipeline mixes them), the
video rows' transfer (:func:`transfer_stage`), the prefill (:func:`prefill_stage`) and the
decode (:func:`decode_stage`). :func:`apbv.cost.predict.estimate` puts them together.

Per-rank lists are indexed by rank; seconds are one rank's own (the stage's time is the
slowest rank's plus the closing barrier, added by ``estimate``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from apbv.cost.decode import GraphDecode, decode_s, graph_decode
from apbv.cost.hardware import Hardware, Machine
from apbv.cost.schedule import full_layer, layer_events, simulate, vision_cost
from apbv.cost.work import ModelDims, full_pairs
from apbv.cost.workload import Workload
from apbv.modes import Mode
from apbv.ownership import VideoSpan, embedding_routes, needed_video_tokens
from apbv.plan import Plan, Range, patch_ranges
from apbv.video.patches import PIPELINE_CHUNK_ROWS, patches_per_chunk

SIGNATURE_CHANNELS = 3
"""Channels of a temporal patch's pruning signature (:func:`apbv.video.prune.signatures`):
one float32 per channel and merged-patch cell."""


@dataclass(frozen=True)
class Layout:
    """Where one request's work lies: the plan of the prompt as it runs (pruned, if it is),
    and per rank the temporal patches it decodes and encodes."""

    plan: Plan
    ranks: int
    """Ranks that run it (1 for a single-process mode)."""
    unit: int
    """Frames per temporal patch."""
    grid: tuple[int, int]
    """Merged-token (rows, cols) of an encoded frame."""
    video_patches: int
    """Temporal patches of the whole sampled video."""
    decoded: tuple[int, ...]
    """Per rank, the temporal patches whose frames it decodes (its whole share)."""
    encoded: tuple[Range, ...]
    """Per rank, [start, end) of the patches it runs the vision tower on, counted over the
    encoded patches (the kept ones, when whole patches are pruned)."""
    span: VideoSpan | None
    """The video tokens in the prompt as it runs; None without video."""

    @property
    def shares(self) -> list[int]:
        """Per rank, the temporal patches it encodes."""
        return [e - s for s, e in self.encoded]


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


def kept_patches(patches: int, keep_rate: float) -> int:
    """Temporal patches kept of ``patches`` at ``keep_rate``: the first is always kept."""
    return max(1, round(keep_rate * patches)) if patches else 0


def _kept_ranges(ranges: list[Range], keep_rate: float) -> list[Range]:
    """Each rank's whole-video patch range as a range of the kept patches, the kept ones
    spread evenly over the video (which ones a camera keeps is not known ahead)."""
    def before(p: int) -> int:
        return kept_patches(p, keep_rate)

    return [(before(s), before(e)) for s, e in ranges]


def layout(spec: Mode, dims: ModelDims, work: Workload) -> Layout:
    """The plan and the frame split of ``work`` in mode ``spec``. ValueError naming a video
    that does not fit the context, a split that leaves a rank without a patch, or video
    without ``video_start``."""
    ranks = 1 if spec.single_process else work.world_size
    plan = spec.plan(work.context_len, work.query_len, ranks, anchor_len=work.anchor_len,
                     passing_len=work.passing_len)
    unit, tokens_per_patch = dims.temporal_patch_size, work.tokens_per_patch
    patches = work.frames // unit
    video_tokens = patches * tokens_per_patch
    if video_tokens > work.context_len:
        raise ValueError(f"the video's {video_tokens} tokens do not fit in a context of "
                         f"{work.context_len} tokens")
    if not patches:
        ranges = [(0, 0)] * ranks
    elif spec.vit_split:
        ranges = list(patch_ranges(patches, ranks))  # ValueError when a rank gets none
    else:
        ranges = [(0, patches)] * ranks
    decoded = tuple(e - s for s, e in ranges)
    encoded, span_patches, span_tokens, dropped = ranges, patches, tokens_per_patch, 0
    if work.pruned and work.keep_by == "patch":  # whole patches dropped before the tower
        span_patches = kept_patches(patches, work.keep_rate)
        encoded = _kept_ranges(ranges, work.keep_rate)
        dropped = (patches - span_patches) * (tokens_per_patch + dims.unit_text_tokens)
    elif work.pruned:  # tokens dropped after the tower: each patch keeps about keep_rate
        span_tokens = max(1, round(work.keep_rate * tokens_per_patch))
        dropped = patches * (tokens_per_patch - span_tokens)
    if work.pruned:
        plan = spec.plan(work.context_len - dropped, work.query_len, ranks,
                         anchor_len=work.anchor_len, passing_len=work.passing_len)
    video_start = dims.video_start if work.video_start is None else work.video_start
    span = None
    if video_tokens:
        if video_start is None:
            raise ValueError("a prompt with video needs video_start (the context tokens before "
                             "the video): pass it, or dims from checkpoint_dims() or a preset")
        span = _video_span(dims, plan.context_len, video_start, span_patches, span_tokens)
    return Layout(plan=plan, ranks=ranks, unit=unit, grid=work.grid, video_patches=patches,
                  decoded=decoded, encoded=tuple(encoded), span=span)


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
    ``decode_s_per_pixel`` and ``decode_frame_s`` each and the frames walked past them at
    :func:`walk_s`. The video processor's work per resized pixel is not included."""
    if not hw.convert_s_per_pixel:
        return (sampled * (hw.decode_s_per_pixel * pixels + hw.decode_frame_s)
                + walk_s(hw, walked, sampled, pixels))
    return (max(walked, sampled) * hw.coded_frame_s_per_pixel
            + intervals * hw.keyframe_s_per_pixel
            + sampled * hw.convert_s_per_pixel) * pixels


@dataclass(frozen=True)
class VisionStage:
    """Per rank: the preprocess and vision seconds, and the tower's FLOPs."""

    preprocess: list[float]
    seconds: list[float]
    flops: list[float]


def vision_stage(spec: Mode, dims: ModelDims, work: Workload, lay: Layout,
                 m: Machine) -> VisionStage:
    """Preprocessing (open the video, decode every frame of the rank's share at
    ``decode_s_per_pixel`` and ``decode_frame_s`` each, process its encoded ones, tokenize
    the prompt; with whole-patch pruning, the signatures and their all-gather) and
    the vision tower on the encoded patches; with ``work.pipeline`` (not used with pruning)
    the frame work moves into the vision stage, overlapped where the host runs ahead."""
    hw, unit, ranks = m.hw, lay.unit, lay.ranks
    if work.walked_frames is not None and len(work.walked_frames) != ranks:
        raise ValueError(f"walked_frames must give one count per rank ({ranks}), got "
                         f"{len(work.walked_frames)}")
    intervals = work.walked_intervals or (0,) * ranks
    if work.walked_frames is not None and len(intervals) != ranks:
        raise ValueError(f"walked_intervals must give one count per rank ({ranks}), got "
                         f"{len(intervals)}")
    tokens_per_patch = work.tokens_per_patch
    resized = tokens_per_patch * (dims.patch_size * dims.spatial_merge_size) ** 2
    pixels = work.source_pixels or resized
    per_frame = hw.decode_s_per_pixel * pixels + hw.process_s_per_pixel * resized
    tokenize = hw.tokenize_s_per_token * lay.plan.total_len
    frame_work = []
    for r, (n, decoded) in enumerate(zip(lay.shares, lay.decoded)):
        if work.walked_frames is None:  # frames decoded and not encoded: decode only
            frame_work.append(unit * n * per_frame / m.scale + unit * (decoded - n)
                              * hw.decode_s_per_pixel * pixels / m.scale
                              + unit * decoded * hw.decode_frame_s / m.scale)
        else:
            frame_work.append((footage_frame_s(hw, work.walked_frames[r], unit * decoded,
                                               pixels, intervals[r])
                               + unit * n * hw.process_s_per_pixel * resized) / m.scale)
    opened = hw.video_open_s if lay.video_patches else 0.0  # every rank opens the video
    preprocess = [hw.preprocess_fixed_s + opened + tokenize + w for w in frame_work]
    if work.pruned and work.keep_by == "patch":  # each rank's signatures, then all of them
        cells = SIGNATURE_CHANNELS * tokens_per_patch * 4
        for r, decoded in enumerate(lay.decoded):
            gathered = m.collective((lay.video_patches - decoded) * cells, ranks) \
                if spec.vit_split and ranks > 1 else 0.0  # one rank: apbv.comm moves nothing
            preprocess[r] += m.mem(unit * decoded * SIGNATURE_CHANNELS * resized * 4) + gathered
    grouped = work.vision_attention == "grouped"
    vision = [vision_cost(dims, n, lay.grid, m, grouped) for n in lay.shares]
    seconds = [v[0] for v in vision]
    if work.pipeline and lay.video_patches and not work.pruned:
        per_chunk = patches_per_chunk(tokens_per_patch * dims.spatial_merge_size ** 2,
                                      PIPELINE_CHUNK_ROWS)
        for r, (n, w) in enumerate(zip(lay.shares, frame_work)):
            preprocess[r] -= w
            if hw.host_overlaps_device and n:
                chunks = -(-n // per_chunk)
                seconds[r] = max(w, seconds[r]) + min(w, seconds[r]) / chunks
            else:
                seconds[r] += w
    return VisionStage(preprocess, seconds, [v[1] for v in vision])


@dataclass(frozen=True)
class TransferStage:
    """Per rank: the video rows it sends, receives and holds, and its seconds."""

    rows: list[tuple[int, int, int]]
    seconds: list[float]
    row_bytes: int


def _embedding_rows(plan: Plan, span: VideoSpan | None, ranges: list[Range],
                    ) -> list[tuple[int, int, int]]:
    """Per rank: the video rows it sends to other ranks, receives from them, and holds."""
    if span is None:
        return [(0, 0, 0)] * plan.world_size
    routes = embedding_routes(plan, span, ranges)
    world = len(routes)

    def count(runs: list[Range]) -> int:
        return sum(e - s for s, e in runs)

    return [(sum(count(routes[r][d]) for d in range(world) if d != r),
             sum(count(routes[s][r]) for s in range(world) if s != r),
             count(needed_video_tokens(plan, span, r))) for r in range(world)]


def transfer_stage(spec: Mode, dims: ModelDims, lay: Layout, m: Machine) -> TransferStage:
    """Every rank's video embeddings to the ranks whose tokens they are (without the split,
    every rank encoded everything and only takes its own rows)."""
    rows = _embedding_rows(lay.plan, lay.span, list(lay.encoded))
    if not spec.vit_split:
        rows = [(0, 0, held) for _, _, held in rows]
    row_bytes = dims.embedding_width * m.dtype
    moved = spec.vit_split and lay.ranks > 1  # one rank: apbv.comm copies, no collective
    seconds = [(m.collective(row_bytes * max(sent, got), lay.ranks) if moved else 0.0)
               + m.mem(2 * row_bytes * held) for sent, got, held in rows]
    return TransferStage(rows, seconds, row_bytes)


@dataclass(frozen=True)
class PrefillStage:
    """Per rank: its local tokens, the query-key pairs of one layer and its prefill seconds;
    the stage's seconds (before the barrier), the first token's, and the bytes each rank
    receives in the prefill's collectives."""

    local: list[int]
    pairs: list[int]
    seconds: list[float]
    stage_s: float
    first_token_s: float
    received: int


def prefill_stage(spec: Mode, dims: ModelDims, lay: Layout, m: Machine) -> PrefillStage:
    """Each layer simulated on all ranks together (they meet in its collectives), then the
    lm_head on the last row and the first token's pick."""
    plan, ranks, dt = lay.plan, lay.ranks, m.dtype
    hw = m.hw
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
    seconds = [dims.layers * t + m.mem(2 * dt * dims.hidden * n) + lm_head
               for t, n in zip(layer, local)]
    stage = dims.layers * max(layer) + m.mem(2 * dt * dims.hidden * max(local)) + lm_head
    first_token = m.mem(4 * dims.vocab) + m.collective(8, ranks)
    return PrefillStage(local, pairs, seconds, stage, first_token, received)


@dataclass(frozen=True)
class DecodeStage:
    """The decode stage's seconds (barrier included), per token, and with CUDA graphs."""

    seconds: float
    per_token_s: float
    graphs: GraphDecode | None


def decode_stage(dims: ModelDims, m: Machine, cached: list[int], answer_tokens: int,
                 ranks: int, barrier: float) -> DecodeStage:
    """The greedy steps after the first token over the ``cached`` KV of each rank
    (:func:`apbv.cost.decode.decode_s`), and with ``decode.graphs`` where the hardware has
    CUDA graphs."""
    decode = decode_s(dims, m, cached, answer_tokens, ranks)
    steps = max(1, answer_tokens - 1)
    per_token = (decode / steps if answer_tokens > 1
                 else decode_s(dims, m, cached, 2, ranks))
    graphs = None
    if m.hw.graph_capture_s > 0:  # CUDA graphs: the decode stage as decode.graphs runs it
        g = graph_decode(dims, m, cached, answer_tokens, ranks, owner_pass="kernel")
        graphs = dataclasses.replace(g, first_s=g.first_s + barrier,
                                     reused_s=g.reused_s + barrier)
    return DecodeStage(decode + barrier, per_token, graphs)
