"""Admission without a server: EDF order, deadline refusal with the prediction, queue bound,
a dropped waiter."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from apbv.openai.policy import ClientError
from apbv.serve.scheduler.admission import Admission


def _call(deadline_ms: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(deadline_ms=deadline_ms, request=None)


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


def test_finished_requests_correct_the_cost_model() -> None:
    """A machine twice as slow as the model's preset: each finished request moves the scale a
    quarter of the way (in log space) to the measured ratio, and deadlines are judged with it."""
    async def scenario() -> None:
        adm = Admission(8, predictor=lambda call, measured: 2.0)
        job = adm.admit(_call(), {})
        assert (job.modelled_s, job.predicted_s) == (2.0, 2.0)
        for n in range(1, 11):
            adm.learn(job, 4.0)
            assert adm.scale == pytest.approx(2.0 ** (1 - 0.75 ** n), rel=1e-12), (n, adm.scale)
        assert adm.learned == 10 and 1.88 < adm.scale < 2.0  # within 6% of the ratio
        assert adm.admit(_call(), {}).predicted_s == pytest.approx(2.0 * adm.scale)
        await adm.next()
        adm.done(job)
        with pytest.raises(ClientError) as err:  # 3.8 s predicted: a 3 s deadline is missed
            adm.admit(_call(3_000), {})
        assert (f"predicted TTFT is {2000 * adm.scale:.0f} ms (the cost model's 2000 ms x "
                f"{adm.scale:.2f}, the measured/modelled ratio of 10 finished requests)"
                ) in err.value.message, err.value.message
        before = adm.scale
        stream_op = adm.admit(_call(), {}, predicted_s=0.0)  # not the model's prediction
        adm.learn(stream_op, 9.0)
        adm.learn(job, 0.0)
        assert (adm.scale, adm.learned) == (before, 10)
        for _ in range(100):  # an absurd ratio is bounded
            adm.learn(job, 1e9)
        assert adm.scale == 100.0

    asyncio.run(scenario())
