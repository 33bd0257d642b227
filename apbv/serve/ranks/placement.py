"""Where a rank group's Ray actors go and which device each one uses, and which replica a new
live stream goes to (pure functions, no Ray).

A group of H ranks asks for ``gpus_per_rank`` GPUs (and one CPU) per rank. :func:`group_layout`
packs the group on one node when a node can hold it (one bundle, STRICT_PACK); otherwise it
takes whole nodes in rank order, as vLLM places its workers: bundle b holds ranks
``b*k .. b*k+k-1`` (k ranks per node, the last bundle the rest), one bundle per node
(STRICT_SPREAD). Ranks in one bundle share its node, and Ray gives each its own GPU ids
within the bundle.

Ray hands a GPU actor its GPU ids (``ray.get_gpu_ids()``) and sets its CUDA_VISIBLE_DEVICES to
them, so the actor sees only its own GPU(s) and :func:`rank_device` is ``cuda:0`` of that set,
whatever the rank's index on its node. With fractional GPUs (``gpus_per_rank`` 0.5: two ranks
per GPU, for checks on one GPU) two actors get the same GPU id: NCCL refuses two ranks on one
GPU, so such a group runs gloo on its CUDA tensors (:func:`group_backend`).

A new live stream goes to the ready replica whose streams take the least of its time
(:func:`place_stream`): each stream's appends and its watches' evaluations, in seconds on the
ranks per second of footage, as measured or else predicted (:class:`ReplicaLoad`); among
those whose stream memory budget holds it. Ties (e.g. nothing measured yet) to the fewest
bytes reserved, the fewest jobs queued, the lowest index.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLoad:
    """What placing a stream weighs of one ready replica."""

    index: int
    busy: float
    """Seconds its open streams' appends and watch evaluations take on its ranks per second
    of footage, summed over them (as last measured; predicted by the cost model, or 0 without
    one, for what was not yet measured: :mod:`apbv.serve.streams.pricing`)."""
    held: int
    """KV bytes per rank its open streams reserve."""
    queued: int
    """Jobs queued or running there."""


def place_stream(replicas: Sequence[ReplicaLoad], need: int, budget: int) -> int | None:
    """The index of the replica a new stream that reserves ``need`` bytes per rank goes to:
    of ``replicas`` those whose ``budget`` (bytes per rank) holds it, the least busy, then the
    fewest bytes held, the fewest jobs queued, the lowest index; None when none holds it."""
    fits = [r for r in replicas if r.held + need <= budget]
    if not fits:
        return None
    return min(fits, key=lambda r: (r.busy, r.held, r.queued, r.index)).index


@dataclass(frozen=True)
class GroupLayout:
    """Placement-group bundles, their strategy, and the bundle each rank's actor takes."""

    bundles: list[dict[str, float]]
    strategy: str
    """"STRICT_PACK" (one node) or "STRICT_SPREAD" (whole nodes, one bundle per node)."""
    rank_bundle: list[int]
    """rank -> bundle index (bundles hold ranks in rank order)."""


def check_gpus_per_rank(gpus_per_rank: float) -> None:
    """A rank runs on at most one GPU: 0 (CPU ranks), a fraction of one, or one whole GPU."""
    if not 0 <= gpus_per_rank <= 1 or (0 < gpus_per_rank < 1 and
                                       not (1 / gpus_per_rank).is_integer()):
        raise ValueError(f"--gpus-per-rank must be 0 (CPU ranks), 1, or 1/k for k ranks per "
                         f"GPU (0.5, 0.25, ...), got {gpus_per_rank}")


def group_backend(backend: str, gpus_per_rank: float) -> str | None:
    """The process-group backend of a group (None: nccl on CUDA, else gloo).

    ``backend`` is ``parallel.backend`` (auto, nccl or gloo). Fractional GPUs put several
    ranks on one GPU, which NCCL refuses: auto then means gloo, and nccl is refused.
    """
    if 0 < gpus_per_rank < 1:
        if backend == "nccl":
            raise ValueError(f"--gpus-per-rank {gpus_per_rank} puts {round(1 / gpus_per_rank)} "
                             "ranks on one GPU, which NCCL refuses; use parallel.backend=gloo "
                             "or auto (gloo on the ranks' CUDA tensors), or --gpus-per-rank 1")
        return "gloo"
    return None if backend == "auto" else backend


def group_layout(world_size: int, gpus_per_rank: float,
                 nodes: Sequence[Mapping[str, float]]) -> GroupLayout:
    """Bundles for ``world_size`` ranks of ``gpus_per_rank`` GPUs (0: CPU ranks) and 1 CPU each,
    given the alive nodes' total resources (``ray.nodes()[i]["Resources"]``).

    Raises ValueError when the nodes together cannot hold the group.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    check_gpus_per_rank(gpus_per_rank)
    per_rank = {"GPU": gpus_per_rank, "CPU": 1.0} if gpus_per_rank else {"CPU": 1.0}

    def fits(node: Mapping[str, float]) -> int:  # ranks this node can hold
        return min(int(node.get(k, 0) / v + 1e-9) for k, v in per_rank.items())

    def bundle(ranks: int) -> dict[str, float]:
        return {k: v * ranks for k, v in per_rank.items()}

    per_node = max((fits(n) for n in nodes), default=0)
    if per_node >= world_size:
        return GroupLayout([bundle(world_size)], "STRICT_PACK", [0] * world_size)
    count = math.ceil(world_size / per_node) if per_node else 0
    sizes = [per_node] * (count - 1) + [world_size - per_node * (count - 1)] if count else []
    held = sorted((fits(n) for n in nodes), reverse=True)
    if not count or len(held) < count or any(h < k for h, k in zip(held, sizes)):
        have = ", ".join(map(str, held)) or "none"
        raise ValueError(
            f"the Ray cluster cannot place {world_size} ranks of {gpus_per_rank} GPU(s) and "
            f"1 CPU each on whole nodes (ranks its alive nodes can hold: {have}); lower "
            "--world-size or --gpus-per-rank, or add nodes")
    return GroupLayout([bundle(k) for k in sizes], "STRICT_SPREAD",
                       [r // per_node for r in range(world_size)])


def rank_device(gpu_ids: Sequence[int | str], visible: str | None) -> str:
    """The device a rank's actor uses: ``"cpu"`` without GPU ids; else the first of its GPU
    ids (``ray.get_gpu_ids()``) as numbered in this process, whose CUDA_VISIBLE_DEVICES is
    ``visible`` (Ray sets it to the actor's ids, so this is ``cuda:0``; unset: every GPU is
    visible and the id is the index).
    """
    if not gpu_ids:
        return "cpu"
    mine = str(gpu_ids[0]).strip()
    if visible is None:
        if not mine.isdigit():
            raise ValueError(f"GPU id {mine!r} is not an index and CUDA_VISIBLE_DEVICES is "
                             "unset: cannot tell which device it is")
        return f"cuda:{int(mine)}"
    order = [v.strip() for v in visible.split(",") if v.strip()]
    if mine not in order:
        raise ValueError(f"GPU id {mine} given by Ray is not in this process's "
                         f"CUDA_VISIBLE_DEVICES={visible!r}")
    return f"cuda:{order.index(mine)}"
