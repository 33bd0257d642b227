"""The host memory the server admits work against, so that it refuses work (503 or 429, with
the figures) before the host reaches the line where Ray's memory monitor kills a rank.

Ray kills a worker when the node's used memory passes ``RAY_memory_usage_threshold`` (0.95 of
the host by default). :func:`default_budget_bytes` gives apbv's work the memory below that line
less :data:`HEADROOM`, less what the host used when the server started (other tenants, Ray,
the driver), less what the ranks will hold once loaded (their weights and the engine's own
memory): what requests, streams, the vision cache and downloads may add. ``serve
--host-memory-budget-gb`` sets it instead (a cluster joined with ``--address`` has no default:
this host's memory does not describe its nodes).

:class:`MemoryBudget` counts, at admission (:meth:`apbv.serve.scheduler.admission.Admission.admit`):

- each replica's largest chat request queued or running: its ranks' host bytes by
  :func:`request_host_bytes` (the cost model's peak, with the decoding chunk at the file's
  native frame size; the weights and the engine's own memory are not the request's). A
  replica runs one request at a time, so its largest, not the sum, is what it may hold;
- the parts the server holds besides (:attr:`MemoryBudget.parts`): the vision cache at its
  size, the live streams' reservations, downloads where their directory is memory (a tmpfs).

A request that would take the total past the budget is refused: 503 when it could not fit
even with no other request or stream in flight, 429 when it could later. Either message
names what it needs, what is in flight (by part) and the budget.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from apbv.openai.policy import ClientError

if TYPE_CHECKING:
    from apbv.cost.work import ModelDims
    from apbv.openai.chat import ChatCall
    from apbv.serve.scheduler.admission import Admission

GIB = 1 << 30
RAY_KILL_FRACTION = 0.95
"""The share of the host's memory at which Ray's memory monitor kills a worker by default
(``RAY_memory_usage_threshold``)."""
HEADROOM = 0.10
"""The share of the host's memory kept free below Ray's line: the estimates' error, Ray's own
processes and the allocators' slack."""
KEPT = ("vision cache",)
"""Parts held for as long as the server runs: a request that does not fit beside them never
will (503)."""


def ray_kill_fraction(env: dict[str, str] | os._Environ[str] = os.environ) -> float:
    """Ray's ``RAY_memory_usage_threshold`` from ``env`` when it is a number in (0, 1], else
    :data:`RAY_KILL_FRACTION`."""
    try:
        value = float(env.get("RAY_memory_usage_threshold", RAY_KILL_FRACTION))
    except ValueError:
        return RAY_KILL_FRACTION
    return value if 0 < value <= 1 else RAY_KILL_FRACTION


def host_memory() -> tuple[int, int]:
    """(MemTotal, MemAvailable) of /proc/meminfo in bytes (elsewhere the physical memory for
    both)."""
    found: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    found[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return found.get("MemTotal", physical), found.get("MemAvailable", physical)


def default_budget_bytes(total: int, available: int, to_load: int,
                         kill_fraction: float = RAY_KILL_FRACTION) -> tuple[int, str]:
    """(bytes, the sentence that says how) apbv's work may add to a host of ``total`` bytes
    with ``available`` bytes free now, once the ranks have loaded ``to_load`` bytes: the
    memory below ``kill_fraction`` (Ray's line) less :data:`HEADROOM`, less what is used now
    and ``to_load``. ValueError when nothing is left (the host is already near Ray's line)."""
    line = int(total * (kill_fraction - HEADROOM))
    used = total - available
    budget = line - used - to_load
    why = (f"host memory budget {budget / GIB:.2f} GiB: {kill_fraction - HEADROOM:.0%} of "
           f"{total / GIB:.2f} GiB (Ray kills a rank at {kill_fraction:.0%}) less "
           f"{used / GIB:.2f} GiB used at start and {to_load / GIB:.2f} GiB the ranks load "
           f"(--host-memory-budget-gb sets it)")
    if budget <= 0:
        raise ValueError(f"no host memory is left for requests: {why.split(': ', 1)[1]}; free "
                         f"memory or set --host-memory-budget-gb")
    return budget, why


def on_tmpfs(path: str, mounts: str = "/proc/self/mounts") -> bool:
    """Whether ``path`` lies on a tmpfs or ramfs (its files are memory), by the longest mount
    point above it; False when the mounts cannot be read."""
    real, best, kind = os.path.realpath(path), "", ""
    try:
        with open(mounts) as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return False
    return kind in ("tmpfs", "ramfs")


def request_host_bytes(dims: ModelDims, measured: dict[str, int], *, mode: str,
                       world_size: int, dtype_bytes: int, max_tokens: int, on_gpu: bool,
                       anchor_len: int | None = None, passing_len: int | None = None) -> int:
    """Host bytes one request adds on its replica's ``world_size`` ranks, from what
    :func:`apbv.openai.chat.check_request` ``measured`` (frames, resized height and width, the
    prompt's context and query lengths, the native frame's ``source_pixels``): each rank's
    peak phase by :func:`apbv.cost.request_memory`, every rank at the largest share of the
    temporal patches (all of them where the mode does not split the vision work; one rank
    for a single-process mode), without the weights and the engine's own memory (loaded
    already); on GPU ranks only the parts held in host memory
    (:data:`apbv.cost.memory.HOST_PARTS`)."""
    from apbv.cost.memory import HOST_PARTS, request_memory
    from apbv.modes import get_mode

    spec = get_mode(mode)
    world_size = 1 if spec.single_process else world_size  # one process does all the work
    plan = spec.plan(measured["context_len"], measured["query_len"], world_size,
                     anchor_len=anchor_len, passing_len=passing_len)
    side = dims.patch_size
    grid = (measured["height"] // side, measured["width"] // side)
    patches = measured["frames"] // dims.temporal_patch_size
    if spec.vit_split:  # else every rank encodes the whole video
        patches = -(-patches // world_size)
    total = 0
    for rank in range(world_size):
        est = request_memory(dims, plan, patches=patches, grid_hw=grid,
                             dtype_bytes=dtype_bytes, reserve_tokens=max_tokens, rank=rank,
                             native_pixels=measured.get("source_pixels", 0))
        counted = [p for p in est.parts if p not in ("runtime", "weights")
                   and (not on_gpu or p in HOST_PARTS)]
        total += max(sum(est.parts[p] for p in parts if p in counted)
                     for parts in est.phases.values())
    return total


Sizer = Callable[["ChatCall", dict[str, int]], int]
"""(ChatCall, what check_request measured) -> the host bytes it adds (:func:`request_host_bytes`
with the served model)."""


@dataclass
class MemoryBudget:
    """The host memory apbv's work may hold (``budget_bytes``) and what holds it: the chat
    requests of every admission that registered (:meth:`register`) and :attr:`parts`."""

    budget_bytes: int
    sizer: Sizer
    flag: str = "--host-memory-budget-gb"
    parts: dict[str, Callable[[], int]] = field(default_factory=dict)
    """Host bytes held besides the chat requests, by name, as they are now."""
    admissions: list[Admission] = field(default_factory=list)

    def register(self, admission: Admission) -> None:
        self.admissions.append(admission)

    @staticmethod
    def largest(admission: Admission) -> int:
        """The host bytes of the admission's largest job, queued or running."""
        jobs = [job for _, job in admission.heap]
        if admission.running is not None:
            jobs.append(admission.running)
        return max((job.host_bytes for job in jobs), default=0)

    def held(self) -> dict[str, int]:
        """Host bytes held now, by part: "requests" (each replica's largest) and
        :attr:`parts`."""
        held = {"requests": sum(self.largest(a) for a in self.admissions)}
        held.update((name, int(part())) for name, part in self.parts.items())
        return held

    def admit(self, call: ChatCall, measured: dict[str, int], admission: Admission) -> int:
        """The host bytes of ``call`` on ``admission``'s replica, or ClientError (503: more
        than the budget leaves beside the parts that stay; 429: more than is free now) with
        the figures."""
        need = self.sizer(call, measured)
        held = self.held()
        in_flight = sum(held.values())
        added = max(0, need - self.largest(admission))  # the replica's largest may cover it
        if in_flight + added <= self.budget_bytes:
            return need
        kept = sum(held.get(name, 0) for name in KEPT)
        parts = ", ".join(f"{name} {_gib(b)}" for name, b in held.items() if b)
        figures = (f"it needs {_gib(need)} GiB of host memory on its ranks, {_gib(in_flight)} "
                   f"GiB are in flight ({parts or 'nothing'}), the budget is "
                   f"{_gib(self.budget_bytes)} GiB ({self.flag})")
        if need + kept > self.budget_bytes:
            raise ClientError(503, f"the request cannot be admitted: {figures}; sample fewer "
                                   f"frames or pixels (fps, nframes, max_pixels) or send a "
                                   f"video of smaller frames")
        raise ClientError(429, f"too much host memory is in flight to admit the request now: "
                               f"{figures}; try again when the work in flight is done")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.3f}"


def served_sizer(model_path: str, world_size: int, dtype_bytes: int, on_gpu: bool) -> Sizer:
    """:func:`request_host_bytes` for the served checkpoint, as a :data:`Sizer`."""
    from apbv import cost

    dims = cost.checkpoint_dims(model_path)

    def size(call: ChatCall, measured: dict[str, int]) -> int:
        request = call.request
        return request_host_bytes(dims, measured, mode=request.mode.name,
                                  world_size=world_size, dtype_bytes=dtype_bytes,
                                  max_tokens=request.max_new_tokens, on_gpu=on_gpu,
                                  anchor_len=request.anchor_len,
                                  passing_len=request.passing_len)

    return size
