"""The per-rank vision cache: exact byte budget, LRU eviction, oversized entries, and keys that
change with everything deciding the embeddings (file identity, sampling, model, rank)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from apbv.config import load_config
from apbv.engine.vision_cache import VisionCache, VisionEntry, VisionKey, vision_key
from apbv.video import Sampling, VideoSpec

SAMPLING = Sampling(indices=(0, 2, 4, 6), sample_fps=2.0, resized_height=56, resized_width=56)


def _entry(rows: int, dtype: torch.dtype = torch.float32) -> VisionEntry:
    return VisionEntry(torch.zeros(rows, 8, dtype=dtype), SAMPLING, (0, 2))


def _key(name: str, file: tuple[int, int, int, int] = (1, 2, 3, 4)) -> VisionKey:
    return VisionKey(path=name, file=file, sampling=(("fps", 2.0),),
                     model=("m", "torch.float32"), rank=0, world_size=2, vit_split=True)


def test_entry_bytes_are_counted_from_the_tensor() -> None:
    assert _entry(4).nbytes == 4 * 8 * 4
    assert _entry(4, torch.bfloat16).nbytes == 4 * 8 * 2


def test_budget_and_least_recently_used_eviction() -> None:
    cache = VisionCache(3 * 128)  # three entries of 4 rows x 8 fp32
    for name in "abc":
        assert cache.put(_key(name), _entry(4))
    assert cache.nbytes == 3 * 128 and len(cache) == 3
    assert cache.get(_key("a")) is not None  # a is now the most recently used
    assert cache.put(_key("d"), _entry(4))
    assert cache.keys() == [_key("c"), _key("a"), _key("d")]  # b went first
    assert cache.evictions == 1 and cache.nbytes == 3 * 128
    assert cache.put(_key("e"), _entry(8))  # needs two slots: c and a go
    assert cache.keys() == [_key("d"), _key("e")] and cache.nbytes == 3 * 128
    assert cache.get(_key("b")) is None
    assert (cache.hits, cache.misses) == (1, 1)


def test_oversized_entry_is_not_stored_and_evicts_nothing() -> None:
    cache = VisionCache(256)
    assert cache.put(_key("a"), _entry(4))
    assert not cache.put(_key("big"), _entry(9))  # 288 bytes > 256
    assert cache.keys() == [_key("a")] and cache.nbytes == 128 and cache.evictions == 0
    assert cache.put(_key("b"), _entry(4))  # exactly the budget
    assert cache.nbytes == 256


def test_replacing_a_key_and_a_rewritten_file() -> None:
    cache = VisionCache(1024)
    cache.put(_key("a"), _entry(4))
    cache.put(_key("a"), _entry(2))
    assert len(cache) == 1 and cache.nbytes == 64
    cache.put(_key("b"), _entry(2))
    cache.put(_key("a", (1, 2, 3, 5)), _entry(4))  # a new version of file a
    assert cache.keys() == [_key("b"), _key("a", (1, 2, 3, 5))] and cache.nbytes == 64 + 128


def test_a_zero_budget_is_off() -> None:
    cache = VisionCache(0)
    assert not cache.enabled and not cache.put(_key("a"), _entry(1)) and len(cache) == 0
    with pytest.raises(ValueError, match="integer >= 0"):
        VisionCache(-1)


def test_key_changes_with_everything_that_decides_the_embeddings(tmp_path: Path) -> None:
    video = tmp_path / "clip.mp4"
    video.write_bytes(b"x" * 100)
    spec = VideoSpec(path=str(video), fps=2.0)

    def key(s: VideoSpec = spec, **kw) -> VisionKey | None:
        args = {"model_path": "ckpt", "dtype": torch.float32, "rank": 0, "world_size": 2,
                "vit_split": True, **kw}
        return vision_key(s, **args)

    base = key()
    assert base is not None and base == key()
    # The same file through another path (a symlink) is the same entry.
    link = tmp_path / "link.mp4"
    link.symlink_to(video)
    assert key(dataclasses.replace(spec, path=str(link))) == base
    others = [
        key(dataclasses.replace(spec, fps=1.0)),
        key(dataclasses.replace(spec, fps=None, nframes=8)),
        key(dataclasses.replace(spec, max_pixels=50176)),
        key(dataclasses.replace(spec, video_start=1.0)),
        key(dataclasses.replace(spec, backend="pyav")),
        key(model_path="other"),
        key(dtype=torch.bfloat16),
        key(rank=1),
        key(world_size=4),
        key(vit_split=False),
    ]
    assert all(k is not None and k != base for k in others)
    assert len(set(others)) == len(others)
    st = video.stat()
    os.utime(video, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # touched: new mtime
    touched = key()
    assert touched != base and touched.file[3] == st.st_mtime_ns + 1_000_000
    with open(video, "ab") as f:  # grown: new size
        f.write(b"y")
    grown = key()
    assert grown not in (base, touched) and grown.file[2] == 101
    assert key(dataclasses.replace(spec, path=str(tmp_path / "missing.mp4"))) is None


def test_cache_config_section() -> None:
    assert load_config().cache.vision_gb == 0.0
    assert load_config(None, ["cache.vision_gb=4"]).cache.vision_gb == 4
    for bad in ("-1", "nan", "true", '"4"'):
        with pytest.raises(ValueError, match=r"cache\.vision_gb must be .*>= 0"):
            load_config(None, [f"cache.vision_gb={bad}"])
    with pytest.raises(ValueError, match="unknown key cache.vision"):
        load_config(None, ["cache.vision=1"])
