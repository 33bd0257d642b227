"""Every collective apbv uses, and nothing else.

Functions take the process group explicitly (None means the default group when one is
initialised). Without an initialised process group the world is one rank and every collective
completes at once. Waits are bounded, so a rank whose peer died raises instead of hanging: on
gloo each wait passes the timeout given at :func:`apbv.distributed.init_distributed`; on NCCL a
wait with a timeout would block the CPU thread until the collective completes (the host could
no longer queue work ahead of the GPU), so NCCL waits take none and only order the current CUDA
stream after the collective: the process group's timeout and NCCL's watchdog bound them.

:func:`startup_barrier` is the one wait outside the process group: through the rendezvous
store, bounded by the start-up timeout, so neither a late peer's model load nor NCCL's watchdog
(which polices only the group's collectives) ends the ranks that were ready first.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Older torch only has the name that 2.14 deprecates.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_timeout = timedelta(minutes=10)


def set_timeout(seconds: float) -> None:
    """The bound on every collective wait in this process (set by init_distributed)."""
    global _timeout
    _timeout = timedelta(seconds=seconds)


def timeout_s() -> float:
    """The bound on collective waits in this process, in seconds (:func:`set_timeout`)."""
    return _timeout.total_seconds()


def abort(group: dist.ProcessGroup | None = None) -> None:
    """End ``group`` now, on this rank, after a peer was found stuck: on NCCL its
    communicators are aborted (every pending collective fails instead of waiting); other
    backends have no abort and their waits are bounded already. Nothing without a group."""
    if is_distributed() and dist.get_backend(group) == "nccl":
        dist.distributed_c10d._abort_process_group(group)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_size(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world size) within ``group``; (0, 1) without a process group."""
    if not is_distributed():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _scalar_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where small control tensors live: NCCL only moves CUDA tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wait(work: dist.Work | None, group: dist.ProcessGroup | None) -> None:
    """Wait for an async collective: bounded on gloo (a CPU wait anyway); on NCCL without a
    CPU-side timeout, so the host keeps running ahead of the GPU (the stream waits instead).
    ``work`` is what a collective called with ``async_op=True`` returns (torch types it
    ``Work | None``; None only without ``async_op``)."""
    assert work is not None, "an async collective returns its Work"
    if dist.get_backend(group) == "nccl":
        work.wait()
    else:
        work.wait(timeout=_timeout)


@dataclass
class PendingGather:
    """An all-gather in flight; :meth:`wait` returns the (H, *shape) result."""

    result: torch.Tensor
    work: dist.Work | None
    group: dist.ProcessGroup | None = None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            _wait(self.work, self.group)
            self.work = None
        return self.result


def start_all_gather(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> PendingGather:
    """Start gathering ``x`` (same shape on every rank) from all ranks; result[i] is rank i's.
    Without a process group nothing moves; a one-rank group still runs its collective (a
    one-rank NCCL group is how one GPU checks collectives inside a captured decode step)."""
    if not is_distributed():
        return PendingGather(x.unsqueeze(0), None)
    _, world = rank_and_size(group)
    x = x.contiguous().view(1, *x.shape)  # gathered along dim 0 (gloo takes only this form)
    result = x.new_empty((world, *x.shape[1:]))
    work = _all_gather_single(result, x, group=group, async_op=True)
    return PendingGather(result, work, group)


def all_gather(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Blocking form of :func:`start_all_gather`."""
    return start_all_gather(x, group).wait()


def all_to_all_rows(
    x: torch.Tensor,
    send_counts: list[int],
    recv_counts: list[int],
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Send rows of ``x`` (n, ...) to every rank: the first send_counts[0] rows to rank 0, the
    next send_counts[1] to rank 1, ...; returns the received rows, concatenated in source-rank
    order (sum(recv_counts), ...)."""
    rank, world = rank_and_size(group)
    assert len(send_counts) == len(recv_counts) == world, (send_counts, recv_counts, world)
    assert sum(send_counts) == x.shape[0], (send_counts, x.shape)
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    if world == 1:
        out.copy_(x)
        return out
    work = dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group,
                                  async_op=True)
    _wait(work, group)
    return out


def broadcast(x: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Rank ``src``'s (of ``group``) tensor on every rank; the others pass a tensor of the same
    shape and dtype (its values are overwritten; returned for chaining)."""
    if not is_distributed():
        return x
    x = x.contiguous()
    work = dist.broadcast(x, group_src=src, group=group, async_op=True)
    _wait(work, group)
    return x


def broadcast_object(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """A picklable object from rank ``src`` (of ``group``) on every rank (small control data
    only)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group_src=src, group=group, device=_scalar_device(group))
    return box[0]


def any_rank(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank when ``flag`` is True on at least one (e.g. "my input was bad")."""
    if not is_distributed():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=_scalar_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if is_distributed():
        dist.barrier(group=group)


def all_reduce_max(value: float, group: dist.ProcessGroup | None = None) -> float:
    """The maximum of a scalar over ranks (for timings: the slowest rank decides)."""
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_scalar_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def all_gather_ints(values: list[int], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """(H, len(values)) int64: every rank's ``values`` (the same length on every rank)."""
    t = torch.tensor(values, dtype=torch.int64)
    if not is_distributed():
        return t.unsqueeze(0)
    return all_gather(t.to(_scalar_device(group)), group).cpu()


def all_gather_rows(rows: torch.Tensor, counts: list[int],
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's ``rows`` (counts[r], ...) concatenated in rank order (sum(counts), ...) on
    the CPU; ``counts`` (the same on every rank) says how many rows each rank holds. The rows
    travel padded to the largest count, in one all-gather on the group's device."""
    rank, world = rank_and_size(group)
    assert len(counts) == world and rows.shape[0] == counts[rank], (counts, rows.shape, rank)
    if world == 1:
        return rows.cpu()
    padded = rows.new_zeros((max(counts), *rows.shape[1:]), device=_scalar_device(group))
    padded[:rows.shape[0]] = rows
    gathered = all_gather(padded, group).cpu()
    return torch.cat([gathered[r, :counts[r]] for r in range(world)])


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (small control data only)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def first_failure(
    error: BaseException | None, group: dist.ProcessGroup | None = None
) -> tuple[int, str, str] | None:
    """On every rank: (rank, exception type name, message) of the lowest rank whose ``error``
    is set, or None when no rank failed. Two small collectives, whatever the outcome."""
    if not is_distributed():
        return None if error is None else (0, type(error).__name__, str(error))
    rank, world = rank_and_size(group)
    t = torch.tensor([world if error is None else rank], dtype=torch.int64,
                     device=_scalar_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    src = int(t.item())
    if src == world:
        return None
    mine = (type(error).__name__, str(error)) if rank == src else None
    kind, message = broadcast_object(mine, src=src, group=group)
    return src, kind, message


class StartupTimeout(TimeoutError):
    """Some ranks did not reach a start-up point within the start-up timeout (``late``: their
    rank numbers)."""

    def __init__(self, message: str, late: list[int]):
        super().__init__(message)
        self.late = late


class StartupFailed(RuntimeError):
    """Another rank failed before a start-up point (its error is in the message)."""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _startup_key(name: str, rank: int) -> str:
    return f"apbv/startup/{name}/{rank}"


def startup_arrived(store: dist.Store, name: str, ranks: list[int]) -> list[int]:
    """The (global) ``ranks`` that have reached the start-up point ``name`` of
    :func:`startup_barrier` so far (one store check per rank; no waiting)."""
    return [r for r in ranks if store.check([_startup_key(name, r)])]


def startup_barrier(store: dist.Store, name: str, rank: int, world_size: int,
                    timeout_s: float, *, report_every_s: float = 30.0, poll_s: float = 0.1,
                    log: Callable[[str], None] = _stderr, failed: str | None = None,
                    ranks: list[int] | None = None) -> None:
    """Wait until every rank of ``world_size`` has reached the start-up point ``name`` (a key
    per rank in ``store``, the job's rendezvous store; ``name`` unique within the job).

    Not a process-group collective: NCCL's watchdog does not see it, and it is bounded by
    ``timeout_s`` (``parallel.startup_timeout_s``), not ``parallel.timeout_s``. While it
    waits, every ``report_every_s`` seconds ``log`` gets a line naming the ranks not there yet;
    past ``timeout_s`` it raises :class:`StartupTimeout` naming them and the setting.
    Two store checks per ``poll_s`` while waiting (every rank's key at once; a failure).

    ``failed`` (this rank's error, which the caller then raises): posted instead of arriving,
    so the waiting ranks raise :class:`StartupFailed` with it at once instead of waiting out
    the timeout. ``ranks``: the (global) ranks that meet there (default all of
    ``world_size``; a subgroup's, ``name`` unique to it).
    """
    members = list(range(world_size)) if ranks is None else ranks
    if len(members) == 1:
        return
    keys = {r: _startup_key(name, r) for r in members}
    failure = f"apbv/startup/{name}/failed"
    if failed is not None:
        store.set(failure, f"rank {rank}: {failed}"[:1000])
        return
    store.set(keys[rank], "1")
    start = time.monotonic()
    next_report = start + report_every_s
    while not store.check(list(keys.values())):
        if store.check([failure]):
            raise StartupFailed(f"rank {rank}: stopped waiting at the start-up point {name!r}: "
                                f"{store.get(failure).decode()}")
        now = time.monotonic()
        if now - start >= timeout_s or now >= next_report:
            late = [r for r in members if not store.check([keys[r]])]
            if not late:  # they all arrived since the first check
                return
            named = ", ".join(map(str, late))
            if now - start >= timeout_s:
                raise StartupTimeout(
                    f"rank {rank}: rank(s) {named} did not reach the start-up point {name!r} "
                    f"within parallel.startup_timeout_s = {timeout_s:g} s (raise it with "
                    f"--set parallel.startup_timeout_s=SECONDS if loading is that slow)", late)
            log(f"rank {rank}: waiting for rank(s) {named} at the start-up point {name!r} "
                f"({len(members) - len(late)}/{len(members)} there, {now - start:.0f} s so far; "
                f"parallel.startup_timeout_s = {timeout_s:g} s)")
            next_report = now + report_every_s
        time.sleep(poll_s)


def new_groups(ranks: list[list[int]]) -> dist.ProcessGroup | None:
    """Make one process group per list of (global) ranks, on every rank alike and in the same
    order (torch requires it); returns the group holding this rank (None without a process
    group, or when this rank is in none)."""
    if not is_distributed():
        return None
    mine = None
    me = dist.get_rank()
    for members in ranks:
        group = dist.new_group(members, timeout=_timeout)
        if me in members:  # a member gets its group (others: GroupMember.NON_GROUP_MEMBER)
            assert isinstance(group, dist.ProcessGroup), group
            mine = group
    return mine
