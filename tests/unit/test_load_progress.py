"""Model-load progress on rank 0 (apbv.engine.load_progress): the lines from a fake clock, fake
byte counts and fake loaded ranks; the shard sizes read from a checkpoint's index; a safetensors
file's bytes in the page cache measured for real as it is read; the reporting thread."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from apbv import distributed
from apbv.engine.load_progress import (
    LoadProgress,
    cached_bytes,
    checkpoint_shards,
    load_progress,
    ranks_text,
)

GB = 10**9


def test_lines_from_a_fake_clock_bytes_and_ranks() -> None:
    shards = {"a": GB, "b": GB, "c": GB // 2}
    cached: list[dict[str, int] | None] = [
        {"a": GB, "b": GB // 2},        # a read, b half
        {"a": 0, "b": GB // 2 + 10},   # a unmapped: its largest size seen still counts
        {"a": 0, "b": GB, "c": GB // 2},
    ]
    arrived = [[2], [1, 2], [1, 2]]
    progress = LoadProgress(0, 4, shards, cached=lambda: cached.pop(0),
                            arrived=lambda: arrived.pop(0), every_s=5.0)
    assert progress.start(100.0) == "rank 0: loading the model: 3 safetensors shard(s), 2.50 GB"
    assert progress.tick(103.0) is None  # measured, not logged: under every_s since the start
    line = progress.tick(105.0)
    assert line == ("rank 0: loading the model: 1/3 shard(s), 1.50 GB/2.50 GB read, 5 s; "
                    "ranks loaded: 1/4 (waiting for 0, 1, 3)"), line
    assert progress.tick(108.0) is None and not cached  # every tick measured
    assert progress.finish(112.25) == ("rank 0: model loaded in 12.2 s (3 shard(s), 2.50 GB); "
                                       "ranks loaded: 3/4 (waiting for 3)")


def test_unmeasurable_bytes_single_rank_and_a_failure() -> None:
    progress = LoadProgress(0, 1, {"a": 3 * 10**6}, cached=lambda: None,
                            arrived=lambda: pytest.fail("a single rank asks no store"))
    progress.start(0.0)
    assert progress.tick(7.0) == ("rank 0: loading the model: 1 shard(s), 3.0 MB "
                                  "(bytes read not measurable here), 7 s")
    assert progress.finish(9.0, failed=MemoryError("x")) == (
        "rank 0: the model load failed after 9 s (1 shard(s), 3.0 MB "
        "(bytes read not measurable here)): MemoryError")


def test_a_store_error_does_not_fail_the_load() -> None:
    def arrived() -> list[int]:
        raise RuntimeError("store gone")

    progress = LoadProgress(0, 2, {"a": 10}, cached=lambda: {"a": 10}, arrived=arrived)
    progress.start(0.0)
    assert progress.finish(1.0).endswith("; ranks loaded: unknown (RuntimeError)")


def test_ranks_text_names_at_most_eight_waiting() -> None:
    assert ranks_text(list(range(8)), 8) == "ranks loaded: 8/8"
    assert ranks_text([3], 12) == ("ranks loaded: 1/12 (waiting for 0, 1, 2, 4, 5, 6, 7, 8, "
                                   "...)")


def test_checkpoint_shards_from_the_index(tmp_path: Path) -> None:
    (tmp_path / "model-1.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "model-2.safetensors").write_bytes(b"x" * 25)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "w1": "model-1.safetensors", "w2": "model-2.safetensors", "w3": "model-2.safetensors"}}))
    assert checkpoint_shards(tmp_path) == {
        os.path.realpath(tmp_path / "model-1.safetensors"): 10,
        os.path.realpath(tmp_path / "model-2.safetensors"): 25}
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    assert checkpoint_shards(tmp_path) == {}  # the load's own checks name the problem
    assert checkpoint_shards(tmp_path / "missing") == {}


def _fs_type(path: Path) -> str:
    """The file system type holding ``path`` (the longest mount point above it)."""
    mounts = [line.split()[1:3] for line in Path("/proc/self/mounts").read_text().splitlines()]
    above = [(point, kind) for point, kind in mounts
             if str(path.resolve()).startswith(point.rstrip("/") + "/")]
    return max(above, key=lambda m: len(m[0]))[1] if above else "unknown"


@pytest.mark.skipif(not Path("/proc/self/mounts").exists(), reason="needs Linux's page cache")
def test_cached_bytes_follow_the_file_reads(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    save_file({f"w{i}": torch.full((512, 1024), float(i)) for i in range(8)}, str(file))
    shards = checkpoint_shards(tmp_path)
    name = os.path.realpath(file)
    size = shards[name]
    assert cached_bytes(set(shards)) is not None, "mincore is not available here"
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        dropped = cached_bytes(set(shards))[name]  # type: ignore[index]
        if dropped > size // 2 and _fs_type(tmp_path) in ("tmpfs", "ramfs"):
            pytest.skip(f"{_fs_type(tmp_path)} keeps the file in memory")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead past the half
        os.read(fd, size // 2)
        half = cached_bytes(set(shards))[name]  # type: ignore[index]
        while os.read(fd, 1 << 20):
            pass
        full = cached_bytes(set(shards))[name]  # type: ignore[index]
    finally:
        os.close(fd)
    assert dropped < 0.1 * size and 0.49 * size <= half < 0.9 * size and full >= 0.99 * size, \
        f"cached bytes of {size}: {dropped} after the drop, {half} after half, {full} after all"


def test_the_reporting_thread_logs_on_rank_0_only(tmp_path: Path, tiny_model_dir: Path) -> None:
    lines: list[str] = []
    with pytest.raises(ValueError), load_progress(tmp_path, 0, 1, log=lines.append):
        raise ValueError("an empty directory fails the checks: no lines, the load's error only")
    assert lines == []
    tmp_path = tiny_model_dir
    with load_progress(tmp_path, 0, 2, every_s=0.05, log=lines.append, arrived=lambda: [1]):
        time.sleep(0.4)
    assert lines[0].startswith("rank 0: loading the model: 1 safetensors shard(s)"), lines
    assert any(line.startswith("rank 0: loading the model: ") and line.endswith(
        "ranks loaded: 1/2 (waiting for 0)") for line in lines[1:-1]), lines
    assert lines[-1].startswith("rank 0: model loaded in ") and \
        lines[-1].endswith("; ranks loaded: 2/2"), lines
    quiet: list[str] = []
    with pytest.raises(MemoryError), load_progress(tmp_path, 1, 2, log=quiet.append):
        raise MemoryError("rank 1 fails quietly; its error is reported as ever")
    assert quiet == []
    with pytest.raises(OSError), load_progress(tmp_path, 0, 1, log=lines.append):
        raise OSError("disk")
    assert lines[-1].startswith("rank 0: the model load failed after 0 s") and \
        lines[-1].endswith(": OSError"), lines[-1]


def test_ranks_arrived_reads_the_next_ready_points_keys(monkeypatch) -> None:
    store = dist.HashStore()
    monkeypatch.setattr(distributed, "_startup", (store, 0, 4, 10.0))
    monkeypatch.setattr(distributed, "_points", {})
    assert distributed.ranks_arrived("model loaded") == []
    store.set("apbv/startup/1-model loaded/2", "1")
    store.set("apbv/startup/0-model loaded/1", "1")  # another point's key does not count
    assert distributed.ranks_arrived("model loaded") == [2]
    monkeypatch.setattr(distributed, "_startup", None)
    assert distributed.ranks_arrived("model loaded") is None


def test_ranks_arrived_counts_a_subgroups_own_ranks(monkeypatch) -> None:
    """A sequence-parallel group of ranks 1 and 3: its keys carry its ranks, and the arrived
    ones are numbered within the group (rank 3 is its second)."""
    store = dist.HashStore()
    monkeypatch.setattr(distributed, "_startup", (store, 1, 4, 10.0))
    monkeypatch.setattr(distributed, "_points", {})
    monkeypatch.setattr(distributed.dist, "get_process_group_ranks", lambda group: [3, 1])
    store.set("apbv/startup/1-model loaded/3", "1")  # the whole job's point: not this group's
    assert distributed.ranks_arrived("model loaded", group="g") == []
    store.set("apbv/startup/ranks 1,3 1-model loaded/3", "1")
    assert distributed.ranks_arrived("model loaded", group="g") == [1]
