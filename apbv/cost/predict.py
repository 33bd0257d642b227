"""Predicted work and stage times of one request (:func:`estimate` of a resolved mode and a
:class:`~apbv.cost.workload.Workload`; :func:`predict` by name and fields), as
:class:`Prediction` with one :class:`RankCost` per rank (:mod:`apbv.cost.table` prints them).

For one mode, per rank and per stage of the engine (:data:`apbv.timing.TTFT_STAGES`), the
FLOPs, bytes moved and KV memory, and from the hardware constants the seconds. Stage times are
reported the way the engine times them: every stage ends with a barrier, so each is the
slowest rank's time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from apbv.cost.control import PREPROCESS_CHECKS, VISION_CHECKS, bookkeeping_s
from apbv.cost.decode import GraphDecode
from apbv.cost.hardware import Hardware, Machine
from apbv.cost.stages import (
    decode_stage,
    footage_frame_s,
    layout,
    prefill_stage,
    transfer_stage,
    vision_stage,
    walk_s,
)
from apbv.cost.work import ModelDims, _flops, attention_flops
from apbv.cost.workload import Workload
from apbv.modes import Mode, get_mode
from apbv.ownership import owned_local_index
from apbv.plan import Plan
from apbv.timing import TTFT_STAGES

__all__ = ["Prediction", "RankCost", "estimate", "footage_frame_s", "predict", "walk_s"]


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
    keep_rate: float = 1.0
    """Fraction of the video's tokens in the prompt (:class:`Workload`; 1: unpruned)."""
    bookkeeping_s: float = 0.0
    """Seconds of the request's collectives outside its timed stages (the request check
    before them, the stage times' and KV bytes' maxima after them:
    :func:`apbv.cost.control.bookkeeping_s`), in its wall time but not in its stages."""

    @property
    def ttft_s(self) -> float:
        return sum(self.seconds[s] for s in TTFT_STAGES)

    @property
    def last_token_s(self) -> float:
        """Seconds to the answer's last token: TTFT and the decode stage."""
        return self.ttft_s + self.seconds["decode"]

    @property
    def request_s(self) -> float:
        """The request's wall time on its ranks: :attr:`last_token_s` and
        :attr:`bookkeeping_s`."""
        return self.last_token_s + self.bookkeeping_s

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
            "keep_rate": self.keep_rate, "answer_tokens": self.answer_tokens,
            "decode_token_s": self.decode_token_s,
            "last_token_s": self.last_token_s,
            "bookkeeping_s": self.bookkeeping_s,
            "graphs": None if self.graphs is None else dataclasses.asdict(self.graphs),
            "last_token_graphs_s": self.last_token_graphs_s,
            "ranks": [dataclasses.asdict(r) for r in self.ranks],
        }


def predict(mode: str, dims: ModelDims, *, hw: Hardware, tokens_per_patch: int | None = None,
            grid: tuple[int, int] | None = None, **workload: Any) -> Prediction:
    """Predicted work and stage times of one request in ``mode`` on ``world_size`` ranks: the
    keyword form of :func:`estimate` (the mode by name, the :class:`Workload` by its fields).

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
        keep_rate, keep_by: the fraction of the video's tokens kept and how the rest go
            (:mod:`apbv.cost.workload`); ``context_len`` is then the whole video's prompt.
    """
    spec = get_mode(mode)
    return estimate(spec, dims, Workload.of(dims, tokens_per_patch=tokens_per_patch,
                                            grid=grid, **workload), hw)


def estimate(spec: Mode, dims: ModelDims, work: Workload, hw: Hardware) -> Prediction:
    """Predicted work and stage times of ``work`` in mode ``spec`` on ``hw``: the stages of
    :mod:`apbv.cost.stages` put together, every stage the slowest rank's time plus the
    barrier that ends it."""
    lay = layout(spec, dims, work)
    ranks = lay.ranks
    pooled = spec.single_process and hw.full_uses_all_ranks
    m = Machine(hw, hw.dtype_bytes if work.dtype_bytes is None else work.dtype_bytes,
                max(1.0, work.world_size * hw.thread_efficiency) if pooled else 1.0)
    vision = vision_stage(spec, dims, work, lay, m)
    transfer = transfer_stage(spec, dims, lay, m)
    prefill = prefill_stage(spec, dims, lay, m)
    plan = lay.plan
    kv_token = 2 * dims.layers * dims.kv_heads * dims.head_dim * m.dtype
    linear = dims.layers * _flops(dims.text_linears())
    costs = []
    for r in range(ranks):
        local = prefill.local[r]
        cached = local if spec.single_process else len(owned_local_index(plan, r))
        costs.append(RankCost(
            rank=r,
            tokens=local,
            cached_tokens=cached,
            temporal_patches=lay.shares[r],
            attention_pairs=prefill.pairs[r],
            attention_flops=dims.layers * attention_flops(prefill.pairs[r], dims.heads,
                                                          dims.head_dim),
            linear_flops=float(local * linear + 2 * dims.hidden * dims.vocab),
            vision_flops=vision.flops[r],
            prefill_bytes=prefill.received,
            transfer_bytes=transfer.rows[r][1] * transfer.row_bytes,
            kv_bytes=cached * kv_token,
            seconds={"preprocess": vision.preprocess[r], "vision": vision.seconds[r],
                     "transfer": transfer.seconds[r], "prefill": prefill.seconds[r],
                     "first_token": prefill.first_token_s},
        ))
    # apbv.timing ends every stage with a barrier: the slowest rank's time, plus the barrier.
    barrier = m.collective(0, ranks)
    decode = decode_stage(dims, m, [c.cached_tokens for c in costs], work.answer_tokens, ranks,
                          barrier)
    checks = m.collectives(PREPROCESS_CHECKS, ranks), m.collectives(VISION_CHECKS, ranks)
    seconds = {"preprocess": max(vision.preprocess) + barrier + checks[0],
               "vision": max(vision.seconds) + barrier + checks[1],
               "transfer": max(transfer.seconds) + barrier, "prefill": prefill.stage_s + barrier,
               "first_token": prefill.first_token_s + barrier, "decode": decode.seconds}
    return Prediction(mode=spec.name, hardware=hw.name, world_size=work.world_size, plan=plan,
                      seconds=seconds, ranks=tuple(costs), answer_tokens=work.answer_tokens,
                      decode_token_s=decode.per_token_s, graphs=decode.graphs,
                      keep_rate=work.keep_rate if work.frames else 1.0,
                      bookkeeping_s=bookkeeping_s(m, ranks, len(seconds)))
