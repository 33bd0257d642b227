"""Process-group setup and teardown, and local multi-rank launching on CPU (gloo).

``init_distributed`` is the only caller of ``init_process_group``. Under torchrun it reads RANK,
WORLD_SIZE and LOCAL_RANK; without them the run is a single rank with no process group and every
collective in :mod:`apbv.comm` completes at once.

Start-up skew (ranks loading a model from shared storage finish minutes apart) is absorbed by
:func:`ranks_ready`, a wait through the rendezvous store bounded by the start-up timeout, not
by the process group's collective timeout (which NCCL's watchdog enforces).

``spawn_local`` starts W gloo ranks on this machine (torch.multiprocessing-style spawn, a free
port, bounded waits) and returns each rank's result, or raises :class:`RankFailure` carrying
every rank's error, so one failing rank never leaves the caller hanging.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from apbv import comm


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    """"nccl", "gloo", or None for a single rank without a process group."""
    group: dist.ProcessGroup | None = None
    """The ranks' process group (None: the default group, or no group on a single rank)."""


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


_startup: tuple[dist.Store, int, int, float] | None = None
"""(rendezvous store, rank, world size, start-up timeout in s) of this process's group."""
_points: dict[tuple[int, ...], int] = {}
"""How many :func:`ranks_ready` points this process has passed, per set of ranks waited for."""

LATE_RANK_ENV = "APBV_TEST_LATE_RANK"
"""Test-only: ``R:S`` makes rank R arrive S seconds late at each :func:`ranks_ready` point (a
slow model load, simulated); read nowhere else."""


def init_distributed(*, backend: str | None = None, timeout_s: float = 600.0,
                     device: torch.device | str | None = None,
                     store: dist.Store | None = None,
                     startup_timeout_s: float = 1800.0) -> DistInfo:
    """Join the job's process group (once per process) and pick this rank's device.

    Args:
        backend: "nccl" or "gloo"; default nccl when CUDA is available, gloo otherwise.
        timeout_s: bound on every collective, in seconds: the process group's timeout (on NCCL
            the watchdog then ends the process, see :func:`_nccl_environment`) and, on gloo,
            each wait's own bound.
        device: this rank's device, from a caller that knows it (a Ray actor: the GPU Ray gave
            it; a check putting gloo ranks on one GPU: ``cuda:0``). Default: ``cuda:LOCAL_RANK``
            on NCCL (torchrun's one process per GPU), the CPU on gloo.
        store: the rendezvous store (default: env://, rank 0 hosting a TCPStore at MASTER_ADDR
            and MASTER_PORT, which listens on every interface, or the one torchrun hosts).
        startup_timeout_s: bound on the start-up: the rendezvous, every rank's arrival before
            the group is made, and each :func:`ranks_ready` wait (``parallel.startup_timeout_s``).
    """
    if backend not in (None, "nccl", "gloo"):
        raise ValueError(f"unknown backend {backend!r}; allowed: nccl, gloo")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if startup_timeout_s <= 0:
        raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    elif backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("parallel.backend=nccl needs CUDA, which is not available; "
                         "use gloo or auto")
    if device is not None:
        device = torch.device(device)
        if backend == "nccl" and device.type != "cuda":
            raise ValueError(f"the nccl backend needs a CUDA device, got {device}; use gloo")
    elif backend == "nccl":
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    comm.set_timeout(timeout_s)
    if world_size == 1:
        return DistInfo(0, 1, 0, device, None)
    if not dist.is_initialized():
        global _startup
        if backend == "nccl":
            _nccl_environment()
        if store is None:  # connecting waits for a late peer up to the start-up timeout
            store, rank, world_size = next(dist.rendezvous(
                "env://", rank, world_size, timeout=timedelta(seconds=startup_timeout_s)))
        _startup = (store, rank, world_size, startup_timeout_s)
        _points.clear()
        # Every rank is here before the group is made (NCCL's set-up is itself a collective).
        comm.startup_barrier(store, "joined", rank, world_size, startup_timeout_s)
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
            store=store,
        )
    return DistInfo(rank, world_size, local_rank, device, backend)


def _nccl_environment() -> None:
    """How an NCCL hang ends (the user's own settings win): NCCL collectives are waited without
    a CPU-side bound (:mod:`apbv.comm`), so the watchdog bounds them: a collective past the
    group's timeout is reported on stderr by the watchdog ("Watchdog caught collective
    operation timeout: WorkNCCL(SeqNum=..., OpType=...) ran for ... milliseconds before timing
    out"), the communicators are aborted and the process ends (``TORCH_NCCL_ASYNC_ERROR_HANDLING
    =3``); with ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` the flight recorder's trace of the last
    collectives is written first (``TORCH_NCCL_TRACE_BUFFER_SIZE`` entries, to
    ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``)."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")


def _point(point: str, group: dist.ProcessGroup | None, count: int) -> tuple[list[int], str]:
    """The (global) ranks of ``group`` (None: all) and the store name of their ``count``-th
    start-up point ``point`` (a subgroup's names carry its ranks, so they are its own)."""
    assert _startup is not None
    world_size = _startup[2]
    members = (list(range(world_size)) if group is None
               else sorted(dist.get_process_group_ranks(group)))
    where = "" if len(members) == world_size else "ranks " + ",".join(map(str, members)) + " "
    return members, f"{where}{count}-{point}"


def ranks_ready(point: str, failed: BaseException | None = None,
                group: dist.ProcessGroup | None = None) -> None:
    """Wait, on every rank of ``group`` (None: this process's whole group), until each has
    reached ``point`` (e.g. after loading the model: the first request's collectives then do
    not absorb the load skew), bounded by the start-up timeout; the waiting ranks name the late
    ones every 30 s. Call it on every rank of ``group`` alike (a subgroup's ranks wait only for
    each other: sequence-parallel groups of one job load their engines independently); without
    a process group it returns at once. A rank that failed on the way passes its error as
    ``failed`` (and raises it afterwards): the others then raise
    :class:`~apbv.comm.StartupFailed` naming it at once."""
    if _startup is None:
        return
    store, rank, world_size, timeout_s = _startup
    members, _ = _point(point, group, 0)
    if len(members) == 1:
        return
    late = os.environ.get(LATE_RANK_ENV)
    if late and failed is None:
        late_rank, _, seconds = late.partition(":")
        if int(late_rank) == rank:
            time.sleep(float(seconds))
    key = tuple(members)
    _points[key] = _points.get(key, 0) + 1
    _, name = _point(point, group, _points[key])
    comm.startup_barrier(store, name, rank, world_size, timeout_s,
                         failed=None if failed is None else f"{type(failed).__name__}: {failed}",
                         ranks=members)


def ranks_arrived(point: str, group: dist.ProcessGroup | None = None) -> list[int] | None:
    """The ranks of ``group`` (None: all; numbered within it) that have reached its next
    :func:`ranks_ready` ``point`` so far (no waiting; the group's first rank counts them while
    it loads the model); None without a process group."""
    if _startup is None:
        return None
    members, _ = _point(point, group, 0)
    _, name = _point(point, group, _points.get(tuple(members), 0) + 1)
    return [members.index(r) for r in comm.startup_arrived(_startup[0], name, members)]


def destroy_distributed() -> None:
    global _startup
    _startup = None
    _points.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class RankFailure(RuntimeError):
    """One or more ranks of a :func:`spawn_local` run failed.

    ``errors`` maps rank -> (exception type name, message); ``tracebacks`` rank -> text.
    """

    def __init__(self, errors: dict[int, tuple[str, str]], tracebacks: dict[int, str]):
        self.errors = errors
        self.tracebacks = tracebacks
        first = next(iter(errors))  # the first to report
        summary = "\n".join(f"  rank {r}: {t}: {m}" for r, (t, m) in sorted(errors.items()))
        super().__init__(
            f"{len(errors)} rank(s) failed:\n{summary}\n"
            f"first failure (rank {first}):\n{tracebacks[first]}"
        )


def free_port() -> int:
    """A TCP port free on this host now (for a rendezvous of local processes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    threads: int,
    collective_timeout_s: float,
    device: str | None,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(threads)
    try:
        info = init_distributed(backend="gloo", timeout_s=collective_timeout_s, device=device)
        report = ("ok", rank, fn(info, *args), "")
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        report = ("error", rank, (type(exc).__name__, str(exc)), traceback.format_exc())
    finally:
        destroy_distributed()
    results.put(pickle.dumps(report))


def spawn_local(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 600.0,
    collective_timeout_s: float = 60.0,
    threads_per_rank: int = 1,
    device: str | None = None,
) -> list[Any]:
    """Run ``fn(info: DistInfo, *args)`` on ``world_size`` local gloo ranks.

    ``device``: every rank's device (default the CPU; ``"cuda:0"`` puts all the ranks on one
    GPU, gloo moving their CUDA tensors).

    ``fn`` must be importable by name (a module-level function) and its result picklable.
    Returns the per-rank results in rank order. If any rank raises, waits up to
    ``collective_timeout_s`` more for the others to report (their collectives fail or time
    out), kills what is left, and raises :class:`RankFailure` with every rank's error.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world_size, port, fn, tuple(args), results, threads_per_rank,
                  collective_timeout_s, device),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: dict[int, tuple[str, str]] = {}
    tracebacks: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    died_at: dict[int, float] = {}
    try:
        while len(outputs) + len(errors) < world_size:
            now = time.monotonic()
            if now > deadline:
                break
            try:
                status, rank, value, tb = pickle.loads(results.get(timeout=0.2))
            except queue_module.Empty:
                for r, p in enumerate(procs):
                    if r in outputs or r in errors or p.exitcode is None:
                        continue
                    # Exited without a report: give the queue a moment, then call it dead.
                    if now - died_at.setdefault(r, now) > 2.0:
                        errors[r] = ("ProcessDied", f"exit code {p.exitcode}, no report")
                        tracebacks[r] = errors[r][1]
                        deadline = min(deadline, now + collective_timeout_s + 5.0)
                continue
            if status == "ok":
                outputs[rank] = value
            else:
                errors[rank] = value
                tracebacks[rank] = tb
                deadline = min(deadline, time.monotonic() + collective_timeout_s + 5.0)
    finally:
        for p in procs:
            p.join(timeout=5.0 if not errors else 1.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
    for r in range(world_size):
        if r not in outputs and r not in errors:
            errors[r] = ("Timeout", f"no report within the time limit ({timeout_s:.0f} s)")
            tracebacks[r] = errors[r][1]
    if errors:
        raise RankFailure(errors, tracebacks)
    return [outputs[r] for r in range(world_size)]


def group_ranks(world_size: int, groups: int) -> list[list[int]]:
    """The global ranks of each of ``groups`` rank groups: consecutive blocks of
    world_size/groups ranks (group g holds ranks g*H .. g*H+H-1). Raises ValueError unless
    ``groups`` divides the world."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be an integer >= 1, got {groups!r}")
    if world_size % groups:
        raise ValueError(f"groups={groups} does not divide the world of {world_size} rank(s); "
                         f"pick a divisor of {world_size}")
    size = world_size // groups
    return [list(range(g * size, (g + 1) * size)) for g in range(groups)]


def rank_groups(info: DistInfo, groups: int) -> tuple[int, DistInfo]:
    """Split the world of ``info`` into ``groups`` sequence-parallel groups
    (:func:`group_ranks`); call on every rank alike. Returns this rank's group index and its
    :class:`DistInfo` within the group (rank and world size of the group, ``group`` its
    process group; rank 0 of the group is its query rank). One group: ``info`` itself."""
    blocks = group_ranks(info.world_size, groups)
    if groups == 1:
        return 0, info
    mine = comm.new_groups(blocks)
    index = info.rank // len(blocks[0])
    return index, DistInfo(info.rank - blocks[index][0], len(blocks[0]), info.local_rank,
                           info.device, info.backend, mine)
