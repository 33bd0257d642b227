"""Hardware constants of the cost model: :class:`Hardware` (a dozen throughput, bandwidth and
host-overhead constants), its presets (:data:`HARDWARE_PRESETS`: the calibrated development
CPU, H200s, and H100s derived from them), :func:`hardware` to pick one or read a calibration
JSON written by ``benchmarks/calibrate_cpu.py``, and :class:`Machine`, which turns work into
seconds; :func:`rates_line` says which rates a prediction assumes."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
    """Fixed cost of one collective of two or more ranks (a round trip of a small one)."""
    decode_s_per_pixel: float
    """Host seconds to decode and resize a sampled frame, per source pixel (besides
    ``decode_frame_s``)."""
    process_s_per_pixel: float
    """Host seconds of the video processor (normalise, patchify), per resized pixel."""
    preprocess_fixed_s: float
    """Host seconds per request besides the frames, the tokens and the video's open
    (``video_open_s``)."""
    tokenize_s_per_token: float
    """Host seconds per prompt token to tokenize the prompt with its video placeholders."""
    layer_overhead_s: float
    """Host seconds per decoder layer (Python and op dispatch of the layer and the APB-V op)."""
    vision_layer_overhead_s: float
    """Host seconds per vision block, besides its attention calls."""
    call_overhead_s: float
    """Host seconds per attention call of the vision tower (the stock path: one per window;
    grouped: one per window size and block)."""
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
    vision_elementwise_efficiency: float = 1.0
    """The share of ``memory_bw`` the vision blocks' elementwise passes (norms, residuals, the
    q/k rotary in fp32, the MLP's activation; as the cost model counts them) reach: fitted
    by ``benchmarks/calibrate_gpu.py`` from the tower's measured time per temporal patch;
    1.0 where not fitted."""
    coded_frame_s_per_pixel: float = 0.0
    """Host seconds per source pixel of each coded frame a decoder walks to reach the sampled
    ones, the sampled frames included (``video.decode=needed``: the frames nothing refers to
    are skipped, so this is an average over the file's frame types; the sampled frames' RGB
    conversion is counted here), measured on camera footage with 3 B-frames
    (``benchmarks/footage_decode.py``; :func:`apbv.cost.predict.footage_frame_s`). 0.0: not
    measured (only the sampled frames are counted)."""
    keyframe_s_per_pixel: float = 0.0
    """Host seconds per source pixel of each keyframe interval a decoder walks into, beyond
    its frames' ``coded_frame_s_per_pixel``: the seek, and a keyframe's decoding over an
    average coded frame's (about 9x the average on the benchmark's camera footage), measured
    by decoding keyframes alone (``benchmarks/footage_decode.py``). 0.0: not measured."""
    convert_s_per_pixel: float = 0.0
    """Host seconds per source pixel to resize a decoded sampled frame of camera footage
    (``video.decode=needed``: the antialiased bicubic resize, which reads every source pixel,
    by :func:`apbv.video.bicubic.frame_resizer`), measured on 1080p camera footage with the
    decoding timed apart (``benchmarks/footage_decode.py``). 0.0: not measured (a sampled
    frame costs ``decode_s_per_pixel``, the frames walked past it
    :func:`apbv.cost.predict.walk_s`)."""
    attention_kernel: str = ""
    """The kernel whose rate ``attention_flops`` is, and where it was measured (``plan``
    prints it); "" where not stated."""
    graph_layer_s: float = 0.0
    """Device seconds per decoder layer of a decode step replayed from a CUDA graph, beyond
    its kernels' work (the gaps between its kernel nodes; the host launches the whole step
    at once): :func:`apbv.cost.decode.graph_step_s`."""
    graph_capture_s: float = 0.0
    """Seconds to capture a decode step besides dispatching it twice (the warm-up and the
    recording): the device sync and cache release that open a capture and
    ``cudaGraphInstantiate`` of its nodes. 0.0: no CUDA graphs here (decode is eager)."""
    solo_collective_s: float = 0.0
    """Fixed cost of one collective on a process group of one rank (``apbv eval --groups``
    with groups of one rank: :mod:`apbv.comm` still runs it through the backend), measured
    by :func:`apbv.cost.calibrate.probe_collectives`; 0.0 where a one-rank run has no process
    group (a single process)."""
    sample_overhead_s: float = 0.0
    """Host seconds per evaluated sample outside the engine's stages (``apbv eval``'s
    harness: the request and its checks, the video's header probe for the ETA, the row and
    the round's gather; the row's fsync is ``sample_sync_s``), which
    :mod:`apbv.eval.forecast` adds per sample; measured by ``benchmarks/bench_eval.py``
    (0.0: not measured, as on the GPU presets)."""
    sample_sync_s: float = 0.0
    """Seconds per evaluated sample of the row's ``fsync`` (I/O: a loaded CPU does not make
    it longer, so :mod:`apbv.cost.calibrate` does not scale it); 0.0: not measured."""
    decode_frame_s: float = 0.0
    """Host seconds per sampled frame the decoder returns, besides its pixels'
    ``decode_s_per_pixel``: the reader's call, its seek and the frames decoded on the way
    (decord seeks to each frame of a strided batch), the frame's copy out; it dominates at
    small frames (about 0.6 ms a frame against 0.09 ms for the pixels at 112 x 112).
    :func:`apbv.cost.calibrate.probe_decoding` measures it on a small synthetic video of
    twice the sampling rate. Wherever a sampled frame is priced at ``decode_s_per_pixel``;
    not with a measured ``convert_s_per_pixel`` (:func:`apbv.cost.stages.footage_frame_s`,
    whose per-pixel rates were measured on 1080p footage, a frame's own cost in them)."""
    video_open_s: float = 0.0
    """Host seconds to open a request's video on one rank (the decoder, the header and the
    check that the last frame decodes), once per rank and request; measured with
    ``decode_frame_s``."""

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
    matmul_flops=1.928e+11,
    conv_flops=3.23e+11,
    attention_flops=1.887e+11,
    attention_pair_s=4.204e-10,
    memory_bw=2.212e+10,
    link_bw=7.267e+08,
    link_latency_s=0.0002438,
    decode_s_per_pixel=7.013e-09,
    process_s_per_pixel=2.923e-09,
    preprocess_fixed_s=0.003949,
    tokenize_s_per_token=6.098e-08,
    layer_overhead_s=0.001626,
    vision_layer_overhead_s=0.0005868,
    call_overhead_s=3.825e-05,
    host_overlaps_device=False,
    full_uses_all_ranks=True,
    thread_efficiency=0.938,
    dtype_bytes=4,
    coded_frame_s_per_pixel=4.099e-10,
    keyframe_s_per_pixel=3.752e-09,
    convert_s_per_pixel=1.888e-09,
    sample_overhead_s=0.001,
    sample_sync_s=0.004,
    decode_frame_s=3.9e-04,
    video_open_s=2.1e-03,
)
"""The 2-core development machine, one thread per rank: the values of
benchmarks/results/cpu_calibration.json (``python benchmarks/calibrate_cpu.py``), but for the
decoding and the harness. That calibration fits a rank's frames at one frame size (448 x 448,
every frame of a 2 fps file), so its ``decode_s_per_pixel`` (7.598e-09) and its fixed part
(``preprocess_fixed_s`` 0.006049) held a frame's own cost and the video's open; they are
split by the reader's own time (CPU seconds, best of 27, ``apbv.video.load_rank_frames`` with
one decoder thread, 8 and 64 frames) at 112 x 112 and 448 x 448: a frame costs 0.14 ms plus
8.6e-09 s a pixel, so 7.7% of a 448 x 448 frame's time is per frame and the per-pixel rate
keeps 92.3% (7.013e-09); the open (``apbv.video.probe``) of the 448 x 448 videos took 2.1 ms,
moved from the fixed part (0.006049 - 0.0021). ``decode_frame_s`` is what
:func:`apbv.cost.calibrate.probe_decoding` measures in the same way: 0.48 ms a frame of its
112 x 112 video sampled at every other frame (decord seeks to each) less its pixels, 0.39
ms (a 2 fps file read frame after frame pays about 0.14 ms of it). The harness:
``benchmarks/bench_eval.py`` measured 0.021-0.023 s per sample at 3.5-5.8x an idle core's host
times, about 5 ms idle; timed apart (``run_eval`` with an engine that answers at once) 5.5 ms,
4 ms of it the row's fsync: ``sample_sync_s`` 4 ms (I/O, not scaled with the load) and
``sample_overhead_s`` 1 ms."""

H200_MEASURED: dict[str, float] = {
    "matmul_flops": 7.59e14,
    "conv_flops": 5.994e14,
    "attention_flops": 3.21e14,
    "memory_bw": 3.898e12,
    "layer_overhead_s": 1.069e-3,
    "vision_layer_overhead_s": 6.456e-4,
    "call_overhead_s": 3.85e-5,
    "vision_elementwise_efficiency": 0.3867,
}
"""One H200's device constants as measured by ``scripts/gpu_check.sh``
(``benchmarks/results/h200_calibration.json``; bf16, torch 2.11 with PyTorch's SDPA and no
flash-attn, transformers 5.17): F.linear at the 7B's MLP shape, the runtime's patch embedding,
the kernel adapter's causal attention at 16k tokens, a large add, one 7B decoder layer and
the 7B's vision tower on inputs too small to compute (host overhead), the host seconds per
attention call of the stock per-window tower, and the share of the bandwidth the tower's
elementwise passes reach (fitted on its time per temporal patch). The add was ``a + a``,
which reads ``a`` once: its bytes are one read and one write (``calibrate_gpu.py --refit``;
counted as two reads, it gave 5.847e12, over the H200's 4.8e12 spec)."""
H200_KERNELS = "PyTorch SDPA measured on NVIDIA H200, torch 2.11.0+cu130"
"""What :data:`H200_MEASURED`'s ``attention_flops`` is the rate of."""
H200_HBM_BW = 4.8e12
"""The H200 SXM's HBM3e bandwidth (spec)."""
H100_HBM_BW = 3.35e12
"""The H100 SXM 80 GB's HBM3 bandwidth (spec)."""
GRAPH_LAYER_S = 2e-5
"""Assumed, not measured: a replayed decode layer's gaps between its kernels (about 40
kernel nodes per layer at about 0.5 us each) on an H100/H200."""
GRAPH_CAPTURE_S = 0.02
"""Assumed, not measured: the sync, the cache release and ``cudaGraphInstantiate`` of a
captured 7B decode step (28 layers x 40-60 nodes); with the two dispatches of the step
around it a capture comes to the 50-150 ms a reading of torch's capture path estimates.
``benchmarks/multirank_check.py``'s graphs part prints what it is on a GPU."""
H200_MATMUL_FLOPS = H200_MEASURED["matmul_flops"]
"""Dense bf16 matmul throughput measured on an H200 (989 TFLOP/s peak)."""
NVLINK4_BW = 450e9
"""NVLink 4 bandwidth per direction per GPU (18 links x 25 GB/s), within a node."""
IB_NDR_BW = 50e9
"""One 400 Gb/s InfiniBand NDR port per GPU, between nodes."""
HOST_SPEEDUP = 1.5
"""A GPU server's host core against one of the CPU development machine (host work per core)."""
HOST_CORES_PER_GPU = 8
"""Host cores decoding and preprocessing frames for each GPU rank."""


def h200(*, attention_efficiency: float | None = None, link_bw: float = NVLINK4_BW,
         name: str = "h200") -> Hardware:
    """One H200 per rank: the device constants of :data:`H200_MEASURED`.
    ``attention_efficiency``: the attention kernel's share of the matmul throughput instead of
    the measured one (None; PyTorch's SDPA reached 0.42 at 16k tokens; flash-attn 2's forward
    about 0.5 at long sequences, flash-attn 3 about 0.7). The link and the host's frame work
    are not measured: NVLink 4 (or ``link_bw``), and the :data:`CPU` calibration on a core
    :data:`HOST_SPEEDUP` times faster, frame work (per pixel and ``decode_frame_s``) spread
    over :data:`HOST_CORES_PER_GPU`, the video's open and the fixed part on one core."""
    if attention_efficiency is not None and not 0 < attention_efficiency <= 1:
        raise ValueError(f"attention_efficiency must be in (0, 1], got {attention_efficiency}")
    measured: dict[str, Any] = dict(H200_MEASURED)  # Hardware's measured fields by name
    kernel = H200_KERNELS
    if attention_efficiency is not None:
        measured["attention_flops"] = attention_efficiency * measured["matmul_flops"]
        kernel = f"{attention_efficiency} x the matmul rate (assumed)"
    return Hardware(
        name=name,
        **measured,
        attention_kernel=kernel,
        graph_layer_s=GRAPH_LAYER_S,
        graph_capture_s=GRAPH_CAPTURE_S,
        attention_pair_s=0.0,
        link_bw=link_bw,
        link_latency_s=20e-6,
        decode_s_per_pixel=CPU.decode_s_per_pixel / (HOST_SPEEDUP * HOST_CORES_PER_GPU),
        decode_frame_s=CPU.decode_frame_s / (HOST_SPEEDUP * HOST_CORES_PER_GPU),
        video_open_s=CPU.video_open_s / HOST_SPEEDUP,
        coded_frame_s_per_pixel=CPU.coded_frame_s_per_pixel / (HOST_SPEEDUP
                                                               * HOST_CORES_PER_GPU),
        keyframe_s_per_pixel=CPU.keyframe_s_per_pixel / (HOST_SPEEDUP * HOST_CORES_PER_GPU),
        convert_s_per_pixel=CPU.convert_s_per_pixel / (HOST_SPEEDUP * HOST_CORES_PER_GPU),
        process_s_per_pixel=CPU.process_s_per_pixel / (HOST_SPEEDUP * HOST_CORES_PER_GPU),
        preprocess_fixed_s=CPU.preprocess_fixed_s / HOST_SPEEDUP,
        tokenize_s_per_token=CPU.tokenize_s_per_token / HOST_SPEEDUP,
        host_overlaps_device=True,
        dtype_bytes=2,
    )


def h100(*, attention_efficiency: float | None = None, link_bw: float = NVLINK4_BW,
         name: str = "h100") -> Hardware:
    """One H100 SXM 80 GB per rank, derived from the H200's measurements (:func:`h200`; no
    H100 has been measured): the two are the same GH100 chip (132 SMs, the same clocks,
    989 TFLOP/s bf16 dense, NVLink 4) and differ in memory, so the compute rates, the host
    overheads and the link are the H200's, and ``memory_bw`` is scaled by the bandwidth
    specs, :data:`H100_HBM_BW` / :data:`H200_HBM_BW` = 3.35 / 4.8 = 0.698
    (``vision_elementwise_efficiency`` is a share of it and stays)."""
    base = h200(attention_efficiency=attention_efficiency, link_bw=link_bw, name=name)
    scaled = float(f"{base.memory_bw * H100_HBM_BW / H200_HBM_BW:.4g}")
    return dataclasses.replace(base, memory_bw=scaled,
                               attention_kernel=f"{base.attention_kernel}; the H200's rate")


HARDWARE_PRESETS: dict[str, Hardware] = {
    "h200": h200(),
    "h200-ib": h200(link_bw=IB_NDR_BW, name="h200-ib"),
    "h100": h100(),
    "cpu": CPU,
}


def write_calibration(path: str | Path, report: dict[str, Any], name: str) -> None:
    """Write a calibration ``report`` (``{"hardware": Hardware.to_json(), ...}``, the form
    :meth:`Hardware.from_json` reads) to ``path``, print its constants and one JSON line
    naming the benchmark ``name``, the file and the seconds it took."""
    import json

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    for key, value in report["hardware"].items():
        print(f"{key:>24} {value}")
    print(json.dumps({"benchmark": name, "out": str(out),
                      "seconds": round(report["seconds"], 1)}))


def hardware(name_or_path: str | Path) -> Hardware:
    """A preset of :data:`HARDWARE_PRESETS` by name, or a JSON file (:meth:`Hardware.from_json`)."""
    if str(name_or_path) in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[str(name_or_path)]
    if not str(name_or_path).endswith(".json"):
        raise ValueError(f"unknown hardware {str(name_or_path)!r}; allowed: "
                         f"{', '.join(HARDWARE_PRESETS)} or a .json file")
    return Hardware.from_json(name_or_path)


def rates_line(hw: Hardware) -> str:
    """One line naming the rates a prediction on ``hw`` assumes: the matmul and attention
    kernels (and what the attention rate is of), the memory, the link, the eager decode's
    host time and the decode graphs' constants."""
    kernel = f" ({hw.attention_kernel})" if hw.attention_kernel else ""
    graphs = (f"; decode graphs: {1e6 * hw.graph_layer_s:.0f} us per replayed layer, capture "
              f"{1e3 * hw.graph_capture_s:.0f} ms + 2 eager steps (assumed)" if hw.graph_capture_s
              else "; no decode graphs (eager)")
    return (f"rates assumed on {hw.name}: matmul {hw.matmul_flops / 1e12:.4g} TFLOP/s, "
            f"attention {hw.attention_flops / 1e12:.4g} TFLOP/s{kernel}, memory "
            f"{hw.memory_bw / 1e12:.4g} TB/s, link {hw.link_bw / 1e9:.4g} GB/s; eager decode "
            f"{1e3 * hw.layer_overhead_s:.3g} ms host per layer{graphs}")


@dataclass(frozen=True)
class Machine:
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
        if world_size == 1:  # nothing moves; a one-rank process group still pays its call
            return self.hw.solo_collective_s
        return self.hw.link_latency_s + received_bytes / self.hw.link_bw

    def collectives(self, count: int, world_size: int) -> float:
        """Seconds of ``count`` small control collectives (a flag's all-reduce, a barrier):
        their fixed costs alone."""
        return count * self.collective(0, world_size)

    def host(self, device_s: float, host_s: float) -> float:
        """Time of work that needs ``device_s`` of compute and ``host_s`` of dispatch."""
        if self.hw.host_overlaps_device:
            return max(device_s, host_s)
        return device_s + host_s

