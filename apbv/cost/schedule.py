"""The per-layer schedule of the cost model: each rank's steps in the order the runtime runs
them (:func:`layer_events`), the single-process layer (:func:`full_layer`), the vision tower
(:func:`vision_cost`), and :func:`simulate`, which runs every rank's steps together against the
collectives they share."""

from __future__ import annotations

from apbv.cost.hardware import Machine
from apbv.cost.work import (
    ModelDims,
    _flops,
    anchor_pairs,
    attention_flops,
    block_pairs,
    full_pairs,
    query_pairs,
    split_window,
)
from apbv.ownership import owned_local_index
from apbv.plan import Plan

Event = tuple[str, float]
"""One step of a rank's layer: ("compute", seconds), ("start", j) or ("wait", j), where j
numbers the layer's collectives in issue order (the same on every rank)."""


def simulate(events: list[list[Event]], durations: list[float]) -> list[float]:
    """Run every rank's steps together; returns when each rank finishes.

    Collective j ends ``durations[j]`` after the last rank has started it and the previous
    collective has ended (they share one communicator, which runs them in order). A wait
    blocks its rank until the collective has ended; compute adds to the rank's clock.
    """
    world = len(events)
    clock, pos = [0.0] * world, [0] * world
    started: list[list[float]] = [[] for _ in durations]
    ends: dict[int, float] = {}
    while True:
        moved = False
        for r in range(world):
            while pos[r] < len(events[r]):
                kind, value = events[r][pos[r]]
                if kind == "wait":
                    if int(value) not in ends:
                        break
                    clock[r] = max(clock[r], ends[int(value)])
                elif kind == "start":
                    started[int(value)].append(clock[r])
                else:
                    clock[r] += value
                pos[r] += 1
                moved = True
        for j, duration in enumerate(durations):
            if j not in ends and len(started[j]) == world and (j == 0 or j - 1 in ends):
                ends[j] = max(max(started[j]), ends.get(j - 1, 0.0)) + duration
                moved = True
        if all(pos[r] == len(events[r]) for r in range(world)):
            return clock
        if not moved:
            raise AssertionError(f"schedule cannot finish: ranks stopped at steps {pos}")


def layer_events(plan: Plan, rank: int, dims: ModelDims, m: Machine, overlap: bool,
                 ) -> tuple[list[Event], int]:
    """One decoder layer of ``rank`` in the order apbv.attention.spava runs it, and its pairs."""
    d, kv, hq, dt = dims.head_dim, dims.kv_heads, dims.heads, m.dtype
    tokens, a, q = plan.local_len(rank), plan.anchor_len, plan.query_len
    cached = len(owned_local_index(plan, rank))
    blocks = plan.rank_blocks(rank)
    # Before attention: norm, q/k/v, RoPE (about 10 passes over q and k), the KV-cache copy
    # of the owned tokens.
    pre = (m.matmuls(tokens, dims.text_linears()[:3])
           + m.mem(dt * tokens * (2 * dims.hidden + 10 * (hq + kv) * d)
                   + 4 * dt * cached * kv * d))
    events: list[Event] = [("compute", pre)]

    def start(j: int) -> list[Event]:
        started: list[Event] = [("start", j)]
        return started if overlap else [*started, ("wait", j)]

    for j, b in enumerate(blocks):  # select each block, start its all-gather
        n, count = plan.block_len(b), plan.selected_len(b)
        traffic = 2 * plan.passing_capacity * kv * d * dt  # the zeroed send buffer
        if count == n:
            traffic += 4 * n * kv * d * dt
        elif count:  # fp32 scores of every key, pooling and top-k, gathering the chosen rows
            traffic += n * kv * (d * (dt + 8) + 16) + 4 * count * kv * d * dt
        events += [("compute", m.mem(traffic))] + start(j)
    queries = query_pairs(plan, rank)
    events += [("compute", m.attention(queries, hq, d) + m.mem(20 * q * hq * (d + 1)))]
    events += start(len(blocks))
    events += [("compute", m.attention(anchor_pairs(plan), hq, d))]  # anchor rows
    pairs = queries + anchor_pairs(plan)
    for b in blocks:
        for slot in sorted({plan.block_slot(u)[1] for u in range(b)}):
            events.append(("wait", slot))
        n, passed = plan.block_len(b), sum(plan.selected_len(u) for u in range(b))
        pairs += block_pairs(plan, b)
        if n:  # two kernel calls (context, causal block), the concatenated context, a merge
            copies = 4 * (passed + a) * kv * d * dt + n * hq * d * (3 * dt + 16)
            events.append(("compute", m.attention(block_pairs(plan, b), hq, d) + m.mem(copies)))
    merge = m.mem(12 * plan.world_size * q * hq * (d + 1))
    events += [("wait", len(blocks)), ("compute", merge)]
    events += [("wait", j) for j in range(len(blocks))]
    # After attention: o_proj, residuals, norm, the MLP and its activation.
    post = (m.matmuls(tokens, dims.text_linears()[3:])
            + m.mem(dt * tokens * (8 * dims.hidden + 3 * dims.intermediate)))
    events.append(("compute", post))
    return events, pairs


def full_layer(plan: Plan, dims: ModelDims, m: Machine) -> float:
    """One decoder layer of the single-process baseline: one causal kernel call."""
    total, d, kv, hq = plan.total_len, dims.head_dim, dims.kv_heads, dims.heads
    elementwise = (10 * dims.hidden + 3 * dims.intermediate + 10 * (hq + kv) * d + 4 * kv * d)
    return (m.matmuls(total, dims.text_linears()) + m.mem(m.dtype * total * elementwise)
            + m.attention(full_pairs(plan), hq, d))


def vision_cost(dims: ModelDims, patches: int, grid: tuple[int, int], m: Machine,
                grouped: bool = True) -> tuple[float, float]:
    """(seconds, FLOPs) of the vision tower on ``patches`` temporal patches whose frames are a
    merged rows x cols grid: patch embedding, windowed and full blocks, merger.

    ``grouped`` (``vision.attention=grouped``, the default): a windowed block makes one
    attention call per window size (at most four: interior, right and bottom edges, corner)
    and a full block one call, whatever the number of windows and temporal patches;
    otherwise (``per_window``, the stock path) one call per window and per temporal patch."""
    if patches == 0:
        return 0.0, 0.0
    merge, (rows, cols) = dims.spatial_merge_size, grid
    per_patch = rows * cols * merge**2  # ViT patches per temporal patch
    n, merged = patches * per_patch, patches * rows * cols
    vh, heads = dims.vision_hidden, dims.vision_heads
    embed = [(dims.in_channels * dims.temporal_patch_size * dims.patch_size**2, vh)]
    merger = dims.projector_linears()
    block = dims.vision_linears()
    # Per block: norms and residuals 10 passes over the hidden state, RoPE on q and k 10
    # passes each (upcast, rotate_half, products), the MLP activation 3 over the intermediate,
    # at the share of the memory bandwidth such passes reach.
    elementwise = m.mem(m.dtype * n * (30 * vh + 3 * dims.vision_intermediate)) \
        / m.hw.vision_elementwise_efficiency
    mergers = 1 + dims.deepstack_levels  # the merger and DeepStack's (Qwen3-VL)
    device = (m.conv(n * _flops(embed)) + mergers * m.matmuls(merged, merger)
              + dims.vision_depth * (m.matmuls(n, block) + elementwise))
    flops = float(n * _flops(embed) + mergers * merged * _flops(merger)
                  + dims.vision_depth * n * _flops(block))
    row_sizes = split_window(rows, dims.window_tokens)
    col_sizes = split_window(cols, dims.window_tokens)
    window_pairs = (patches * merge**4 * sum(s * s for s in row_sizes)
                    * sum(s * s for s in col_sizes))
    frame_pairs = patches * per_patch**2
    windowed = dims.vision_depth - dims.fullatt_blocks
    head_dim = vh // heads
    device += (windowed * m.attention(window_pairs, heads, head_dim)
               + dims.fullatt_blocks * m.attention(frame_pairs, heads, head_dim))
    flops += attention_flops(windowed * window_pairs + dims.fullatt_blocks * frame_pairs,
                             heads, head_dim)
    calls = vision_calls(dims, patches, grid, grouped)
    host = dims.vision_depth * m.hw.vision_layer_overhead_s + calls * m.hw.call_overhead_s
    return m.host(device, host), flops


def vision_calls(dims: ModelDims, patches: int, grid: tuple[int, int], grouped: bool) -> int:
    """Attention calls of one vision-tower call on ``patches`` temporal patches of a merged
    rows x cols ``grid``: grouped, one per window size per windowed block and one per full
    block; per window (the stock path), one per window and per temporal patch in every
    block."""
    row_sizes = split_window(grid[0], dims.window_tokens)
    col_sizes = split_window(grid[1], dims.window_tokens)
    windowed = dims.vision_depth - dims.fullatt_blocks
    if grouped:
        return windowed * len(set(row_sizes)) * len(set(col_sizes)) + dims.fullatt_blocks
    return patches * (windowed * len(row_sizes) * len(col_sizes) + dims.fullatt_blocks)

