"""Which device each Ray rank actor uses, and where a group's ranks are placed, on a local Ray
whose GPUs are fake (``ray.init(num_gpus=4)`` on a CPU machine: Ray still hands each actor GPU
ids and sets its CUDA_VISIBLE_DEVICES to them). Nothing touches CUDA."""

from __future__ import annotations

import os
import threading
from collections import Counter
from types import SimpleNamespace

import pytest
import ray
import torch

from apbv.serve.ranks.group import RankActor, RankGroup
from apbv.serve.ranks.ops import Generate
from apbv.serve.ranks.placement import check_gpus_per_rank, group_backend, group_layout, rank_device

# --- the pure functions -----------------------------------------------------------------------

def test_rank_device_is_the_first_gpu_id_in_the_visible_set():
    assert rank_device([], None) == "cpu"
    assert rank_device([], "0,1") == "cpu"
    assert rank_device([5], "5") == "cuda:0"  # what Ray sets: this process sees only GPU 5
    assert rank_device(["3"], "3") == "cuda:0"
    assert rank_device([3], "1,3") == "cuda:1"
    assert rank_device(["GPU-ab12"], "GPU-ab12") == "cuda:0"
    assert rank_device([6], None) == "cuda:6"  # Ray told not to set it: every GPU is visible
    with pytest.raises(ValueError, match="not in this process's CUDA_VISIBLE_DEVICES"):
        rank_device([2], "0,1")
    with pytest.raises(ValueError, match="not an index"):
        rank_device(["GPU-ab12"], None)


def test_group_layout_packs_one_node_or_takes_whole_nodes_in_rank_order():
    node8 = {"GPU": 8.0, "CPU": 32.0}
    one = group_layout(8, 1, [node8, node8])
    assert (one.bundles, one.strategy, one.rank_bundle) == \
        ([{"GPU": 8.0, "CPU": 8.0}], "STRICT_PACK", [0] * 8)
    two = group_layout(12, 1, [node8, node8])
    assert two.strategy == "STRICT_SPREAD"
    assert two.bundles == [{"GPU": 8.0, "CPU": 8.0}, {"GPU": 4.0, "CPU": 4.0}]
    assert two.rank_bundle == [0] * 8 + [1] * 4
    half = group_layout(4, 0.5, [{"GPU": 2.0, "CPU": 4.0}])
    assert (half.bundles, half.strategy) == ([{"GPU": 2.0, "CPU": 4.0}], "STRICT_PACK")
    cpu = group_layout(2, 0, [{"CPU": 2.0}])
    assert (cpu.bundles, cpu.strategy) == ([{"CPU": 2.0}], "STRICT_PACK")
    with pytest.raises(ValueError, match="cannot place 24 ranks"):
        group_layout(24, 1, [node8, node8])
    with pytest.raises(ValueError, match="cannot place 2 ranks"):
        group_layout(2, 1, [{"CPU": 8.0}])


def test_gpus_per_rank_and_its_backend():
    for ok in (0, 0.25, 0.5, 1):
        check_gpus_per_rank(ok)
    for bad in (0.3, 1.5, 2, -1):
        with pytest.raises(ValueError, match="--gpus-per-rank must be"):
            check_gpus_per_rank(bad)
    assert group_backend("auto", 0.5) == "gloo"
    assert group_backend("gloo", 0.5) == "gloo"
    with pytest.raises(ValueError, match="NCCL refuses"):
        group_backend("nccl", 0.5)
    assert group_backend("auto", 1) is None
    assert group_backend("nccl", 1) == "nccl"


def test_every_thread_that_runs_engine_work_sets_the_ranks_device(monkeypatch):
    """The current CUDA device is per thread: the streamed generate runs in a thread of its
    own, and Ray runs the actor's calls in its own threads."""
    current = threading.local()
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: setattr(current, "device", torch.device(device)))
    seen: list[tuple[str, torch.device | None]] = []

    class Engine:  # a request here is the name of what it stands for
        def generate(self, request, on_token=None, stop=None):
            seen.append((request, getattr(current, "device", None)))
            if on_token is not None:
                on_token(7)
            return SimpleNamespace(first_logits=1)

    actor = RankActor(None, 0, 2, torch.get_num_threads())
    actor.device, actor.engine = torch.device("cuda", 0), Engine()
    assert list(actor.run_tokens(Generate("generate")))[0] == 7
    list(actor.run_tokens(Generate("ask")))  # a stream's question is a request too
    worker = threading.Thread(target=actor.run, args=(Generate("generate"),))
    worker.start()
    worker.join(timeout=10)
    assert seen == [("generate", torch.device("cuda", 0)), ("ask", torch.device("cuda", 0)),
                    ("generate", torch.device("cuda", 0))]


# --- on a local Ray with 4 fake GPUs ------------------------------------------------------------

GROUPS = [(2, 1), (4, 1), (2, 0.5), (4, 0.5)]
"""(ranks, GPUs per rank) of the groups started side by side: 9 GPUs in all."""


@pytest.fixture(scope="module")
def fake_gpu_ray():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=sum(h for h, _ in GROUPS), num_gpus=sum(h * g for h, g in GROUPS),
             include_dashboard=False, log_to_driver=False, object_store_memory=80 << 20,
             _node_ip_address="127.0.0.1")
    try:
        yield
    finally:
        ray.shutdown()


def _what_ray_gave(actor) -> tuple[list[str], str | None, str]:
    return (ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"), actor.device_given())


def test_each_rank_uses_the_gpu_ray_gave_it(fake_gpu_ray):
    """2 and 4 ranks, whole and half GPUs (the groups started at once: one actor start each)."""
    groups = [RankGroup(None, h, gpus_per_rank=g, backend="gloo") for h, g in GROUPS]
    try:
        for group in groups:
            group.start_actors()
        refs = [[a.__ray_call__.remote(_what_ray_gave) for a in group.actors]
                for group in groups]
        given = [ray.get(r, timeout=120) for r in refs]
    finally:
        for group in groups:
            group.stop()
    taken: list[str] = []
    for (world_size, gpus_per_rank), ranks in zip(GROUPS, given):
        ids = []
        for rank, (gpu_ids, visible, device) in enumerate(ranks):
            where = (world_size, gpus_per_rank, rank, gpu_ids, visible, device)
            assert len(gpu_ids) == 1 and visible == str(gpu_ids[0]), where
            # cuda:0 of its own visible set, whatever its rank (the old code: cuda:<rank>)
            assert device == "cuda:0", where
            ids.append(str(gpu_ids[0]))
        per_gpu = round(1 / gpus_per_rank)
        # packed: whole GPUs, each shared one full
        assert len(set(ids)) == world_size // per_gpu, (world_size, gpus_per_rank, ids)
        assert max(Counter(ids).values()) == per_gpu, (world_size, gpus_per_rank, ids)
        taken += sorted(set(ids))
    assert len(taken) == len(set(taken)) == 9, taken  # no GPU given to two groups


@pytest.mark.parametrize("flags,message", [
    (["--gpus-per-rank", "0.5", "--set", "parallel.backend=nccl"], "NCCL refuses"),
    (["--gpus-per-rank", "0.3"], "--gpus-per-rank must be 0"),
])
def test_serve_refuses_shared_gpus_on_nccl_before_ray_starts(monkeypatch, flags, message):
    import argparse

    from apbv.config import load_config
    from apbv.serve import main

    p = argparse.ArgumentParser()
    main.add_serve_args(p)
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args(flags)
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    with pytest.raises(ValueError, match=message):
        main.run_server(load_config("tiny_cpu", args.set), args)
