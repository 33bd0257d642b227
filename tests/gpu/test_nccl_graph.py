"""NCCL inside a captured CUDA graph on one GPU (skipped without CUDA): a 1-rank NCCL group,
28 x (matmul + comm's all-gather + wait) captured with eager collectives in flight
(capture_error_mode="thread_local"), replayed 20 times on fresh inputs against the eager loop
(benchmarks/nccl_graph.py; fp32, the same kernels). The decode step's all-gathers are
captured this way on NCCL ranks (apbv/engine/decode_graph.py)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not (dist.is_available() and dist.is_nccl_available()),
                       reason="needs torch built with NCCL"),
]


@pytest.fixture
def one_rank_nccl():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    dist.init_process_group("nccl", rank=0, world_size=1, store=store, device_id=device)
    try:
        yield device
    finally:
        dist.destroy_process_group()


def test_nccl_all_gathers_captured_in_a_graph_replay_as_eager(one_rank_nccl) -> None:
    from benchmarks.nccl_graph import graph_case

    r = graph_case(one_rank_nccl, layers=28, replays=20)
    assert r["in_flight_ok"], f"eager collectives in flight during the capture went wrong: {r}"
    assert r["max_rel_diff"] <= r["tolerance"], (
        f"replayed graph against eager: max relative difference {r['max_rel_diff']:.3g} > "
        f"{r['tolerance']:g} ({r})")
    print(f"\nNCCL graph case: capture {r['capture_ms']:.1f} ms, replay {r['replay_ms']:.3f} ms "
          f"against eager {r['eager_ms']:.3f} ms")
