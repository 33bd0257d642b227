"""Admission without a server: EDF order, deadline refusal with the prediction, queue bound,
a dropped waiter."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from apbv.serve.admission import Admission
from apbv.serve.policy import ClientError


def _call(deadline_ms: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(deadline_ms=deadline_ms)


def test_order_deadline_refusal_bound_and_drop() -> None:
    async def scenario() -> None:
        adm = Admission(3, predictor=lambda call, measured: 2.0)  # 2 s per request
        first = adm.admit(_call(), {})
        late = adm.admit(_call(60_000), {})
        early = adm.admit(_call(30_000), {})
        assert [await adm.next() for _ in range(2)] == [early, late]  # EDF before FIFO
        adm.done(late)
        adm.admit(_call(), {})
        adm.admit(_call(), {})
        with pytest.raises(ClientError) as err:
            adm.admit(_call(), {})
        assert err.value.status == 429 and "limit is 3 (--max-queue)" in err.value.message
        assert adm.drop(first) and not adm.drop(first) and len(adm) == 2
        await adm.next()  # running: 2 s left; deadline jobs go before the 1 without one
        with pytest.raises(ClientError) as err:
            adm.admit(_call(3_000), {})  # 2 s + 2 s running = 4 s: misses 3 s
        assert "predicted TTFT is 2000 ms plus 2000 ms" in err.value.message
        adm.admit(_call(4_500), {})  # 4 s: fits
        with pytest.raises(ClientError) as err:
            adm.admit(_call(5_000), {})  # 2 s + 2 s running + 2 s of the 4.5 s job ahead
        assert err.value.status == 503
        assert "predicted TTFT is 2000 ms plus 4000 ms" in err.value.message

    asyncio.run(scenario())
