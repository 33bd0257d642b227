"""The per-token read-back of a decode, bounded in time.

A replayed CUDA graph's collectives create no work objects, so the NCCL watchdog does not see
them and ``parallel.timeout_s`` would no longer bound a decode: a peer that is alive but stuck
(a GPU hang, a pre-empted rank) would leave every other rank waiting for its token forever.
The read-back therefore polls its event against a deadline of ``parallel.timeout_s`` instead
of blocking on it, and past the deadline aborts the process group (every collective still
pending on this rank fails at once) and raises an error saying what was waited for and for
how long. Polling also frees the core a blocking wait would spin on.
"""

from __future__ import annotations

import time
from collections.abc import Callable

FIRST_DELAY_S = 1e-5
"""The first pause between two polls; each pause doubles up to :data:`MAX_DELAY_S`."""

MAX_DELAY_S = 1e-4
"""The longest pause between two polls: a token is read back at most this late."""


class PeerStuck(RuntimeError):
    """A read-back did not complete within ``parallel.timeout_s``: a peer rank is stuck inside
    a collective (the process group has been aborted)."""


def poll(done: Callable[[], bool], timeout_s: float, what: str,
         abort: Callable[[], None] = lambda: None, *,
         clock: Callable[[], float] = time.monotonic,
         sleep: Callable[[float], None] = time.sleep) -> None:
    """Return once ``done()`` is true (an event's ``query``); if it is still false
    ``timeout_s`` seconds after the first poll, call ``abort()`` (end the process group)
    and raise :class:`PeerStuck` naming ``what`` and the limit. ``clock`` and ``sleep`` are
    the time source and the pause (replaced in tests)."""
    if timeout_s <= 0:
        raise ValueError(f"the read-back's timeout_s must be > 0, got {timeout_s}")
    deadline = clock() + timeout_s
    delay = FIRST_DELAY_S
    while not done():
        if clock() >= deadline:
            ended = "the process group was aborted"
            try:
                abort()
            except Exception as exc:  # the stuck peer is the error to report
                ended = f"aborting the process group failed too ({exc})"
            raise PeerStuck(
                f"{what} was not ready within parallel.timeout_s={timeout_s:g} s: a peer rank "
                "is stuck in a collective of the step (a replayed CUDA graph's collectives "
                f"escape the NCCL watchdog), so {ended}; raise parallel.timeout_s if the "
                "steps are legitimately this slow")
        sleep(delay)
        delay = min(2 * delay, MAX_DELAY_S)
