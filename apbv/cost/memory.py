"""The memory one rank needs for one request, by part, before any work is done.

:func:`request_memory` is pure: the model's sizes, the plan and the rank's share of the video
give the bytes of each part the rank holds, and which parts are alive together in each phase
of the request. The estimate is the largest phase:

- ``preprocess``: the weights, the decoded frames (uint8), the chunk being decoded and resized,
  and the patch rows being made (int8 pixel levels, the default, or float32 rows; the HF video
  processor also holds float32 copies of the frames);
- ``vision``: the weights, the patch rows, and the vision tower's activations (one block's
  hidden states, q/k/v, attention output and MLP rows over the patches of one tower call:
  ``vision.chunk_rows`` of them on CPU, the rank's whole share elsewhere; windowed attention
  keeps the score matrices small) with the embeddings the calls have made;
- ``prefill``: the weights, the patch rows (still referenced by the request), the video
  embeddings, the decoder's activations on the local shard (hidden states, q/k/v, the MLP
  intermediate), the KV cache the rank keeps (:func:`apbv.ownership.owned_local_index`,
  and the decode reserve on :data:`apbv.plan.QUERY_RANK` only), the passing buffers, the
  gathered query partials, and the logits.

Every phase also holds the engine's own host memory (:data:`RUNTIME_BYTES`).

The per-element factors were fitted to peak resident memory measured on CPU with
``benchmarks/bench_memory.py`` (fp32, 1 rank; results in ``benchmarks/results/memory_cpu.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from apbv.cost.work import ModelDims
from apbv.ownership import owned_local_index
from apbv.plan import QUERY_RANK, Plan
from apbv.validate import integer
from apbv.video.load import DECODE_CHUNK_ELEMENTS
from apbv.video.patches import patches_per_chunk

PHASES: dict[str, tuple[str, ...]] = {
    "preprocess": ("runtime", "weights", "frames", "decode", "processor"),
    "vision": ("runtime", "weights", "pixel_values", "vision_activations"),
    "prefill": ("runtime", "weights", "pixel_values", "video_embeddings",
                "decoder_activations", "kv_cache", "passing_buffers", "query_gathers", "logits"),
}
"""The parts alive together in each phase of a request."""
HOST_PARTS = ("runtime", "frames", "decode", "processor", "pixel_values")
"""Parts that live in host memory when the model runs on a GPU (the vision tower's device copy
of a call's patch rows is counted in ``vision_activations``)."""

RUNTIME_BYTES = 128 << 20
"""Host memory the engine holds besides the weights in every phase (the tokenizer and
processor, the interpreter's objects, allocator slack)."""
DECODE_COPIES = 6.0
"""Copies of one decoding chunk (:data:`apbv.video.load.DECODE_CHUNK_ELEMENTS` uint8 values,
or the rank's frames if fewer) alive while it is decoded and resized: the decoder's buffers,
its array, the resize's output and the allocator's slack."""
NATIVE_FRAME_BYTES = 34.0
"""Bytes per native pixel of the one frame being decoded and resized: the decoder's reference
and output frames and the resize's float32 copies (12 bytes a pixel)."""
NATIVE_CHUNK_BYTES = 8.0
"""Bytes per native pixel of each frame of a decoding chunk (:data:`DECODE_CHUNK_ELEMENTS`
values of native frames, at least one frame): the decoded RGB array, its tensor and slack.
With :data:`NATIVE_FRAME_BYTES`, the upper side of the peak resident memory of
:func:`apbv.video.load_rank_frames` with decord (the default decoder; PyAV needs about half):
measured / modelled 0.80-0.95 for 1920x1080 to 8192x8192 frames
(``benchmarks/bench_native_decode.py``, ``benchmarks/results/native_decode_cpu.md``)."""
PROCESSOR_FLOAT_COPIES = 2.5
"""float32 copies of the decoded frames the video processor holds at once besides its output
(the rescaled-and-normalised frames, then the patchified copy)."""
VISION_HIDDEN_ROWS = 10.0
"""Live rows of vision-hidden width per patch during a vision block: the residual stream, the
norm, q/k/v (and their float32 RoPE copies), the attention output and the window reordering."""
VISION_MLP_ROWS = 3.0
"""Live rows of the vision MLP's intermediate width per patch: gate, up and their product."""
DECODER_HIDDEN_ROWS = 6.0
"""Live rows of hidden width per local token in a decoder layer: the input embeddings, the
residual stream, the norm, the attention and o_proj outputs, the MLP output."""
DECODER_HEAD_ROWS = 3.0
"""Copies of q, k and v (one row of (Hq + 2 Hkv) D per token) alive in attention: the
projections, RoPE's outputs and the kernel's layout."""
DECODER_MLP_ROWS = 3.0
"""Live rows of the MLP intermediate width per local token: gate, up and their product."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds for one request, by part; :attr:`total` is the largest phase."""

    rank: int
    parts: dict[str, int]
    """Bytes of each part (see :data:`PHASES` for which parts live together)."""
    phases: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(PHASES))

    def phase_bytes(self, phase: str) -> int:
        return sum(self.parts[p] for p in self.phases[phase])

    @property
    def peak_phase(self) -> str:
        """The phase of the peak (the first of the largest)."""
        return max(self.phases, key=self.phase_bytes)

    @property
    def total(self) -> int:
        """Peak bytes: the largest phase's parts together."""
        return self.phase_bytes(self.peak_phase)

    @property
    def device_total(self) -> int:
        """Peak bytes on a GPU: the largest phase without the :data:`HOST_PARTS`."""
        return max(sum(self.parts[p] for p in parts if p not in HOST_PARTS)
                   for parts in self.phases.values())

    def describe(self, top: int = 3) -> str:
        """One line: the total, the peak phase and its ``top`` largest parts."""
        phase = self.peak_phase
        largest = sorted(self.phases[phase], key=lambda p: -self.parts[p])[:top]
        parts = ", ".join(f"{p} {_gib(self.parts[p])}" for p in largest)
        return f"rank {self.rank}: {_gib(self.total)} GiB at its {phase} peak ({parts} GiB)"


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 1024**3:.3f}"


def request_memory(
    dims: ModelDims,
    plan: Plan,
    *,
    patches: int,
    grid_hw: tuple[int, int],
    dtype_bytes: int,
    reserve_tokens: int,
    rank: int,
    row_bytes: int = 1,
    processor_copies: float = 0.0,
    call_rows: int = 0,
    frame_hw: tuple[int, int] | None = None,
    native_pixels: int = 0,
) -> MemoryEstimate:
    """Bytes rank ``rank`` needs for one request under ``plan``.

    Args:
        dims: the model's sizes (:func:`apbv.cost.checkpoint_dims` or a preset).
        plan: the request's plan (:func:`apbv.modes.get_mode` ``(mode).plan(N, Q, H)``).
        patches: temporal patches this rank encodes (:func:`apbv.plan.patch_ranges`); 0: none.
        grid_hw: (h, w) patch grid of one frame, before the spatial merge (as in
            ``video_grid_thw``); ignored when ``patches`` is 0.
        dtype_bytes: bytes per weight and activation element (4 fp32, 2 bf16).
        reserve_tokens: KV rows reserved per layer for decode (kept on the query rank).
        rank: the rank, in ``[0, plan.world_size)``.
        row_bytes: bytes per element of the patch rows: 1 for pixel levels (int8; the default
            ``vision.preprocess=levels`` with the linear patch embedding), 4 for float32 rows.
        processor_copies: float32 copies of the decoded frames held while the rows are made:
            :data:`PROCESSOR_FLOAT_COPIES` for the HF video processor
            (``vision.preprocess=processor``); 0 where :mod:`apbv.video.patches` writes the
            rows once, chunk by chunk.
        call_rows: patch rows per vision-tower call (``vision.chunk_rows``, whole temporal
            patches); 0: the rank's share in one call.
        frame_hw: (height, width) in pixels of each decoded frame as the rank holds it before
            the patch rows are made (InternVL3: the file's native size, resized to the
            checkpoint's tile by its processor; the processor's float copies are counted at
            this size too, the safe side); None: the patch grid's size (frames arrive resized,
            as for Qwen2.5-VL).
        native_pixels: pixels of one frame as the file stores it (its native size, from the
            container's header); the decoding is then counted at that size
            (:data:`NATIVE_FRAME_BYTES`, :data:`NATIVE_CHUNK_BYTES`), where it is larger than
            the resized frames' copies;
            0: unknown (the resized frames' copies only).
    """
    integer("patches", patches, 0)
    integer("reserve_tokens", reserve_tokens, 0)
    integer("call_rows", call_rows, 0)
    integer("native_pixels", native_pixels, 0)
    for name, value in (("dtype_bytes", dtype_bytes), ("row_bytes", row_bytes)):
        if value not in (1, 2, 4, 8):
            raise ValueError(f"{name} must be one of 1, 2, 4, 8, got {value!r}")
    if not processor_copies >= 0:
        raise ValueError(f"processor_copies must be >= 0, got {processor_copies!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < plan.world_size:
        raise ValueError(f"rank must be in [0, {plan.world_size}), got {rank!r}")
    merge = dims.spatial_merge_size
    gh, gw = grid_hw if patches else (0, 0)
    if patches and (gh <= 0 or gw <= 0 or gh % merge or gw % merge):
        raise ValueError(f"grid_hw must be two positive multiples of the spatial merge size "
                         f"{merge}, got {grid_hw!r}")
    if frame_hw is not None and (len(frame_hw) != 2 or any(
            isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in frame_hw)):
        raise ValueError(f"frame_hw must be two positive integers (pixels), got {frame_hw!r}")
    e, f32 = dtype_bytes, 4
    d, hq, kv = dims.head_dim, dims.heads, dims.kv_heads

    # Video: frames, patch rows, the vision tower's activations, the merged embeddings.
    vit_patches = patches * gh * gw
    frame_pixels = gh * gw * dims.patch_size**2 if frame_hw is None or not patches \
        else frame_hw[0] * frame_hw[1]
    frames = patches * dims.temporal_patch_size * frame_pixels * dims.in_channels
    patch_row = dims.in_channels * dims.temporal_patch_size * dims.patch_size**2
    pixel_values = vit_patches * patch_row * row_bytes
    processor = int(processor_copies * frames * f32) + pixel_values
    call = vit_patches
    if call_rows and vit_patches:
        call = min(vit_patches, patches_per_chunk(gh * gw, call_rows) * gh * gw)
    vision = call * e * (VISION_HIDDEN_ROWS * dims.vision_hidden
                         + VISION_MLP_ROWS * dims.vision_intermediate)
    if row_bytes != e:  # the call's rows in the tower's dtype (levels widened, floats cast)
        vision += call * patch_row * e
    merged = vit_patches // merge**2
    # The calls' embeddings, and their concatenation when there are several calls.
    vision += merged * dims.embedding_width * e * (1 if call == vit_patches else 2)
    # The rank's encoded rows, and the rows its shard holds after routing: at most its context
    # tokens (the video fills nearly all of a long context).
    held = plan.local_len(rank) - plan.query_len if merged else 0
    video_embeddings = (merged + held) * dims.embedding_width * e

    # Decoder over the local shard, its KV cache and its collectives' buffers.
    tokens = plan.local_len(rank)
    decoder = int(tokens * e * (DECODER_HIDDEN_ROWS * dims.hidden
                                + DECODER_HEAD_ROWS * (hq + 2 * kv) * d
                                + DECODER_MLP_ROWS * dims.intermediate))
    decoder += tokens * 3 * 8  # the (3, 1, T) int64 M-RoPE positions
    cached = len(owned_local_index(plan, rank))
    if rank == QUERY_RANK:
        cached += reserve_tokens
    kv_cache = dims.layers * cached * 2 * kv * d * e
    passing = plan.passing_capacity * kv * d * 2 * plan.blocks_per_rank * plan.world_size * e
    query = plan.world_size * plan.query_len * hq * (d + 1) * f32
    logits = dims.vocab * (e + f32)
    decode = int(DECODE_COPIES * min(frames, DECODE_CHUNK_ELEMENTS))
    if native_pixels and patches:
        decoded = patches * dims.temporal_patch_size
        chunk = min(decoded, max(1, DECODE_CHUNK_ELEMENTS // (3 * native_pixels)))
        decode = max(decode, int(native_pixels * (NATIVE_FRAME_BYTES
                                                  + NATIVE_CHUNK_BYTES * chunk)))
    parts = {
        "runtime": RUNTIME_BYTES,
        "weights": dims.parameters() * e,
        "frames": frames,
        "decode": decode,
        "processor": processor,
        "pixel_values": pixel_values,
        "vision_activations": int(vision),
        "video_embeddings": video_embeddings,
        "decoder_activations": decoder,
        "kv_cache": kv_cache,
        "passing_buffers": passing,
        "query_gathers": query,
        "logits": logits,
    }
    return MemoryEstimate(rank=rank, parts=parts)


def memory_lines(plan: Plan, dims: ModelDims, *, patches: int = 0,
                 grid_hw: tuple[int, int] = (0, 0), dtype_bytes: int = 2,
                 reserve_tokens: int = 0) -> list[str]:
    """The ``plan`` command's per-rank memory estimate: a header and one line per rank (its
    :meth:`MemoryEstimate.describe` and its prompt KV cache).

    ``patches`` is the whole video's temporal patches, split over the ranks as the engine
    splits them (:func:`apbv.plan.patch_ranges`)."""
    from apbv.plan import patch_ranges

    shares = ([b - a for a, b in patch_ranges(patches, plan.world_size)] if patches
              else [0] * plan.world_size)
    lines = [(f"memory per rank ({dims.layers} layers, {dims.kv_heads} KV heads x "
              f"{dims.head_dim}, {dtype_bytes} bytes per element):")]
    for rank in range(plan.world_size):
        est = request_memory(dims, plan, patches=shares[rank], grid_hw=grid_hw,
                             dtype_bytes=dtype_bytes, reserve_tokens=reserve_tokens, rank=rank)
        cached = len(owned_local_index(plan, rank))
        prompt_kv = dims.layers * cached * 2 * dims.kv_heads * dims.head_dim * dtype_bytes
        reserve = (f" + {reserve_tokens} decode rows"
                   if rank == QUERY_RANK and reserve_tokens else "")
        lines.append(f"  {est.describe()}; prompt KV cache {_gib(prompt_kv)} GiB "
                     f"({cached} tokens){reserve}")
    return lines
