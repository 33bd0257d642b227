"""Runtime configuration: dataclasses (the schema), TOML presets in configs/, CLI overrides.

Presets live in apbv/configs/ (shipped in the wheel); the source tree's configs/ points there.

Precedence: command-line overrides > the TOML preset > the defaults below. A TOML file has one
table per section ([model], [video], [parallel], [attention], [generate], [decode], [cache])
whose keys are the field names; an override is ``section.key=value`` with the value parsed as
TOML (``attention.passing_len=256``, ``video.fps=1.0``, ``model.path="/ckpt/Qwen2.5-VL-7B"``,
or a bare word for a string: ``attention.mode=exact``).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_type_hints

from apbv.modes import MODE_NAMES
from apbv.validate import boolean, integer, number, one_of, pruning_settings, string

if TYPE_CHECKING:
    from apbv.video import VideoSpec

PACKAGED_CONFIG_DIR = Path(__file__).resolve().parent / "configs"
"""The presets shipped inside the package (a wheel install has only these)."""
SOURCE_CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
"""The source tree's configs/ (where users edit presets), when running from a checkout."""
DTYPES = ("auto", "float32", "bfloat16", "float16")
DIST_BACKENDS = ("auto", "nccl", "gloo")
RESIZE_DEVICES = ("cpu", "cuda")
DECODE_GRAPHS = ("auto", "on", "off")  # values of decode.graphs (docs/decode_graphs.md)
_FRAME_KEYS = ("fps", "nframes")  # video: exactly one sets the frame count
MAX_NEW_TOKENS = 32768
"""Upper bound of generate.max_new_tokens."""
MAX_TIMEOUT_S = 86400.0
"""Upper bound of parallel.timeout_s and parallel.startup_timeout_s (one day)."""

# The allowed values of the settings that name an implementation; the modules that implement
# them import these (this module imports no torch, so every layer can).
KERNEL_BACKENDS = ("flash", "sdpa", "reference")
"""``attention.kernel``: the attention kernels of :mod:`apbv.attention.kernels`."""
VIDEO_BACKENDS = ("decord", "pyav")
"""``video.backend``: the host decoders :class:`apbv.video.VideoSpec` accepts (the CPU's, and
the bit-parity reference)."""
VIDEO_DEVICE_BACKENDS = ("nvdec",)
"""``video.backend`` on the rank's GPU: ``nvdec`` is NVIDIA's hardware decoder through
torchcodec's CUDA decoder (frames stay on the device; not bit-equal to the host decoders;
written for GPU hosts and not run on a CPU machine)."""
VIDEO_DECODE_MODES = ("needed", "all")
"""``video.decode``: how PyAV walks a file; the sampled frames are the same."""
PREPROCESS = ("levels", "fused", "processor")
"""``vision.preprocess``: frames to patch rows by :mod:`apbv.video.patches`, as pixel levels
(``levels``) or as the processor's float rows (``fused``), or by the HF video processor."""
VISION_ATTENTION = ("grouped", "per_window")
"""``vision.attention``: grouped (:mod:`apbv.model.vision_attention`) or per_window (stock)."""
VISION_ROTARY = ("fused", "stock")
"""``vision.rotary``: fused (:func:`apbv.model.vision_attention.fused_rotary`) or stock."""
VISION_NORM = ("fused", "stock")
"""``vision.norm``: fused (:func:`apbv.model.vision_blocks.fused_rms_norm`) or stock."""
PATCH_EMBED = ("linear", "conv")
"""``vision.patch_embed``: linear (:func:`apbv.model.patch_embed.linear_patch_embed`) or conv."""


@dataclass
class ModelConfig:
    path: str = ""
    """Checkpoint directory (config.json, weights, tokenizer, processor configs)."""
    dtype: str = "auto"
    """Weights and activations: auto = bfloat16 on CUDA, float32 on CPU."""

    def __post_init__(self) -> None:
        string("model.path", self.path)
        one_of("model.dtype", self.dtype, DTYPES)


@dataclass
class VideoConfig:
    """Frame sampling: qwen-vl-utils' video keys (same names, same defaults), plus the decoder."""

    fps: float | None = 2.0
    """Frames sampled per second (qwen-vl-utils' rule); exclusive with nframes."""
    nframes: int | None = None
    """Exact number of frames to sample (rounded to a multiple of 2)."""
    min_frames: int = 4
    """With fps: at least this many frames."""
    max_frames: int | None = None
    """With fps: at most this many frames (qwen-vl-utils' default when unset)."""
    min_pixels: int | None = None
    """Per-frame pixel floor (qwen-vl-utils' default when unset, or max_pixels if lower)."""
    max_pixels: int | None = None
    """Per-frame pixel cap (qwen-vl-utils' default when unset)."""
    total_pixels: int | None = None
    """Pixel budget of the whole video (qwen-vl-utils' default when unset)."""
    video_start: float | None = None
    """Start of the clip in seconds (unset: the first frame)."""
    video_end: float | None = None
    """End of the clip in seconds (unset: the last frame)."""
    resized_height: int | None = None
    """With resized_width: a fixed frame size instead of the pixel settings."""
    resized_width: int | None = None
    """With resized_height: a fixed frame size instead of the pixel settings."""
    backend: str = "decord"
    """Decoder: decord or pyav (chosen explicitly, never a silent fallback), or nvdec (the
    GPU's hardware decoder through torchcodec; CUDA ranks with torchcodec installed)."""
    decode: str = "needed"
    """How PyAV walks the file: needed (skip the frames nothing refers to unless sampled; no
    decode at the end of the file at open) or all (the earlier reader); the same frames."""
    decode_threads: int | None = None
    """Decoder threads per rank (unset: the cores divided by the ranks)."""
    snap_to_keyframes: float | None = None
    """Seconds (opt-in, approximate): a sampled frame within this of a keyframe takes the
    keyframe instead (decoded alone); unset: exact sampling."""
    keyframe_split: bool = False
    """Opt-in: move each boundary of the ranks' frame split by at most one temporal patch to
    where the two ranks' frames lie in different keyframe intervals, so no two ranks walk the
    same GOP (apbv/video/gop.py); the same tokens as the balanced split."""
    resize_device: str = "cpu"
    """Where decoded frames are resized into patch rows: cpu (qwen-vl-utils' pixels bit for
    bit) or cuda (the rank's GPU: uint8 frames resized on the device, differing from the CPU's
    by rounding; CUDA ranks only)."""
    static_threshold: float = 0.0
    """Temporal patches changed by less, in channel levels 0-255, are dropped (0: off)."""
    pruning_rate: float = 0.0
    """Fraction of video tokens that changed least, dropped (vLLM's; 0: off; docs/pruning.md)."""

    def __post_init__(self) -> None:
        pruning_settings(self.pruning_rate, self.static_threshold)
        one_of("video.backend", self.backend, VIDEO_BACKENDS + VIDEO_DEVICE_BACKENDS)
        one_of("video.resize_device", self.resize_device, RESIZE_DEVICES)
        one_of("video.decode", self.decode, VIDEO_DECODE_MODES)
        integer("video.decode_threads", self.decode_threads, 1, optional=True)
        number("video.snap_to_keyframes", self.snap_to_keyframes, optional=True)
        boolean("video.keyframe_split", self.keyframe_split)
        if self.fps is not None and self.nframes is not None:
            raise ValueError("video.fps and video.nframes are exclusive; set one of them")
        number("video.fps", self.fps, optional=True)
        integer("video.nframes", self.nframes, 2, optional=True)
        integer("video.min_frames", self.min_frames, 1)
        integer("video.max_frames", self.max_frames, max(2, self.min_frames), optional=True)
        for name in ("min_pixels", "max_pixels", "total_pixels", "resized_height",
                     "resized_width"):
            integer(f"video.{name}", getattr(self, name), 1, optional=True)
        if self.min_pixels is not None and self.max_pixels is not None \
                and self.max_pixels < self.min_pixels:
            raise ValueError(f"video.max_pixels must be >= video.min_pixels ({self.min_pixels}), "
                             f"got {self.max_pixels}")
        number("video.video_start", self.video_start, low_open=False, optional=True)
        number("video.video_end", self.video_end, low_open=False, optional=True)
        if self.video_start is not None and self.video_end is not None \
                and self.video_end <= self.video_start:
            raise ValueError(f"video.video_end must be > video.video_start ({self.video_start}), "
                             f"got {self.video_end}")
        if (self.resized_height is None) != (self.resized_width is None):
            raise ValueError("video.resized_height and video.resized_width go together; "
                             "set both or neither")

    def spec(self, path: str) -> VideoSpec:
        """The sampling request for one video file (the fields it has carry over by name; where
        frames are resized is the engine's, the pruning settings are the request's)."""
        from apbv.video import VideoSpec

        return VideoSpec(path=path, **{f.name: getattr(self, f.name)
                                       for f in dataclasses.fields(self)
                                       if f.name in VideoSpec.__dataclass_fields__})


@dataclass
class ParallelConfig:
    backend: str = "auto"
    """Process-group backend: auto = nccl with CUDA, gloo otherwise."""
    timeout_s: float = 600.0
    """Bound on each collective wait after start-up (so also on a request's skew across ranks)."""
    startup_timeout_s: float = 1800.0
    """Bound on start-up: rendezvous, group set-up, the wait until every rank's model loaded."""
    memory_gb: float | None = None
    """Memory budget per rank in GiB, weights included, that a request's estimate must fit
    (checked before the video is decoded). Default: the device's free memory on CUDA; on CPU
    the host's available memory shared by the ranks on it."""

    def __post_init__(self) -> None:
        one_of("parallel.backend", self.backend, DIST_BACKENDS)
        number("parallel.timeout_s", self.timeout_s, high=MAX_TIMEOUT_S)
        number("parallel.startup_timeout_s", self.startup_timeout_s, high=MAX_TIMEOUT_S)
        number("parallel.memory_gb", self.memory_gb, optional=True)


@dataclass
class AttentionConfig:
    mode: str = "spava"
    """spava (the method), exact, no_overlap, no_vit_split, zigzag_ring, star, apb or full
    (see apbv/modes.py)."""
    anchor_len: int | None = None
    """Anchor tokens A; default about N/64."""
    passing_len: int | None = None
    """Passed tokens per block, per KV head, per layer P; default about N/128."""
    kernel: str | None = None
    """Attention kernel: flash, sdpa or reference; default picks flash-attn when usable."""

    def __post_init__(self) -> None:
        one_of("attention.mode", self.mode, MODE_NAMES)
        integer("attention.anchor_len", self.anchor_len, 0, optional=True)
        integer("attention.passing_len", self.passing_len, 0, optional=True)
        if self.kernel is not None:
            one_of("attention.kernel", self.kernel, KERNEL_BACKENDS)


@dataclass
class GenerateConfig:
    max_new_tokens: int = 128
    """Greedy tokens to generate at most (the first one included)."""

    def __post_init__(self) -> None:
        integer("generate.max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS)


@dataclass
class DecodeConfig:
    graphs: str = "auto"
    """CUDA-graph decode steps (docs/decode_graphs.md): auto = on for CUDA ranks with nccl or
    one rank (the CPU decodes eagerly); on (refused where it cannot work); off."""
    graphs_min_tokens: int = 16
    """Answers allowed fewer tokens (max_new_tokens) decode eagerly: a capture costs more."""
    graphs_kept: int = 4
    """Captured steps kept across requests (one per KV bucket and world); 0: none kept."""

    def __post_init__(self) -> None:
        one_of("decode.graphs", self.graphs, DECODE_GRAPHS)
        integer("decode.graphs_min_tokens", self.graphs_min_tokens, 1)
        integer("decode.graphs_kept", self.graphs_kept, 0)


@dataclass
class CacheConfig:
    vision_gb: float = 0.0
    """Vision embeddings kept per rank for reuse, in GiB (0: off): a later request about the
    same video file with the same sampling skips decoding and the vision tower on that rank
    (least recently used entries are evicted; see apbv/engine/vision_cache.py)."""

    def __post_init__(self) -> None:
        number("cache.vision_gb", self.vision_gb, low_open=False)


@dataclass
class VisionConfig:
    attention: str = "grouped"
    """Vision tower attention: grouped (equal-size windows in one call per size; one varlen
    call on CUDA) or per_window (the stock path: one SDPA call per window)."""
    patch_embed: str = "linear"
    """Vision patch embedding: linear (one matrix product of the patch rows with the
    flattened kernel) or conv (the stock Conv3d)."""
    rotary: str = "fused"
    """Vision q/k rotary: fused (q and k in one set of passes: bit-equal to transformers',
    2-3x faster in fp32 on CPU) or stock (transformers' own, on the strided views of q
    and k)."""
    norm: str = "fused"
    """Vision RMSNorms: fused (one torch.rms_norm kernel for bf16/fp16 on CUDA, fp32
    statistics as transformers'; the stock forward elsewhere) or stock."""
    mlp_pad: int | None = None
    """The vision MLPs' hidden width padded with zero units to a multiple of this (the same
    sums; on GPUs the products' rows then align for the fast kernels: 3420 -> 3456 on the
    3B/7B/72B); 0: the checkpoint's width; unset: 64 on CUDA, 0 elsewhere."""
    chunk_rows: int | None = None
    """Patch rows per vision-tower call, in whole temporal patches (independent in every block:
    the same result up to the fp32 rounding of smaller products); 0: the whole video in one
    call; unset: 8192 on CPU (activations stay in cache), one call on GPUs."""

    preprocess: str = "levels"
    """Frames to patch rows: levels (apbv.video.patches: int8 pixel levels, the normalisation
    folded into the linear patch embedding; off the CPU the processor's float rows made on the
    device), fused (the processor's float rows bit for bit, in fewer passes) or processor (the
    HF video processor itself)."""
    preprocess_workers: int = 1
    """Threads that turn frames into patch rows (levels and fused), chunk by chunk."""
    pipeline: bool = False
    """Decode, patch rows and vision tower chunk by chunk (whole temporal patches) inside each
    rank: the tower starts before the last frame is decoded and a chunk or two of patch rows
    are held, not the rank's whole video; on GPUs a worker thread readies the next chunk
    while the tower encodes the current one. Same embeddings. The decoding then counts in
    the vision stage, not in preprocess."""

    def __post_init__(self) -> None:
        one_of("vision.attention", self.attention, VISION_ATTENTION)
        one_of("vision.patch_embed", self.patch_embed, PATCH_EMBED)
        one_of("vision.rotary", self.rotary, VISION_ROTARY)
        one_of("vision.norm", self.norm, VISION_NORM)
        integer("vision.mlp_pad", self.mlp_pad, 0, 4096, optional=True)
        integer("vision.chunk_rows", self.chunk_rows, 0, optional=True)
        one_of("vision.preprocess", self.preprocess, PREPROCESS)
        integer("vision.preprocess_workers", self.preprocess_workers, 1)
        boolean("vision.pipeline", self.pipeline)


@dataclass
class RuntimeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    video: VideoConfig = field(default_factory=VideoConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)


def _parse_override(text: str) -> tuple[str, str, Any]:
    key, sep, raw = text.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot:
        raise ValueError(f"override {text!r} must look like section.key=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is a string
    return section, name, value


def preset_dirs() -> list[Path]:
    """Where preset names are looked up, in order: the source tree's configs/ when running from
    a checkout (a pyproject.toml next to it), then the copy shipped in the package."""
    dirs = [PACKAGED_CONFIG_DIR]
    if (SOURCE_CONFIG_DIR.parent / "pyproject.toml").is_file():
        dirs.insert(0, SOURCE_CONFIG_DIR)
    return [d for d in dirs if d.is_dir()]


def preset_names() -> list[str]:
    """Every preset name that :func:`resolve_preset` accepts."""
    return sorted({p.stem for d in preset_dirs() for p in d.glob("*.toml")})


def resolve_preset(name_or_path: str) -> Path:
    """A preset name (``tiny_cpu``: configs/ of the source tree, else the packaged copy) or a
    path to a TOML file."""
    path = Path(name_or_path)
    if path.suffix == ".toml":
        if path.is_file():
            return path
    else:
        for directory in preset_dirs():
            if (directory / f"{name_or_path}.toml").is_file():
                return directory / f"{name_or_path}.toml"
    raise ValueError(f"config {name_or_path!r} not found; presets: {', '.join(preset_names())} "
                     "(or a path to a .toml file)")


def _model_path_from(preset: Path, data: dict[str, Any]) -> None:
    """A preset's relative ``model.path`` made absolute from the preset's directory when it
    names a directory there (a checkpoint kept beside its preset); else it stays relative to
    the current directory."""
    model = data.get("model")
    path = model.get("path") if isinstance(model, dict) else None
    if isinstance(path, str) and path and not Path(path).is_absolute() and \
            (preset.parent / path).is_dir():
        model["path"] = str((preset.parent / path).resolve())


def load_config(preset: str | None = None, overrides: list[str] = ()) -> RuntimeConfig:
    """Defaults, then the preset's values, then ``section.key=value`` overrides.

    video.fps and video.nframes are exclusive: setting one in a later layer (the preset over the
    defaults, an override over the preset) unsets the other from the earlier layers.
    """
    data: dict[str, dict[str, Any]] = {}
    if preset:
        path = resolve_preset(preset)
        with open(path, "rb") as f:
            data = tomllib.load(f)
        _model_path_from(path, data)
    video = data.get("video")
    if isinstance(video, dict) and "nframes" in video and "fps" not in video:
        video["fps"] = None
    layered: set[str] = set()
    for text in overrides:
        section, name, value = _parse_override(text)
        values = data.setdefault(section, {})
        if not isinstance(values, dict):
            raise ValueError(f"config section [{section}] must be a table, got {values!r}")
        if section == "video" and name in _FRAME_KEYS:
            other = _FRAME_KEYS[1 - _FRAME_KEYS.index(name)]
            if other not in layered:
                values[other] = None
            layered.add(name)
        values[name] = value
    hints = get_type_hints(RuntimeConfig)
    sections = {f.name: hints[f.name] for f in dataclasses.fields(RuntimeConfig)}
    kwargs = {}
    for section, values in data.items():
        if section not in sections:
            raise ValueError(f"unknown config section [{section}]; allowed: {', '.join(sections)}")
        cls = sections[section]
        if not isinstance(values, dict):
            raise ValueError(f"config section [{section}] must be a table, got {values!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        for name in values:
            if name not in names:
                raise ValueError(f"unknown key {section}.{name}; allowed: {', '.join(names)}")
        kwargs[section] = cls(**values)
    return RuntimeConfig(**kwargs)
