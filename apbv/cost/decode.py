"""Predicted seconds of greedy decode (:mod:`apbv.engine.decode`) after the first token.

Every rank runs the whole model on each new token (hidden states are replicated); in each
layer it reads the layer's weights and the KV it holds, the H (out, lse) partials are
all-gathered (the one collective of a layer, and of a step: every rank picks the same token
from the same merged partials, and the query rank's stop flag rides along the first layer's
gather) and merged, and after the last layer the lm_head gives the logits and their argmax.
Per token, with L layers, W_l the
bytes of a layer's linear weights, S_r the tokens whose KV rank r holds (its anchor share and
blocks; the query rank also the query and the answer so far), kv the bytes of one token's K
and V in one layer (2 * Hkv * D * dtype), B the memory bandwidth:

    device_layer = sum over matmuls of roofline(1 row)   (= W_l / B: weight-bound)
                 + max_r max(S_r * kv / B, attention FLOPs of S_r keys)
                 + merge of H fp32 partials (H * Hq * (D + 1) * 4 bytes, read and written)
    layer        = host(device_layer + collective((H - 1) * Hq * (D + 1) * 4 bytes), overhead)
    token        = L * layer + roofline(lm_head, 1 row) + argmax

``host(device, overhead)`` is :meth:`Machine.host`: max of the two where the host runs ahead of
the device (GPUs), their sum on CPUs; the overhead is the calibrated per-layer host time
(``layer_overhead_s``: an eager HF decoder layer's dispatch, which a one-row step cannot hide).
The slowest rank decides each layer, as they meet in its all-gather. ``full`` is one process
holding every token, with no collective.

With ``decode.graphs`` (CUDA ranks) the steps replay one captured step (:func:`graph_decode`):
no host dispatch (``graph_layer_s`` per layer instead: the gaps between the replayed
kernels), and the owner (the query rank) attends over its reserved KV buffer of C rows
(prompt and answer) with a device-side valid length
(:func:`apbv.attention.kernels.attention_upto`): on CUDA torch's bundled flash kernel reads
only the valid rows in bf16 (``owner_pass="kernel"``, what :func:`apbv.cost.predict` prices);
where that kernel refuses the call, the masked fp32 einsum over every reserved row
(``owner_pass="fp32"``: the bf16 K and V read, written as fp32 copies and read again, 10 bytes
per element where the eager kernel reads 2). A capture costs, once per KV bucket, the step
dispatched twice more (warm-up and recording), ``graph_capture_s`` (the sync and the
instantiation), one replay and the check's all-reduce; answers of fewer than
:data:`MIN_GRAPH_TOKENS` tokens are decoded eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

from apbv.cost.hardware import Hardware, Machine
from apbv.cost.work import ModelDims

MIN_GRAPH_TOKENS = 16
"""Answer tokens below which a decode is not captured (``decode.graphs_min_tokens``' default:
the runtime captures when ``max_new_tokens`` reaches it): a capture costs several eager steps,
which a shorter answer does not win back."""
OWNER_PASSES = ("fp32", "kernel")
"""How a captured step's owner attends its reserved buffer: ``kernel`` (torch's bundled flash
kernel reading the valid rows only, in bf16: the runtime's path on CUDA) or ``fp32`` (the
masked fp32 einsums over every reserved row, its fallback where that kernel refuses)."""


def decode_step_s(dims: ModelDims, m: Machine, held: list[int], world_size: int) -> float:
    """Seconds of one decode step (one new token) with ``held[r]`` tokens of KV on rank r
    (every layer alike); ``world_size`` is the number of ranks meeting in the collectives
    (1 for one process)."""
    kv = max(_kv_s(dims, m, n) for n in held)
    layer = m.host(_layer_rest_s(dims, m, world_size) + kv, m.hw.layer_overhead_s)
    return dims.layers * layer + _head_s(dims, m)


def _kv_s(dims: ModelDims, m: Machine, n: int) -> float:
    """One layer's attention of one row over ``n`` keys: their K and V read, or the FLOPs."""
    d = dims.head_dim
    return max(m.mem(n * 2 * dims.kv_heads * d * m.dtype), m.attention(n, dims.heads, d))


def _layer_rest_s(dims: ModelDims, m: Machine, world_size: int) -> float:
    """One layer's device seconds besides its attention: the weights' read (one row), the
    merge of the H fp32 partials and their all-gather."""
    partial = dims.heads * (dims.head_dim + 1) * 4  # one rank's fp32 (out, lse) row per head
    return (m.matmuls(1, dims.text_linears()) + m.mem(2 * world_size * partial)
            + m.collective((world_size - 1) * partial, world_size))


def _head_s(dims: ModelDims, m: Machine) -> float:
    """The lm_head on one row and the argmax over its fp32 logits."""
    return m.matmuls(1, [(dims.hidden, dims.vocab)]) + m.mem(4 * dims.vocab)


def owner_pass_s(dims: ModelDims, m: Machine, valid: int, capacity: int,
                 owner_pass: str = "fp32") -> float:
    """One layer's attention of the owner's captured step, ``valid`` of its ``capacity``
    reserved rows holding keys: ``fp32``: the K and V buffers (Hkv D elements each per row)
    read at the dtype and written and read again as fp32 copies, and the (Hq, capacity)
    fp32 scores written, read by the log-sum-exp and the exp, and read by the second einsum;
    ``kernel``: the eager kernel's cost over the valid rows (:func:`_kv_s`)."""
    if owner_pass not in OWNER_PASSES:
        raise ValueError(f"owner_pass must be one of {', '.join(OWNER_PASSES)}; got "
                         f"{owner_pass!r}")
    if owner_pass == "kernel":
        return _kv_s(dims, m, valid)
    elements = capacity * 2 * dims.kv_heads * dims.head_dim
    return m.mem(elements * (m.dtype + 4 + 4) + 4 * capacity * dims.heads * 4)


def graph_step_s(dims: ModelDims, m: Machine, held: list[int], world_size: int,
                 capacity: int, owner: int = 0, owner_pass: str = "fp32") -> float:
    """Seconds of one decode step replayed from a CUDA graph, ``held[r]`` valid KV rows on
    rank r and ``capacity`` reserved rows on the ``owner``: :func:`decode_step_s`'s device
    work without the host's dispatch, ``graph_layer_s`` more per layer, and the owner's
    attention :func:`owner_pass_s`."""
    kv = max(owner_pass_s(dims, m, n, capacity, owner_pass) if r == owner
             else _kv_s(dims, m, n) for r, n in enumerate(held))
    layer = _layer_rest_s(dims, m, world_size) + kv + m.hw.graph_layer_s
    return dims.layers * layer + _head_s(dims, m)


@dataclass(frozen=True)
class GraphDecode:
    """The decode stage with ``decode.graphs`` (:func:`graph_decode`), seconds."""

    captured: bool
    """False where the answer is too short to capture (:data:`MIN_GRAPH_TOKENS`): eager."""
    token_s: float
    """Seconds per replayed step (the mean over the answer's steps; eager's when not
    captured)."""
    capture_s: float
    """What the capture adds, once per KV bucket (0 when not captured)."""
    first_s: float
    """The decode stage of a request that captures (the first of its bucket)."""
    reused_s: float
    """The decode stage of a later request of the bucket, which replays from its first step."""


def decode_s(dims: ModelDims, m: Machine, cached: list[int], answer_tokens: int,
             world_size: int, appending_rank: int = 0) -> float:
    """Seconds of the decode stage of an ``answer_tokens``-token answer: its
    ``answer_tokens - 1`` steps after the first token (which the prefill's logits give).
    ``cached[r]``: the prompt tokens whose KV rank r keeps; step i (from 0) feeds the i-th
    answer token, appended to ``appending_rank``'s KV first."""
    if isinstance(answer_tokens, bool) or not isinstance(answer_tokens, int) \
            or answer_tokens < 1:
        raise ValueError(f"answer_tokens must be an integer >= 1, got {answer_tokens!r}")
    total = 0.0
    for step in range(answer_tokens - 1):
        held = [n + (step + 1 if r == appending_rank else 0) for r, n in enumerate(cached)]
        total += decode_step_s(dims, m, held, world_size)
    return total


def graph_decode(dims: ModelDims, m: Machine, cached: list[int], answer_tokens: int,
                 world_size: int, appending_rank: int = 0, capacity: int | None = None,
                 owner_pass: str = "fp32") -> GraphDecode:
    """:func:`decode_s` with ``decode.graphs`` on CUDA ranks: the first step eager, then the
    capture (the step dispatched twice: its warm-up and its recording; ``graph_capture_s``;
    one replay of it and the check's all-reduce), then the other steps replayed
    (:func:`graph_step_s`); a request whose bucket was captured before replays every step.
    ``capacity``: the appending rank's reserved rows (default its prompt rows and the
    answer's, as ``max_new_tokens = answer_tokens`` reserves; a bucket may round it up)."""
    steps = answer_tokens - 1
    eager = decode_s(dims, m, cached, answer_tokens, world_size, appending_rank)
    if capacity is None:
        capacity = cached[appending_rank] + max(steps, 0)
    if capacity < cached[appending_rank] + max(steps, 0):
        raise ValueError(f"capacity ({capacity}) must hold the {cached[appending_rank]} "
                         f"cached rows and the {steps} decode steps")
    if answer_tokens < MIN_GRAPH_TOKENS:
        per = eager / steps if steps else 0.0
        return GraphDecode(False, per, 0.0, eager, eager)

    def held(step: int) -> list[int]:
        return [n + (step + 1 if r == appending_rank else 0) for r, n in enumerate(cached)]

    replays = [graph_step_s(dims, m, held(i), world_size, capacity, appending_rank,
                            owner_pass) for i in range(steps)]
    first = decode_step_s(dims, m, held(0), world_size)
    capture = (2 * first + m.hw.graph_capture_s + replays[0]
               + m.collective(4 * world_size, world_size))
    return GraphDecode(True, sum(replays) / steps, capture,
                       first + capture + sum(replays[1:]), sum(replays))


def decode_token_s(dims: ModelDims, *, context_len: int, world_size: int, hw: Hardware,
                   dtype_bytes: int | None = None) -> float:
    """Seconds of one decode step (:func:`decode_step_s`) after a prompt of ``context_len``
    tokens held evenly by ``world_size`` ranks, on the preset ``hw``: the serve admission's
    prior for its learned seconds per token, before any request has measured one."""
    m = Machine(hw, hw.dtype_bytes if dtype_bytes is None else dtype_bytes)
    return decode_step_s(dims, m, [-(-context_len // world_size)] * world_size, world_size)
