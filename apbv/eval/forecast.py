"""The predicted wall time of an evaluation for each split of the world into rank groups.

A benchmark's wall time is what its user pays for: with G groups of H = world/G ranks, each
sample runs on H ranks (its time from the cost model, :func:`apbv.cost.estimate`: TTFT and the
answer's decode, the slowest rank, the request's collectives outside its stages, plus the
harness's own work per sample, ``Hardware.sample_overhead_s``, and its row's fsync,
``sample_sync_s``), and the samples are dealt as the run deals them
(:func:`apbv.eval.groups.deal`, by predicted seconds here), a round lasting as long as its
slowest group and, with more than one group, the gather of the
round's rows over the world (:data:`ROUND_GATHER_COLLECTIVES`). Each sample's video is probed
for its frame count, rate and size (the file's headers, no frame decoded); its frames and
tokens follow the runtime's sampling rules (:func:`apbv.video.plan_sampling`). The
question's tokens are estimated from its text (about 4 characters a token); the model load
and the process start are not counted. On a CPU machine shared with other work, the ``cpu``
constants are an idle machine's: :func:`apbv.cost.calibrate.calibrate_here` scales them to
the load of the moment and measures the fixed cost of a collective on groups of each size H,
giving one hardware per H (the ``hw`` mapping of :func:`forecast`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from apbv.cost.calibrate import divisors
from apbv.eval.data import Sample
from apbv.eval.groups import deal

CHARS_PER_TOKEN = 4
"""The question's tokens: its characters over this (English text in Qwen's tokenizer)."""
ROUND_GATHER_COLLECTIVES = 2
"""Collectives over the world per round with more than one group: the rows' gather
(:func:`apbv.comm.all_gather_object`: torch all-gathers the pickled sizes, then the padded
payloads)."""


@dataclass(frozen=True)
class SampleWork:
    """What the cost model needs of one sample (the same for every G)."""

    id: str
    frames: int
    grid: tuple[int, int]
    """Merged tokens (rows, cols) of a frame."""
    context_len: int
    query_len: int


@dataclass(frozen=True)
class GroupForecast:
    """The predicted run with ``groups`` groups of ``ranks`` ranks."""

    groups: int
    ranks: int
    wall_s: float
    sample_s: float
    """Mean predicted seconds of one sample on ``ranks`` ranks."""
    samples: int
    why_not: str | None = None
    """Why this split cannot run the set (a video with fewer temporal patches than ranks);
    its times are then infinite."""

    @property
    def samples_per_hour(self) -> float:
        return 3600.0 * self.samples / self.wall_s if self.wall_s > 0 else 0.0


def sample_work(samples: Sequence[Sample], dims: Any, video: dict[str, Any], *,
                skip_bad: bool = False) -> list[SampleWork]:
    """Each sample's frames and tokens from its video's headers (``video``: VideoSpec fields,
    e.g. nframes, max_pixels; the backend is PyAV, which reads headers without decoding).
    ValueError naming a missing or unreadable video, unless ``skip_bad``: its samples are
    left out."""
    from apbv.cost.work import video_context_len
    from apbv.video import VideoSpec, plan_sampling, probe

    metas: dict[str, Any] = {}
    out = []
    for s in samples:
        spec = VideoSpec(s.video_path, backend="pyav", image_patch_size=dims.patch_size,
                         **video)
        try:
            if s.video_path not in metas:
                metas[s.video_path] = probe(spec)
            meta = metas[s.video_path]
            if meta is None:
                continue
            sampling = plan_sampling(spec, meta)
        except ValueError:
            if not skip_bad:
                raise
            metas[s.video_path] = None
            continue
        merge = dims.patch_size * dims.spatial_merge_size
        grid = (sampling.resized_height // merge, sampling.resized_width // merge)
        patches = sampling.num_patches
        query = max(1, len(s.prompt) // CHARS_PER_TOKEN)
        out.append(SampleWork(s.id, sampling.num_frames, grid,
                              video_context_len(dims, patches, grid), query))
    return out


def hardware_for(hw: Any, ranks: int) -> Any:
    """The hardware of a group of ``ranks`` ranks: ``hw`` itself, or from a mapping by group
    size (:func:`apbv.cost.calibrate.calibrate_here`) its entry (ValueError naming the sizes
    it has when it lacks one)."""
    if not isinstance(hw, Mapping):
        return hw
    if ranks not in hw:
        raise ValueError(f"no hardware measured for groups of {ranks} rank(s); measured: "
                         f"{', '.join(str(h) for h in sorted(hw))}")
    return hw[ranks]


def forecast(work: Sequence[SampleWork], dims: Any, hw: Any, *, world_size: int, mode: str,
             answer_tokens: int, groups: Sequence[int] | None = None) -> list[GroupForecast]:
    """The predicted wall time of running ``work`` for each G of ``groups`` (default every
    divisor of ``world_size``). ``hw``: a :class:`~apbv.cost.hardware.Hardware`, or a mapping
    from the group size H to one (:func:`hardware_for`; with G > 1 the rounds' gathers are
    priced on the world's, H = ``world_size``)."""
    out = []
    for g in groups or divisors(world_size):
        ranks = world_size // g
        group_hw = hardware_for(hw, ranks)  # ValueError: not measured (not a split's limit)
        try:
            seconds = [predict_one(w, dims, group_hw, ranks, mode, answer_tokens) for w in work]
        except ValueError as exc:  # a sample this H cannot split
            out.append(GroupForecast(g, ranks, float("inf"), float("inf"), len(work), str(exc)))
            continue
        dealt = deal(seconds, g)
        rounds = max((len(d) for d in dealt), default=0)
        gather = round_gather_s(hardware_for(hw, world_size), world_size) if g > 1 else 0.0
        wall = sum(max(seconds[d[r]] for d in dealt if r < len(d)) + gather
                   for r in range(rounds))
        out.append(GroupForecast(g, ranks, wall, sum(seconds) / max(1, len(seconds)),
                                 len(seconds)))
    return out


def recommend(forecasts: Sequence[GroupForecast]) -> GroupForecast:
    """The split with the least wall time (ties: fewer groups); ValueError when none can
    run."""
    possible = [f for f in forecasts if f.why_not is None]
    if not possible:
        raise ValueError(f"no split can run these samples: {forecasts[0].why_not}")
    return min(possible, key=lambda f: (round(f.wall_s, 6), f.groups))


def forecast_lines(forecasts: Sequence[GroupForecast], hw_name: str) -> list[str]:
    """A table of every split and the recommendation."""
    best = recommend(forecasts)
    lines = [f"{'G':>3} {'H':>3} {'s/sample':>9} {'wall':>10} {'samples/h':>10}"]
    for f in forecasts:
        if f.why_not is not None:
            lines.append(f"{f.groups:>3} {f.ranks:>3}  cannot run: {f.why_not}")
            continue
        mark = "  <- recommended" if f is best else ""
        lines.append(f"{f.groups:>3} {f.ranks:>3} {f.sample_s:>9.3f} {_hms(f.wall_s):>10} "
                     f"{f.samples_per_hour:>10.1f}{mark}")
    lines.append(f"recommended on {hw_name}: --groups {best.groups} ({best.groups} group(s) of "
                 f"{best.ranks} rank(s)), predicted wall time {_hms(best.wall_s)}")
    return lines


def _hms(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def predicted_seconds(samples: Sequence[Sample], cfg: Any, ranks: int,
                      answer_tokens: int) -> dict[str, float] | None:
    """Each sample's predicted seconds on ``ranks`` ranks with ``cfg``'s model, video
    settings and mode, on the cost model's hardware for this device (``cpu``, else ``h200``):
    the weights of the run's ETA, which scales them by the measured time of the samples done
    (so the hardware's constants need not be exact). None when no prediction can be made (a
    checkpoint the cost model does not read, a video it cannot probe): the ETA then counts
    samples."""
    import torch

    from apbv import cost

    try:
        dims = cost.config_dims(cfg.model.path)  # relative weights: no tokenizer to load
        video = {k: getattr(cfg.video, k) for k in ("fps", "nframes", "min_pixels",
                                                     "max_pixels", "total_pixels")
                 if getattr(cfg.video, k) is not None}
        work = sample_work(samples, dims, video, skip_bad=True)
        hw = cost.hardware("h200" if torch.cuda.is_available() else "cpu")
        return {w.id: predict_one(w, dims, hw, ranks, cfg.attention.mode, answer_tokens)
                for w in work}
    except (ValueError, OSError, ImportError, KeyError, TypeError):
        return None


def round_gather_s(hw: Any, world_size: int) -> float:
    """Seconds of one round's gather of the groups' rows over ``world_size`` ranks: the fixed
    costs of :data:`ROUND_GATHER_COLLECTIVES` collectives (the rows are a few kB)."""
    from apbv.cost.hardware import Machine

    return Machine(hw, hw.dtype_bytes).collectives(ROUND_GATHER_COLLECTIVES, world_size)


def predict_one(work: SampleWork, dims: Any, hw: Any, ranks: int, mode: str,
                answer_tokens: int) -> float:
    """One sample's predicted seconds on ``ranks`` ranks: to its last token with the
    request's collectives outside its stages (:attr:`apbv.cost.Prediction.request_s`), and
    the harness's work around it (``hw.sample_overhead_s``) and its row's fsync
    (``hw.sample_sync_s``)."""
    from apbv.cost.predict import estimate
    from apbv.cost.workload import Workload
    from apbv.modes import get_mode

    load = Workload.of(dims, context_len=work.context_len, query_len=work.query_len,
                       world_size=ranks, frames=work.frames, grid=work.grid,
                       answer_tokens=answer_tokens)
    return (estimate(get_mode(mode), dims, load, hw).request_s + hw.sample_overhead_s
            + hw.sample_sync_s)
