"""Cost model of one request: counted work per rank, and predicted stage times and TTFT.

Three layers, each usable on its own (docs/cost_model.md has the formulas and their limits):

1. Counted work, exact and pure: :func:`rank_pairs` counts the query-key pairs a rank scores
   in one layer under a plan, :func:`full_pairs` those of single-process causal attention.
   FLOPs of softmax attention = 4 * D * Hq * pairs (QK^T and PV, a multiply-add each); causal
   squares count n(n+1)/2 pairs.
2. What runs where: :class:`ModelDims` (from a checkpoint's config.json, :func:`model_dims`, or
   a preset of :data:`MODEL_PRESETS`) and :class:`Hardware` (a dozen throughput, bandwidth and
   host-overhead constants; presets in :data:`HARDWARE_PRESETS`, or a calibration JSON written
   by ``benchmarks/calibrate_cpu.py``).
3. :func:`predict`: for one mode, per rank and per stage of the engine (preprocess, vision,
   transfer, prefill, first_token), the FLOPs, bytes moved and KV memory, and from the hardware
   constants the seconds. Stage times are reported the way the engine times them: every stage
   ends with a barrier, so each is the slowest rank's time.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apbv.engine.kvcache import owned_local_index
from apbv.modes import get_mode
from apbv.plan import QUERY_RANK, Plan, patch_ranges
from apbv.timing import TTFT_STAGES
from apbv.video import VideoMeta, VideoSpec, plan_sampling
from apbv.engine.routing import VideoSpan, embedding_routes, needed_video_tokens

VIDEO_START = 15
"""Context tokens before the first video token in the default Qwen2.5-VL chat template (system
prompt, user header, <|vision_start|>); one more (<|vision_end|>) follows the video."""


def _causal(n: int) -> int:
    return n * (n + 1) // 2


def rank_pairs(plan: Plan, rank: int) -> int:
    """Query-key pairs rank ``rank`` scores in one APB-V layer (use ``plan.exact()`` for exact)."""
    a, q = plan.anchor_len, plan.query_len
    pairs = _causal(a)
    blocks_len = 0
    for block in plan.rank_blocks(rank):
        n = plan.block_len(block)
        passed = sum(plan.selected_len(u) for u in range(block))
        pairs += n * (a + passed) + _causal(n)
        blocks_len += n
    a0, a1 = plan.anchor_share(rank)
    pairs += q * (a1 - a0 + blocks_len) + (_causal(q) if rank == 0 else 0)
    return pairs


def full_pairs(plan: Plan) -> int:
    """Pairs of ordinary causal attention over the whole prompt in one process."""
    return _causal(plan.total_len)


def attention_flops(pairs: int, num_heads: int, head_dim: int) -> float:
    return 4.0 * head_dim * num_heads * pairs


# ---------------------------------------------------------------------------------------------
# Model dimensions.


@dataclass(frozen=True)
class ModelDims:
    """The sizes of a Qwen2.5-VL checkpoint that the cost model needs."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    vision_depth: int
    vision_hidden: int
    vision_intermediate: int
    vision_heads: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    window_size: int = 112
    """Vision attention window edge in pixels; window_size // merge // patch merged tokens."""
    fullatt_blocks: int = 4
    """Vision blocks attending over a whole temporal patch; the others attend in windows."""

    @property
    def window_tokens(self) -> int:
        """Merged tokens along each edge of a vision attention window."""
        return max(1, self.window_size // self.spatial_merge_size // self.patch_size)

    def text_linears(self) -> list[tuple[int, int]]:
        """(in, out) of the matmuls of one decoder layer: q, k, v, o, gate, up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]

    def vision_linears(self) -> list[tuple[int, int]]:
        """(in, out) of the matmuls of one vision block, per patch: qkv, proj, gate, up, down."""
        h, i = self.vision_hidden, self.vision_intermediate
        return [(h, 3 * h), (h, h), (h, i), (h, i), (i, h)]


def _required(section: Mapping[str, Any], where: str, *names: str) -> Any:
    for name in names:
        if name in section:
            return section[name]
    raise ValueError(f"config.json has no {' or '.join(names)} in {where}")


def _text_section(config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def model_dims(config: Mapping[str, Any]) -> ModelDims:
    """ModelDims from a Qwen2.5-VL config.json dict.

    Both forms are read: transformers v5's nested one (``text_config`` and ``vision_config``)
    and the released checkpoints' flat one (text fields at the top, ``vision_config`` nested).
    """
    text = _text_section(config)
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        raise ValueError("config.json has no vision_config: not a Qwen2.5-VL checkpoint")
    where = "text_config" if text is not config else "the top level"
    heads = _required(text, where, "num_attention_heads")
    hidden = _required(text, where, "hidden_size")
    vocab = text.get("vocab_size", config.get("vocab_size"))
    if vocab is None:
        raise ValueError("config.json has no vocab_size")
    fullatt = _required(vision, "vision_config", "fullatt_block_indexes")
    out_hidden = vision.get("out_hidden_size", hidden)
    if out_hidden != hidden:
        raise ValueError(f"vision_config.out_hidden_size ({out_hidden}) differs from the text "
                         f"hidden_size ({hidden})")
    return ModelDims(
        layers=_required(text, where, "num_hidden_layers"),
        hidden=hidden,
        heads=heads,
        kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or hidden // heads,
        intermediate=_required(text, where, "intermediate_size"),
        vocab=vocab,
        vision_depth=_required(vision, "vision_config", "depth"),
        vision_hidden=_required(vision, "vision_config", "hidden_size"),
        vision_intermediate=_required(vision, "vision_config", "intermediate_size"),
        vision_heads=_required(vision, "vision_config", "num_heads"),
        patch_size=_required(vision, "vision_config", "patch_size", "spatial_patch_size"),
        temporal_patch_size=_required(vision, "vision_config", "temporal_patch_size"),
        spatial_merge_size=_required(vision, "vision_config", "spatial_merge_size"),
        in_channels=vision.get("in_channels", vision.get("in_chans", 3)),
        window_size=_required(vision, "vision_config", "window_size"),
        fullatt_blocks=len(fullatt),
    )


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """A checkpoint directory's config.json (no weights are read)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{str(path)!r} not found")
    return json.loads(path.read_text())


def _released_config(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
                     vocab: int) -> dict[str, Any]:
    """The fields of a released Qwen2.5-VL config.json (flat form) that ModelDims reads."""
    return {
        "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "intermediate_size": intermediate, "vocab_size": vocab,
        "vision_config": {
            "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
            "in_chans": 3, "out_hidden_size": hidden, "patch_size": 14, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
        },
    }


MODEL_PRESETS: dict[str, ModelDims] = {
    "qwen2.5-vl-3b": model_dims(_released_config(36, 2048, 16, 2, 11008, 151936)),
    "qwen2.5-vl-7b": model_dims(_released_config(28, 3584, 28, 4, 18944, 152064)),
}
"""Qwen2.5-VL-3B/7B-Instruct as released (config.json on the Hugging Face hub)."""


def preset_dims(name: str) -> ModelDims:
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; allowed: {', '.join(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]


# ---------------------------------------------------------------------------------------------
# Hardware.


@dataclass(frozen=True)
class Hardware:
    """Per-rank throughput, bandwidth and host-overhead constants (SI units: s, bytes, FLOP)."""

    name: str
    matmul_flops: float
    """FLOP/s of one rank's dense matmuls (linear layers)."""
    conv_flops: float
    """FLOP/s of the vision tower's patch embedding (a Conv3d whose stride is its kernel)."""
    attention_flops: float
    """FLOP/s of the fused attention kernel on its 4 * D FLOPs per query-key pair and head."""
    attention_pair_s: float
    """Seconds per pair and head on top of the FLOPs (softmax and bookkeeping; 0 where the
    efficiency in ``attention_flops`` covers it)."""
    memory_bw: float
    """Bytes/s of memory-bound work (elementwise ops, copies, weight reads of small matmuls)."""
    link_bw: float
    """Bytes/s one rank receives in a collective."""
    link_latency_s: float
    """Fixed cost of one collective."""
    decode_s_per_pixel: float
    """Host seconds to decode and resize a sampled frame, per source pixel."""
    process_s_per_pixel: float
    """Host seconds of the video processor (normalise, patchify), per resized pixel."""
    preprocess_fixed_s: float
    """Host seconds per request besides the frames and the tokens (open and probe the file)."""
    tokenize_s_per_token: float
    """Host seconds per prompt token to tokenize the prompt with its video placeholders."""
    layer_overhead_s: float
    """Host seconds per decoder layer (Python and op dispatch of the layer and the APB-V op)."""
    vision_layer_overhead_s: float
    """Host seconds per vision block, besides its attention calls."""
    call_overhead_s: float
    """Host seconds per attention call of the vision tower (SDPA runs once per window)."""
    host_overlaps_device: bool = False
    """True on GPUs: the host queues work ahead, so a layer costs max(host, device) time; False
    on CPUs: host and compute add up."""
    full_uses_all_ranks: bool = False
    """True where the single-process ``full`` baseline gets the compute of all H ranks (the
    CPU benchmarks give it H threads); False where it gets one device."""
    thread_efficiency: float = 1.0
    """With ``full_uses_all_ranks``: its throughput is H * thread_efficiency times a rank's."""
    dtype_bytes: int = 2
    """Bytes per activation / KV element the runtime uses here (bf16 on GPUs, fp32 on CPUs)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, source: str | Path | Mapping[str, Any]) -> Hardware:
        """From a JSON file or dict: the fields at the top level or under ``"hardware"``
        (the form ``benchmarks/calibrate_cpu.py`` writes)."""
        data: Any = source
        if not isinstance(source, Mapping):
            path = Path(source)
            if not path.is_file():
                raise ValueError(f"hardware file {str(path)!r} not found")
            data = json.loads(path.read_text())
        if isinstance(data, Mapping) and isinstance(data.get("hardware"), Mapping):
            data = data["hardware"]
        if not isinstance(data, Mapping):
            raise ValueError("a hardware description must be a JSON object")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"unknown hardware field(s) {unknown}; allowed: {', '.join(names)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"incomplete hardware description: {exc}") from None


CPU = Hardware(
    name="cpu",
    matmul_flops=8.006e+10,
    conv_flops=1.51e+10,
    attention_flops=9.327e+10,
    attention_pair_s=1.075e-09,
    memory_bw=9.487e+09,
    link_bw=4.097e+08,
    link_latency_s=0.0003856,
    decode_s_per_pixel=1.547e-08,
    process_s_per_pixel=3.827e-08,
    preprocess_fixed_s=0.008457,
    tokenize_s_per_token=3.141e-06,
    layer_overhead_s=0.004288,
    vision_layer_overhead_s=0.002112,
    call_overhead_s=3.149e-05,
    host_overlaps_device=False,
    full_uses_all_ranks=True,
    thread_efficiency=0.9001,
    dtype_bytes=4,
)
"""The 2-core development machine, one thread per rank: the values of
benchmarks/results/cpu_calibration.json (``python benchmarks/calibrate_cpu.py``)."""

H200_MATMUL_FLOPS = 790e12
"""Dense bf16 matmul throughput measured on an H200 (989 TFLOP/s peak)."""
NVLINK4_BW = 450e9
"""NVLink 4 bandwidth per direction per GPU (18 links x 25 GB/s), within a node."""
IB_NDR_BW = 50e9
"""One 400 Gb/s InfiniBand NDR port per GPU, between nodes."""
HOST_SPEEDUP = 1.5
"""A GPU server's host core against one of the CPU development machine (host work per core)."""
HOST_CORES_PER_GPU = 8
"""Host cores decoding and preprocessing frames for each GPU rank."""


def h200(*, attention_efficiency: float = 0.5, link_bw: float = NVLINK4_BW,
         name: str = "h200") -> Hardware:
    """One H200 per rank. ``attention_efficiency``: the attention kernel's share of the matmul
    throughput (0.5 is flash-attn 2's forward at long sequences, which the reference uses;
    flash-attn 3 reaches about 0.7). Host work: the :data:`CPU` calibration on a core
    :data:`HOST_SPEEDUP` times faster, frame work spread over :data:`HOST_CORES_PER_GPU`."""
    if not 0 < attention_efficiency <= 1:
        raise ValueError(f"attention_efficiency must be in (0, 1], got {attention_efficiency}")
    return Hardware(
        name=name,
        matmul_flops=H200_MATMUL_FLOPS,
        conv_flops=0.5 * H200_MATMUL_FLOPS,
        attention_flops=attention_efficiency * H200_MATMUL_FLOPS,
        attention_pair_s=0.0,
        memory_bw=4.8e12,
        link_bw=link_bw,
        link_latency_s=20e-6,
        decode_s_per_pixel=CPU.decode_s_per_pixel / (HOST_SPEEDUP * HOST_CORES_PER_GPU),
        process_s_per_pixel=CPU.process_s_per_pixel / (HOST_SPEEDUP * HOST_CORES_PER_GPU),
        preprocess_fixed_s=CPU.preprocess_fixed_s / HOST_SPEEDUP,
        tokenize_s_per_token=CPU.tokenize_s_per_token / HOST_SPEEDUP,
        layer_overhead_s=CPU.layer_overhead_s / HOST_SPEEDUP,
        vision_layer_overhead_s=CPU.vision_layer_overhead_s / HOST_SPEEDUP,
        call_overhead_s=CPU.call_overhead_s / HOST_SPEEDUP,
        host_overlaps_device=True,
        dtype_bytes=2,
    )


HARDWARE_PRESETS: dict[str, Hardware] = {
    "h200": h200(),
    "h200-ib": h200(link_bw=IB_NDR_BW, name="h200-ib"),
    "cpu": CPU,
}


def hardware(name_or_path: str | Path) -> Hardware:
    """A preset of :data:`HARDWARE_PRESETS` by name, or a JSON file (:meth:`Hardware.from_json`)."""
    if str(name_or_path) in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[str(name_or_path)]
    if not str(name_or_path).endswith(".json"):
        raise ValueError(f"unknown hardware {str(name_or_path)!r}; allowed: "
                         f"{', '.join(HARDWARE_PRESETS)} or a .json file")
    return Hardware.from_json(name_or_path)


# ---------------------------------------------------------------------------------------------
# Video geometry.


def video_grid(frames: int, height: int, width: int, *, patch_size: int = 14,
               max_pixels: int | None = None, min_pixels: int | None = None,
               ) -> tuple[int, int, int]:
    """(temporal patches, merged-token rows, merged-token cols) of ``frames`` sampled frames of
    height x width, by the runtime's rules (:func:`apbv.video.plan_sampling`: qwen-vl-utils'
    smart_resize with the default video pixel limits, which cap a frame at 768 tokens)."""
    spec = VideoSpec("planned-video", nframes=frames, max_pixels=max_pixels,
                     min_pixels=min_pixels, image_patch_size=patch_size)
    sampling = plan_sampling(spec, VideoMeta(frames, 2.0, height, width))
    t, h, w = sampling.grid_thw
    return t, h // 2, w // 2  # qwen-vl-utils sizes frames for a 2 x 2 spatial merge


def squarest_grid(tokens_per_patch: int) -> tuple[int, int]:
    """(rows, cols) with rows * cols = tokens_per_patch and rows the largest divisor <= sqrt."""
    rows = max(d for d in range(1, math.isqrt(tokens_per_patch) + 1) if tokens_per_patch % d == 0)
    return rows, tokens_per_patch // rows


# ---------------------------------------------------------------------------------------------
# Prediction.


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

    @property
    def ttft_s(self) -> float:
        return sum(self.seconds[s] for s in TTFT_STAGES)

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
            "ranks": [dataclasses.asdict(r) for r in self.ranks],
        }


@dataclass(frozen=True)
class _Machine:
    """Seconds of each kind of work on one rank; ``scale`` multiplies the throughputs."""

    hw: Hardware
    dtype: int
    scale: float = 1.0

    def mem(self, num_bytes: float) -> float:
        return num_bytes / (self.hw.memory_bw * self.scale)

    def matmuls(self, rows: int, shapes: list[tuple[int, int]]) -> float:
        """Roofline per matmul: the larger of its FLOP time and its memory time."""
        total = 0.0
        for d_in, d_out in shapes:
            flops = 2.0 * rows * d_in * d_out
            traffic = self.dtype * (rows * (d_in + d_out) + d_in * d_out)
            total += max(flops / (self.hw.matmul_flops * self.scale), self.mem(traffic))
        return total

    def conv(self, flops: float) -> float:
        return flops / (self.hw.conv_flops * self.scale)

    def attention(self, pairs: int, heads: int, head_dim: int) -> float:
        per_pair = 4.0 * head_dim / self.hw.attention_flops + self.hw.attention_pair_s
        return pairs * heads * per_pair / self.scale

    def collective(self, received_bytes: float, world_size: int) -> float:
        if world_size == 1:  # apbv.comm completes at once without a process group
            return 0.0
        return self.hw.link_latency_s + received_bytes / self.hw.link_bw

    def host(self, device_s: float, host_s: float) -> float:
        """Time of work that needs ``device_s`` of compute and ``host_s`` of dispatch."""
        if self.hw.host_overlaps_device:
            return max(device_s, host_s)
        return device_s + host_s


def _flops(shapes: list[tuple[int, int]]) -> int:
    return sum(2 * d_in * d_out for d_in, d_out in shapes)


Event = tuple[str, float]
"""One step of a rank's layer: ("compute", seconds), ("start", j) or ("wait", j), where j
numbers the layer's collectives in issue order (the same on every rank)."""


def simulate(events: list[list[Event]], durations: list[float]) -> list[float]:
    """Run every rank's steps together; returns when each rank finishes.

    Collective j ends ``durations[j]`` after the last rank has started it and the previous
    collective has ended (they share one communicator, which runs them in order). A wait
    blocks its rank until the collective has ended; compute adds to the rank's clock.
    """
    world = len(events)
    clock, pos = [0.0] * world, [0] * world
    started: list[list[float]] = [[] for _ in durations]
    ends: dict[int, float] = {}
    while True:
        moved = False
        for r in range(world):
            while pos[r] < len(events[r]):
                kind, value = events[r][pos[r]]
                if kind == "wait":
                    if int(value) not in ends:
                        break
                    clock[r] = max(clock[r], ends[int(value)])
                elif kind == "start":
                    started[int(value)].append(clock[r])
                else:
                    clock[r] += value
                pos[r] += 1
                moved = True
        for j, duration in enumerate(durations):
            if j not in ends and len(started[j]) == world and (j == 0 or j - 1 in ends):
                ends[j] = max(max(started[j]), ends.get(j - 1, 0.0)) + duration
                moved = True
        if all(pos[r] == len(events[r]) for r in range(world)):
            return clock
        if not moved:
            raise AssertionError(f"schedule cannot finish: ranks stopped at steps {pos}")


def _layer_events(plan: Plan, rank: int, dims: ModelDims, m: _Machine, overlap: bool,
                  ) -> tuple[list[Event], int]:
    """One decoder layer of ``rank`` in the order apbv.attention.spava runs it, and its pairs."""
    d, kv, hq, dt = dims.head_dim, dims.kv_heads, dims.heads, m.dtype
    tokens, a, q = plan.local_len(rank), plan.anchor_len, plan.query_len
    cached = len(owned_local_index(plan, rank))
    blocks = plan.rank_blocks(rank)
    # Before attention: norm, q/k/v, RoPE (about 10 passes over q and k), the KV-cache copy
    # of the owned tokens.
    pre = (m.matmuls(tokens, dims.text_linears()[:3])
           + m.mem(dt * tokens * (2 * dims.hidden + 10 * (hq + kv) * d)
                   + 4 * dt * cached * kv * d))
    events: list[Event] = [("compute", pre)]

    def start(j: int) -> list[Event]:
        return [("start", j)] + ([] if overlap else [("wait", j)])

    for j, b in enumerate(blocks):  # select each block, start its all-gather
        n, count = plan.block_len(b), plan.selected_len(b)
        traffic = 2 * plan.passing_capacity * kv * d * dt  # the zeroed send buffer
        if count == n:
            traffic += 4 * n * kv * d * dt
        elif count:  # fp32 scores of every key, pooling and top-k, gathering the chosen rows
            traffic += n * kv * (d * (dt + 8) + 16) + 4 * count * kv * d * dt
        events += [("compute", m.mem(traffic))] + start(j)
    a0, a1 = plan.anchor_share(rank)
    blocks_len = sum(plan.block_len(b) for b in blocks)
    query_pairs = q * (a1 - a0 + blocks_len) + (_causal(q) if rank == QUERY_RANK else 0)
    events += [("compute", m.attention(query_pairs, hq, d) + m.mem(20 * q * hq * (d + 1)))]
    events += start(len(blocks))
    events += [("compute", m.attention(_causal(a), hq, d))]  # anchor rows
    pairs = query_pairs + _causal(a)
    for b in blocks:
        for slot in sorted({plan.block_slot(u)[1] for u in range(b)}):
            events.append(("wait", slot))
        n, passed = plan.block_len(b), sum(plan.selected_len(u) for u in range(b))
        block_pairs = n * (a + passed) + _causal(n)
        pairs += block_pairs
        if n:  # two kernel calls (context, causal block), the concatenated context, a merge
            copies = 4 * (passed + a) * kv * d * dt + n * hq * d * (3 * dt + 16)
            events.append(("compute", m.attention(block_pairs, hq, d) + m.mem(copies)))
    merge = m.mem(12 * plan.world_size * q * hq * (d + 1))
    events += [("wait", len(blocks)), ("compute", merge)]
    events += [("wait", j) for j in range(len(blocks))]
    # After attention: o_proj, residuals, norm, the MLP and its activation.
    post = (m.matmuls(tokens, dims.text_linears()[3:])
            + m.mem(dt * tokens * (8 * dims.hidden + 3 * dims.intermediate)))
    events.append(("compute", post))
    return events, pairs


def _full_layer(plan: Plan, dims: ModelDims, m: _Machine) -> float:
    """One decoder layer of the single-process baseline: one causal kernel call."""
    total, d, kv, hq = plan.total_len, dims.head_dim, dims.kv_heads, dims.heads
    elementwise = (10 * dims.hidden + 3 * dims.intermediate + 10 * (hq + kv) * d + 4 * kv * d)
    return (m.matmuls(total, dims.text_linears()) + m.mem(m.dtype * total * elementwise)
            + m.attention(full_pairs(plan), hq, d))


def split_window(length: int, window: int) -> list[int]:
    """Edges of the vision attention windows along one axis of ``length`` merged tokens."""
    return [window] * (length // window) + ([length % window] if length % window else [])


def _vision(dims: ModelDims, patches: int, grid: tuple[int, int], m: _Machine,
            ) -> tuple[float, float]:
    """(seconds, FLOPs) of the vision tower on ``patches`` temporal patches whose frames are a
    merged rows x cols grid: patch embedding, windowed and full blocks, merger."""
    if patches == 0:
        return 0.0, 0.0
    merge, (rows, cols) = dims.spatial_merge_size, grid
    per_patch = rows * cols * merge**2  # ViT patches per temporal patch
    n, merged = patches * per_patch, patches * rows * cols
    vh, heads = dims.vision_hidden, dims.vision_heads
    embed = [(dims.in_channels * dims.temporal_patch_size * dims.patch_size**2, vh)]
    merger = [(vh * merge**2, vh * merge**2), (vh * merge**2, dims.hidden)]
    block = dims.vision_linears()
    # Per block: norms and residuals 10 passes over the hidden state, RoPE on q and k 10
    # passes each (upcast, rotate_half, products), the MLP activation 3 over the intermediate.
    device = (m.conv(n * _flops(embed)) + m.matmuls(merged, merger)
              + dims.vision_depth * (m.matmuls(n, block) + m.mem(
                  m.dtype * n * (30 * vh + 3 * dims.vision_intermediate))))
    flops = float(n * _flops(embed) + merged * _flops(merger)
                  + dims.vision_depth * n * _flops(block))
    row_sizes = split_window(rows, dims.window_tokens)
    col_sizes = split_window(cols, dims.window_tokens)
    window_pairs = (patches * merge**4 * sum(s * s for s in row_sizes)
                    * sum(s * s for s in col_sizes))
    frame_pairs = patches * per_patch**2
    windowed = dims.vision_depth - dims.fullatt_blocks
    head_dim = vh // heads
    device += (windowed * m.attention(window_pairs, heads, head_dim)
               + dims.fullatt_blocks * m.attention(frame_pairs, heads, head_dim))
    flops += attention_flops(windowed * window_pairs + dims.fullatt_blocks * frame_pairs,
                             heads, head_dim)
    calls = patches * (windowed * len(row_sizes) * len(col_sizes) + dims.fullatt_blocks)
    host = dims.vision_depth * m.hw.vision_layer_overhead_s + calls * m.hw.call_overhead_s
    return m.host(device, host), flops


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
    video_start: int = VIDEO_START,
    anchor_len: int | None = None,
    passing_len: int | None = None,
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
        video_start: context tokens before the video (:data:`VIDEO_START`).
        anchor_len, passing_len: override the mode's defaults, as the runtime's flags do.
    """
    spec = get_mode(mode)
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 0 or frames % 2:
        raise ValueError(f"frames must be an even integer >= 0 (2 frames per temporal patch), "
                         f"got {frames!r}")
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
    patches = frames // 2
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
    m = _Machine(hw, hw.dtype_bytes if dtype_bytes is None else dtype_bytes,
                 max(1.0, world_size * hw.thread_efficiency) if pooled else 1.0)
    dt = m.dtype

    # Preprocess and vision: rank r takes a contiguous share of the temporal patches.
    shares = [e - s for s, e in ranges]
    resized = tokens_per_patch * (dims.patch_size * dims.spatial_merge_size) ** 2
    per_frame = (hw.decode_s_per_pixel * (source_pixels or resized)
                 + hw.process_s_per_pixel * resized)
    tokenize = hw.tokenize_s_per_token * plan.total_len
    preprocess = [hw.preprocess_fixed_s + tokenize + 2 * n * per_frame / m.scale for n in shares]
    vision = [_vision(dims, n, grid, m) for n in shares]
    vision_s = [v[0] for v in vision]

    # Transfer: every rank's video embeddings to the ranks whose tokens they are.
    span = VideoSpan(min(video_start, context_len - video_tokens), video_tokens,
                     tokens_per_patch) if video_tokens else None
    rows = _embedding_rows(plan, span, ranges)
    if not spec.vit_split:  # every rank encoded everything: it only takes its own rows
        rows = [(0, 0, held) for _, _, held in rows]
    row_bytes = dims.hidden * dt
    transfer = [(m.collective(row_bytes * max(sent, got), ranks) if spec.vit_split else 0.0)
                + m.mem(2 * row_bytes * held) for sent, got, held in rows]

    # Prefill: each layer simulated on all ranks together (they meet in its collectives).
    if spec.single_process:
        pairs = [full_pairs(plan)]
        layer = [m.host(_full_layer(plan, dims, m), hw.layer_overhead_s)]
        received = 0
    else:
        built = [_layer_events(plan, r, dims, m, spec.overlap) for r in range(ranks)]
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
    seconds = {"preprocess": max(preprocess) + barrier, "vision": max(vision_s) + barrier,
               "transfer": max(transfer) + barrier, "prefill": prefill_stage + barrier,
               "first_token": first_token + barrier}
    return Prediction(mode=mode, hardware=hw.name, world_size=world_size, plan=plan,
                      seconds=seconds, ranks=tuple(costs))


def memory_estimate(plan: Plan, model_dir: str | Path, *, dtype_bytes: int = 2) -> list[str]:
    """Per-rank memory of one request, from the checkpoint's config.json only (no weights)."""
    text = _text_section(read_config(model_dir))
    layers, hidden = text["num_hidden_layers"], text["hidden_size"]
    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]
    head_dim = text.get("head_dim") or hidden // heads
    kv_token = 2 * layers * kv_heads * head_dim * dtype_bytes
    gib = 1024**3
    lines = [f"memory per rank ({layers} layers, {kv_heads} KV heads x {head_dim}, "
             f"{dtype_bytes} bytes per element):"]
    for rank in range(plan.world_size):
        cached = len(owned_local_index(plan, rank))
        local = plan.local_len(rank)
        passing = 2 * 2 * plan.world_size * plan.passing_capacity * kv_heads * head_dim
        lines.append(
            f"  rank {rank}: prompt KV cache {cached * kv_token / gib:.3f} GiB ({cached} tokens), "
            f"hidden states {local * hidden * dtype_bytes / gib:.3f} GiB ({local} tokens), "
            f"passing buffers {passing * dtype_bytes / gib:.4f} GiB per layer"
        )
    return lines


def prediction_table(predictions: list[Prediction]) -> str:
    """One row per mode: stage seconds, TTFT with and without preprocessing, speedups over
    ``full`` and ``zigzag_ring`` (when predicted) and the largest per-rank KV cache."""
    by_mode = {p.mode: p for p in predictions}
    head = (f"{'mode':<13} {'TTFT s':>9} " + " ".join(f"{s:>11}" for s in TTFT_STAGES)
            + f" {'no-prep s':>10} {'x full':>7} {'x zigzag':>8} {'KV GiB/rank':>11}")
    lines = [head]
    for p in predictions:
        speedups = []
        for base in ("full", "zigzag_ring"):
            other = by_mode.get(base)
            speedups.append(f"{other.ttft_s / p.ttft_s:.2f}" if other else "-")
        kv = max(r.kv_bytes for r in p.ranks) / 1024**3
        lines.append(f"{p.mode:<13} {p.ttft_s:>9.3f} "
                     + " ".join(f"{p.seconds[s]:>11.3f}" for s in TTFT_STAGES)
                     + f" {p.device_ttft_s:>10.3f} {speedups[0]:>7} {speedups[1]:>8} {kv:>11.3f}")
    spava = by_mode.get("spava")
    others = [m for m in ("full", "zigzag_ring", "apb") if m in by_mode]
    if spava and others:
        ratios = ", ".join(f"{by_mode[m].device_ttft_s / spava.device_ttft_s:.2f}x {m}"
                           for m in others)
        lines.append(f"spava's speedup without preprocessing (what the reference times): {ratios}")
    return "\n".join(lines)
