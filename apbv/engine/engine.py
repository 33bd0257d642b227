"""The long-lived per-rank engine: load the checkpoint once, then answer requests one by one.

Every client (the ``generate`` CLI, the demo, benchmarks, evaluation, a serving backend) builds
one :class:`apbv.engine.request.Request` and calls :meth:`Engine.generate` with it on every rank.
The answer comes back with its TTFT breakdown (max over ranks; :data:`apbv.timing.STAGES`):

    preprocess   decode this rank's frames + the video processor + tokenization
    vision       the vision tower on this rank's temporal patches (both skipped on a rank
                 whose vision cache holds its share of the video: cache.vision_gb)
    transfer     video embeddings to the ranks that own their tokens
    prefill      embeddings, positions, the decoder over the local shard
    first_token  greedy choice on the query rank and its broadcast     -> TTFT ends here
    decode       the remaining greedy tokens (exact attention), or scoring the choices

Before any model collective the ranks check that they were given the same request (a
mismatch is a ValueError naming the field, on every rank), and they agree on failure: an error
on one rank while preprocessing or encoding is raised on every rank, naming that rank
(:mod:`apbv.engine.agree`).

The engine also holds this rank's part of its live streams, by id (:meth:`Engine.open_stream`,
:meth:`~Engine.append`, :meth:`~Engine.describe_stream`, :meth:`~Engine.close_stream`); a
question about one is a request whose video is a :class:`~apbv.engine.request.StreamRef`,
answered by :meth:`Engine.generate` like any other (:mod:`apbv.engine.stream_ask`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from apbv.config import RuntimeConfig, VisionConfig
from apbv.cost import (
    PROCESSOR_FLOAT_COPIES,
    MemoryEstimate,
    ModelDims,
    model_dims,
    read_config,
    request_memory,
)
from apbv.distributed import DistInfo, ranks_ready
from apbv.engine.agree import agreement, cancelled_here, check_same
from apbv.engine.decode import choice_token_ids, decode_reserve
from apbv.engine.decode_graph import GraphSteps, resolve_graphs
from apbv.engine.load_progress import load_progress
from apbv.engine.pruned import Unpruned, agreed_keep, pruned_inputs, unpruned_share
from apbv.engine.request import PromptInputs, Request, Result, StreamRef
from apbv.engine.runner import check_context, run_prompt
from apbv.engine.stream import Stream
from apbv.engine.stream_ask import HeldAsk, asked_stream, held_ask, run_on_stream, window_inputs
from apbv.engine.stream_plan import Appended, StreamInfo, StreamSpec
from apbv.engine.vision_cache import VisionCache, VisionEntry, VisionKey, vision_key
from apbv.model.adapter import VideoModel
from apbv.model.families import load_adapter
from apbv.plan import Range
from apbv.timing import StageTimer
from apbv.video import Sampling, VideoSpec, decoded_rank_frames, load_rank_frames
from apbv.video.gop import frame_split
from apbv.video.load import rank_frame_chunks


def _available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux); elsewhere the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _snapped(request: Request, sampling: Sampling) -> tuple[tuple[int, int, int], ...] | None:
    """:attr:`Sampling.moved` with ``video.snap_to_keyframes``, else None."""
    return sampling.moved if isinstance(request.video, VideoSpec) \
        and request.video.snap_to_keyframes is not None else None


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class Engine:
    """One rank's model and process group; :meth:`generate` is called on every rank alike."""

    def __init__(self, cfg: RuntimeConfig, info: DistInfo):
        if cfg.video.resize_device == "cuda" and info.device.type != "cuda":
            raise ValueError(f"video.resize_device=cuda needs ranks on CUDA devices; this rank "
                             f"runs on {info.device.type} (use video.resize_device=cpu)")
        self.decode_graphs, self.decode_graphs_why = resolve_graphs(
            cfg.decode.graphs, info.device, info.backend, info.world_size)
        """Whether greedy decode replays a captured step (``decode.graphs``), and why."""
        self.graph_steps: GraphSteps | None = None
        """The captured decode steps kept across requests (made at the first one)."""
        self.cfg = cfg
        self.info = info
        self.frame_device = None if cfg.video.resize_device == "cpu" else info.device
        """Where frames are resized and made into patch rows (None: the CPU)."""
        try:
            with load_progress(cfg.model.path, info.rank, info.world_size,
                               group=info.group):  # the group's rank 0 logs
                self.model: VideoModel = load_adapter(
                    cfg.model.path, device=info.device,
                    dtype=_dtype(cfg.model.dtype, info.device), vision=cfg.vision)
        except Exception as exc:  # the other ranks stop waiting for this one (below)
            if info.world_size > 1:
                ranks_ready("model loaded", failed=exc, group=info.group)
            raise
        self.dims: ModelDims = model_dims(read_config(cfg.model.path))
        self.vision_cache = VisionCache(int(cfg.cache.vision_gb * 2**30))
        """This rank's vision embeddings of recent videos (cache.vision_gb; empty when 0)."""
        self.streams: dict[str, Stream] = {}
        """This rank's part of each open live stream, by id."""
        if info.world_size > 1:  # the first request's collectives then see no load skew
            ranks_ready("model loaded", group=info.group)

    def set_vision(self, vision: VisionConfig) -> None:
        """Use the ``vision`` settings from the next request on (every rank alike): the tower's
        set-up, the patch rows, the pipeline. The vision cache is emptied (its embeddings came
        from the old settings). Benchmarks switch paths this way on one loaded model."""
        self.cfg = dataclasses.replace(self.cfg, vision=vision)
        self.model.set_vision(vision)
        self.vision_cache = VisionCache(int(self.cfg.cache.vision_gb * 2**30))

    def request(self, video: str, question: str, **overrides: Any) -> Request:
        """A request from this engine's config; ``mode``/``max_new_tokens`` may replace it."""
        return Request.from_config(self.cfg, video, question, **overrides)

    def preprocess(self, request: Request) -> PromptInputs | Unpruned:
        """Sample the video, tokenize the prompt, check that the request fits (context and
        memory) and only then decode and process this rank's frames. With temporal pruning
        (``request.static_threshold``, ``request.pruning_rate``) the decoded frames come back
        as :class:`Unpruned` (checked against the whole video's prompt; the ranks then agree
        on what stays: :mod:`apbv.engine.pruned`).

        With the vision cache on, a hit (same file, sampling, model and place in the frame
        split) gives this rank's vision embeddings and sampling instead: only the prompt is
        built and checked. A miss carries ``vision_store``, which keeps the tower's output."""
        assert not isinstance(request.video, StreamRef), "a stream's ask: see _inputs"
        rank, world = self.info.rank, self.info.world_size
        split = request.mode.vit_split
        share = (rank, world) if split else (0, 1)  # this rank's place in the frame split
        ids: list[torch.Tensor] = []
        choice_ids = (None if request.choices is None else
                      choice_token_ids(self.model.processor.tokenizer, request.choices))

        def preflight(sampling: Sampling) -> None:
            t, h, w = self.model.video_grid(sampling)
            ids.extend(self.model.prompt(request.question, (t, h, w), request.system,
                                         sampling=sampling))
            self.check_fits(request, len(ids[0]), len(ids[1]),
                            frame_split(sampling, world)[rank] if split else (0, t), (h, w),
                            choice_ids=choice_ids,
                            frame_hw=(sampling.resized_height, sampling.resized_width))

        key, entry = None, None
        prune = request.static_threshold > 0 or request.pruning_rate > 0
        if self.vision_cache.enabled and isinstance(request.video, VideoSpec) and not prune:
            key = vision_key(request.video, self.cfg.model.path, self.model.dtype, rank, world,
                             split)
            entry = self.vision_cache.get(key)
        pipeline = self.cfg.vision.pipeline and not prune  # decoded in the vision stage
        pixel_values, chunks = None, None
        if entry is not None:  # no probe, no decoding, no processor; the preflight still runs
            preflight(entry.sampling)
            sampling = entry.sampling
        elif pipeline and isinstance(request.video, VideoSpec):  # decoded as it is encoded
            sampling, patches, chunks = rank_frame_chunks(
                request.video, *share, frames_per_chunk=self.model.frames_per_chunk,
                before_decode=preflight, device=self.frame_device,
                planner=self.model.plan_sampling)
        else:
            assert not isinstance(request.video, StreamRef), "a stream ask: Engine.generate"
            frames = load_rank_frames(request.video, *share, before_decode=preflight,
                                      device=self.frame_device,
                                      planner=self.model.plan_sampling) \
                if isinstance(request.video, VideoSpec) else \
                decoded_rank_frames(request.video, *share, before_process=preflight,
                                    temporal_patch_size=self.model.temporal_patch_size)
            sampling, patches = frames.sampling, frames.patch_range
            if prune:
                t = self.model.video_grid(sampling)[0]
                ranges = frame_split(sampling, world) if split else ((0, t),) * world
                return unpruned_share(self.model, frames, ranges, split=split, rank=rank,
                                      choice_ids=choice_ids, snapped=_snapped(request, sampling))
            if pipeline:  # frames already in memory: the chunks are views
                chunks = frames.frames.split(self.model.frames_per_chunk(*frames.frames.shape[-2:]))
            else:
                pixel_values, local_grid = self.model.tower_rows(frames.frames)
                t, h, w = self.model.video_grid(sampling)
                assert local_grid == (patches[1] - patches[0], h, w), local_grid
        store = None if key is None or entry is not None else \
            partial(self._store_vision, key, sampling, patches)
        context_ids, query_ids = ids
        t, h, w = self.model.video_grid(sampling)
        return PromptInputs(
            context_ids=context_ids,
            query_ids=query_ids,
            video_grid=(t, h, w),
            second_per_grid_t=sampling.second_per_grid_t,
            patch_ranges=frame_split(sampling, world) if split else ((0, t),) * world,
            pixel_values=pixel_values,
            num_frames=sampling.num_frames,
            choice_ids=choice_ids,
            vision_embeds=None if entry is None else entry.embeddings,
            vision_store=store,
            frame_chunks=chunks,
            snapped=_snapped(request, sampling),
        )

    def _store_vision(self, key: VisionKey, sampling: Sampling, patches: Range,
                      embeddings: torch.Tensor) -> None:
        """Keep this rank's vision tower output (exactly its own bytes: a view is copied)."""
        embeddings = embeddings.detach()
        if embeddings.untyped_storage().nbytes() != embeddings.numel() * \
                embeddings.element_size():
            embeddings = embeddings.clone()
        self.vision_cache.put(key, VisionEntry(embeddings, sampling, patches))

    def check_fits(self, request: Request, context_len: int, query_len: int,
                   patches: Range, grid_hw: tuple[int, int], *,
                   choice_ids: list[list[int]] | None,
                   frame_hw: tuple[int, int] | None = None) -> None:
        """ValueError unless the prompt plus max_new_tokens (with choices, ``choice_ids``: the
        longest choice's tokens) fits the model's context and this rank's memory estimate fits
        its budget (both named in the message); ``frame_hw`` as in :meth:`memory_estimate`."""
        check_context(request, context_len, query_len, choice_ids, self.model.max_positions)
        reserve, _ = decode_reserve(request.max_new_tokens, choice_ids)
        estimate = self.memory_estimate(request, context_len, query_len, patches, grid_hw,
                                        reserve, frame_hw)
        need, budget, source = self._memory_need_and_budget(estimate)
        if need > budget:
            raise ValueError(
                f"the request does not fit in memory on rank {self.info.rank}: it needs about "
                f"{need / 2**30:.2f} GiB ({estimate.describe()}; {context_len + query_len} "
                f"prompt tokens) but {source} is {budget / 2**30:.2f} GiB: sample fewer frames "
                f"(video.fps / video.nframes) or pixels (video.max_pixels), use more ranks, "
                f"or raise parallel.memory_gb")

    def memory_estimate(self, request: Request, context_len: int, query_len: int,
                        patches: Range, grid_hw: tuple[int, int], reserve: int,
                        frame_hw: tuple[int, int] | None = None) -> MemoryEstimate:
        """:func:`apbv.cost.request_memory` for ``request`` on this rank (``patches``: its
        temporal patches, ``grid_hw``: a frame's patch grid, ``reserve``: decode rows,
        ``frame_hw``: the decoded frames' (height, width) as they are held, e.g. InternVL3's
        native size before its processor resizes them; None: the grid's size), with
        this engine's patch rows (levels or float32, made by the processor or not) and tower
        calls (``vision.chunk_rows``). It counts the rank's whole video decoded at once, also
        where ``vision.pipeline`` holds a chunk or two (the safe side)."""
        plan = request.plan(context_len, query_len, self.info.world_size)
        model = self.model
        return request_memory(
            self.dims, plan, patches=patches[1] - patches[0], grid_hw=grid_hw,
            dtype_bytes=model.dtype.itemsize, reserve_tokens=reserve, rank=self.info.rank,
            row_bytes=1 if model.preprocess == "levels" and model.embeds_levels else 4,
            processor_copies=PROCESSOR_FLOAT_COPIES if model.preprocess == "processor" else 0.0,
            call_rows=model.chunk_rows, frame_hw=frame_hw)

    def _memory_need_and_budget(self, estimate: MemoryEstimate) -> tuple[int, int, str]:
        """(bytes needed, bytes available, what the budget is): parallel.memory_gb counts the
        weights; the free memory of a device or host does not (they are loaded already)."""
        if self.cfg.parallel.memory_gb is not None:
            return (estimate.total, int(self.cfg.parallel.memory_gb * 2**30),
                    "the budget parallel.memory_gb")
        weights = estimate.parts["weights"]
        device = self.info.device
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            need = estimate.device_total - weights
            if need > free + cached and self.graph_steps is not None and \
                    self.graph_steps.make_room(need - free - cached):  # kept decode steps' KV
                cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            return need, free + cached, f"the free memory of {device}"
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.info.world_size))
        return (estimate.total - weights, _available_host_bytes() // max(1, local),
                f"this rank's share (1/{local}) of the host's available memory")

    # -- live streams (every method on every rank alike) -----------------------------------

    def open_stream(self, stream_id: str, spec: StreamSpec) -> StreamInfo:
        """Open a live stream under ``stream_id`` (its chat template's header is fed now);
        see :mod:`apbv.engine.stream`."""
        if not isinstance(stream_id, str) or not stream_id:
            raise ValueError(f"a stream id must be a non-empty string, got {stream_id!r}")
        if stream_id in self.streams:
            raise ValueError(f"stream {stream_id[:64]!r} is already open")
        if not self.model.streams:
            raise ValueError(f"the loaded model ({self.model.family}) runs no live streams")
        if spec.static_threshold is None:  # the config's temporal pruning
            spec = dataclasses.replace(spec, static_threshold=self.cfg.video.static_threshold)
        stream = Stream(self.model, self.info, spec, kernel=self.cfg.attention.kernel)
        self.streams[stream_id] = stream
        return stream.describe()

    def append(self, stream_id: str, frames: torch.Tensor, timestamps: Sequence[float],
               held: Sequence[tuple[torch.Tensor, Sequence[float]]] = ()) -> Appended:
        """Add frames (uint8 (F, 3, H, W) at the stream's size) with their timestamps (seconds,
        increasing), after the pushes the server ``held``, to stream ``stream_id``
        (:meth:`apbv.engine.stream.Stream.append`)."""
        return self._stream(stream_id).append(frames, timestamps, held)

    def describe_stream(self, stream_id: str) -> StreamInfo:
        """Stream ``stream_id``'s state (no collective)."""
        return self._stream(stream_id).describe()

    def close_stream(self, stream_id: str) -> None:
        """Free this rank's part of stream ``stream_id`` (no collective)."""
        self._stream(stream_id)
        self.streams.pop(stream_id).close()

    def _stream(self, stream_id: str) -> Stream:
        stream = self.streams.get(stream_id)
        if stream is None:
            raise ValueError(f"no stream {str(stream_id)[:64]!r} on rank {self.info.rank}")
        return stream

    # -- questions ---------------------------------------------------------------------------

    def generate(self, request: Request, on_token: Callable[[int], None] | None = None,
                 stop: Callable[[], bool] | None = None) -> Result:
        """Answer ``request`` (the same on every rank); call on every rank alike.

        Bad input (a missing or unreadable video, too few temporal patches for the ranks, a
        prompt beyond the model's context, a stream not open) raises ValueError on every rank;
        any error while one rank preprocesses or encodes is raised on every rank, naming that
        rank, before the next collective of the model, so none is left waiting.

        Args:
            request: the question and its video: a file, decoded frames, or a live stream
                (:class:`~apbv.engine.request.StreamRef`: held KV, mode ``exact``; or fresh,
                a one-shot prefill of the held window in the request's mode).
            on_token: called on this rank with each token id as soon as it is known (the
                first included).
            stop: asked on the query rank before each decode step's token is picked; True
                (a client gone) ends the decode on every rank at that step, the result holding
                the tokens so far with ``finish_reason`` ``cancelled``. Asked as well after
                preprocessing and after the vision tower, it ends the request there on every
                rank with :class:`~apbv.engine.request.RequestCancelled`.
        """
        group = self.info.group
        check_same("requests", request.fingerprint(), group)
        timer = StageTimer(self.info.device, group)
        with timer.stage("preprocess"):
            inputs = self._inputs(request, stop)
        if isinstance(inputs, HeldAsk):
            assert isinstance(request.video, StreamRef)
            return run_on_stream(self.model, self.streams[request.video.stream_id], inputs,
                                 request, self.info, timer, on_token, stop,
                                 graphs=self._graph_steps())
        return run_prompt(self.model, inputs, request, self.info, timer, on_token, stop,
                          graphs=self._graph_steps())

    def _graph_steps(self) -> GraphSteps | None:
        """The kept captured steps while :attr:`decode_graphs` is on, else None (eager)."""
        if not self.decode_graphs:
            return None
        if self.graph_steps is None:
            decode = self.cfg.decode
            self.graph_steps = GraphSteps(decode.graphs_kept, decode.graphs_min_tokens,
                                          self.info.device)
        return self.graph_steps

    def _inputs(self, request: Request,
                stop: Callable[[], bool] | None) -> PromptInputs | HeldAsk:
        """What this rank feeds for ``request``, the ranks agreeing on failure (and on the
        query rank's cancel) before the model runs."""
        group, stream, kept = self.info.group, None, None
        if isinstance(request.video, StreamRef):
            with agreement(group):
                stream = asked_stream(self.streams, request, self.info.rank)
            if request.video.fresh:
                kept = stream.kept_vision()  # a collective
        inputs: PromptInputs | HeldAsk | Unpruned
        with agreement(group):
            if stream is None:
                inputs = self.preprocess(request)
            elif kept is None:
                inputs = held_ask(self.model, stream, request)
            else:
                inputs = window_inputs(self.model, stream, request, self.info, kept)
                self.check_fits(request, len(inputs.context_ids), len(inputs.query_ids),
                                inputs.patch_ranges[self.info.rank], stream.grid_hw,
                                choice_ids=inputs.choice_ids)
            cancel = cancelled_here(stop, self.info, "the vision tower")
            if cancel is not None:
                raise cancel
        if isinstance(inputs, Unpruned):  # on every rank alike (the request's setting)
            keep = agreed_keep(inputs, request.static_threshold, request.pruning_rate, group)
            with agreement(group):
                inputs = pruned_inputs(self.model, request, inputs, keep)
        return inputs
