"""The frame worker on CUDA (skipped without CUDA): apbv.model.common.tower.rows_in_worker runs the
worker's device work on a stream of its own and hands each chunk over with an event, so the
caller sees every chunk's finished rows while its own stream stays free for the tower."""

from __future__ import annotations

import pytest
import torch

from apbv.model.common.tower import rows_in_worker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_worker_rows_come_from_its_own_stream_complete() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    caller = torch.cuda.current_stream(device)
    worker_streams: list[int] = []
    n = 1 << 22

    def process(chunk: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        worker_streams.append(torch.cuda.current_stream().stream_id)
        x = chunk.to(device, non_blocking=True)
        for _ in range(20):  # enough device work that an unsynchronised read would see it
            x = x * 1.0 + 0.0
        return x + 1.0, (1, 1, 1)

    chunks = [torch.full((n,), float(i)).pin_memory() for i in range(6)]
    sums = []
    for rows, grid in rows_in_worker(process, chunks, device):
        assert grid == (1, 1, 1)
        sums.append(float(rows.sum()))  # on the caller's stream, after the chunk's event
    torch.cuda.synchronize()
    assert sums == [float((i + 1) * n) for i in range(6)], sums
    assert worker_streams and all(s != caller.stream_id for s in worker_streams), (
        worker_streams, caller.stream_id)

