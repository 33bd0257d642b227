"""A failure on one rank before a collective reaches every rank at once, on 2 gloo ranks:

- a model load that fails on one rank ends the others' start-up wait naming it
  (:func:`apbv.distributed.ranks_ready`), where they would otherwise wait out
  ``parallel.startup_timeout_s``;
- the captured decode's room check (:func:`apbv.engine.decode.check_decode_room`): a query
  rank whose KV reservation is short fails every rank, naming the rows, instead of leaving the
  others in the first step's all-gather until the collective timeout.
"""

from __future__ import annotations

import time

import torch

from apbv.config import RuntimeConfig
from apbv.distributed import DistInfo, spawn_local
from apbv.engine import engine as engine_module
from apbv.engine.decode import check_decode_room
from apbv.engine.kvcache import RankKVCache
from apbv.plan import QUERY_RANK


def _timed(call) -> tuple[str, str, float]:
    """(error type, message, seconds) of ``call()`` (("", "", seconds) when it passes)."""
    start = time.monotonic()
    try:
        call()
    except Exception as exc:  # returned for the test to check
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "", "", time.monotonic() - start


def _room(info: DistInfo, reserve: int, max_new_tokens: int) -> tuple[str, str, float]:
    """The room check with the query rank reserving ``reserve`` rows."""
    cache = RankKVCache(2, reserve=reserve if info.rank == QUERY_RANK else 0)
    for layer in range(2):
        cache.store(layer, torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4))
    return _timed(lambda: check_decode_room(cache, max_new_tokens, info))


def _failures_job(info: DistInfo, cfg: RuntimeConfig) -> dict:
    if info.rank == 1:  # rank 1 cannot load the model (rank 0 loads it)
        def no_memory(*args, **kwargs):
            raise MemoryError("cannot allocate the weights")
        engine_module.load_adapter = no_memory
    load = _timed(lambda: engine_module.Engine(cfg, info))
    # short by one row, then just enough
    return {"load": load, "short": _room(info, 3, 5), "enough": _room(info, 4, 5)}


def test_one_rank_failures_reach_every_rank_at_once(tiny_config: RuntimeConfig) -> None:
    # Every wait here would take a minute (collective_timeout_s) or half an hour (start-up)
    # if left to run out; each must end in seconds.
    r0, r1 = spawn_local(_failures_job, 2, (tiny_config,), timeout_s=300,
                         collective_timeout_s=60)
    assert r1["load"][:2] == ("MemoryError", "cannot allocate the weights"), r1["load"]
    kind, text, waited = r0["load"]
    assert kind == "StartupFailed" and text == (
        "rank 0: stopped waiting at the start-up point '1-model loaded': rank 1: MemoryError: "
        "cannot allocate the weights"), r0["load"]
    assert waited < 30, f"rank 0 waited {waited:.1f} s after loading"

    assert QUERY_RANK == 0
    (kind0, text0, s0), (kind1, text1, s1) = r0["short"], r1["short"]
    assert kind0 == "RuntimeError" and text0 == (
        "the query rank reserved 3 KV rows for the 4 captured decode steps"), text0
    assert kind1 == "RequestFailed" and text1 == (
        "the request failed on rank 0: RuntimeError: " + text0), text1
    assert max(s0, s1) < 10, f"the ranks took {s0:.1f} s and {s1:.1f} s to fail"
    assert r0["enough"][:2] == r1["enough"][:2] == ("", ""), (r0["enough"], r1["enough"])
