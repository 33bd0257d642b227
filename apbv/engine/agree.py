"""The ranks agree, before any model collective: on their input, and on failure.

- :func:`check_same`: every rank was handed an equal input (a request, a stream's frames),
  compared field by field as :func:`field_hashes` of a fingerprint; a mismatch is a ValueError
  on every rank naming the fields.
- :func:`agreement`: a block whose error on one rank is raised on every rank (naming that
  rank) when the block ends, so no rank goes on into a collective the failed one never reaches.
  :func:`raise_if_any_failed` is the collective it ends with, :func:`cancelled_here` the query
  rank's cancel taken at such a point.

Every function here is a collective over ``group``: call it on every rank alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.distributed as dist

from apbv import comm
from apbv.distributed import DistInfo
from apbv.engine.request import RequestCancelled
from apbv.plan import QUERY_RANK


class RequestFailed(RuntimeError):
    """Another rank's non-ValueError failure, raised on the ranks where nothing went wrong."""


def field_hashes(fingerprint: dict[str, str]) -> list[int]:
    """One signed 63-bit hash per field (in the fingerprint's order), for a cheap comparison."""
    return [int.from_bytes(hashlib.sha256(f"{k}={v}".encode()).digest()[:8], "big") >> 1
            for k, v in fingerprint.items()]


def check_same(what: str, fingerprint: dict[str, str],
               group: dist.ProcessGroup | None) -> None:
    """ValueError on every rank ("the ranks were given different ``what``"), naming each
    differing field, unless every rank holds an equal ``fingerprint`` (one small all-gather;
    the values only travel on a mismatch)."""
    gathered = comm.all_gather_ints(field_hashes(fingerprint), group)
    differ = [name for i, name in enumerate(fingerprint)
              if not bool((gathered[:, i] == gathered[0, i]).all())]
    if not differ:
        return
    values = comm.all_gather_object({k: fingerprint[k] for k in differ}, group)
    details = "; ".join(
        f"{k}: " + ", ".join(f"rank {r} {v[k][:80]}" for r, v in enumerate(values))
        for k in differ)
    raise ValueError(f"the ranks were given different {what} ({', '.join(differ)} "
                     f"differ): {details}")


def raise_if_any_failed(error: Exception | None, group: dist.ProcessGroup | None) -> None:
    """Agree on failure (a collective): re-raise this rank's ``error``, or on the other ranks
    an error naming the rank that failed and its message (ValueError when it was one; a
    :class:`RequestCancelled` as it is)."""
    failure = comm.first_failure(error, group)
    if failure is None:
        return
    if error is not None:
        raise error
    rank, kind, message = failure
    if kind == RequestCancelled.__name__:
        raise RequestCancelled(message)
    text = f"the request failed on rank {rank}: {kind}: {message}"
    raise ValueError(text) if kind == "ValueError" else RequestFailed(text)


@contextmanager
def agreement(group: dist.ProcessGroup | None) -> Iterator[None]:
    """``with agreement(group): ...``: an Exception raised in the block on any rank is raised
    on every rank once the block ends there (:func:`raise_if_any_failed`; the block is left at
    the error, the agreement is reached on every rank, failed or not)."""
    error: Exception | None = None
    try:
        yield
    except Exception as exc:  # every error takes part in the agreement
        error = exc
    raise_if_any_failed(error, group)


def cancelled_here(stop: Callable[[], bool] | None, info: DistInfo,
                   where: str) -> RequestCancelled | None:
    """The query rank's cancel at an agreement point (``where``: what it spares), to raise in
    an :func:`agreement` block; None elsewhere, or while ``stop`` is false."""
    if stop is not None and info.rank == QUERY_RANK and stop():
        return RequestCancelled(f"cancelled before {where}")
    return None
