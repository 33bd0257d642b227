"""The decode's bounded read-back (apbv/engine/readback.py): a token whose event never
completes (a peer stuck inside a replayed step) ends the group with a clear error after
``timeout_s``; a token that completes is returned at once, the group untouched."""

from __future__ import annotations

import time

import pytest

from apbv.engine import readback


class FakeClock:
    """A clock that advances only when the poll pauses."""

    def __init__(self) -> None:
        self.now = 100.0
        self.pauses: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def test_a_token_that_never_completes_aborts_the_group_after_the_timeout() -> None:
    clock, aborted, polls = FakeClock(), [], []

    def never() -> bool:
        polls.append(clock.now)
        return False

    with pytest.raises(readback.PeerStuck, match=r"decode step 7's token was not ready within "
                       r"parallel\.timeout_s=0\.5 s: a peer rank is stuck.*aborted"):
        readback.poll(never, 0.5, "decode step 7's token", lambda: aborted.append(clock.now),
                      clock=clock, sleep=clock.sleep)
    assert len(aborted) == 1 and aborted[0] >= 100.5, aborted
    waited = clock.now - 100.0
    assert 0.5 <= waited <= 0.5 + readback.MAX_DELAY_S, waited
    # Pauses grow from the first to the longest and no further: no core spun, no token late
    # by more than the longest pause.
    assert clock.pauses[0] == readback.FIRST_DELAY_S and max(clock.pauses) == \
        readback.MAX_DELAY_S, clock.pauses[:12]
    assert len(polls) == len(clock.pauses) + 1, (len(polls), len(clock.pauses))


def test_a_token_that_completes_is_not_aborted() -> None:
    clock, aborted = FakeClock(), []
    ready = iter([False, False, False, True])
    readback.poll(lambda: next(ready), 0.5, "a token", lambda: aborted.append(1), clock=clock,
                  sleep=clock.sleep)
    assert aborted == [] and clock.pauses == [1e-5, 2e-5, 4e-5], clock.pauses


def test_the_abort_failing_still_raises_the_stuck_error() -> None:
    def broken() -> None:
        raise RuntimeError("abort failed")

    clock = FakeClock()
    with pytest.raises(readback.PeerStuck, match="a token was not ready.*aborting the process "
                       "group failed too \\(abort failed\\)"):
        readback.poll(lambda: False, 0.01, "a token", broken, clock=clock, sleep=clock.sleep)


def test_real_clock_bound() -> None:
    t0 = time.monotonic()
    with pytest.raises(readback.PeerStuck):
        readback.poll(lambda: False, 0.2, "a token")
    waited = time.monotonic() - t0
    assert 0.2 <= waited < 1.0, f"the poll waited {waited:.3f} s for a 0.2 s bound"


def test_bad_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
        readback.poll(lambda: True, 0, "a token")
