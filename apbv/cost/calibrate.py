"""The CPU rates as loaded now: a short measurement in as many processes as the run will have
(:func:`calibrate_here`), and the hardware constants it implies (:func:`as_loaded`,
:func:`with_collectives`).

The ``cpu`` preset holds an idle machine's constants (``benchmarks/calibrate_cpu.py``). On a
machine shared with other work each process gets a share of a core, and every kind of work it
does (kernels, frame decoding, Python and op dispatch, the eval harness, the copies of a
collective) takes that much longer. So each process measures the share of a core it gets: CPU
seconds over wall seconds of a busy Python loop of about ``seconds`` (a window long enough to
average the scheduler's slices and the other jobs' bursts), all processes at once, as the
run's ranks will be (:func:`calibrate_here` forks them; a benchmark's own ranks call
:func:`probe_rank`). The preset's rates are then divided, and its seconds multiplied, by the
inverse of the mean share.

A collective's fixed cost does not scale that way: on gloo it is a round trip through the
kernel and a wake-up of every peer, and every rank waits there for the last to arrive; a
loaded machine delays that by whole scheduler slices (a rank descheduled in the work before
the collective holds up the others), and an idle one still charges hundreds of microseconds
on the 2-core development machine (some tens on a process group of one rank). So the same
processes then join one gloo group and measure, on groups of each size H the run could use
(all groups at once, as the run's would be), what a small control collective (the flag
all-reduces, barriers and small all-gathers the engine issues around every stage) adds to
the work before it (:func:`probe_collectives`: about a millisecond of Python, the order of
the engine's work between two collectives of a small model); :func:`with_collectives` puts
the measured mean into the hardware of that H (``link_latency_s``, or ``solo_collective_s``
for one rank), which the cost model charges per collective as the engine issues them
(:mod:`apbv.cost.control`).

Frame decoding is measured directly too (:func:`probe_decoding`): each process opens a small
synthetic video (:data:`DECODE_PROBE`, written once before the processes start by
:func:`apbv.synthetic.videos.write_decode_probe`) with
the engine's own reader (:mod:`apbv.video`) and decodes its share of the sampled frames as a
rank of a group of each size H would, a few times; :func:`with_decoding` puts the seconds of
the open (``video_open_s``) and what a frame costs beyond its pixels (``decode_frame_s``) into
that H's hardware. The harness's fsync (``sample_sync_s``) is I/O and is not scaled.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from apbv.cost.hardware import Hardware

RATE_FIELDS = ("matmul_flops", "conv_flops", "attention_flops", "memory_bw", "link_bw")
"""Throughputs: divided by the slowdown."""
SECONDS_FIELDS = ("attention_pair_s", "link_latency_s", "decode_s_per_pixel",
                  "process_s_per_pixel", "preprocess_fixed_s", "tokenize_s_per_token",
                  "layer_overhead_s", "vision_layer_overhead_s", "call_overhead_s",
                  "coded_frame_s_per_pixel", "keyframe_s_per_pixel", "convert_s_per_pixel",
                  "graph_layer_s", "graph_capture_s", "sample_overhead_s",
                  "solo_collective_s", "decode_frame_s", "video_open_s")
"""Times: multiplied by the slowdown (the other float fields are ratios, and the I/O of
:data:`IO_FIELDS`)."""
IO_FIELDS = ("sample_sync_s",)
"""Seconds of I/O (the row's fsync): a share of a core does not change them."""
DECODE_PROBE = (112, 4.0, 8)
"""The video :func:`probe_decoding` reads: side (pixels, square), frame rate and seconds; at
the engine's default 2 fps it samples every other frame (16), as on the eval fixtures: a
strided batch, which decord reads by seeking to each frame."""
DECODE_PROBE_FPS = 2.0
"""The sampling rate :func:`probe_decoding` asks for."""
DECODE_REPEATS = 3
"""Timed reads of :func:`probe_decoding` (after one warm-up): about 0.1 s idle."""
COLLECTIVE_ROUNDS = 30
"""Rounds of :func:`probe_collectives` (three collectives each): about 0.3 s on two idle CPU
ranks, a second or two on a heavily shared machine."""
SEGMENT_UNITS = 36
"""Busy-loop units (``sum(range(2000))``, about 28 us each on the development machine's
idle core) of the work before each probed collective: about 1 ms, the order of the engine's
Python between two collectives of the tiny model (a decoder layer's dispatch, the
``cpu`` preset's ``layer_overhead_s``: 1.6 ms)."""


def probe(seconds: float = 2.0) -> dict[str, float]:
    """This process's ``host_share`` now: CPU seconds over wall seconds of a busy loop of
    about ``seconds``."""
    wall, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        sum(range(2000))
    return {"host_share": (time.process_time() - cpu) / (time.perf_counter() - wall)}


def probe_rank(info: Any, seconds: float = 2.0) -> dict[str, float]:
    """:func:`probe` on one of the spawned ranks (``info`` unused: every rank alike)."""
    return probe(seconds)


def as_loaded(hw: Hardware, probes: Sequence[dict[str, float]]) -> Hardware:
    """``hw`` (an idle machine's constants) as the ``probes`` (one per process, :func:`probe`)
    found the machine: its :data:`RATE_FIELDS` divided and its :data:`SECONDS_FIELDS`
    multiplied by the inverse of the probes' mean share of a core. The name says by how
    much."""
    if not probes:
        raise ValueError("as_loaded needs at least one probe")
    share = statistics.fmean(p["host_share"] for p in probes)
    if not 0 < share <= 1.5:  # process time can run a little ahead of the wall clock
        raise ValueError(f"a probe's share of a core must be in (0, 1], got {share}")
    slower = 1.0 / min(share, 1.0)
    changes: dict[str, Any] = {k: getattr(hw, k) / slower for k in RATE_FIELDS}
    changes.update({k: getattr(hw, k) * slower for k in SECONDS_FIELDS})
    changes["name"] = f"{hw.name} as loaded now ({slower:.2f}x its times)"
    return dataclasses.replace(hw, **changes)


def slowdown(loaded: Hardware, idle: Hardware) -> float:
    """How many times ``idle``'s times ``loaded`` (:func:`as_loaded`) predicts."""
    return idle.matmul_flops / loaded.matmul_flops


def _segment() -> None:
    """The work before a probed collective (:data:`SEGMENT_UNITS`)."""
    for _ in range(SEGMENT_UNITS):
        sum(range(2000))


def probe_collectives(group: Any = None, rounds: int = COLLECTIVE_ROUNDS) -> float:
    """Mean seconds a small control collective on ``group`` (this rank's process group; None:
    the world) adds to the work before it, called on every rank of it at once: per round,
    three segments of work alone (:func:`_segment`), an untimed barrier, then three segments
    each followed by a collective through :mod:`apbv.comm` (a flag's all-reduce, a barrier,
    an all-gather of 4 floats; each wait bounded by its timeout); the difference of the two
    timed parts over the collectives, after one untimed round. 0.0 without a process group
    (nothing runs)."""
    import torch

    from apbv import comm

    if not comm.is_distributed():
        return 0.0
    row = torch.zeros(4)
    ops = (lambda: comm.any_rank(False, group), lambda: comm.barrier(group),
           lambda: comm.all_gather(row, group))
    alone = together = 0.0
    for r in range(rounds + 1):
        start = time.perf_counter()
        for _ in ops:
            _segment()
        middle = time.perf_counter()
        comm.barrier(group)  # the ranks start the timed collectives together
        restart = time.perf_counter()
        for op in ops:
            _segment()
            op()
        if r:  # round 0 warms up
            alone += middle - start
            together += time.perf_counter() - restart
    return max(0.0, together - alone) / (rounds * len(ops))


def with_collectives(hw: Hardware, ranks: int, seconds: float) -> Hardware:
    """``hw`` with ``seconds`` (:func:`probe_collectives`) as the fixed cost of a collective
    on a group of ``ranks`` ranks: ``link_latency_s``, or for one rank
    ``solo_collective_s``; the name says so."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if not 0 <= seconds < 60:
        raise ValueError(f"a collective's measured seconds must be in [0, 60), got {seconds}")
    changes: dict[str, Any] = {"solo_collective_s" if ranks == 1 else "link_latency_s": seconds,
                               "name": f"{hw.name}; a collective {1e3 * seconds:.2f} ms on "
                                       f"{ranks} rank(s)"}
    return dataclasses.replace(hw, **changes)


def probe_decoding(path: str, rank: int = 0, ranks: int = 1,
                   repeats: int = DECODE_REPEATS) -> dict[str, float]:
    """What decoding costs this process now, through the engine's reader (:mod:`apbv.video`,
    decord with the threads of a rank of ``ranks``): the medians over ``repeats`` (after one
    warm-up) of opening ``path`` (``open_s``: :func:`apbv.video.probe`) and of reading
    ``rank``'s share of its frames sampled at :data:`DECODE_PROBE_FPS` at the video's own size
    (:func:`apbv.video.load_rank_frames`), less the open (``frames_s``); ``frames`` read and
    ``pixels`` a frame."""
    from apbv.video import VideoSpec, load_rank_frames, probe

    meta = probe(VideoSpec(path))
    pixels = meta.height * meta.width
    spec = VideoSpec(path, fps=DECODE_PROBE_FPS, min_pixels=pixels, max_pixels=pixels)
    opens, loads, frames = [], [], 0
    for r in range(repeats + 1):
        start = time.perf_counter()
        probe(spec)
        middle = time.perf_counter()
        frames = len(load_rank_frames(spec, rank, ranks).frames)
        if r:  # read 0 warms up
            opens.append(middle - start)
            loads.append(time.perf_counter() - middle)
    open_s = statistics.median(opens)
    return {"open_s": open_s, "frames_s": max(0.0, statistics.median(loads) - open_s),
            "frames": float(frames), "pixels": float(pixels)}


def warm_decoding() -> None:
    """Import what :func:`probe_decoding` needs (the sampling rules' qwen-vl-utils take
    seconds to import) by planning :data:`DECODE_PROBE`'s sampling, no file opened: called
    before forking the probes, so they time the decoding and not the imports."""
    from apbv.video import VideoMeta, VideoSpec, plan_sampling

    side, fps, seconds = DECODE_PROBE
    pixels = side * side
    plan_sampling(VideoSpec("decode_probe.mp4", fps=DECODE_PROBE_FPS, min_pixels=pixels,
                            max_pixels=pixels),
                  VideoMeta(round(fps * seconds), fps, side, side))


def with_decoding(hw: Hardware, measured: Mapping[str, float]) -> Hardware:
    """``hw`` with the decoding :func:`probe_decoding` ``measured``: ``video_open_s`` its
    open, ``decode_frame_s`` its seconds a frame less ``hw``'s ``decode_s_per_pixel`` of the
    frame's pixels (at least 0)."""
    if not measured["frames"] >= 1 or not 0 <= measured["open_s"] < 60 \
            or not 0 <= measured["frames_s"] < 60:
        raise ValueError(f"measured decoding must read >= 1 frame in [0, 60) s, got {measured}")
    per_frame = measured["frames_s"] / measured["frames"]
    return dataclasses.replace(
        hw, video_open_s=measured["open_s"],
        decode_frame_s=max(0.0, per_frame - hw.decode_s_per_pixel * measured["pixels"]),
        name=f"{hw.name}; a video open {1e3 * measured['open_s']:.2f} ms, a frame "
             f"{1e3 * per_frame:.2f} ms")


def mean_decoding(found: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The processes' :func:`probe_decoding` results as one: the mean open and the mean
    seconds a frame (``frames`` 1)."""
    if not found:
        raise ValueError("mean_decoding needs at least one measurement")
    return {"open_s": statistics.fmean(f["open_s"] for f in found),
            "frames_s": statistics.fmean(f["frames_s"] / f["frames"] for f in found),
            "frames": 1.0, "pixels": statistics.fmean(f["pixels"] for f in found)}


def loaded_groups(hw: Hardware, probes: Sequence[dict[str, float]],
                  collective_s: Mapping[int, float],
                  decoding: Mapping[int, Mapping[str, float]] | None = None,
                  ) -> dict[int, Hardware]:
    """Per group size H of ``collective_s`` (measured seconds of a collective on groups of H
    ranks): ``hw`` as the ``probes`` found the machine (:func:`as_loaded`) with that
    collective cost (:func:`with_collectives`) and, where ``decoding`` has H, the decoding a
    rank of such a group measured (:func:`with_decoding`); the mapping
    :func:`apbv.eval.forecast.forecast` takes."""
    loaded = as_loaded(hw, probes)
    out = {h: with_collectives(loaded, h, s) for h, s in sorted(collective_s.items())}
    for h, measured in (decoding or {}).items():
        if h in out:
            out[h] = with_decoding(out[h], measured)
    return out


def divisors(world_size: int) -> list[int]:
    """The numbers that divide ``world_size``, ascending: the group counts G, and the group
    sizes H, of every split of its ranks into equal groups."""
    return [g for g in range(1, world_size + 1) if world_size % g == 0]


def _probe_into(queue: Any, seconds: float, rank: int, world_size: int, port: int,
                rounds: int, video: str | None) -> None:
    """One forked rank: its share of a core, its decoding of ``video`` as a rank of a group
    of each size (:func:`probe_decoding`; None: not measured), then (more than one rank) a
    gloo group of ``world_size`` on ``port`` and :func:`probe_collectives` on groups of each
    size."""
    import torch

    torch.set_num_threads(1)
    out: dict[str, Any] = {"probe": probe(seconds), "collective_s": {}, "decoding": {}}
    try:
        try:
            for h in divisors(world_size) if video is not None else []:
                out["decoding"][h] = probe_decoding(str(video), rank % h, h)
        except ImportError:  # no decoder here (the video extra): the preset's decoding
            out["decoding"] = {}
        if world_size > 1:
            from apbv.distributed import destroy_distributed, init_distributed

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                              WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
            init_distributed(backend="gloo", timeout_s=60.0, startup_timeout_s=60.0)
            try:
                from apbv import comm

                for h in divisors(world_size):
                    blocks = [list(range(s, s + h)) for s in range(0, world_size, h)]
                    group = None if h == world_size else comm.new_groups(blocks)
                    out["collective_s"][h] = probe_collectives(group, rounds)
            finally:
                destroy_distributed()
    except Exception as exc:  # reported to the parent, which raises it
        out = {"error": f"rank {rank}: {type(exc).__name__}: {exc}"}
    queue.put(out)


def calibrate_here(hw: Hardware, processes: int, seconds: float = 2.0,
                   rounds: int = COLLECTIVE_ROUNDS, video: str | None = None,
                   ) -> dict[int, Hardware]:
    """:func:`loaded_groups` of ``processes`` probes run at once (the run's ranks), each in a
    process forked from this one (no start-up to wait for): per group size H dividing
    ``processes``, ``hw`` as loaded now with the collective cost measured on groups of H
    (one rank alone has no process group: its collectives cost nothing) and, given a
    ``video`` (:data:`DECODE_PROBE`'s), the frame decoding measured as a rank of such a group
    (:func:`probe_decoding`); ``seconds`` of the share's probe, ``rounds`` of
    :func:`probe_collectives`."""
    import multiprocessing

    if video is not None:
        warm_decoding()  # the forked probes inherit the imports
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    from apbv.distributed import free_port

    port = free_port()
    children = [ctx.Process(target=_probe_into, args=(queue, seconds, r, processes, port,
                                                      rounds, video), daemon=True)
                for r in range(processes)]
    for child in children:
        child.start()
    try:
        found = [queue.get(timeout=seconds + 120) for _ in children]
    finally:
        for child in children:
            child.join(timeout=5)
    failed = [f["error"] for f in found if "error" in f]
    if failed:
        raise RuntimeError(f"measuring the collectives or the decoding failed: "
                           f"{'; '.join(failed)}")
    probes = [f["probe"] for f in found]
    sizes = divisors(processes)
    decoded = {h: mean_decoding([f["decoding"][h] for f in found]) for h in sizes} \
        if all(f["decoding"] for f in found) else {}
    if processes == 1:
        loaded = as_loaded(hw, probes)
        return {1: with_decoding(loaded, decoded[1]) if decoded else loaded}
    return loaded_groups(hw, probes, {h: statistics.fmean(f["collective_s"][h] for f in found)
                                      for h in sizes}, decoded)
