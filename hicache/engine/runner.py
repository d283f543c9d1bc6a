"""Run an Engine on a background thread and stream its outputs to asyncio (or any thread-safe sink).

`EngineThread` owns the engine: every engine (and so tree and controller) call happens on its thread.
Other threads talk to it through a thread-safe command queue (submit, abort, call); outputs are handed
to per-request sinks on the engine thread. `AsyncEngine` wraps it for asyncio: each request's outputs
go to an asyncio.Queue through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import cProfile
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from hicache.engine.engine import Engine
from hicache.engine.request import StepOutput, Usage
from radix import DEFAULT_NAMESPACE, TIERS, CacheNamespace

logger = logging.getLogger(__name__)

Sink = Callable[[StepOutput], None]

# how often the engine thread renews the stats it publishes (`stats()`), and whenever the engine runs dry. The
# snapshot only answers /metrics when the engine thread takes over 2 s to: renewing it whenever a request finished
# asked the L3 process for its page count hundreds of times a run, each round trip a GIL handoff on the engine
# thread while the HTTP thread streams tokens (bench/RESULTS.md, 'No-reuse overhead')
STATS_REFRESH_S = 1.0


def error_output(request_id: str, message: str, prompt_tokens: int = 0) -> StepOutput:
    """A final output reporting that a request failed before producing anything."""
    usage = Usage(prompt_tokens, 0, dict.fromkeys(TIERS, 0))
    return StepOutput(request_id, [], "", True, "error", usage, message)


class EngineThread:
    """The engine loop on a daemon thread; submit/abort/call/stats are safe from any thread."""

    def __init__(self, engine: Engine, idle_wait_s: float = 0.05, profile_path: str | None = None):
        """profile_path: run the loop under cProfile and write its stats there (pstats format) at shutdown."""
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.profile_path = profile_path
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._stats: dict[str, Any] = engine.stats()
        self._stats_lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None  # set if the loop died
        self._thread = threading.Thread(target=self._loop, name="hicache-engine", daemon=True)

    def start(self) -> EngineThread:
        self._thread.start()
        return self

    # ------------------------------------------------------------------ any thread

    def submit(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: Any, sink: Sink,
               namespace: CacheNamespace = DEFAULT_NAMESPACE) -> None:
        """Queue a request; `sink` gets its StepOutputs (called on the engine thread) until one is finished.
        `namespace`: the part of the cache it may match and fill (Engine.add_request)."""
        if self.error is not None or self._stop.is_set():
            sink(error_output(request_id, f"engine is not running: {self.error or 'shut down'}"))
            return
        self._commands.put(("add", request_id, list(prompt_token_ids), sampling_params, sink, namespace))

    def abort(self, request_id: str) -> None:
        """Stop a request (its sink gets a final "abort" output) and free its pages."""
        self._commands.put(("abort", request_id))

    def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread; the future holds its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, future))
        return future

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of its last step (no round trip to the engine thread)."""
        with self._stats_lock:
            return self._stats

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the loop has ended (shut down, or died: see `error`); False on timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop (open requests get an "abort" output) and close the engine's cache."""
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        if self.profile_path is None:
            self._run_loop()
            return
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            self._run_loop()
        finally:
            profiler.disable()
            profiler.dump_stats(self.profile_path)
            logger.info("engine thread profile written to %s", self.profile_path)

    def _run_loop(self) -> None:
        stats_due = 0.0
        dry = False  # whether the engine had nothing left to run after the last step
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if self._stop.is_set():
                    break
                outputs = self.engine.step()
                for out in outputs:
                    self._deliver(out)
                now = time.monotonic()
                was_dry, dry = dry, not self.engine.has_unfinished()
                if now >= stats_due or (dry and not was_dry):
                    with self._stats_lock:
                        self._stats = self.engine.stats()
                    stats_due = now + STATS_REFRESH_S
                if not outputs and self.engine.has_unfinished():
                    time.sleep(0.0005)  # waiting on loads or L3 writes: don't spin
            for request_id in list(self._sinks):
                self._abort(request_id)
        except BaseException as e:  # the engine state is unknown now: fail everything, accept nothing
            logger.exception("engine loop died")
            self.error = e
            for request_id, sink in self._sinks.items():
                sink(error_output(request_id, f"engine failure: {e!r}"))
            self._sinks.clear()
        finally:
            self._fail_queued()
            try:
                self.engine.close()
            except Exception:
                logger.exception("closing the engine failed")

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self.idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self, command: tuple[Any, ...]) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, sink, namespace = command
            try:
                self.engine.add_request(request_id, prompt, params, namespace)
            except (ValueError, TypeError) as e:
                sink(error_output(request_id, str(e), len(prompt)))
                return
            self._sinks[request_id] = sink
        elif kind == "abort":
            self._abort(command[1])
        elif kind == "call":
            _, fn, future = command
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as e:
                    future.set_exception(e)

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort(request_id)
        if out is not None:
            self._deliver(out)

    def _deliver(self, out: StepOutput) -> None:
        sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
        if sink is None:
            return
        try:
            sink(out)
        except Exception:
            logger.exception("output sink of %s failed", out.request_id)

    def _fail_queued(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                command[4](error_output(command[1], "engine shut down"))
            elif command[0] == "call":
                command[2].cancel()


class AsyncEngine:
    """asyncio front of an EngineThread: `generate` yields a request's StepOutputs as they come."""

    def __init__(self, engine: Engine, profile_path: str | None = None):
        self.engine = engine
        self.runner = EngineThread(engine, profile_path=profile_path).start()

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (thread safe: encode/decode may be called from the event loop)."""
        return self.engine.tokenizer

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: Any = None,
        namespace: CacheNamespace = DEFAULT_NAMESPACE,
    ) -> AsyncIterator[StepOutput]:
        """Submit a request and yield its outputs until the finished one; closing the iterator aborts it."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[StepOutput] = asyncio.Queue()
        self.runner.submit(
            request_id,
            prompt_token_ids,
            sampling_params,
            lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out),
            namespace,
        )
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.runner.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.runner.abort(request_id)

    async def stats(self) -> dict[str, Any]:
        """A fresh stats snapshot taken on the engine thread."""
        return await asyncio.wrap_future(self.runner.call(lambda engine: engine.stats()))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        self.runner.shutdown(timeout)
