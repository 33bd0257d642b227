"""The H engine ranks as Ray actors in one placement group, one torch.distributed group.

:class:`RankGroup` reserves a placement group for H ranks (1 CPU and ``gpus_per_rank`` GPUs
each; one node when one holds them all, else whole nodes in rank order:
:mod:`apbv.serve.ranks.placement`), starts one :class:`RankActor` per rank, and has every actor
join the process group (rank 0's node and a free port rank 0 picks) and load the engine once. A
GPU actor runs on the device Ray gave it (``cuda:0`` of its own visible set), made the current
device in every thread that runs engine work. :meth:`RankGroup.submit` hands the same operation
(:mod:`apbv.serve.ranks.ops`) to every actor and returns rank 0's outcome; for an answer, rank 0
streams each token id as soon as it is known (a Ray streaming generator fed by the engine's
``on_token`` hook). A request whose ``cancel`` event is set (its client went away) is stopped at
its next decode step: rank 0, the query rank, takes the cancel beside the running request (the
actors take two calls at once) and broadcasts the stop with the next token, so every rank ends
together. A dead actor makes the request fail with :class:`RankLost` naming the rank;
:meth:`RankGroup.rebuild` then starts new actors, a new process group and reloads the model.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, cast

import ray
from ray.exceptions import (
    ActorUnavailableError,
    GetTimeoutError,
    OutOfMemoryError,
    RayActorError,
    RayError,
    RayTaskError,
)
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from apbv.engine.request import RequestCancelled, Result
from apbv.serve.ranks.ops import Op, apply
from apbv.serve.ranks.placement import group_layout, rank_device

if TYPE_CHECKING:
    from apbv.config import RuntimeConfig
    from apbv.engine.engine import Engine
    from apbv.serve.ranks.ops import Outcome, T

PING_TIMEOUT_S = 5.0
"""How long a rank's actor has to answer a ping (:meth:`RankGroup.unanswered`)."""
NO_ANSWER = "did not answer"
"""How :meth:`RankGroup.unanswered` begins the why of a rank that is alive but silent."""
BRIEF_CHARS = 200
"""The most of an error's text a client body carries (:func:`brief`; Ray's run to KBs)."""


class RankLost(RuntimeError):
    """A rank's actor died (or stopped answering) during a request; the group must be
    rebuilt. ``why``: what happened to them (default: the actor died)."""

    def __init__(self, ranks: list[int], detail: str = "", why: str = "actor died"):
        self.ranks, self.why = ranks, why
        super().__init__(f"rank(s) {', '.join(map(str, ranks))} of the engine group were lost "
                         f"({why}){': ' + detail if detail else ''}; the request failed "
                         "and the group is being rebuilt")


class RankActor:
    """One engine rank (wrapped with ``ray.remote`` by :class:`RankGroup`)."""

    def __init__(self, cfg: RuntimeConfig, rank: int, world_size: int, threads: int):
        import torch

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device: torch.device = torch.device("cpu")
        """This rank's device (set by :meth:`setup` from what Ray gave the actor)."""
        self.engine: Engine | None = None
        self.cancelled: int | None = None
        """The ticket of the last request :meth:`cancel` was called for."""
        self.listener: socket.socket | None = None
        """Rank 0's listening socket for the rendezvous store (see :meth:`address`)."""
        torch.set_num_threads(threads)

    def address(self) -> tuple[str, int, int]:
        """(this node's IP, the port of rank 0's rendezvous store, this process id): rank 0
        listens on the node's IP only (127.0.0.1 for a local cluster), not on every interface
        as torch's own TCPStore would, and keeps the socket for :meth:`setup`; other ranks
        (and a single rank) answer port 0."""
        ip = ray.util.get_node_ip_address()
        port = 0
        if self.rank == 0 and self.world_size > 1:
            family = socket.AF_INET6 if ":" in ip else socket.AF_INET
            self.listener = socket.create_server((ip, 0), family=family,
                                                 backlog=socket.SOMAXCONN)
            port = self.listener.getsockname()[1]
        return ip, port, os.getpid()

    def device_given(self) -> str:
        """The device Ray gave this actor: ``cuda:0`` of its visible set, or ``cpu``."""
        return rank_device(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))

    def setup(self, master_addr: str, master_port: int, local_rank: int,
              backend: str | None = None) -> int:
        """Join the process group (``backend``: None picks nccl on a GPU, gloo otherwise) on
        the device Ray gave this actor, and load the engine."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from apbv.distributed import init_distributed
        from apbv.engine.engine import Engine

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                          RANK=str(self.rank), WORLD_SIZE=str(self.world_size),
                          LOCAL_RANK=str(local_rank))
        self.device = torch.device(self.device_given())
        if backend is None:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._use_device()
        timeout_s, startup_s = self.cfg.parallel.timeout_s, self.cfg.parallel.startup_timeout_s
        store = None
        if self.world_size > 1:  # rank 0's store takes over the socket (detach: not closed here)
            fd = None if self.listener is None else self.listener.detach()
            self.listener = None
            store = dist.TCPStore(master_addr, master_port, self.world_size, self.rank == 0,
                                  timedelta(seconds=startup_s), master_listen_fd=fd)
        info = init_distributed(backend=backend, timeout_s=timeout_s, device=self.device,
                                store=store, startup_timeout_s=startup_s)
        self.engine = Engine(self.cfg, info)
        return os.getpid()

    def _use_device(self) -> None:
        """Make this rank's GPU the current device of the calling thread (the current CUDA
        device is per thread, and Ray runs the actor's calls in several threads)."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.set_device(self.device)

    def ping(self) -> int:
        return os.getpid()

    def cancel(self, ticket: int) -> None:
        """Stop the request of ``ticket`` at its next decode step (see :meth:`_stop`)."""
        self.cancelled = ticket

    def _stop(self, ticket: int | None) -> Callable[[], bool] | None:
        """The engine's ``stop`` for the request of ``ticket``: true once it is cancelled (a
        late cancel of a finished request names a ticket no later request has)."""
        return None if ticket is None else lambda: self.cancelled == ticket

    def run(self, op: Op[object], ticket: int | None = None,
            on_token: Callable[[int], None] | None = None) -> Outcome:
        """``op``'s outcome on this rank (:func:`apbv.serve.ranks.ops.apply`); ``ticket``: the
        request :meth:`cancel` may name (its ``stop``)."""
        self._use_device()
        assert self.engine is not None, "setup() loads the engine first"
        out = apply(op, self.engine, on_token=on_token, stop=self._stop(ticket))
        if isinstance(out, Result):
            out.first_logits = None  # a tensor the client never reads
        return out

    def run_tokens(self, op: Op[object], ticket: int | None = None) -> Iterator[int | Outcome]:
        """Yield each token id of ``op``'s answer as soon as it is known, then its outcome."""
        yield from _streamed(lambda on_token: self.run(op, ticket, on_token))


def _streamed(work: Callable[[Callable[[int], None]], Outcome]) -> Iterator[int | Outcome]:
    """Run ``work(on_token)`` in a thread; yield each token id it reports, then its result
    (or raise its error)."""
    items: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            items.put(("result", work(items.put)))
        except BaseException as exc:  # handed to the caller below
            items.put(("error", exc))

    threading.Thread(target=run, daemon=True).start()
    while True:
        item = items.get()
        if isinstance(item, int):
            yield item
        elif item[0] == "result":
            yield item[1]
            return
        else:
            raise item[1]


class RankGroup:
    """H rank actors in one placement group; one request at a time."""

    def __init__(self, cfg: RuntimeConfig, world_size: int, *, gpus_per_rank: float = 0,
                 backend: str | None = None, threads: int = 1,
                 env: dict[str, str] | None = None):
        """``gpus_per_rank``: 0 for CPU ranks, 1, or a fraction (several ranks per GPU, with
        ``backend`` gloo); ``backend``: the process group's (None: nccl on GPUs, else gloo)."""
        self.cfg, self.world_size, self.gpus_per_rank = cfg, world_size, gpus_per_rank
        self.backend = backend
        self.threads, self.env = threads, env or {}
        self.actors: list[ray.actor.ActorHandle[RankActor]] = []
        self.pids: list[int] = []
        self.local_pids: list[int] = []
        """The pids of the ranks on this process's node (their liveness is a local check)."""
        self.pg: PlacementGroup | None = None
        self.tickets = itertools.count(1)

    def start(self) -> None:
        """Reserve the bundles, start the actors, join the process group, load the model."""
        self.start_actors()
        addresses: list[tuple[str, int, int]] = ray.get(
            [a.address.remote() for a in self.actors], timeout=600)
        master, port, _ = addresses[0]  # rank 0 listens on its node's IP
        local_ranks: list[int] = []
        seen: dict[str, int] = {}
        for node_ip, _, _ in addresses:  # index on its node: bundles hold ranks in rank order
            local_ranks.append(seen.get(node_ip, 0))
            seen[node_ip] = local_ranks[-1] + 1
        # Each setup loads the model, then waits up to parallel.startup_timeout_s for the rest.
        setup_s = max(1800.0, self.cfg.parallel.startup_timeout_s + 600.0)
        self.pids = ray.get([a.setup.remote(master, port, lr, self.backend)
                             for a, lr in zip(self.actors, local_ranks)], timeout=setup_s)
        here = ray.util.get_node_ip_address()
        self.local_pids = [pid for pid, (ip, _, _) in zip(self.pids, addresses) if ip == here]

    def start_actors(self) -> None:
        """Reserve the placement group and start one actor per rank (nothing loaded yet)."""
        layout = group_layout(self.world_size, self.gpus_per_rank,
                              [n["Resources"] for n in ray.nodes() if n.get("Alive")])
        self.pg = placement_group(layout.bundles, strategy=layout.strategy)
        ray.get(self.pg.ready(), timeout=600)
        cls = ray.remote(RankActor)
        self.actors = [
            cast("ray.actor.ActorHandle[RankActor]", cls.options(
                num_cpus=1, num_gpus=self.gpus_per_rank, max_concurrency=2,
                max_restarts=0, runtime_env={"env_vars": dict(self.env)},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=bundle),
            ).remote(self.cfg, r, self.world_size, self.threads))
            for r, bundle in enumerate(layout.rank_bundle)
        ]

    def stop(self) -> None:
        """Kill every actor and release the placement group."""
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors, self.pids, self.local_pids = [], [], []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:  # already removed
                pass
            self.pg = None

    def rebuild(self) -> None:
        self.stop()
        self.start()

    def unanswered(self, timeout_s: float = PING_TIMEOUT_S) -> dict[int, str]:
        """The ranks whose actor does not answer a ping, each with why: ``did not answer
        within N s`` (stopped or hung past ``timeout_s``), or any other Ray error as
        :func:`lost_cause` names it (``died``, ``killed by Ray's out-of-memory monitor``, ...).
        Blocking: the pings share one deadline, so it returns within about ``timeout_s``."""
        lost = {}
        refs: list[ray.ObjectRef[int]] = [a.ping.remote() for a in self.actors]
        ends = time.monotonic() + timeout_s
        for r, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=max(0.0, ends - time.monotonic()))
            except GetTimeoutError:
                lost[r] = f"{NO_ANSWER} within {timeout_s:g} s"
            except RayError as exc:
                lost[r] = lost_cause(exc)
        return lost

    async def submit(self, op: Op[T], on_token: Callable[[int], None] | None = None,
                     cancel: asyncio.Event | None = None) -> T:
        """Rank 0's outcome of ``op`` handed to every rank alike. For an answer
        (``op.answers``), ``on_token`` (in the event loop) gets each token id from rank 0 as
        soon as it is known, and once ``cancel`` is set the decode stops at its next step (the
        Result's ``finish_reason`` ``cancelled``).

        Raises :class:`RankLost` when an actor died, the engine's ValueError when the op was
        refused on the ranks, RuntimeError for other failures.
        """
        if op.answers:
            return cast("T", await self._streaming(
                lambda ticket: self.actors[0].run_tokens.options(
                    num_returns="streaming").remote(op, ticket),
                [a.run.remote(op) for a in self.actors[1:]], on_token, cancel))
        tasks = [asyncio.ensure_future(_tagged(r, a.run.remote(op)))
                 for r, a in enumerate(self.actors)]
        return cast("T", await self._outcome(tasks))  # every rank ran op: its outcome is a T

    async def _streaming(self, start: Callable[[int], ray.ObjectRefGenerator],
                         others: list[ray.ObjectRef], on_token: Callable[[int], None] | None,
                         cancel: asyncio.Event | None) -> object:
        """Rank 0's streamed result (``start(ticket)``: its generator of token ids, to
        ``on_token`` as they come, then the result) and the other ranks' refs, as in
        :meth:`_outcome`; ``cancel`` set sends rank 0 the cancel of the ticket."""
        ticket = next(self.tickets)
        gen = start(ticket)

        async def rank0() -> object:
            async for ref in gen:
                item = await ref
                if isinstance(item, int):
                    if on_token is not None:
                        on_token(item)
                else:
                    return item
            raise RuntimeError("rank 0 returned no result")

        async def cancel_when_set() -> None:
            assert cancel is not None
            await cancel.wait()
            self.actors[0].cancel.remote(ticket)  # rank 0 is the query rank: it decides

        tasks = [asyncio.ensure_future(rank0())] + [asyncio.ensure_future(_tagged(r + 1, ref))
                                                    for r, ref in enumerate(others)]
        watcher = None if cancel is None else asyncio.ensure_future(cancel_when_set())
        try:
            return await self._outcome(tasks)
        finally:
            if watcher is not None:
                watcher.cancel()

    async def _outcome(self, tasks: Sequence[asyncio.Future]) -> object:
        """The first task's result once every rank is done; RankLost when an actor died (the
        others are not waited for: they may hang in a collective), else the ranks' error."""
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in done if t.exception() is not None]
        if not failed:
            return tasks[0].result()
        lost = await asyncio.to_thread(self.unanswered)
        if lost:
            for t in pending:
                t.cancel()
            raise RankLost(sorted(lost), why=describe_lost(lost))
        await asyncio.gather(*pending, return_exceptions=True)  # the ranks agree on failure
        error = failed[0].exception()
        assert error is not None, "a failed task holds its exception"
        if isinstance(error, RankLost):
            raise error
        cause = error.cause if isinstance(error, RayTaskError) else error
        if isinstance(cause, ValueError):
            raise ValueError(str(cause)) from None
        if isinstance(cause, RequestCancelled):
            raise RequestCancelled(str(cause)) from None
        raise RuntimeError(f"the request failed: {brief(cause or error)}")


def describe_lost(lost: dict[int, str]) -> str:
    """``lost`` (:meth:`RankGroup.unanswered`) in words: ``actor died`` when every rank died,
    else each rank with why (``rank 0 died; rank 1 did not answer within 5 s``)."""
    if set(lost.values()) == {"died"}:
        return "actor died"
    return "; ".join(f"rank {r} {why}" for r, why in sorted(lost.items()))


def lost_cause(exc: BaseException) -> str:
    """What a Ray error from a rank (or its ping) says happened to the rank, briefly (never
    Ray's own text, KBs long): ``killed by Ray's out-of-memory monitor``, ``unavailable``,
    ``died``, or ``lost (TypeName)``."""
    if isinstance(exc, OutOfMemoryError):
        return "killed by Ray's out-of-memory monitor"
    if isinstance(exc, ActorUnavailableError):  # a RayActorError too: named apart
        return "unavailable"
    if isinstance(exc, RayActorError):
        return "died"
    return f"lost ({type(exc).__name__})"


def brief(exc: BaseException) -> str:
    """``TypeName: the first line of its text``, at most :data:`BRIEF_CHARS` characters of
    it: what a client body may carry of an error."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    if len(text) > BRIEF_CHARS:
        text = text[:BRIEF_CHARS] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def _tagged(rank: int, ref: ray.ObjectRef) -> object:
    """``ref``'s value; :class:`RankLost` for a Ray error that means the rank is gone (any but
    the rank's own exception, :class:`RayTaskError`, and a timeout)."""
    try:
        return await ref
    except (RayTaskError, GetTimeoutError):
        raise
    except RayError as exc:
        raise RankLost([rank], type(exc).__name__,
                       why=describe_lost({rank: lost_cause(exc)})) from exc
