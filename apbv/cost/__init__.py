"""Cost model of one request: counted work per rank, predicted stage times and TTFT, and the
memory a rank needs.

Layers, each usable on its own (docs/cost_model.md has the formulas and their limits):

1. Counted work, exact and pure (:mod:`apbv.cost.work`): :func:`rank_pairs` counts the
   query-key pairs a rank scores in one layer under a plan, :func:`full_pairs` those of
   single-process causal attention; :class:`ModelDims` holds a checkpoint's sizes
   (:func:`checkpoint_dims`, :func:`config_dims` without the processor, :func:`model_dims` of
   a config.json, or a preset of :data:`MODEL_PRESETS`).
2. What runs where (:mod:`apbv.cost.hardware`): :class:`Hardware`, a dozen throughput, bandwidth
   and host-overhead constants; presets in :data:`HARDWARE_PRESETS`, or a calibration JSON
   written by ``benchmarks/calibrate_cpu.py``; :func:`apbv.cost.calibrate.calibrate_here`
   scales the ``cpu`` preset to the load of the moment and measures a collective's fixed cost
   per group size.
3. :func:`estimate` of a resolved mode and a :class:`Workload` (:mod:`apbv.cost.predict`, by
   stage in :mod:`apbv.cost.stages`, on the schedule of :mod:`apbv.cost.schedule`;
   :func:`predict` takes the mode's name and the workload's fields): for one mode, per rank
   and per stage of the engine, the FLOPs, bytes moved and KV memory, and from the hardware
   constants the seconds; a keep rate prices pruned video; the engine's control collectives
   are counted in :mod:`apbv.cost.control`.
4. :func:`request_memory` (:mod:`apbv.cost.memory`): the bytes one rank holds at its peak for
   one request, by part, checked before any work.
"""

from apbv.cost.decode import MIN_GRAPH_TOKENS, GraphDecode, decode_token_s, graph_decode
from apbv.cost.hardware import (
    CPU,
    H200_MATMUL_FLOPS,
    H200_MEASURED,
    HARDWARE_PRESETS,
    HOST_CORES_PER_GPU,
    HOST_SPEEDUP,
    IB_NDR_BW,
    NVLINK4_BW,
    Hardware,
    h100,
    h200,
    hardware,
    rates_line,
)
from apbv.cost.memory import PROCESSOR_FLOAT_COPIES, MemoryEstimate, memory_lines, request_memory
from apbv.cost.predict import Prediction, RankCost, estimate, predict
from apbv.cost.schedule import Event, simulate
from apbv.cost.table import prediction_table
from apbv.cost.work import (
    MODEL_PRESETS,
    RELEASED_VIDEO_START,
    ModelDims,
    anchor_pairs,
    attention_flops,
    block_pairs,
    checkpoint_dims,
    config_dims,
    full_pairs,
    model_dims,
    preset_dims,
    preset_name,
    query_pairs,
    rank_pairs,
    read_config,
    split_window,
    squarest_grid,
    template_video_start,
    video_context_len,
    video_grid,
)
from apbv.cost.workload import KEEP_BY, Workload

__all__ = [
    "CPU",
    "H200_MATMUL_FLOPS",
    "H200_MEASURED",
    "HARDWARE_PRESETS",
    "HOST_CORES_PER_GPU",
    "HOST_SPEEDUP",
    "IB_NDR_BW",
    "KEEP_BY",
    "MIN_GRAPH_TOKENS",
    "MODEL_PRESETS",
    "NVLINK4_BW",
    "PROCESSOR_FLOAT_COPIES",
    "RELEASED_VIDEO_START",
    "Event",
    "GraphDecode",
    "Hardware",
    "MemoryEstimate",
    "ModelDims",
    "Prediction",
    "RankCost",
    "Workload",
    "anchor_pairs",
    "attention_flops",
    "block_pairs",
    "checkpoint_dims",
    "config_dims",
    "decode_token_s",
    "estimate",
    "full_pairs",
    "graph_decode",
    "h100",
    "h200",
    "hardware",
    "memory_lines",
    "model_dims",
    "predict",
    "prediction_table",
    "preset_dims",
    "preset_name",
    "query_pairs",
    "rank_pairs",
    "rates_line",
    "read_config",
    "request_memory",
    "simulate",
    "split_window",
    "squarest_grid",
    "template_video_start",
    "video_context_len",
    "video_grid",
]
