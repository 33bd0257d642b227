"""Offline batch: an OpenAI batch file of chat requests answered with one model load.

    apbv batch -i requests.jsonl -o results.jsonl --model DIR --media-root DIR
    torchrun --nproc-per-node 4 -m apbv batch -i requests.jsonl -o results.jsonl ...

Each input line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body"}``
(OpenAI's batch format); the body is read exactly as the server reads it
(:mod:`apbv.cli.batch_lines`: the strict JSON reader, then :func:`apbv.openai.chat.parse_chat`:
the same fields, limits and media policy: local ``file://`` videos under ``--media-root`` and
``data:`` videos; no downloads). Each output line is ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}``, the body a chat.completion or the error the
server would have answered: a bad body, or a request that fails, is an error row and the run
goes on. The input's envelopes are checked whole before the model loads (a line that is no
request names its number).

Resumable like ``apbv eval`` (:mod:`apbv.eval.store`): rows are appended one fsynced line at a
time under an exclusive lock on ``OUT.lock``; a run on an existing output skips the
``custom_id``\\ s it holds, retries those that failed with a server error (5xx; a 4xx row is
the request's own answer and stays; ``--no-retry-failed`` keeps every row), and
refuses when the settings stored beside it (``OUT_settings.json``: the model, the attention and
video settings, the limits) differ from this run's. A sampled request without a ``seed`` gets
one from its ``custom_id``, so every rank and every resumed run draws the same answer.
Progress goes to stderr; the last line counts the rows written and the failed ones. The exit
status is 0 once every row is written, failed rows included (a failed request is an answer,
not a failed run), 1 with ``--fail-on-error`` when a row failed, and non-zero when the run
itself failed (bad input, refused settings, a rank lost).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from apbv.cli.batch_lines import BATCH_URL, read_requests

if TYPE_CHECKING:
    from apbv.config import RuntimeConfig
    from apbv.distributed import DistInfo
    from apbv.engine.engine import Engine

__all__ = ["BATCH_URL", "read_requests", "run_batch", "main"]


def seeded(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with a seed from ``custom_id`` when it samples without one (the same on every
    rank and every resumed run)."""
    if body.get("temperature") and body.get("seed") is None:
        digest = hashlib.sha256(custom_id.encode()).digest()
        return {**body, "seed": int.from_bytes(digest[:8], "big") >> 1}
    return body


def batch_settings(cfg: RuntimeConfig, limits: Any, world_size: int,
                   groups: int = 1) -> dict[str, Any]:
    """What decides a row's answer, stored beside the output and checked on resume
    (``groups`` only when > 1, so outputs of earlier runs still resume)."""
    from apbv.eval.settings import file_digest

    model = Path(cfg.model.path).resolve()
    extra = {"groups": groups} if groups != 1 else {}
    return json.loads(json.dumps({**extra,
        "model.path": str(model), "model.config_sha256": file_digest(model / "config.json"),
        "model.dtype": cfg.model.dtype, "attention": asdict(cfg.attention),
        "video": asdict(cfg.video), "generate.max_new_tokens": cfg.generate.max_new_tokens,
        "limits": asdict(limits), "world_size": world_size}, default=str))


def settings_path(out: Path) -> Path:
    """``OUT_settings.json`` beside the output ``OUT.jsonl``."""
    return out.with_name(out.stem + "_settings.json")


def _check_settings(path: Path, settings: dict[str, Any]) -> None:
    """Store ``settings`` at ``path``, or ValueError when the stored ones differ."""
    if path.exists():
        stored = json.loads(path.read_text())
        differ = sorted(k for k in set(stored) | set(settings) if stored.get(k) != settings.get(k))
        if differ:
            raise ValueError(f"{path} was written with other settings ({', '.join(differ)} "
                             f"differ); resume with the same ones, or pass another -o")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1) + "\n")


def run_batch(cfg: RuntimeConfig, info: DistInfo, engine: Engine,
              requests: list[dict[str, Any]], out: Path,
              media_roots: tuple[str, ...], *, retry_failed: bool = True,
              progress: TextIO = sys.stderr, limits: Any = None, groups: int = 1) -> int:
    """Answer ``requests`` (:func:`read_requests`) into ``out`` with ``engine`` (every rank
    of a group calls it alike; rank 0 writes); returns the number of failed rows in ``out``.
    ``groups`` > 1: ``info`` is the world's rank, ``engine`` runs on this rank's group
    (:func:`apbv.distributed.rank_groups`); the requests are dealt to the groups in turn and
    each round's rows meet on rank 0 (the file is put back in input order at the end)."""
    from apbv.eval.store import OutputLock, ResultLog
    from apbv.openai.download import MediaStore
    from apbv.openai.policy import Limits, MediaPolicy

    limits = limits or Limits()
    writer = info.rank == 0
    log, lock = ResultLog(out), OutputLock(out)
    if writer:
        lock.acquire()
    try:
        done: dict[str, dict] = {}
        if writer:
            _check_settings(settings_path(out), batch_settings(cfg, limits, info.world_size,
                                                               groups))
            rows, note = log.read_rows("custom_id", what="custom_ids")
            if note:
                print(f"batch: {note}", file=progress)
            kept = [r for r in rows if not retry_failed or not _retried(r)]
            if len(kept) != len(rows):
                log.rewrite(kept)
            done = {r["custom_id"]: r for r in kept}
        answered = _agree(set(done), info)
        todo = [item for item in requests if item["custom_id"] not in answered]
        from apbv.distributed import group_ranks
        from apbv.eval.groups import deal

        size = len(group_ranks(info.world_size, groups)[0])
        mine = [todo[i] for i in deal([1.0] * len(todo), groups)[info.rank // size]]
        rounds = -(-len(todo) // groups)
        if writer:
            print(f"batch: {len(requests)} requests, {len(requests) - len(todo)} done before, "
                  f"{len(todo)} to run", file=progress)
        with tempfile.TemporaryDirectory(prefix="apbv-batch-media-") as media:
            policy = MediaPolicy(media_roots, store=MediaStore(media, 0))
            started = time.monotonic()
            ranks = info if groups == 1 else engine.info  # the ranks answering one request
            n = 0
            for turn in range(rounds):
                if turn >= len(mine):  # this group is done: the others' last round
                    finished = _gather(None, info, groups, size)
                    n = _write(finished, log, writer, n, len(todo), started, progress)
                    continue
                item = mine[turn]
                cid = item["custom_id"]
                status, body = _answer(item, cfg, ranks, engine, limits, policy)
                row = {"id": f"batch_req_{_digest(cid)}", "custom_id": cid,
                       "response": {"status_code": status, "request_id": _completion_id(cid),
                                    "body": body}, "error": None}
                finished = _gather(row, info, groups, size)
                n = _write(finished, log, writer, n, len(todo), started, progress)
        failed = 0
        if writer:
            rows, _ = log.read_rows("custom_id", what="custom_ids")
            if groups > 1:  # rows of a round arrive group by group: put them in input order
                at = {item["custom_id"]: i for i, item in enumerate(requests)}
                rows.sort(key=lambda r: at.get(r["custom_id"], len(at)))
                log.rewrite(rows)
            failed = sum(not _ok(r) for r in rows)
            print(f"batch: done: {len(rows)} rows in {out}, {failed} failed", file=progress,
                  flush=True)
        return failed
    finally:
        log.close()
        if writer:
            lock.release()


def _answer(item: dict[str, Any], cfg: RuntimeConfig, ranks: DistInfo, engine: Engine,
            limits: Any, policy: Any) -> tuple[int, dict[str, Any]]:
    """(status, body) of one request line, as the server would answer its body: a body the
    strict reader refused, a refused field, a failed request each become an error row (400,
    or 500 for a failure that is not the request's fault) and the run goes on. Every rank
    reaches the same outcome: the line's checks end in an agreement (one rank's refusal is
    every rank's among ``ranks``, the engine's group), and the engine agrees on its own
    failures."""
    from apbv.openai import chat as api
    from apbv.openai import responses
    from apbv.openai.download import discard
    from apbv.openai.policy import ClientError, error_body

    cid, call = item["custom_id"], None
    try:
        with _agreement(ranks):
            if item["refused"] is not None:
                raise item["refused"]
            call = api.parse_chat(seeded(cid, item["body"]), cfg, limits, policy,
                                  api_model(item["body"], cfg))
            api.check_request(call.request, limits, engine.model.processor)
        result = engine.generate(call.request)
        return 200, responses.completion(call, _completion_id(cid), result, 0.0,
                                         tokenizer=engine.model.processor.tokenizer)
    except ClientError as exc:
        return exc.status, error_body(exc.status, exc.message, exc.param)
    except ValueError as exc:  # the engine's refusal, raised on every rank
        return 400, error_body(400, str(exc))
    except Exception as exc:  # noqa: BLE001 - a failed row, not a failed run
        return 500, error_body(500, f"{type(exc).__name__}: {str(exc)[:500]}")
    finally:
        discard(call.downloaded if call is not None else None)


def _agreement(info: DistInfo) -> contextlib.AbstractContextManager[None]:
    """:func:`apbv.engine.agree.agreement` over the ranks (nothing to agree on with one)."""
    if info.world_size == 1:
        return contextlib.nullcontext()
    from apbv.engine.agree import agreement

    return agreement(info.group)


def _gather(row: dict[str, Any] | None, info: DistInfo, groups: int,
            size: int) -> list[dict[str, Any]]:
    """The rows this round's groups finished (each from its group's first rank)."""
    if groups == 1:
        return [row] if row is not None else []
    from apbv import comm

    sent = row if info.rank % size == 0 else None
    return [r for r in comm.all_gather_object(sent) if r is not None]


def _write(rows: list[dict[str, Any]], log: Any, writer: bool, n: int, total: int,
           started: float, progress: TextIO) -> int:
    """Append ``rows`` on the writing rank, one progress line each; returns the count so far."""
    for row in rows:
        n += 1
        if writer:
            log.append(row)
            print(f"batch: {n}/{total} {row['custom_id'][:60]} "
                  f"{row['response']['status_code']} ({time.monotonic() - started:.1f} s)",
                  file=progress, flush=True)
    return n


def api_model(body: dict[str, Any], cfg: RuntimeConfig) -> str:
    """The model name a body may give: the checkpoint directory's name (as ``serve``'s
    default ``--served-model-name``), or whatever the body says when it names one."""
    name = Path(cfg.model.path.rstrip("/")).name
    given = body.get("model")
    return given if isinstance(given, str) and given else name


def _ok(row: dict[str, Any]) -> bool:
    return (row.get("response") or {}).get("status_code") == 200


def _retried(row: dict[str, Any]) -> bool:
    """Whether a resume runs ``row``'s request again: a server error (5xx) may pass next
    time; a 4xx is the request's own answer (its line, read the same way, is refused again)."""
    status = (row.get("response") or {}).get("status_code")
    return not isinstance(status, int) or status >= 500


def _digest(custom_id: str) -> str:
    return hashlib.sha256(custom_id.encode()).hexdigest()[:24]


def _completion_id(custom_id: str) -> str:
    return "chatcmpl-" + _digest(custom_id)


def _agree(done: set[str], info: DistInfo) -> set[str]:
    """Rank 0's ``done`` on every rank (the rows only rank 0 read)."""
    if info.world_size == 1:
        return done
    from apbv import comm

    return set(comm.broadcast_object(sorted(done), src=0, group=info.group))


def main(args: argparse.Namespace, cfg: RuntimeConfig) -> int:
    """``apbv batch``: the command line's entry (``args``: -i, -o, --media-root,
    --no-retry-failed, --fail-on-error); the exit status (0 with failed rows unless
    ``--fail-on-error``)."""
    from apbv import import_extra

    for module, package in (("pydantic", "fastapi"), ("uvicorn", "uvicorn")):
        import_extra(module, package=package, extra="serve",
                     purpose="apbv batch (it reads each body as the server does)")
    from apbv.distributed import destroy_distributed, init_distributed, rank_groups
    from apbv.engine.engine import Engine

    if not cfg.model.path:
        raise ValueError("no model: pass --model DIR or set model.path in the config")
    from apbv.openai.policy import Limits

    requests = read_requests(args.input)  # checked whole before the model loads
    roots = tuple(args.media_root) or (str(Path(args.input).resolve().parent),)
    backend = None if cfg.parallel.backend == "auto" else cfg.parallel.backend
    info = init_distributed(backend=backend, timeout_s=cfg.parallel.timeout_s,
                            startup_timeout_s=cfg.parallel.startup_timeout_s)
    out, limits = Path(args.output), Limits()
    groups = getattr(args, "groups", 1)
    try:
        _, group = rank_groups(info, groups)  # a G that does not divide the world: here
        if info.rank == 0:  # refused settings: before the model loads
            _check_settings(settings_path(out), batch_settings(cfg, limits, info.world_size,
                                                               groups))
        failed = run_batch(cfg, info, Engine(cfg, group), requests, out, roots,
                           retry_failed=args.retry_failed, limits=limits, groups=groups)
    finally:
        destroy_distributed()
    return 1 if failed and getattr(args, "fail_on_error", False) else 0
