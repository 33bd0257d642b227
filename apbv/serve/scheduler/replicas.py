"""R independent replicas behind one front end, and the rule that picks one per request.

A :class:`Replica` is one rank group (H actors in its own placement group) with its own bounded
queue and one worker task that runs one request at a time on it (chat requests and live-stream
operations alike, :mod:`apbv.serve.ranks.ops`, so a stream's append never interleaves with a
request's collectives); a lost rank fails that replica's in-flight request, the replica rebuilds its
group (status ``degraded``, no new requests while another replica is ready; ``generation``
counts the rebuilds, since the streams the old ranks held are gone) and then serves its queue
again. The chat requests waiting in its queue move to the least loaded ready replicas with
room first (:meth:`Replica.hand_over`): a rebuild reloads the model.

A job that runs past :data:`STALL_FACTOR` times its prediction (and at least
:data:`STALL_FLOOR_S`) makes the replica ping its ranks every :data:`STALL_POLL_S`; while one
does not answer (a stopped or hung process), the replica's status is ``stalled``, naming the
ranks (``/health``, ``apbv:replica_stalled``), and it takes no new requests while another
replica is ready. The job then fails when the ranks' collective timeout (``parallel.timeout_s``)
ends it, with the ranks' ping naming who did not answer, and the group is rebuilt; if they
answer again, the replica is ``ready`` again.

An idle replica (no job running or waiting) pings its ranks every :data:`LIVENESS_POLL_S`, and
``/health`` checks that the processes of the ranks on this node still exist
(:meth:`Replica.check_pids`): a rank that is gone (killed by Ray's out-of-memory monitor or the
kernel's, SIGKILL, crashed: any Ray error of its ping, :func:`apbv.serve.ranks.group.lost_cause`)
makes the replica ``degraded`` at once, naming why (``lost``), and its group is rebuilt without
waiting for a request; the hooks in :attr:`Replica.on_lost` hear of it first (the streams it
held end, :mod:`apbv.serve.streams.registry`). A rank that is alive but does not answer the
idle ping makes it ``stalled`` until it answers again.

:func:`pick` routes a request: to a ready replica that answered the same video recently (its
ranks' vision caches hold the embeddings; the identity is the resolved path, size, mtime in ns
and every sampling field, kept in a bounded LRU per replica, only when the vision cache is on),
otherwise to the least loaded ready replica (queued + running; ties to the lowest index).
Degraded replicas are used only when none is ready (the request waits for the rebuild).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from apbv.engine.request import Request, RequestCancelled, Result
from apbv.openai.download import discard
from apbv.openai.policy import ClientError
from apbv.serve.ranks.group import NO_ANSWER, RankGroup, RankLost, brief, describe_lost
from apbv.serve.scheduler.admission import Admission, Job
from apbv.serve.scheduler.recording import ReplicaMetrics
from apbv.video import video_identity

log = logging.getLogger("apbv.serve")

RECENT_VIDEOS = 256
"""Video identities remembered per replica (least recently answered forgotten first)."""
STALL_FACTOR = 2.0
"""A job running this many times its predicted time (TTFT and decode) gets its ranks pinged."""
STALL_FLOOR_S = 10.0
"""... but not before it ran this long (predictions of short jobs are too rough)."""
STALL_POLL_S = 2.0
"""Seconds between the pings (each waits up to the group's ping timeout) while it runs on."""
LIVENESS_POLL_S = 2.0
"""Seconds between the pings of an idle replica's ranks (a dead rank is found unasked)."""

if TYPE_CHECKING:
    from apbv.openai.chat import ChatCall
    from apbv.serve.ranks.ops import Outcome


class Replica:
    """One rank group, its queue and its worker."""

    def __init__(self, index: int, group: RankGroup, admission: Admission,
                 metrics: ReplicaMetrics,
                 observe: Callable[[Result], None]):
        self.index, self.group, self.admission = index, group, admission
        self.metrics, self.observe = metrics, observe
        self.status = "starting"
        self.peers: list[Replica] = []
        """Every replica of the server (this one included): where waiting jobs may move."""
        self.generation = 0
        self.stalled: list[int] = []
        """The ranks that did not answer while the job ran long (status ``stalled``)."""
        self.lost: str | None = None
        """Why its ranks were lost, while it is ``degraded`` (rebuilding)."""
        self.last_loss = "a rank died"
        """Why its ranks were lost the last time (what its lost streams are told)."""
        self.on_lost: list[Callable[[Replica], None]] = []
        """Called when its ranks are found lost, before the rebuild (``generation`` is the
        new group's already)."""
        self.recent: OrderedDict[tuple, None] = OrderedDict()
        label = str(index)
        metrics.queue_depth.labels(label).set_function(lambda: len(self.admission))
        metrics.running.labels(label).set_function(
            lambda: int(self.admission.running is not None))
        metrics.replica_ready.labels(label).set_function(lambda: int(self.status == "ready"))
        metrics.replica_stalled.labels(label).set_function(lambda: int(bool(self.stalled)))
        metrics.ttft_scale.labels(label).set_function(lambda: self.admission.scale)
        metrics.decode_s.labels(label).set_function(lambda: self.admission.decode_s)

    @property
    def load(self) -> int:
        return len(self.admission) + (self.admission.running is not None)

    def holds(self, identity: tuple | None) -> bool:
        return identity is not None and identity in self.recent

    def remember(self, identity: tuple | None) -> None:
        if identity is None:
            return
        self.recent[identity] = None
        self.recent.move_to_end(identity)
        while len(self.recent) > RECENT_VIDEOS:
            self.recent.popitem(last=False)

    def describe(self) -> dict[str, Any]:
        out = {"replica": self.index, "status": self.status, "queued": len(self.admission),
               "running": self.admission.running is not None, "rank_pids": self.group.pids}
        job = self.admission.running
        if job is not None and job.started is not None:
            out["running_s"] = round(time.monotonic() - job.started, 3)
            out["predicted_s"] = round(self.admission.expected_s(job), 3)
        if self.stalled:
            out["stalled_ranks"] = list(self.stalled)
        if self.lost is not None:
            out["lost"] = self.lost
        return out

    def check_pids(self) -> None:
        """``degraded`` at once, naming the rank, when the process of a rank on this node is
        gone (the next liveness ping rebuilds the group; a stand-in group in tests has no
        ``local_pids``)."""
        if self.status not in ("ready", "stalled"):
            return
        local = set(getattr(self.group, "local_pids", ()))
        gone = [(r, pid) for r, pid in enumerate(self.group.pids)
                if pid in local and not _alive(pid)]
        if gone:
            self.status = "degraded"
            self.lost = "; ".join(f"rank {r}'s process {pid} is gone" for r, pid in gone)
            log.warning("replica %d: %s", self.index, self.lost)

    async def boot(self) -> None:
        """Start the group (actors, process group, model), then serve the queue."""
        started = time.monotonic()
        try:
            await asyncio.to_thread(self.group.start)
        except Exception:
            self.status = "failed"
            log.exception("replica %d failed to start", self.index)
            raise
        self.status = "ready"
        log.info("replica %d ready in %.1f s: %d rank(s), pids %s", self.index,
                 time.monotonic() - started, self.group.world_size, self.group.pids)
        await self.run()

    async def run(self) -> None:
        while True:
            job = await self._next()
            if job is None:
                continue
            job.started = time.monotonic()
            wait = job.started - job.enqueued
            error: ClientError | None = self.admission.expired(job, job.started)
            if error is not None:
                self._finish(job, "deadline_missed", wait, None, error)
                continue
            if job.call is not None:
                self.metrics.queue_wait.observe(wait)
            lost: RankLost | None = None
            try:
                if job.stream_id is not None and job.generation != self.generation:
                    raise ClientError(410, f"stream {job.stream_id!r} was lost with replica "
                                           f"{self.index}'s ranks; open a new stream")
                result = await self._watched(job, self.group.submit(
                    job.op, self._counter(job), job.cancel))
                outcome = "stream" if job.call is None else self._answered(job, job.call, result)
            except RankLost as exc:
                outcome, error = "rank_lost", ClientError(503, f"replica {self.index}: {exc}")
                lost = exc
            except RequestCancelled as exc:  # the client went away before the first token
                outcome, error = "cancelled", ClientError(499, f"the client went away: {exc}")
            except ClientError as exc:  # a live stream's operation after its ranks were lost
                outcome, error = f"refused_{exc.status}", exc
            except ValueError as exc:
                outcome, error = "rejected", ClientError(400, str(exc))
            except Exception as exc:
                log.exception("%s on replica %d failed", job.name, self.index)
                outcome, error = "error", ClientError(500, brief(exc))
            self._finish(job, outcome, wait, None if error else result, error)
            if lost is not None:
                await self._rebuild(_loss_words(lost.ranks, lost.why))

    async def _next(self) -> Job | None:
        """The next job, or None after :data:`LIVENESS_POLL_S` with none (the ranks were
        pinged meanwhile: :meth:`_probe`). A job waiting is taken at once, before any other
        task runs (one that is about to queue its next job, e.g. a watch's next evaluation of
        a round, must not go ahead of what waits: :mod:`apbv.serve.scheduler.fair_order`)."""
        if len(self.admission):
            return await self.admission.next()  # returns without suspending
        waiter = asyncio.ensure_future(self.admission.next())
        try:
            await asyncio.wait([waiter], timeout=LIVENESS_POLL_S)
        finally:
            if not waiter.done():
                waiter.cancel()
                await asyncio.gather(waiter, return_exceptions=True)
        if not waiter.cancelled():  # taken (also when it came as the wait ended)
            return waiter.result()
        await self._probe()
        return None

    async def _probe(self) -> None:
        """Ping the idle ranks: any gone (a Ray error) rebuilds the group now; one alive but
        silent makes the replica ``stalled`` until it answers."""
        try:
            lost = await asyncio.to_thread(self.group.unanswered)
        except Exception as exc:  # the ping itself failed: no verdict on the ranks
            log.warning("replica %d: pinging its ranks failed (%s)", self.index, brief(exc))
            return
        dead = {r: why for r, why in lost.items() if not why.startswith(NO_ANSWER)}
        if dead:
            await self._rebuild(_loss_words(sorted(dead), describe_lost(dead)))
            return
        if lost and not self.stalled:
            log.warning("replica %d is stalled while idle: %s", self.index, describe_lost(lost))
        self.stalled, self.lost = sorted(lost), None
        self.status = "stalled" if lost else "ready"

    def _answered(self, job: Job, call: ChatCall, result: Result) -> str:
        """Learn from a chat request's answer (observed, TTFT and decode rates, its video
        remembered for routing); its outcome. A live stream's questions teach nothing here:
        the streams router observes them."""
        assert job.started is not None
        self.observe(result)
        if not result.vision_cache_hit:  # the case the cost model predicts
            self.admission.learn(job, result.ttft_s)
        self.admission.learn_decode(time.monotonic() - job.started - result.ttft_s,
                                    len(result.token_ids) - 1)
        self.remember(video_identity(call.request.video))
        return "cancelled" if result.finish_reason == "cancelled" else "ok"

    def _finish(self, job: Job, outcome: str, wait: float, result: Outcome,
                error: ClientError | None) -> None:
        """Count, log and answer a job (its result, or ``error``), and let the queue move."""
        self.metrics.finished(job, outcome, result)
        _log_outcome(job, self.index, outcome, wait, result, error)
        if error is None:
            job.future.set_result((result, wait))
        else:
            job.future.set_exception(error)
        self.admission.done(job)
        discard(job.downloaded)

    @staticmethod
    def _counter(job: Job) -> Callable[[int], None]:
        """The ``on_token`` of a running job: counts its tokens (admission's remaining time)
        and hands them to its token queue when it streams."""
        def on_token(token: int) -> None:
            job.generated += 1
            job.token_times.append(time.monotonic())
            if job.tokens is not None:
                job.tokens.put_nowait(token)
        return on_token

    async def _watched(self, job: Job, work: Awaitable[Any]) -> Any:
        """``work``'s outcome; once it ran past :data:`STALL_FACTOR` x the job's prediction (at
        least :data:`STALL_FLOOR_S`), the ranks are pinged every :data:`STALL_POLL_S` and the
        replica is ``stalled`` while one does not answer (see the module docstring)."""
        task = asyncio.ensure_future(work)
        assert job.started is not None
        after = max(STALL_FACTOR * self.admission.expected_s(job), STALL_FLOOR_S)
        try:
            while True:
                left = job.started + after - time.monotonic()
                done, _ = await asyncio.wait([task], timeout=max(left, STALL_POLL_S))
                if done:
                    return task.result()
                lost = await asyncio.to_thread(self.group.unanswered)
                if lost and not self.stalled:
                    log.warning("replica %d is stalled: %s, %.0f s into %s (predicted %.1f s)",
                                self.index, describe_lost(lost),
                                time.monotonic() - job.started, job.name,
                                self.admission.expected_s(job))
                elif self.stalled and not lost:
                    log.info("replica %d: its ranks answer again", self.index)
                self.stalled = sorted(lost)
                if self.status in ("ready", "stalled"):
                    self.status = "stalled" if lost else "ready"
        finally:
            task.cancel()  # only when this wait itself is cancelled (the server stops)
            if self.stalled:
                self.stalled = []
                if self.status == "stalled":
                    self.status = "ready"

    async def _rebuild(self, why: str) -> None:
        """Rebuild the group whose ranks were lost (``why``, in words)."""
        self.status, self.lost, self.last_loss = "degraded", why, why
        self.stalled = []
        self.generation += 1
        self.recent.clear()  # the new ranks' vision caches are empty
        self.metrics.rebuilds.inc()
        moved = self.hand_over()
        log.warning("replica %d lost a rank (%s): rebuilding its group (%d waiting request(s) "
                    "moved to other replicas, %d wait)", self.index, why, len(moved),
                    len(self.admission))
        for hook in self.on_lost:
            try:
                hook(self)
            except Exception:  # one hook's failure must not stop the rebuild
                log.exception("replica %d: a lost-ranks hook failed", self.index)
        started = time.monotonic()
        while True:
            try:
                await asyncio.to_thread(self.group.rebuild)
                self.status, self.lost = "ready", None
                log.info("replica %d rebuilt in %.1f s", self.index, time.monotonic() - started)
                return
            except Exception as exc:  # keep trying: the queue waits for a whole group
                log.warning("replica %d: rebuilding failed (%s: %s); retrying in 2 s",
                            self.index, type(exc).__name__, exc)
                await asyncio.sleep(2.0)


    def hand_over(self) -> list[Job]:
        """Move the waiting chat requests, in their order, each to the least loaded ready peer
        with room, while there is one; live-stream operations stay (their streams lived on
        these ranks). Returns the jobs moved (``job.replica`` is their new replica)."""
        moved = []
        for job in self.admission.waiting():
            if job.stream_id is not None:
                continue
            peers = [r for r in self.peers if r is not self and r.status == "ready"
                     and len(r.admission) < r.admission.max_queue]
            if not peers:
                break
            target = min(peers, key=lambda r: (r.load, r.index))
            self.admission.drop(job)
            target.admission.take(job)
            job.replica = target
            moved.append(job)
        return moved


def _log_outcome(job: Job, replica: int, outcome: str, wait: float, result: Outcome,
                 error: ClientError | None) -> None:
    """One line per finished job: its name, replica, outcome and, for an answer, what it took."""
    head, extra = f"{job.name} on replica {replica}: {outcome}", {"request_id": job.request_id}
    if error is not None:
        log.warning("%s (%d: %s)", head, error.status, error.message, extra=extra)
    elif job.call is None or not isinstance(result, Result):  # a live stream's operation
        log.info("%s, queued %.3f s", head, wait, extra=extra)
    else:
        log.info("%s, %d frames, %d prompt tokens, %d new, TTFT %.3f s, queued %.3f s%s", head,
                 result.frames, result.context_len + result.query_len, len(result.token_ids),
                 result.ttft_s, wait, ", vision cache hit" * result.vision_cache_hit, extra=extra)


def _loss_words(ranks: list[int], why: str) -> str:
    """Lost ``ranks`` and ``why`` (:func:`~apbv.serve.ranks.group.describe_lost`) in words that name
    the ranks: ``rank 1 killed by Ray's out-of-memory monitor``, ``rank(s) 0, 1: actor died``."""
    return why if why.startswith("rank ") else f"rank(s) {', '.join(map(str, ranks))}: {why}"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0: nothing is sent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        return True
    return True


def pick(replicas: list[Replica], request: Request, affinity: bool) -> Replica:
    """The replica for ``request`` (see the module docstring), or 503 when none can take it."""
    usable = [r for r in replicas if r.status == "ready"] or \
        [r for r in replicas if r.status in ("degraded", "stalled")]
    if not usable:
        states = ", ".join(f"{r.index}: {r.status}" for r in replicas)
        raise ClientError(503, f"no engine group is ready (replicas {states}); retry shortly")
    if affinity:
        identity = video_identity(request.video)
        holders = [r for r in usable if r.holds(identity)
                   and len(r.admission) < r.admission.max_queue]
        if holders:
            return min(holders, key=lambda r: (r.load, r.index))
    return min(usable, key=lambda r: (r.load, r.index))


def overall_status(replicas: list[Replica]) -> str:
    states = {r.status for r in replicas}
    for status in ("ready", "stalled", "degraded", "starting"):
        if status in states:
            return status
    return "failed"
