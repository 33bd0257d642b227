"""``python -m apbv serve``: Ray, the rank group, and the HTTP front end in this process.

The front end runs in the driver (uvicorn + FastAPI): one process owns the queue and the
admission decisions, and the H ranks are one group of Ray actors that must all take every
request. uvicorn handles SIGINT/SIGTERM: it stops accepting, the requests in flight are
answered 503 at once (:mod:`apbv.serve.http_guard`; a download in flight is ended, its
temporary file removed), the app's shutdown kills the rank actors and releases their placement
group, and Ray is shut down (or, with ``--address``, disconnected from); nothing is left
running.

Ray's own ports run code for whoever can call them, so Ray's token authentication is never
turned off (:mod:`apbv.serve.ranks.ray_cluster`): the local cluster, always a new one, gets a token
made at each start (in the environment Ray's processes and the rank actors inherit) and binds
every port to 127.0.0.1 whatever ``--host`` is, since it is one host; ``--address`` joins with
the operator's token (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import os
import shutil
import socket
import tempfile
from typing import TYPE_CHECKING, Any

from apbv.openai.policy import Limits, MediaPolicy
from apbv.serve import log_format
from apbv.serve.front.metric_rules import DEFAULT_PREFIX, check_prefix

if TYPE_CHECKING:
    from apbv.config import RuntimeConfig


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, default=2,
                   help="H, engine ranks (Ray actors) of one replica")
    p.add_argument("--replicas", type=int, default=1,
                   help="R independent rank groups, each with its own queue (R x H actors)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--allow-host", action="append", default=[], metavar="HOST[:PORT]",
                   help="a Host header requests may carry besides the bound address "
                        "(repeatable; without a port, any port; '*': no Host check); others "
                        "are refused with 421 (DNS rebinding)")
    p.add_argument("--read-timeout-s", type=float, default=30.0,
                   help="a request's head, and then its body, must each arrive within this "
                        "many seconds, else 408 and the connection is closed (slowloris; "
                        "default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="the server's log on stderr: a line per finished request and per "
                        "replica event at info (default: %(default)s)")
    p.add_argument("--log-format", default="text", choices=log_format.FORMATS,
                   help="log lines as text, or one JSON object each (default: %(default)s)")
    p.add_argument("--metrics-prefix", default=DEFAULT_PREFIX, help="/metrics names are PREFIX:"
                   "name (vllm: vLLM's dashboards read them; default: %(default)s)")
    p.add_argument("--address", help="join this Ray cluster, with token authentication and "
                                     "the token in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
                                     "~/.ray/auth_token (default: start a private local one)")
    p.add_argument("--media-root", action="append", default=[], metavar="DIR",
                   help="directory whose files requests may name (file:// URLs; repeatable; "
                        "none: every local video is refused)")
    p.add_argument("--allow-media-domain", action="append", default=[], metavar="HOST",
                   help="host whose http(s) video URLs the server downloads (repeatable; none: "
                        "remote media is off)")
    p.add_argument("--allow-webhook-host", action="append", default=[], metavar="HOST",
                   help="host watches may post events to (repeatable; none: webhooks off); a "
                        "private or loopback address only when given by IP")
    p.add_argument("--max-download-mb", type=float, default=512,
                   help="largest remote video in MiB (default: %(default)s)")
    p.add_argument("--download-timeout-s", type=float, default=120,
                   help="wall-clock limit of one whole download, connect, headers and body "
                        "(default: %(default)s)")
    p.add_argument("--max-downloads", type=int, default=4,
                   help="remote videos downloading at once; one more is a 429 (default: "
                        "%(default)s)")
    p.add_argument("--download-cache-mb", type=float, default=2048,
                   help="downloaded videos kept (by content) for repeat questions, in MiB; 0: "
                        "each is deleted when its request is over (default: %(default)s)")
    p.add_argument("--download-dir", help="where the private download directory is made "
                                          "(default: the system temp dir; must be visible to "
                                          "every rank's node)")
    p.add_argument("--max-queue", type=int, default=16, help="requests waiting at most")
    p.add_argument("--api-key", default=os.environ.get("APBV_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: env APBV_API_KEY)")
    p.add_argument("--protect-metrics", action="store_true",
                   help="/metrics asks for the API key too (default: open, as vLLM's; keep "
                        "the port behind a firewall)")
    p.add_argument("--ignore-unsupported-fields", action="store_true",
                   help="report chat fields that would change the answer and are not "
                        "supported (tools, min_p, ...: docs/compatibility.md) as ignored "
                        "instead of refusing the request (default: 400 naming the field)")
    p.add_argument("--vision-cache-gb", type=float,
                   help="per-rank vision-embedding cache in GiB (cache.vision_gb; 0 = off; "
                        "default: a share of a rank's memory left after the model and the "
                        "largest admitted request, printed at start-up)")
    p.add_argument("--hardware", help="cost-model preset for deadline admission (default: cpu "
                                      "on CPU ranks, h200 on GPUs)")
    p.add_argument("--served-model-name", help="model id of /v1/models (default: the "
                                               "checkpoint directory's name)")
    p.add_argument("--threads-per-rank", type=int, default=1, help="torch threads per rank")
    p.add_argument("--gpus-per-rank", type=float,
                   help="GPUs of one rank: 1, or 1/k to put k ranks on one GPU (e.g. 0.5, for "
                        "checks on one GPU; the ranks then talk through gloo), or 0 for CPU "
                        "ranks (default: 1 when the Ray cluster has GPUs and parallel.backend "
                        "is not gloo, else 0)")
    p.add_argument("--stream-memory-gb", type=float,
                   help="per-rank KV budget in GiB shared by the live streams of one replica "
                        "(default: half of parallel.memory_gb when set, else a quarter of the "
                        "host's memory divided by --world-size)")
    p.add_argument("--host-memory-budget-gb", type=float,
                   help="host memory in GiB the requests, live streams, vision cache and "
                        "downloads may hold together; a request past it is refused with 503 "
                        "or 429 naming the figures (default: below Ray's out-of-memory line "
                        "less what the host uses at start and the ranks load, printed at "
                        "start-up; none with --address)")
    p.add_argument("--max-streams", type=int, default=8,
                   help="live streams open at once (default: %(default)s)")
    p.add_argument("--stream-idle-s", type=float, default=600,
                   help="close a live stream no client touched for this long (default: "
                        "%(default)s)")
    p.add_argument("--stream-end-after-s", type=float, default=10.0,
                   help="a stream's source (a followed file or a segment directory) ends after "
                        "this long without news, giving its last frames (0: never; default: "
                        "%(default)s)")
    defaults = Limits()
    for f in dataclasses.fields(Limits):
        p.add_argument("--" + f.name.replace("_", "-"), type=int if f.type == "int" else float,
                       default=getattr(defaults, f.name), help="(default: %(default)s)")


def _limits(args: argparse.Namespace) -> Limits:
    values: dict[str, Any] = {f.name: (int if f.type == "int" else float)(getattr(args, f.name))
                              for f in dataclasses.fields(Limits)}
    return Limits(**values)


def _stream_options(cfg: RuntimeConfig, args: argparse.Namespace, path: str, use_gpu: bool,
                    limits: Limits) -> Any:
    from apbv.serve.streams.budget import GIB, KVSizing, default_budget_gb
    from apbv.serve.streams.routes import StreamOptions

    dtype = cfg.model.dtype
    dtype_bytes = 4 if dtype == "float32" or (dtype == "auto" and not use_gpu) else 2
    budget = args.stream_memory_gb
    if budget is None:
        budget = default_budget_gb(cfg.parallel.memory_gb, args.world_size)
    return StreamOptions(
        budget_bytes=int(budget * GIB), max_streams=args.max_streams,
        idle_s=args.stream_idle_s, end_after_s=args.stream_end_after_s or None,
        sizing=KVSizing.of_checkpoint(path, dtype_bytes, args.world_size,
                                      limits.max_frames_per_push))


def _memory_budget(cfg: RuntimeConfig, args: argparse.Namespace, path: str, use_gpu: bool,
                   policy: MediaPolicy) -> Any:
    """The server's :class:`apbv.serve.scheduler.memory_budget.MemoryBudget` (None with
    ``--address`` and no ``--host-memory-budget-gb``), with the vision cache (CPU ranks) and the
    downloads (a download directory on a tmpfs) among its parts; its size is logged."""
    from apbv import cost
    from apbv.cost.memory import RUNTIME_BYTES
    from apbv.serve.scheduler import memory_budget as mb

    log = logging.getLogger("apbv.serve")
    ranks = args.world_size * args.replicas
    if args.host_memory_budget_gb is not None:
        budget = int(args.host_memory_budget_gb * mb.GIB)
        why = f"host memory budget {budget / mb.GIB:.2f} GiB (--host-memory-budget-gb)"
    elif args.address:
        log.info("no host memory budget: the ranks run on the nodes of the cluster at "
                 "--address (--host-memory-budget-gb sets one)")
        return None
    else:
        dims = cost.checkpoint_dims(path)
        weights = 0 if use_gpu else dims.parameters() * _dtype_bytes(cfg, use_gpu)
        total, available = mb.host_memory()
        budget, why = mb.default_budget_bytes(total, available,
                                              ranks * (weights + RUNTIME_BYTES),
                                              mb.ray_kill_fraction())
    memory = mb.MemoryBudget(budget, mb.served_sizer(path, args.world_size,
                                                     _dtype_bytes(cfg, use_gpu), use_gpu))
    if not use_gpu and cfg.cache.vision_gb > 0:
        cache = int(cfg.cache.vision_gb * mb.GIB) * ranks
        memory.parts["vision cache"] = lambda: cache
    store = policy.store
    if store is not None and mb.on_tmpfs(store.directory):
        downloads = store.budget_bytes + policy.max_downloads * policy.max_download_bytes
        memory.parts["downloads"] = lambda: downloads
    log.info("%s", why)
    return memory


def _dtype_bytes(cfg: RuntimeConfig, use_gpu: bool) -> int:
    """Bytes per weight and activation of ``model.dtype`` (auto: bf16 on GPUs, fp32 on
    CPUs)."""
    dtype = cfg.model.dtype
    return 4 if dtype == "float32" or (dtype == "auto" and not use_gpu) else \
        8 if dtype == "float64" else 2


def check_media_roots(roots: list[str]) -> None:
    """ValueError naming the first ``--media-root`` that is not an existing directory."""
    for root in roots:
        if not os.path.isdir(root):
            what = "is not a directory" if os.path.exists(root) else "does not exist"
            raise ValueError(f"--media-root {root!r} {what}")


def check_port_free(host: str, port: int) -> None:
    """ValueError unless ``port`` can be bound on ``host`` now, as uvicorn will bind it
    (asyncio's ``create_server``: every address ``host`` resolves to, SO_REUSEADDR, an address
    family the host lacks skipped): a busy port is found before Ray and the model start, not
    after. (Another process may still take it in between.)"""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port must be an integer in 0 .. 65535, got {port!r}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r} cannot be resolved: {exc.strerror}") from None
    for family, kind, proto, _, address in set(infos):
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:  # an address family this host does not have
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:
                    continue
                raise ValueError(f"--port {port} cannot be bound on {address[0]} (--host "
                                 f"{host}): {exc.strerror or exc}") from None


def _check_decode_graphs(cfg: RuntimeConfig, gpus_per_rank: float, backend: str | None,
                         world_size: int) -> None:
    """ValueError, before any rank starts, for ``decode.graphs=on`` where the ranks could not
    capture a decode step (CPU ranks, gloo between ranks; ``backend`` as
    :func:`apbv.serve.ranks.placement.group_backend` gives it)."""
    import torch

    from apbv.engine.decode_graph import resolve_graphs

    on_gpu = gpus_per_rank > 0
    resolve_graphs(cfg.decode.graphs, torch.device("cuda" if on_gpu else "cpu"),
                   backend or ("nccl" if on_gpu else "gloo"), world_size)


def _gpus_per_rank(cfg: RuntimeConfig, args: argparse.Namespace, cluster_gpus: float) -> float:
    """``--gpus-per-rank`` (checked by :func:`run_server`), or its default for a Ray cluster
    with ``cluster_gpus`` GPUs."""
    if args.gpus_per_rank is None:
        return 1.0 if cfg.parallel.backend != "gloo" and cluster_gpus >= 1 else 0.0
    need = args.gpus_per_rank * args.world_size * args.replicas
    if cluster_gpus < need:
        raise ValueError(f"--gpus-per-rank {args.gpus_per_rank:g} x --world-size "
                         f"{args.world_size} x --replicas {args.replicas} needs {need:g} GPUs; "
                         f"the Ray cluster has {cluster_gpus:g}")
    return args.gpus_per_rank


def run_server(cfg: RuntimeConfig, args: argparse.Namespace) -> int:
    from apbv.serve.http_guard import HostRule, serve
    from apbv.serve.ranks.placement import check_gpus_per_rank, group_backend
    from apbv.serve.ranks.ray_cluster import init_ray, prepare_ray_env

    if args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.max_download_mb <= 0 or args.download_timeout_s <= 0:
        raise ValueError("--max-download-mb and --download-timeout-s must be > 0, got "
                         f"{args.max_download_mb} and {args.download_timeout_s}")
    if args.max_downloads < 1:
        raise ValueError(f"--max-downloads must be >= 1, got {args.max_downloads}")
    if args.download_cache_mb < 0:
        raise ValueError(f"--download-cache-mb must be >= 0, got {args.download_cache_mb}")
    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.gpus_per_rank is not None:  # before Ray starts
        check_gpus_per_rank(args.gpus_per_rank)
        _check_decode_graphs(cfg, args.gpus_per_rank,
                             group_backend(cfg.parallel.backend, args.gpus_per_rank),
                             args.world_size)
    if args.max_streams < 0 or args.stream_idle_s <= 0 or \
            (args.stream_memory_gb is not None and args.stream_memory_gb <= 0):
        raise ValueError("--max-streams must be >= 0, --stream-idle-s and --stream-memory-gb "
                         f"> 0, got {args.max_streams}, {args.stream_idle_s} and "
                         f"{args.stream_memory_gb}")
    if args.host_memory_budget_gb is not None and not args.host_memory_budget_gb > 0:
        raise ValueError(f"--host-memory-budget-gb must be > 0, got "
                         f"{args.host_memory_budget_gb}")
    if not args.stream_end_after_s >= 0:
        raise ValueError(f"--stream-end-after-s must be >= 0, got {args.stream_end_after_s}")
    check_media_roots(args.media_root)
    check_prefix(args.metrics_prefix)
    check_port_free(args.host, args.port)
    if not args.read_timeout_s > 0:
        raise ValueError(f"--read-timeout-s must be > 0, got {args.read_timeout_s}")
    hosts = HostRule(args.host, args.port, tuple(args.allow_host))
    # The flags are checked: now Ray's environment, before anything imports ray.
    prepare_ray_env(args.address)
    import ray
    from transformers import AutoProcessor

    from apbv.openai.download import MediaStore
    from apbv.serve.app import Server, ServerOptions
    from apbv.serve.ranks.group import RankGroup
    from apbv.serve.scheduler.admission import Admission, cost_decode_prior, cost_predictor
    from apbv.serve.streams.pricing import server_pricing

    log_format.configure(args.log_level, args.log_format)
    if getattr(args, "settings_note", None):  # apbv.cli.serve: --config-file, APBV_SERVE_*
        logging.getLogger("apbv.serve").info("%s", args.settings_note)
    path = os.path.abspath(cfg.model.path)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=path))
    if args.vision_cache_gb is not None:
        cfg = dataclasses.replace(
            cfg, cache=dataclasses.replace(cfg.cache, vision_gb=args.vision_cache_gb))
    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    # the actors inherit the Ray token from their raylet, never through their runtime_env
    env = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}
    init_ray(args.address, args.world_size * args.replicas)
    domains = tuple(h.lower() for h in args.allow_media_domain)
    download_dir = None
    try:
        # private (mode 0700), removed on the way out: downloads and data: URLs' videos
        download_dir = tempfile.mkdtemp(prefix="apbv-media-", dir=args.download_dir)
        gpus_per_rank = _gpus_per_rank(cfg, args, ray.cluster_resources().get("GPU", 0))
        use_gpu = gpus_per_rank > 0
        backend = group_backend(cfg.parallel.backend, gpus_per_rank)
        _check_decode_graphs(cfg, gpus_per_rank, backend, args.world_size)
        limits = _limits(args)
        if args.vision_cache_gb is None:  # on by default, sized from the rank's spare memory
            from apbv.serve.vision_budget import default_vision_gb, ranks_on_this_host

            gb, why = default_vision_gb(cfg, limits, args.world_size,
                                        ranks_on_this_host(args.world_size, args.replicas),
                                        use_gpu)
            cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, vision_gb=gb))
            logging.getLogger("apbv.serve").info("%s", why)
        groups = [RankGroup(cfg, args.world_size, gpus_per_rank=gpus_per_rank, backend=backend,
                            threads=args.threads_per_rank, env=env)
                  for _ in range(args.replicas)]
        hardware = args.hardware or ("h200" if use_gpu else "cpu")
        predictor = cost_predictor(path, args.world_size, hardware)
        decode_s = cost_decode_prior(path, args.world_size, hardware, limits.max_prompt_tokens)
        options = ServerOptions(
            model_name=args.served_model_name or os.path.basename(path.rstrip("/")),
            limits=limits, streams=dataclasses.replace(
                _stream_options(cfg, args, path, use_gpu, limits),
                pricing=server_pricing(path, args.world_size, hardware,
                                       limits.max_frames_per_push, processor.tokenizer)),
            policy=MediaPolicy(tuple(args.media_root), domains,
                               None if download_dir is None else MediaStore(
                                   download_dir, int(args.download_cache_mb * 2**20)),
                               int(args.max_download_mb * 2**20), args.download_timeout_s,
                               args.max_downloads),
            api_key=args.api_key or None, max_queue=args.max_queue, hosts=hosts,
            read_timeout_s=args.read_timeout_s, protect_metrics=args.protect_metrics,
            webhook_hosts=tuple(h.lower() for h in args.allow_webhook_host),
            ignore_unsupported_fields=args.ignore_unsupported_fields,
            metrics_prefix=args.metrics_prefix, log_format=args.log_format)
        memory = _memory_budget(cfg, args, path, use_gpu, options.policy)
        server = Server(cfg, groups, processor, options,
                        [Admission(args.max_queue, predictor, decode_s, memory)
                         for _ in groups])
        if memory is not None and server.streams is not None and not use_gpu:
            registry = server.streams.registry  # the KV of CPU ranks is host memory
            memory.parts["streams"] = lambda: args.world_size * sum(
                s.reserved for s in registry.live.values())
        logging.getLogger("apbv.serve").info(
            "serving %s on http://%s:%d: %d replica(s) x %d rank(s) (%s), media roots %s, "
            "remote hosts %s", options.model_name, args.host, args.port, args.replicas,
            args.world_size, "GPUs" if use_gpu else "CPUs", list(options.policy.roots) or "none",
            list(domains) or "none")
        serve(server.app, args.host, args.port, args.read_timeout_s)
    finally:
        ray.shutdown()
        if download_dir is not None:
            shutil.rmtree(download_dir, ignore_errors=True)
    return 0
