"""The task that feeds a stream with a ``source`` (started at its open by
:mod:`apbv.serve.streams.routes`): frames from its :class:`apbv.capture.Capture` to its ranks,
appended as pushed frames are (:meth:`StreamRegistry.append
<apbv.serve.streams.registry.StreamRegistry.append>`), in turn with nothing else (the stream's
``lock``)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import torch

from apbv.openai.policy import ClientError

if TYPE_CHECKING:
    from apbv.serve.streams.registry import LiveStream, StreamRegistry


async def feed(registry: StreamRegistry, live: LiveStream) -> None:
    """Move frames from ``live``'s capture to its ranks until the capture ends; a failure is
    kept as the stream's ``error`` (for GET; the stream stays open for asks)."""
    cap, limit = live.capture, registry.limits.max_frames_per_push
    assert cap is not None, "only a stream with a source is fed"
    try:
        while True:
            frames = await asyncio.to_thread(cap.take, limit, timeout=0.5)
            if frames:
                if not live.sized:
                    height, width = frames[0].image.shape[1:]
                    registry.fix_size(live, (height, width))
                batch = torch.stack([f.image for f in frames])
                while True:
                    try:
                        async with live.lock:
                            await registry.append(live, batch, [f.timestamp for f in frames])
                        break
                    except ClientError as exc:
                        if exc.status != 429:  # the queue is full: try again shortly
                            raise
                        await asyncio.sleep(0.25)
            elif cap.stats()["ended"]:
                return
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # kept for GET; the stream stays open for asks
        live.error = f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"
