"""The captured decode's room check (apbv.engine.decode.check_decode_room) runs on every rank
before the first step's collective: a query rank whose KV reservation is short fails every rank
at once, naming the rows, instead of leaving the others in the all-gather until the timeout."""

from __future__ import annotations

import time

import torch

from apbv.distributed import DistInfo, spawn_local
from apbv.engine.decode import check_decode_room
from apbv.engine.kvcache import RankKVCache
from apbv.plan import QUERY_RANK


def _check(info: DistInfo, reserve: int, max_new_tokens: int) -> tuple[str, str, float]:
    """(error type, message, seconds) of the check with the query rank reserving ``reserve``
    rows (("", "", seconds) when it passes)."""
    cache = RankKVCache(2, reserve=reserve if info.rank == QUERY_RANK else 0)
    for layer in range(2):
        cache.store(layer, torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4))
    start = time.monotonic()
    try:
        check_decode_room(cache, max_new_tokens, info)
    except Exception as exc:  # returned for the test to check
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "", "", time.monotonic() - start


def _room_job(info: DistInfo) -> list[tuple[str, str, float]]:
    return [_check(info, 3, 5), _check(info, 4, 5)]  # short by one row, then just enough


def test_a_short_reservation_fails_every_rank_at_once() -> None:
    # collective_timeout_s=60: a rank left waiting would take a minute; here none waits.
    (short0, enough0), (short1, enough1) = spawn_local(_room_job, 2, timeout_s=120,
                                                       collective_timeout_s=60)
    (kind0, text0, s0), (kind1, text1, s1) = short0, short1
    assert QUERY_RANK == 0
    assert kind0 == "RuntimeError" and text0 == (
        "the query rank reserved 3 KV rows for the 4 captured decode steps"), text0
    assert kind1 == "RequestFailed" and text1 == (
        "the request failed on rank 0: RuntimeError: " + text0), text1
    assert max(s0, s1) < 10, f"the ranks took {s0:.1f} s and {s1:.1f} s to fail"
    assert enough0[:2] == enough1[:2] == ("", ""), (enough0, enough1)
