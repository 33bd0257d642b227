"""apbv.config: strict numbers (finite, integers, bounds), the nccl check, presets in the wheel."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from apbv import config
from apbv.config import RuntimeConfig, load_config

ROOT = Path(__file__).resolve().parents[2]

FLOAT_KEYS = ["video.fps", "video.video_start", "video.video_end", "parallel.timeout_s"]
INT_KEYS = ["video.nframes", "video.min_frames", "video.max_frames", "video.min_pixels",
            "video.max_pixels", "video.total_pixels", "video.resized_height",
            "video.resized_width", "attention.anchor_len", "attention.passing_len",
            "generate.max_new_tokens", "vision.chunk_rows"]


def _load(*overrides: str) -> RuntimeConfig:
    return load_config(None, list(overrides))


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "+nan"])
def test_nan_and_inf_rejected_naming_the_key(key: str, value: str) -> None:
    with pytest.raises(ValueError, match=rf"^{key} must be a finite number \(.+\), got "):
        _load(f"{key}={value}")


def test_nan_timeout_fails_at_load_not_later() -> None:
    """Before: a nan parallel.timeout_s failed later with 'cannot convert float NaN'."""
    with pytest.raises(ValueError, match=r"parallel.timeout_s must be a finite number "
                                         r"\(> 0 and <= 86400\), got nan"):
        load_config("tiny_cpu", ["parallel.timeout_s=nan"])


@pytest.mark.parametrize("key", INT_KEYS)
@pytest.mark.parametrize("value, kind", [("8.0", "float"), ("8.5", "float"), ("true", "bool"),
                                         ("'8'", "str")])
def test_integer_fields_reject_floats_and_bools(key: str, value: str, kind: str) -> None:
    with pytest.raises(ValueError, match=rf"^{key} must be an integer .*\({kind}\)$"):
        _load(f"{key}={value}")


def test_fps_and_nframes_later_layer_wins(tmp_path: Path) -> None:
    assert (_load("video.nframes=8").video.fps, _load("video.nframes=8").video.nframes) == (
        None, 8)
    cfg = load_config("tiny_cpu", ["video.nframes=16"])  # the preset sets fps = 2.0
    assert (cfg.video.fps, cfg.video.nframes) == (None, 16)
    preset = tmp_path / "p.toml"
    preset.write_text("[video]\nnframes = 8\n")
    assert load_config(str(preset)).video.fps is None
    cfg = load_config(str(preset), ["video.fps=1.0"])
    assert (cfg.video.fps, cfg.video.nframes) == (1.0, None)
    with pytest.raises(ValueError, match="video.fps and video.nframes are exclusive"):
        _load("video.nframes=8", "video.fps=1.0")  # both in one layer


@pytest.mark.parametrize("override, match", [
    ("generate.max_new_tokens=0", r"generate.max_new_tokens must be an integer in 1 .. 32768, "
                                  r"got 0"),
    ("generate.max_new_tokens=32769", r"in 1 .. 32768, got 32769"),
    ("parallel.timeout_s=0", r"parallel.timeout_s must be > 0 and <= 86400, got 0"),
    ("parallel.timeout_s=-5.0", r"parallel.timeout_s must be > 0 and <= 86400, got -5.0"),
    ("parallel.timeout_s=86400.5", r"parallel.timeout_s must be > 0 and <= 86400, got 86400.5"),
    ("video.fps=0.0", r"video.fps must be > 0, got 0.0"),
    ("video.fps=-1", r"video.fps must be > 0, got -1"),
    ("video.fps='2'", r"video.fps must be a number \(> 0\), got '2' \(str\)"),
    ("video.min_pixels=0", r"video.min_pixels must be an integer >= 1, got 0"),
    ("attention.anchor_len=-1", r"attention.anchor_len must be an integer >= 0, got -1"),
    ("video.video_start=-0.5", r"video.video_start must be >= 0, got -0.5"),
    ("model.path=3", r"model.path must be a string, got 3 \(int\)"),
    ("vision.chunk_rows=-1", r"vision.chunk_rows must be an integer >= 0, got -1"),
    ("vision.rotary=contiguous", r"vision.rotary must be one of fused, stock; got 'contiguous'"),
    ("vision.norm=layer", r"vision.norm must be one of fused, stock; got 'layer'"),
    ("vision.mlp_pad=-1", r"vision.mlp_pad must be an integer in 0 .. 4096, got -1"),
    ("vision.mlp_pad=8.0", r"vision.mlp_pad must be an integer in 0 .. 4096, got 8.0 \(float\)"),
    ("vision.pipeline=1", r"vision.pipeline must be true or false, got 1 \(int\)"),
    ("vision.pipeline=yes", r"vision.pipeline must be true or false, got 'yes' \(str\)"),
    ("video.resize_device=gpu", r"video.resize_device must be one of cpu, cuda; got 'gpu'"),
])
def test_bounds_name_key_and_range(override: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _load(override)


def test_resizing_on_cuda_needs_cuda_ranks(tiny_config: RuntimeConfig) -> None:
    from apbv.distributed import DistInfo
    from apbv.engine.engine import Engine

    cfg = _load("video.resize_device=cuda")
    assert cfg.video.resize_device == "cuda"
    cfg = dataclasses.replace(tiny_config, video=cfg.video)
    with pytest.raises(ValueError, match="video.resize_device=cuda needs ranks on CUDA "
                                         "devices; this rank runs on cpu"):
        Engine(cfg, DistInfo(0, 1, 0, torch.device("cpu"), None))


def test_cross_field_checks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"video.max_pixels must be >= video.min_pixels "
                                         r"\(1000\), got 999"):
        _load("video.min_pixels=1000", "video.max_pixels=999")
    with pytest.raises(ValueError, match=r"video.video_end must be > video.video_start \(3.0\)"):
        _load("video.video_start=3.0", "video.video_end=2.0")
    with pytest.raises(ValueError, match="video.resized_height and video.resized_width go"):
        _load("video.resized_height=100")
    with pytest.raises(ValueError, match=r"video.max_frames must be an integer >= 8, got 6"):
        _load("video.min_frames=8", "video.max_frames=6")
    bad = tmp_path / "bad.toml"
    bad.write_text("video = 3\n")
    with pytest.raises(ValueError, match=r"config section \[video\] must be a table"):
        load_config(str(bad))


def test_valid_values_pass_through() -> None:
    cfg = load_config("tiny_cpu", [
        "parallel.timeout_s=86400", "generate.max_new_tokens=32768", "video.fps=0.5",
        "video.min_pixels=3136", "video.max_pixels=50176", "video.total_pixels=1000000",
        "video.video_start=1", "video.video_end=2.5", "attention.anchor_len=0",
        "vision.pipeline=true", "vision.chunk_rows=0",
    ])
    assert cfg.vision.pipeline is True and cfg.vision.chunk_rows == 0
    assert cfg.parallel.timeout_s == 86400 and cfg.generate.max_new_tokens == 32768
    spec = cfg.video.spec("v.mp4")
    assert (spec.fps, spec.min_pixels, spec.max_pixels, spec.total_pixels) == (
        0.5, 3136, 50176, 1000000)
    assert (spec.video_start, spec.video_end, spec.min_frames) == (1, 2.5, 4)
    fixed = config.VideoConfig(resized_height=100, resized_width=200).spec("v.mp4")
    assert fixed.qwen_element()["resized_height"] == 100
    assert fixed.qwen_element()["resized_width"] == 200


def test_the_config_and_a_request_share_one_video_schema() -> None:
    """VideoConfig and VideoSpec are VideoSettings plus their own fields: one default and one
    check per sampling key, the setting named as the config or a request names it."""
    from apbv.video import VideoSpec

    shared = [f.name for f in dataclasses.fields(config.VideoSettings)]
    assert len(shared) == 16 and shared[:2] == ["fps", "nframes"]
    for cls in (config.VideoConfig, VideoSpec):
        assert [f.name for f in dataclasses.fields(cls)][:16] == shared
    # fps unset without nframes is DEFAULT_FPS in both (what every run has sampled with).
    assert config.VideoConfig().settings() == VideoSpec("v.mp4").settings()
    assert config.VideoConfig().fps == VideoSpec("v.mp4").fps == config.DEFAULT_FPS == 2.0
    assert config.VideoConfig(nframes=8).fps is None and VideoSpec("v.mp4", nframes=8).fps is None
    cfg = load_config("tiny_cpu", ["video.nframes=6", "video.backend=pyav", "video.min_frames=2",
                                   "video.keyframe_split=true", "video.total_pixels=90000"])
    assert cfg.video.spec("v.mp4").settings() == cfg.video.settings()
    assert cfg.video.spec("v.mp4").backend == "pyav"
    with pytest.raises(ValueError, match=r"^video.max_frames must be an integer >= 8, got 6"):
        config.VideoConfig(min_frames=8, max_frames=6)
    with pytest.raises(ValueError, match=r"^max_frames must be an integer >= 8, got 6"):
        VideoSpec("v.mp4", min_frames=8, max_frames=6)
    with pytest.raises(ValueError, match=r"^total_pixels must be an integer >= 1, got 1.5"):
        VideoSpec("v.mp4", total_pixels=1.5)  # type: ignore[arg-type]


def test_nccl_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from apbv.distributed import init_distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^parallel.backend=nccl needs CUDA, which is not "
                                         r"available; use gloo or auto$"):
        init_distributed(backend="nccl", timeout_s=10.0)


# ---------------------------------------------------------------------------------------------
# Presets: one copy (apbv/configs), found from the source tree and from an installed wheel.


def test_source_configs_is_the_packaged_copy() -> None:
    assert (ROOT / "configs").resolve() == (ROOT / "apbv" / "configs").resolve()
    assert config.preset_dirs()[0] == config.SOURCE_CONFIG_DIR
    assert {"tiny_cpu", "qwen2_5_vl_3b_8gpu", "qwen2_5_vl_7b_8gpu"} <= set(config.preset_names())


@pytest.mark.timeout(120)
def test_wheel_ships_the_presets(tmp_path: Path) -> None:
    """pip wheel (no deps, no build isolation: offline) of a copy of the tree; the wheel holds
    every preset of configs/ and the trained tiny checkpoint, and load_config finds the presets
    when installed elsewhere."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "apbv", src / "apbv",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pip = [sys.executable, "-m", "pip"]
    out = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path / "whl"), str(src)],
                         capture_output=True, text=True, timeout=110, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "whl").glob("apbv-*.whl")
    presets = sorted(p.name for p in (ROOT / "configs").glob("*.toml"))
    with zipfile.ZipFile(wheel) as zf:
        shipped = sorted(Path(n).name for n in zf.namelist() if n.startswith("apbv/configs/"))
        assert shipped == presets
        for name in presets:
            assert zf.read(f"apbv/configs/{name}") == (ROOT / "configs" / name).read_bytes()
        # the trained tiny checkpoint (apbv.assets.needle_tiny), every file of it
        checkpoint = ROOT / "apbv" / "assets" / "needle-tiny"
        for path in checkpoint.iterdir():
            name = f"apbv/assets/needle-tiny/{path.name}"
            assert zf.read(name) == path.read_bytes(), name
        info = {Path(n).relative_to(Path(n).parts[0]).as_posix(): n for n in zf.namelist()
                if n.startswith("apbv-") and ".dist-info/" in n}
        assert zf.read(info["licenses/LICENSE"]) == (ROOT / "LICENSE").read_bytes()
        assert "apbv = apbv.__main__:main" in zf.read(info["entry_points.txt"]).decode()
        zf.extractall(tmp_path / "site")
    code = ("import apbv.config as c; cfg = c.load_config('tiny_cpu'); "
            "print(c.resolve_preset('tiny_cpu').parent.parent.parent, cfg.video.max_pixels)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                         env={"PYTHONPATH": str(tmp_path / "site"), "PATH": ""},
                         capture_output=True, text=True, timeout=110, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [str(tmp_path / "site"), "100352"]
