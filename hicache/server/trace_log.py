"""`--trace-log FILE`: one JSON line per finished request, written off the event loop.

Handlers `submit` a finished request; a background task hashes its prompt pages (in a worker thread)
and appends the line with aiofiles. The line format is hicache.replay.trace's, so `hicache replay FILE`
reads it back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import aiofiles

from hicache.replay.trace import trace_line
from radix import page_keys
from radix.namespace import namespace_seed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinishedRequest:
    """What the trace log needs of one request."""

    timestamp_ms: float  # arrival, wall clock
    prompt_token_ids: Sequence[int]
    output_length: int
    cached_tokens: dict[str, int]
    ttft_ms: float | None
    namespace_id: bytes | None = None  # its cache namespace's (radix.namespace); None: the default one


class TraceLog:
    """Appends trace-log lines for finished requests from a queue; `close` writes what is queued."""

    def __init__(self, path: str, namespace: bytes, page_size: int, max_queue: int = 10000):
        self.path = path
        self.namespace = namespace
        self.page_size = page_size
        self.dropped = 0
        self._queue: asyncio.Queue[FinishedRequest | None] = asyncio.Queue(max_queue)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        async with aiofiles.open(self.path, "a"):  # fail at startup, not at the first request
            pass
        self._task = asyncio.create_task(self._run(), name="hicache-trace-log")

    def submit(self, record: FinishedRequest) -> None:
        """Queue a finished request (never blocks; counts a drop when the queue is full)."""
        try:
            self._queue.put_nowait(record)
        except asyncio.QueueFull:
            self.dropped += 1

    def _lines(self, records: list[FinishedRequest]) -> str:
        """The JSON lines of records (hashes every full prompt page: run in a worker thread)."""
        lines = []
        for r in records:
            # pages of two namespaces never match: their hashes differ, so a replay finds no hit between them
            keys = page_keys(namespace_seed(self.namespace, r.namespace_id), list(r.prompt_token_ids), self.page_size)
            lines.append(trace_line(r.timestamp_ms, len(r.prompt_token_ids), r.output_length, keys,
                                    self.page_size, r.cached_tokens, r.ttft_ms))
        return "".join(lines)

    async def _run(self) -> None:
        async with aiofiles.open(self.path, "a", encoding="utf-8") as f:
            while True:
                record = await self._queue.get()
                if record is None:
                    return
                batch = [record]
                while not self._queue.empty() and batch[-1] is not None:
                    batch.append(self._queue.get_nowait())
                done = batch[-1] is None
                records = [r for r in batch if r is not None]
                try:
                    lines = await asyncio.to_thread(self._lines, records)
                    await f.write(lines)
                    await f.flush()
                except Exception:
                    logger.exception("trace log %s: writing %d lines failed", self.path, len(records))
                if done:
                    return

    async def close(self) -> None:
        """Write everything queued, then stop."""
        if self._task is None:
            return
        await self._queue.put(None)
        await self._task
        self._task = None
