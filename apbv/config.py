"""Runtime configuration: dataclasses (the schema), TOML presets in configs/, CLI overrides.

Precedence: command-line overrides > the TOML preset > the defaults below. A TOML file has one
table per section ([model], [video], [parallel], [attention], [generate]) whose keys are the
field names; an override is ``section.key=value`` with the value parsed as TOML
(``attention.passing_len=256``, ``video.fps=1.0``, ``model.path="/ckpt/Qwen2.5-VL-7B"``, or a
bare word for a string: ``attention.mode=exact``).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from apbv.modes import MODE_NAMES
from apbv.attention.kernels import BACKENDS
from apbv.video import BACKENDS as VIDEO_BACKENDS
from apbv.video import VideoSpec

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DTYPES = ("auto", "float32", "bfloat16", "float16")
DIST_BACKENDS = ("auto", "nccl", "gloo")


def _one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")


def _positive(name: str, value: Any, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass
class ModelConfig:
    path: str = ""
    """Checkpoint directory (config.json, weights, tokenizer, processor configs)."""
    dtype: str = "auto"
    """Weights and activations: auto = bfloat16 on CUDA, float32 on CPU."""

    def __post_init__(self) -> None:
        _one_of("model.dtype", self.dtype, DTYPES)


@dataclass
class VideoConfig:
    fps: float | None = 2.0
    """Frames sampled per second (qwen-vl-utils' rule); exclusive with nframes."""
    nframes: int | None = None
    """Exact number of frames to sample (rounded to a multiple of 2)."""
    min_pixels: int | None = None
    """Per-frame pixel floor (qwen-vl-utils' default when unset)."""
    max_pixels: int | None = None
    """Per-frame pixel cap (qwen-vl-utils' default when unset)."""
    total_pixels: int | None = None
    """Pixel budget of the whole video (qwen-vl-utils' default when unset)."""
    backend: str = "decord"
    """Decoder: decord or pyav (chosen explicitly, never a silent fallback)."""

    def __post_init__(self) -> None:
        _one_of("video.backend", self.backend, VIDEO_BACKENDS)
        if self.fps is not None and self.nframes is not None:
            raise ValueError("video.fps and video.nframes are exclusive; set one of them")
        for name in ("fps", "nframes", "min_pixels", "max_pixels", "total_pixels"):
            _positive(f"video.{name}", getattr(self, name))

    def spec(self, path: str) -> VideoSpec:
        """The sampling request for one video file."""
        return VideoSpec(path=path, fps=self.fps, nframes=self.nframes,
                         min_pixels=self.min_pixels, max_pixels=self.max_pixels,
                         total_pixels=self.total_pixels, backend=self.backend)


@dataclass
class ParallelConfig:
    backend: str = "auto"
    """Process-group backend: auto = nccl with CUDA, gloo otherwise."""
    timeout_s: float = 600.0
    """Bound on every collective wait; a rank whose peer died fails after this."""

    def __post_init__(self) -> None:
        _one_of("parallel.backend", self.backend, DIST_BACKENDS)
        _positive("parallel.timeout_s", self.timeout_s, optional=False)


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
        _one_of("attention.mode", self.mode, MODE_NAMES)
        if self.kernel is not None:
            _one_of("attention.kernel", self.kernel, BACKENDS)


@dataclass
class GenerateConfig:
    max_new_tokens: int = 128
    """Greedy tokens to generate at most (the first one included)."""

    def __post_init__(self) -> None:
        _positive("generate.max_new_tokens", self.max_new_tokens, optional=False)


@dataclass
class RuntimeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    video: VideoConfig = field(default_factory=VideoConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)


def _section_types() -> dict[str, type]:
    return {f.name: get_type_hints(RuntimeConfig)[f.name] for f in dataclasses.fields(RuntimeConfig)}


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


def resolve_preset(name_or_path: str) -> Path:
    """A preset name from configs/ (``tiny_cpu``) or a path to a TOML file."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = CONFIG_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
        raise ValueError(f"config {name_or_path!r} not found; presets: {', '.join(known)}")
    return path


def load_config(preset: str | None = None, overrides: list[str] = ()) -> RuntimeConfig:
    """Defaults, then the preset's values, then ``section.key=value`` overrides."""
    data: dict[str, dict[str, Any]] = {}
    if preset:
        with open(resolve_preset(preset), "rb") as f:
            data = tomllib.load(f)
    for text in overrides:
        section, name, value = _parse_override(text)
        data.setdefault(section, {})[name] = value
    sections = _section_types()
    kwargs = {}
    for section, values in data.items():
        if section not in sections:
            raise ValueError(f"unknown config section [{section}]; allowed: {', '.join(sections)}")
        cls = sections[section]
        names = [f.name for f in dataclasses.fields(cls)]
        for name in values:
            if name not in names:
                raise ValueError(f"unknown key {section}.{name}; allowed: {', '.join(names)}")
        kwargs[section] = cls(**values)
    return RuntimeConfig(**kwargs)


def to_dict(cfg: RuntimeConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
