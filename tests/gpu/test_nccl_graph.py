"""NCCL inside a captured CUDA graph on one GPU, and the bounded token read-back (skipped
without CUDA). A 1-rank NCCL group captures 28 x (matmul + comm's all-gather + wait) with
eager collectives in flight (capture_error_mode="thread_local") and replays it 20 times on
fresh inputs against the eager loop (benchmarks/nccl_graph.py; fp32, the same kernels): the
decode step's all-gathers are captured this way on NCCL ranks (apbv/engine/decode_graph.py)."""

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


def test_the_token_read_back_is_bounded_on_cuda() -> None:
    """A token behind a kernel that runs past parallel.timeout_s (as a replayed step whose
    peer is stuck would): the read-back raises PeerStuck after the timeout, not after the
    kernel."""
    import time

    from apbv import comm
    from apbv.engine.decode import host_token
    from apbv.engine.readback import PeerStuck

    before = comm.timeout_s()
    comm.set_timeout(0.3)
    try:
        token = torch.zeros(1, dtype=torch.long, device="cuda")
        torch.cuda._sleep(10**10)  # several seconds of spinning on the GPU
        token += 1
        t0 = time.monotonic()
        with pytest.raises(PeerStuck, match="the first token was not ready within "
                                             r"parallel\.timeout_s=0\.3 s"):
            host_token(token)
        waited = time.monotonic() - t0
    finally:
        comm.set_timeout(before)
        torch.cuda.synchronize()
    assert 0.3 <= waited < 1.5, f"the read-back waited {waited:.2f} s for a 0.3 s bound"
