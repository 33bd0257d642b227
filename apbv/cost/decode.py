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
"""

from __future__ import annotations

from apbv.cost.hardware import Hardware, Machine
from apbv.cost.work import ModelDims


def decode_step_s(dims: ModelDims, m: Machine, held: list[int], world_size: int) -> float:
    """Seconds of one decode step (one new token) with ``held[r]`` tokens of KV on rank r
    (every layer alike); ``world_size`` is the number of ranks meeting in the collectives
    (1 for one process)."""
    d, dt = dims.head_dim, m.dtype
    weights = m.matmuls(1, dims.text_linears())
    kv = max(max(m.mem(n * 2 * dims.kv_heads * d * dt), m.attention(n, dims.heads, d))
             for n in held)
    partial = dims.heads * (d + 1) * 4  # one rank's fp32 (out, lse) row per head
    merge = m.mem(2 * world_size * partial)
    gather = m.collective((world_size - 1) * partial, world_size)
    layer = m.host(weights + kv + merge + gather, m.hw.layer_overhead_s)
    head = m.matmuls(1, [(dims.hidden, dims.vocab)]) + m.mem(4 * dims.vocab)
    return dims.layers * layer + head


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


def decode_token_s(dims: ModelDims, *, context_len: int, world_size: int, hw: Hardware,
                   dtype_bytes: int | None = None) -> float:
    """Seconds of one decode step (:func:`decode_step_s`) after a prompt of ``context_len``
    tokens held evenly by ``world_size`` ranks, on the preset ``hw``: the serve admission's
    prior for its learned seconds per token, before any request has measured one."""
    m = Machine(hw, hw.dtype_bytes if dtype_bytes is None else dtype_bytes)
    return decode_step_s(dims, m, [-(-context_len // world_size)] * world_size, world_size)
