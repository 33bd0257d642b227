"""The one-GPU multi-rank check: every multi-rank path that one GPU can exercise.

NCCL refuses two ranks on one GPU, but gloo moves CUDA tensors and Ray lends fractions of a
GPU, so H ranks can share ``cuda:0``. Parts (``--parts``, default all):

- ``op``: the APB-V op on H gloo ranks, all on ``--device``, in every mode (spava, exact,
  zigzag_ring, star, apb, no_overlap) against the dense-mask oracle (tests/cases.check, the
  dtype's tolerance); on CUDA the host syncs inside the op are counted
  (``torch.cuda.set_sync_debug_mode``).
- ``engine``: the engine end to end on H ranks (the trained tiny checkpoint, a held-out needle
  video): spava and exact, the answer's choices, a live stream (two appends, an ask, a fresh
  ask); every rank must give the same tokens and the needle's answer; on CUDA the exact tokens
  in fp32 must equal the CPU's on as many gloo ranks.
- ``serve``: ``apbv serve --world-size 2 --gpus-per-rank 0.5`` (two rank actors on the one GPU,
  gloo) answering the official ``openai`` client (on the CPU: ``--gpus-per-rank 0``).
- ``nccl``: a 1-rank NCCL group: the object collectives from a fresh thread, as Ray calls them
  (which device the thread is on), a layer loop's ``wait()`` against ``wait(timeout)``, and
  NCCL inside a captured graph (benchmarks/nccl_graph.py: 28 x (matmul + comm's all-gather +
  wait) captured with eager collectives in flight, replayed against eager). On the CPU its
  CPU-side logic: that loop on a 1-rank gloo group, the bounded decode read-back.
- ``graphs``: ``decode.graphs`` on one rank (the trained tiny checkpoint, fp32 and bf16) and
  on a 1-rank NCCL group (fp32: the step's all-gathers captured as NCCL kernels): the decode
  stage's seconds per token with the captured step (the first request captures, the second
  reuses the kept step) against eager, the captured step accepted at its first-step check,
  and in fp32 the same tokens. On the CPU the same step runs uncaptured (the CPU decodes
  eagerly otherwise).

    python benchmarks/multirank_check.py --device cuda:0 --world-sizes 2,4
    python benchmarks/multirank_check.py --device cpu --world-sizes 2 --parts op,engine   # CI

Prints one line per result and ``multirank_check: N failed`` at the end (exit status 1 then);
a part that cannot run here prints ``skipped:`` and why.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from apbv.distributed import DistInfo, spawn_local  # noqa: E402

PARTS = ("op", "engine", "serve", "nccl", "graphs")
OP_MODES = ("spava", "exact", "zigzag_ring", "star", "apb", "no_overlap")
NEW_TOKENS = 8


def _say(part: str, text: str) -> None:
    print(f"[{part}] {text}", flush=True)


# --- op ---------------------------------------------------------------------------------------

def _op_cases(dtype: str, head_dim: int) -> list:
    from tests.cases import Case

    return [Case(300, 6, heads=8, kv_heads=2, head_dim=head_dim, mode=mode, dtype=dtype, seed=i)
            for i, mode in enumerate(OP_MODES)]


def _op_job(info: DistInfo, cases: list) -> list[tuple[torch.Tensor, int | None]]:
    """Each case's output shard (on the CPU) and the host syncs counted inside the op (None:
    not on CUDA)."""
    from apbv import apbv_attention
    from apbv.layout import shard

    outs = []
    for case in cases:
        plan = case.plan(info.world_size)
        q, k, v = (shard(t, plan, info.rank).to(info.device) for t in case.inputs())
        syncs = None
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = apbv_attention(q, k, v, plan, overlap=case.overlap)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = sum("synchroniz" in str(w.message) for w in caught)
        else:
            out = apbv_attention(q, k, v, plan, overlap=case.overlap)
        outs.append((out.cpu(), syncs))
    return outs


def check_op(device: str, world_size: int) -> list[str]:
    from apbv.layout import unshard
    from tests.cases import check

    on_cuda = device.startswith("cuda")
    cases = _op_cases("bfloat16" if on_cuda else "float32", 64 if on_cuda else 32)
    per_rank = spawn_local(_op_job, world_size, (cases,), device=device, timeout_s=300)
    failures = []
    for i, case in enumerate(cases):
        plan = case.plan(world_size)
        problem = check(case, plan, unshard([outs[i][0] for outs in per_rank], plan))
        syncs = [outs[i][1] for outs in per_rank]
        _say("op", f"H={world_size} {device} {case.dtype} {case.mode}: "
                   f"{'OK' if problem is None else 'FAILED ' + problem}; host syncs in the op "
                   f"{syncs if on_cuda else 'not counted (no CUDA)'}")
        if problem is not None:
            failures.append(f"op H={world_size} {case.mode}")
    return failures


# --- engine -----------------------------------------------------------------------------------

def _engine_job(info: DistInfo, dtype: str, tokens: int) -> dict[str, Any]:
    """The needle request in spava and exact, its choices, and a live stream, on this rank."""
    from apbv.assets import needle_tiny
    from apbv.cli.demo_pipeline import NEEDLE, needle_sample
    from apbv.config import load_config
    from apbv.engine.engine import Engine
    from apbv.engine.request import Request, StreamRef
    from apbv.engine.stream_plan import StreamSpec
    from apbv.synthetic.needles import FRAME_SIZE, answer_choices

    cfg = load_config("tiny_cpu", [f"model.path={str(needle_tiny())!r}", f"model.dtype={dtype!r}"])
    sample = needle_sample(dict(NEEDLE, tokens=tokens))
    engine = Engine(cfg, info)
    out: dict[str, Any] = {}
    for mode in ("spava", "exact"):
        result = engine.generate(Request(video=sample.video(), question=sample.question,
                                         mode=mode, max_new_tokens=NEW_TOKENS))
        out[mode] = (result.answer.strip(), result.token_ids)
    result = engine.generate(Request(video=sample.video(), question=sample.question,
                                     mode="spava", choices=answer_choices(sample.kind)))
    out["choices"] = (result.answer.strip(), result.token_ids)
    engine.open_stream("s", StreamSpec(height=FRAME_SIZE, width=FRAME_SIZE, fps=sample.fps,
                                       keep_vision=True))
    frames = sample.frames
    half = frames.shape[0] // 4 * 2  # whole temporal patches in each append
    stamps = [i / sample.fps for i in range(frames.shape[0])]
    engine.append("s", frames[:half], stamps[:half])
    engine.append("s", frames[half:], stamps[half:])
    for name, fresh in (("stream", False), ("stream_fresh", True)):  # fresh: one-shot spava
        result = engine.generate(Request.from_config(
            cfg, StreamRef("s", fresh), sample.question, mode="spava" if fresh else "exact",
            max_new_tokens=NEW_TOKENS))
        out[name] = (result.answer.strip(), result.token_ids)
    engine.close_stream("s")
    if info.device.type == "cuda":
        out["peak_gib"] = round(torch.cuda.max_memory_allocated(info.device) / 2**30, 3)
    return {"answer": sample.answer, **out}


def check_engine(device: str, world_size: int, tokens: int) -> list[str]:
    failures = []
    runs = [("float32", device)] + ([("bfloat16", device)] if device.startswith("cuda") else [])
    cpu_exact = None
    if device.startswith("cuda"):  # the reference: as many gloo ranks on the CPU, fp32
        cpu = spawn_local(_engine_job, world_size, ("float32", tokens), timeout_s=600)
        cpu_exact = cpu[0]["exact"][1]
    for dtype, dev in runs:
        t0 = time.perf_counter()
        ranks = spawn_local(_engine_job, world_size, (dtype, tokens), device=dev, timeout_s=600)
        first = ranks[0]
        agree = all({k: v for k, v in r.items() if k != "peak_gib"} ==
                    {k: v for k, v in first.items() if k != "peak_gib"} for r in ranks)
        wrong = [k for k in ("spava", "exact", "choices", "stream", "stream_fresh")
                 if first[k][0] != first["answer"]]
        same_as_cpu = None if cpu_exact is None or dtype != "float32" else \
            first["exact"][1] == cpu_exact
        ok = agree and not wrong and same_as_cpu is not False
        _say("engine", f"H={world_size} {dev} {dtype} ({time.perf_counter() - t0:.1f} s): "
                       f"{'OK' if ok else 'FAILED'}; ranks agree {agree}; answer "
                       f"{first['answer']!r}, wrong in {wrong or 'none'}; exact tokens as on "
                       f"the CPU: {'not compared' if same_as_cpu is None else same_as_cpu}; "
                       f"peak GiB per rank {[r.get('peak_gib') for r in ranks]}")
        _say("engine", "  " + ", ".join(f"{k} {v}" for k, v in first.items()
                                        if k not in ("answer", "peak_gib")))
        if not ok:
            failures.append(f"engine H={world_size} {dtype}")
    return failures


# --- serve ------------------------------------------------------------------------------------

def check_serve(device: str) -> list[str]:
    """Two rank actors (a half GPU each on CUDA, CPU ranks otherwise) answer the openai
    client about a short test video."""
    import importlib.util

    missing = [m for m in ("openai", "ray", "fastapi", "uvicorn", "decord")
               if importlib.util.find_spec(m) is None]
    if missing:  # decord: the tiny config's reader of the video file
        _say("serve", f"skipped: not installed: {', '.join(missing)}")
        return []
    import openai

    from apbv.synthetic.videos import write_test_video
    from tests.serve.server import serving

    gpus = "0.5" if device.startswith("cuda") else "0"
    root = Path(tempfile.mkdtemp(prefix="apbv-check-"))
    try:
        from apbv.model.qwen2_5_vl.tiny import write_tiny_checkpoint

        model = root / "tiny"
        write_tiny_checkpoint(model)
        video = write_test_video(root / "clip.mp4", num_frames=16, fps=4.0, width=224,
                                 height=224)
        t0 = time.perf_counter()
        with serving(model, "--world-size", "2", "--gpus-per-rank", gpus, "--media-root",
                     str(root), "--set", "parallel.timeout_s=60") as server:
            server.wait_ready(timeout_s=240)
            client = openai.OpenAI(base_url=server.base + "/v1", api_key="none",
                                   max_retries=0, timeout=120)
            out = client.chat.completions.create(
                model=model.name, max_tokens=4, messages=[{"role": "user", "content": [
                    {"type": "video_url", "video_url": {"url": video.as_uri()}},
                    {"type": "text", "text": "What colour is the square?"}]}])
            placed = [line for line in server.log if "rank(s)" in line]
        answer = out.choices[0].message.content
        ok = out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens
        _say("serve", f"--world-size 2 --gpus-per-rank {gpus} ({time.perf_counter() - t0:.1f} "
                      f"s): {'OK' if ok else 'FAILED'}; answer {answer!r}; "
                      f"{placed[-1].strip() if placed else ''}")
        return [] if ok else ["serve"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --- nccl -------------------------------------------------------------------------------------

def _one_rank_group(backend: str) -> DistInfo:
    """This process as a 1-rank ``backend`` group (cuda:0 on NCCL), made even though one rank
    needs none, so that collectives really run (NCCL: its kernels)."""
    import dataclasses

    import torch.distributed as dist

    from apbv.distributed import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    info = init_distributed(backend=backend, timeout_s=60)
    if not dist.is_initialized():  # one rank makes no group: make it, to talk through it
        dist.init_process_group(backend, rank=0, world_size=1,
                                device_id=info.device if backend == "nccl" else None)
    return dataclasses.replace(info, backend=backend)


def _nccl_job(layers: int, repeats: int) -> dict[str, Any]:
    """In a process of its own: a 1-rank NCCL group on cuda:0."""
    import torch.distributed as dist

    from apbv import comm
    from apbv.distributed import destroy_distributed
    from benchmarks import nccl_graph

    info = _one_rank_group("nccl")
    report: dict[str, Any] = {}

    def worker() -> None:  # as Ray runs an actor call: a thread that never set a device
        report["thread_device"] = torch.cuda.current_device()
        report["broadcast_object"] = comm.broadcast_object({"ok": 1})
        report["all_gather_object"] = comm.all_gather_object("x")

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=60)
    x = torch.randn(4096, 4096, device=info.device, dtype=torch.bfloat16)
    buf = torch.empty(1, 64, 1024, device=info.device)

    def layer_loop(timeout: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(layers):
            y = x @ x  # the layer's work, queued
            work = dist.all_gather_into_tensor(buf, y[:64, :1024].float().unsqueeze(0),
                                               async_op=True)
            work.wait(timeout=comm._timeout) if timeout else work.wait()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        return host

    for timeout in (False, True):
        layer_loop(timeout)  # warm
        report[f"host_s_{'timeout' if timeout else 'plain'}"] = min(
            layer_loop(timeout) for _ in range(repeats))
    try:
        report["graph"] = nccl_graph.graph_case(info.device, layers)
    except RuntimeError as exc:  # a capture NCCL or torch refuses: reported, counted failed
        report["graph"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    destroy_distributed()
    return report


def _nccl_cpu_job(layers: int) -> dict[str, Any]:
    """The nccl part's CPU-side logic, in a process of its own: the graph case's loop on a
    1-rank gloo group, and the decode's bounded read-back on a token that never arrives."""
    from apbv.distributed import destroy_distributed
    from apbv.engine import readback
    from benchmarks import nccl_graph

    _one_rank_group("gloo")
    report: dict[str, Any] = {"graph": nccl_graph.cpu_case(layers)}
    destroy_distributed()
    aborted, t0 = [], time.perf_counter()
    try:
        readback.poll(lambda: False, 0.2, "a stuck token", lambda: aborted.append(True))
        report["stuck"] = "returned"
    except readback.PeerStuck as exc:
        report["stuck"] = f"{time.perf_counter() - t0:.2f} s, aborted {aborted == [True]}: {exc}"
    report["stuck_ok"] = aborted == [True] and time.perf_counter() - t0 < 2.0
    return report


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_process(job: Any, args: tuple, timeout_s: float) -> Any:
    """``job(*args)`` in a fresh spawned process (a process group of its own)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply_async(job, args).get(timeout=timeout_s)


def check_nccl(device: str, layers: int = 28) -> list[str]:
    if not device.startswith("cuda"):
        report = _in_process(_nccl_cpu_job, (layers,), 120)
        g = report["graph"]
        ok = g["ok"] and report["stuck_ok"]
        _say("nccl", "skipped: NCCL needs a CUDA device (the check runs on the CPU); its "
                     f"CPU-side logic: {'OK' if ok else 'FAILED'}; the graph case's "
                     f"{layers} layers with a 1-rank gloo all-gather each against no "
                     f"collective: max rel diff {g['max_rel_diff']:.2g} (tolerance "
                     f"{g['tolerance']:g}); the bounded read-back of a token that never "
                     f"arrives: {report['stuck']}")
        return [] if ok else ["nccl cpu-side"]
    report = _in_process(_nccl_job, (layers, 5), 300)
    g = report["graph"]
    if "error" in g:
        _say("nccl", f"graph case: FAILED: {g['error']}")
    else:
        _say("nccl", f"graph case: {'OK' if g['ok'] else 'FAILED'}; {g['layers']} x (matmul + "
                     f"comm all-gather + wait) captured on a side stream (thread_local) with "
                     f"eager collectives in flight (their results right: {g['in_flight_ok']}),"
                     f" replayed {g['replays']} times: max rel diff against eager "
                     f"{g['max_rel_diff']:.2g} (tolerance {g['tolerance']:g}); capture "
                     f"{g['capture_ms']:.1f} ms, replay {g['replay_ms']:.3f} ms against eager "
                     f"{g['eager_ms']:.3f} ms ({g['eager_ms'] / g['replay_ms']:.2f}x)")
    ok = report.get("broadcast_object") == {"ok": 1} and report.get("all_gather_object") == ["x"]
    _say("nccl", f"1-rank group: {'OK' if ok else 'FAILED'}; object collectives from a fresh "
                 f"thread (on cuda:{report.get('thread_device')}): "
                 f"{report.get('broadcast_object')}, {report.get('all_gather_object')}; "
                 f"{layers} layers queued by the host in {report['host_s_plain'] * 1e3:.1f} ms "
                 f"with wait() against {report['host_s_timeout'] * 1e3:.1f} ms with "
                 "wait(timeout) (the CPU-blocking form comm no longer uses on NCCL)")
    return ([] if ok else ["nccl"]) + ([] if g["ok"] else ["nccl graph case"])


# --- graphs -----------------------------------------------------------------------------------

def _graphs_job(info: DistInfo, dtype: str, tokens: int) -> dict[str, Any]:
    """The needle request decoded eagerly, then with the captured step (kept across requests:
    the first request captures, the second reuses), on this one rank. On the CPU the step
    runs uncaptured (its static KV buffers and masked attention, the kept step's reuse)."""
    from apbv.assets import needle_tiny
    from apbv.cli.demo_pipeline import NEEDLE, needle_sample
    from apbv.config import load_config
    from apbv.engine.engine import Engine
    from apbv.engine.request import Request

    cfg = load_config("tiny_cpu", [f"model.path={str(needle_tiny())!r}", f"model.dtype={dtype!r}",
                                   "decode.graphs=auto", f"decode.graphs_min_tokens={NEW_TOKENS}"])
    sample = needle_sample(dict(NEEDLE, tokens=tokens))
    engine = Engine(cfg, info)
    out: dict[str, Any] = {"resolved": engine.decode_graphs, "why": engine.decode_graphs_why}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for graphs in (False, True):
            engine.decode_graphs = graphs  # forced on the CPU: the static step, uncaptured
            # eager: the first run warms up (one run on the CPU, where no timing counts);
            # graphs: the first run captures the step, the second reuses it
            twice = graphs or info.device.type == "cuda"
            runs = [engine.generate(Request(video=sample.video(), question=sample.question,
                                            mode="spava", max_new_tokens=NEW_TOKENS))
                    for _ in range(2 if twice else 1)]
            runs = runs if twice else runs * 2
            steps = [max(1, len(r.token_ids) - 1) for r in runs]
            out["graph" if graphs else "eager"] = {
                "tokens": runs[1].token_ids, "first_tokens": runs[0].token_ids,
                "s_per_token_first": runs[0].seconds.get("decode", 0.0) / steps[0],
                "s_per_token": runs[1].seconds.get("decode", 0.0) / steps[1]}
    kept = engine.graph_steps
    out["made"], out["reused"] = (kept.made, kept.reused) if kept is not None else (0, 0)
    out["warnings"] = [str(w.message) for w in caught if "decode.graphs" in str(w.message)]
    return out


def _nccl_graphs_job(dtype: str, tokens: int) -> dict[str, Any]:
    """:func:`_graphs_job` on a 1-rank NCCL group: the decode step's all-gathers are NCCL
    collectives, captured with the step."""
    from apbv.distributed import destroy_distributed

    out = _graphs_job(_one_rank_group("nccl"), dtype, tokens)
    destroy_distributed()
    return out


def _graphs_line(r: dict[str, Any], where: str, dtype: str, captured: bool) -> bool:
    """Print one graphs run's line; whether it passed: no fallback, one step made and reused
    by the second request, and (fp32, or uncaptured) the eager tokens."""
    same = r["graph"]["tokens"] == r["eager"]["tokens"] and \
        r["graph"]["first_tokens"] == r["eager"]["tokens"]
    ok = (r["resolved"] or not captured) and not r["warnings"] and \
        (r["made"], r["reused"]) == (1, 1) and (same or (captured and dtype != "float32"))
    g, e = r["graph"], r["eager"]
    _say("graphs", f"{where} {dtype}: {'OK' if ok else 'FAILED'}; auto resolved {r['resolved']} "
                   f"({r['why']}); steps made {r['made']}, reused {r['reused']}; decode s/token "
                   f"graph {g['s_per_token_first']:.5f} with the capture, "
                   f"{g['s_per_token']:.5f} reused, against eager {e['s_per_token']:.5f} "
                   f"({e['s_per_token'] / max(g['s_per_token'], 1e-9):.2f}x); same tokens "
                   f"{same}; fell back: {r['warnings'] or 'no'}")
    return ok


def check_graphs(device: str, tokens: int) -> list[str]:
    if not device.startswith("cuda"):
        r = spawn_local(_graphs_job, 1, ("float32", tokens), device=device, timeout_s=600)[0]
        _say("graphs", "skipped: CUDA graphs need a CUDA device (decode on the CPU is always "
                       "eager); its CPU-side logic: the static step uncaptured, kept across "
                       "requests:")
        return [] if _graphs_line(r, "1 rank cpu", "float32", False) else ["graphs cpu-side"]
    failures = []
    for dtype in ("float32", "bfloat16"):
        r = spawn_local(_graphs_job, 1, (dtype, tokens), device=device, timeout_s=600)[0]
        if not _graphs_line(r, f"1 rank {device}", dtype, True):
            failures.append(f"graphs {dtype}")
    r = _in_process(_nccl_graphs_job, ("float32", tokens), 600)  # NCCL inside the step
    if not _graphs_line(r, f"1-rank NCCL group {device}", "float32", True):
        failures.append("graphs nccl float32")
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu",
                   help="every rank's device (default: %(default)s)")
    p.add_argument("--world-sizes", default="2,4", help="H values, comma-separated")
    p.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    p.add_argument("--tokens", type=int, default=8192,
                   help="the needle video's size in prompt tokens (default: %(default)s)")
    args = p.parse_args(argv)
    parts = [s for s in args.parts.split(",") if s]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"unknown part(s) {unknown}; allowed: {', '.join(PARTS)}")
    sizes = [int(s) for s in args.world_sizes.split(",") if s]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device} needs CUDA, which is not available")
    failures: list[str] = []
    for part in PARTS:
        if part not in parts:
            continue
        t0 = time.perf_counter()
        if part == "op":
            for h in sizes:
                failures += check_op(args.device, h)
        elif part == "engine":
            for h in sizes:
                failures += check_engine(args.device, h, args.tokens)
        elif part == "serve":
            failures += check_serve(args.device)
        elif part == "nccl":
            failures += check_nccl(args.device)
        else:
            failures += check_graphs(args.device, args.tokens)
        _say(part, f"{time.perf_counter() - t0:.1f} s")
    named = ": " + ", ".join(failures) if failures else ""
    print(f"multirank_check: {len(failures)} failed{named}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
