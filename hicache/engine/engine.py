"""The engine: requests in, per-step incremental outputs out, over the scheduler, the model and the cache.

`Engine.step()` plans a batch (scheduler), runs one forward over the shared GPU KV pool, samples the
requests whose prompt is fully computed, applies stop conditions and reports what changed. Not thread
safe: drive it from one thread (see hicache.engine.runner for a background-thread runner).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hicache.config import SchedulerConfig
from hicache.engine.cuda_graph import DecodeGraphs, decode_graph_pages
from hicache.engine.host_io import HostStaging
from hicache.engine.model import ForwardBatch
from hicache.engine.params import SamplingParams
from hicache.engine.request import Request, Status, StepOutput
from hicache.engine.sampling import make_generator, sample
from hicache.engine.scheduler import Scheduler
from hicache.gc_stats import GcTimer
from tiers import LaunchLater

logger = logging.getLogger(__name__)


def find_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    """Index of the earliest stop string in text[start:], or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


ALIGN_INT64 = 2  # 16 bytes


def pack_aligned(parts: Sequence[np.ndarray]) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Concatenate int64 arrays, each starting 16 bytes aligned (zeros pad the gaps); returns the array and each
    part's [start, end). The device views of the parts are then 16-byte aligned too, as Triton assumes when it
    compiles a kernel for its pointer arguments: a page table at an 8-byte offset made the prefix kernel compile
    a second variant (~0.4 s) in the middle of serving (bench/RESULTS.md, ninth session)."""
    offsets, chunks, at = [], [], 0
    for part in parts:
        offsets.append((at, at + len(part)))
        pad = -len(part) % ALIGN_INT64
        chunks.append(part)
        if pad:
            chunks.append(np.zeros(pad, dtype=np.int64))
        at += len(part) + pad
    return (np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)), offsets


class Engine:
    """Continuous-batching generation over a CacheStack; every tree/controller call happens in step()."""

    def __init__(
        self, model: Any, tokenizer: Any, cache: Any, config: SchedulerConfig | None = None,
        cuda_graph_max_batch: int = 0,
    ):
        """cuda_graph_max_batch > 0 captures decode CUDA graphs up to that batch (CUDA and the decode kernel only)."""
        config = config or SchedulerConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.cache = cache
        self.ctrl = cache.controller
        self.kv = self.ctrl.device.kv
        self.page_size = cache.layout.page_size
        self.device = model.device
        self.config = config
        self.scheduler = Scheduler(
            self.ctrl, config.max_running_requests, config.chunk_tokens, config.prefill_batch_tokens
        )
        limit = model.config.max_position_embeddings
        self.max_context = min(config.max_context_tokens or limit, limit)
        self.eos_ids = set(tokenizer.eos_token_ids) | set(model.config.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._pending: list[StepOutput] = []  # errors found at add_request, reported by the next step
        self.counters = {
            "steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "forward_s": 0.0, "finished": 0, "graph_steps": 0,
            "schedule_s": 0.0, "inputs_s": 0.0, "overlapped_s": 0.0,
        }
        if (config.launch_loads_after_forward or config.admit_during_forward) and self.ctrl.copier is not None:
            self.ctrl.copier = LaunchLater(self.ctrl.copier)  # after calibration, which timed the copier itself
            logger.info("page loads start once each step's forward is queued (scheduler.launch_loads_after_forward)")
        # admit for the next step while the forward runs (scheduler.admit_during_forward); its loads and backups
        # wait only for the compute queued before that forward (LaunchLater.pin_fence)
        self.admit_during_forward = config.admit_during_forward
        if self.admit_during_forward:
            logger.info("the next step's admissions run during each forward (scheduler.admit_during_forward)")
        self.staging = HostStaging(self.device) if self.device.type == "cuda" else None
        self._step_log: Any = None  # open_step_log: one JSON line per forward step
        self._step_log_start = self._step_log_last = 0.0
        # step-log lines waiting for their GPU timing events (CUDA): written in order once the events complete
        self._step_log_pending: list[tuple[dict[str, Any], tuple[torch.cuda.Event, ...] | None]] = []
        self._trace: dict[str, Any] | None = None  # trace_gpu: the profiler window
        self._gc_timer: GcTimer | None = None  # the step log's garbage-collection time
        self.graphs: DecodeGraphs | None = None
        max_batch = min(cuda_graph_max_batch, config.max_running_requests)
        if max_batch > 0 and self.device.type == "cuda" and model.uses_decode_kernel(self.page_size):
            if self.ctrl.device.used_pages():
                raise RuntimeError("decode CUDA graphs must be captured before the GPU pool holds any KV")
            pages = decode_graph_pages(self.max_context, self.page_size, self.ctrl.device.capacity_pages)
            self.graphs = DecodeGraphs(model, self.kv, self.page_size, max_batch, pages).capture()
        elif max_batch > 0:
            logger.info("decode CUDA graphs off: they need CUDA and the paged decode kernel (Triton)")

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: Any = None) -> None:
        """Queue a request. Bad prompts or limits do not raise: the next step() reports an "error" output.

        Raises ValueError only for a request id already in use or invalid sampling parameters.
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = SamplingParams.of(sampling_params)
        prompt = [int(t) for t in prompt_token_ids]
        max_tokens = min(params.max_tokens or self.config.default_max_tokens, max(self.max_context - len(prompt), 1))
        req = Request(request_id, len(prompt), prompt, params, max_tokens)
        error = self._check(req)
        if error is not None:
            req.status, req.finish_reason, req.error = Status.FINISHED, "error", error
            self._pending.append(self._output(req))
            return
        req.generator = make_generator(params, self.device)
        req.detokenizer = self.tokenizer.detokenizer()
        self.requests[request_id] = req
        self.scheduler.add(req)

    def _check(self, req: Request) -> str | None:
        n = req.prompt_len
        if n == 0:
            return "the prompt is empty"
        vocab = self.model.config.vocab_size
        if min(req.token_ids) < 0 or max(req.token_ids) >= vocab:
            return f"prompt token ids must be in [0, {vocab})"
        if n >= self.max_context:
            return f"the prompt has {n} tokens; the context limit is {self.max_context}"
        # the last token's KV is never computed: prompt + max_tokens - 1 slots at most
        need = -(-(n + req.max_tokens - 1) // self.page_size)
        have = self.ctrl.device.capacity_pages
        if need > have:
            return (
                f"the request needs {need} GPU pages (prompt {n} + max_tokens {req.max_tokens} tokens, "
                f"{self.page_size} per page) but the GPU pool has only {have}"
            )
        return None

    def abort(self, request_id: str) -> StepOutput | None:
        """Stop a request and free its pages; returns its final output (None for an unknown id)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.remove(req)
        req.finish_reason = "abort"
        return self._output(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._pending or self.scheduler.has_work())

    # ------------------------------------------------------------------ one step

    def open_step_log(self, path: str) -> None:
        """Append one JSON line per forward step to `path` (closed by `close`): when it ran, how long scheduling and
        the forward took, the tokens and sequences in it, the queues and GPU pages in use after it. What the
        aggregate counters cannot show: which steps are decode-only, where the engine waits, how admission moves.

        On CUDA each line also has the GPU's view of the step, from events on the compute stream: `wait_ms`, how long
        the stream waited for the copies the step's requests needed, and `gpu_ms`, from the forward's first kernel
        to its last (including any time the GPU idled because the CPU queued kernels more slowly than it ran them:
        compare with `enqueue_ms`, the wall time spent queueing the forward, and `enqueue_cpu_ms`, the engine thread's
        CPU time in it: less CPU than wall time means the thread waited, for the GIL or for a core). `gc_ms` is the time
        Python's garbage collector ran during the step, on any thread (it holds the GIL). A line is written once its
        events complete, so logging never makes the engine wait for the GPU."""
        self._step_log = open(path, "a", buffering=1)  # noqa: SIM115 - kept open until close()
        self._step_log_start = self._step_log_last = time.monotonic()
        if self._gc_timer is None:
            self._gc_timer = GcTimer().install()

    def _log_step(
        self, before: dict[str, Any], plan: Sequence[tuple[Request, int]], first_tokens: int,
        enqueue_s: tuple[float, float], events: tuple[torch.cuda.Event, ...] | None,
    ) -> None:
        now = time.monotonic()
        c, s = self.counters, self.scheduler
        device = self.ctrl.device
        line = {
            "t": round(now - self._step_log_start, 6),
            "gap_ms": round((now - self._step_log_last) * 1e3 - (c["schedule_s"] - before["schedule_s"]) * 1e3
                            - (c["forward_s"] - before["forward_s"]) * 1e3, 3),
            "schedule_ms": round((c["schedule_s"] - before["schedule_s"]) * 1e3, 3),
            # the part of schedule_ms spent after the forward was queued (launching loads, admit_ahead): the GPU is
            # busy meanwhile, unless the forward ends first
            "overlapped_ms": round((c["overlapped_s"] - before["overlapped_s"]) * 1e3, 3),
            "forward_ms": round((c["forward_s"] - before["forward_s"]) * 1e3, 3),
            "enqueue_ms": round(enqueue_s[0] * 1e3, 3),
            "enqueue_cpu_ms": round(enqueue_s[1] * 1e3, 3),
            "gc_ms": round((self._gc_timer.total - before["gc_s"]) * 1e3, 3),
            "sequences": len(plan),
            "prefill_tokens": c["prefill_tokens"] - before["prefill_tokens"],
            "decode_tokens": c["decode_tokens"] - before["decode_tokens"],
            "graph": c["graph_steps"] > before["graph_steps"],
            "first_tokens": first_tokens,
            "waiting": len(s.waiting), "loading": len(s.loading), "running": len(s.running),
            "device_used_pages": device.used_pages(),  # cached and in use, of device.capacity_pages
            # pages freed this step whose copy to host was still in flight: the next forward waits for those copies
            "backup_wait_pages": self.ctrl.stats.backup_waits - before["backup_waits"],
        }
        self._step_log_last = now
        self._step_log_pending.append((line, events))
        self._flush_step_log()

    def _flush_step_log(self, wait: bool = False) -> None:
        """Write the pending step-log lines whose GPU events completed (all of them, waiting, if `wait`), in order."""
        pending = self._step_log_pending
        while pending:
            line, events = pending[0]
            if events is not None:
                if not wait and not events[-1].query():
                    return
                events[-1].synchronize()
                before_waits, start, end = events
                line["wait_ms"] = round(before_waits.elapsed_time(start), 3)
                line["gpu_ms"] = round(start.elapsed_time(end), 3)
            self._step_log.write(json.dumps(line) + "\n")
            pending.pop(0)

    def trace_gpu(self, path: str, first_step: int, steps: int) -> None:
        """Record steps [first_step, first_step + steps) (counted from 0, forward steps only) with torch's profiler:
        a Chrome trace at `path` (open it in Perfetto or chrome://tracing; each step is a range named `step N`) and
        a table of the busiest kernels at `path` + ".txt". For finding where a step's GPU time goes; the profiler
        slows the traced steps a little."""
        if first_step < 0 or steps < 1:
            raise ValueError(f"trace_gpu: first_step must be >= 0 and steps >= 1 (got {first_step}, {steps})")
        self._trace = {"path": path, "first": first_step, "last": first_step + steps, "profiler": None}

    def _trace_begin(self) -> Any:
        """Start the profiler when the traced window begins; the current step's range (a context manager)."""
        t = self._trace
        n = self.counters["steps"]
        if t["profiler"] is None and t["first"] <= n < t["last"]:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            t["profiler"] = profile(activities=activities)
            t["profiler"].__enter__()
            logger.info("GPU trace: recording steps %d-%d", t["first"], t["last"] - 1)
        if t["profiler"] is None:
            return None
        return torch.profiler.record_function(f"step {n}")

    def _trace_end(self) -> None:
        """Stop the profiler and write its files once the window's last step ran."""
        t = self._trace
        if t["profiler"] is None or self.counters["steps"] < t["last"]:
            return
        profiler, self._trace = t["profiler"], None
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(t["path"])
        sort = "cuda_time_total" if self.device.type == "cuda" else "cpu_time_total"
        with open(t["path"] + ".txt", "w") as f:
            f.write(profiler.key_averages().table(sort_by=sort, row_limit=60) + "\n")
        logger.info("GPU trace written to %s (and %s.txt)", t["path"], t["path"])

    def step(self) -> list[StepOutput]:
        """Run one scheduling step and forward; returns outputs of requests that produced tokens or ended."""
        if self._trace is None:
            return self._step()
        scope = self._trace_begin()
        if scope is None:
            return self._step()
        with scope:
            outputs = self._step()
        self._trace_end()
        return outputs

    def _step(self) -> list[StepOutput]:
        outputs, self._pending = self._pending, []
        before = None
        if self._step_log is not None:
            before = dict(self.counters, backup_waits=self.ctrl.stats.backup_waits, gc_s=self._gc_timer.total)
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        self.counters["schedule_s"] += time.perf_counter() - start
        if not plan:
            self.ctrl.launch_loads()  # every admitted request may be waiting for its loads
            if not self.scheduler.has_work():
                self.ctrl.idle()
            return outputs
        events = None
        if before is not None and self.device.type == "cuda":  # the step log's GPU timings (open_step_log)
            events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
            events[0].record()
        for req, _ in plan:
            if req.needs_stream_wait:  # its prefix was copied in from host or L3 on the copy stream
                self.ctrl.stream_wait(req.ticket)
                req.needs_stream_wait = False
        pin = getattr(self.ctrl.copier, "pin_fence", None) if self.admit_during_forward else None
        if pin is not None:
            pin()  # before the forward is queued: what admit_ahead asks for need not wait for it
        start, start_cpu = time.perf_counter(), time.thread_time()
        if events is not None:
            events[1].record()
        logits = self._forward(plan)
        if events is not None:
            events[2].record()
        launch, launch_cpu = time.perf_counter(), time.thread_time()
        if self.admit_during_forward:
            self.scheduler.admit_ahead(plan)
        self.ctrl.launch_loads()  # loads held while scheduling (launch_loads_after_forward) start behind the forward
        overlapped = time.perf_counter() - launch
        self.counters["schedule_s"] += overlapped
        self.counters["overlapped_s"] += overlapped
        enqueue = launch - start, launch_cpu - start_cpu
        start += overlapped  # counted as scheduling, not forward
        rows = [i for i, (req, n) in enumerate(plan) if req.computed + n == len(req.token_ids)]
        reqs = [plan[i][0] for i in rows]
        chosen = []
        if rows:
            chosen = self._download(sample(logits[rows], [r.params for r in reqs], [r.generator for r in reqs]))
        self.counters["forward_s"] += time.perf_counter() - start
        # commit after the sampled tokens reached the host: the GPU -> host backups that commits start are
        # queued after this step's work, so reading the sampled tokens never waits behind them
        start = time.perf_counter()
        self.scheduler.advance(plan)
        self.counters["schedule_s"] += time.perf_counter() - start
        self.counters["steps"] += 1
        for req, n in plan:
            self.counters["decode_tokens" if n == 1 and req.num_output else "prefill_tokens"] += n
        first_tokens = 0
        for req, token in zip(reqs, chosen):
            first_tokens += req.num_output == 0
            self._append(req, token)
            outputs.append(self._output(req))
        if before is not None:
            self._log_step(before, plan, first_tokens, enqueue, events)
        return outputs

    def _forward(self, plan: Sequence[tuple[Request, int]]) -> torch.Tensor:
        ps = self.page_size
        graphs = self.graphs
        if (
            graphs is not None
            and all(n == 1 for _, n in plan)
            and graphs.can_run(len(plan), max(req.computed for req, _ in plan) // ps + 1)
        ):
            self.counters["graph_steps"] += 1
            return graphs.run(
                [req.token_ids[req.computed] for req, _ in plan],
                [req.computed for req, _ in plan],
                [req.pages for req, _ in plan],
            )
        start_inputs = time.perf_counter()
        # one int64 array [ids | positions | slots | page tables | decode rows | decode lens | last rows], sent to
        # the device in one transfer (on CUDA through HostStaging, which no page load in the copy engines delays)
        ids: list[int] = []
        positions, slots, tables = [], [], []
        decode_rows, decode_lens, last_rows = [], [], []
        for req, n in plan:
            start = req.computed
            if n == 1:
                decode_rows.append(len(ids))
                decode_lens.append(start + 1)
            last_rows.append(len(ids) + n - 1)
            ids.extend(req.token_ids[start : start + n])
            table = np.asarray(req.pages[: -(-(start + n) // ps)], dtype=np.int64)
            pos = np.arange(start, start + n, dtype=np.int64)
            positions.append(pos)
            slots.append(table[pos // ps] * ps + pos % ps)  # flat slot of each new token
            tables.append(table)
        extra = [np.asarray(v, dtype=np.int64) for v in (decode_rows, decode_lens, last_rows)]
        no_ints = np.zeros(0, dtype=np.int64)
        packed, offsets = pack_aligned([np.asarray(ids, dtype=np.int64), np.concatenate([no_ints, *positions]),
                                        np.concatenate([no_ints, *slots]), *tables, *extra])
        flat = self.staging.upload(packed) if self.staging is not None else torch.from_numpy(packed).to(self.device)
        views = [flat[start:end] for start, end in offsets]
        ids_d, positions_d, slots_d = views[:3]
        decode_rows_d, decode_lens_d, last_rows_d = views[3 + len(tables) :]
        batch = ForwardBatch(
            input_ids=ids_d,
            positions=positions_d,
            out_slots=slots_d,
            seq_lens=[req.computed + n for req, n in plan],
            new_lens=[n for _, n in plan],
            page_tables=views[3 : 3 + len(tables)],
            decode_rows=decode_rows_d,
            decode_lens=decode_lens_d,
            last_rows=last_rows_d,
        )
        self.counters["inputs_s"] += time.perf_counter() - start_inputs
        return self.model(batch, self.kv, ps)

    def _download(self, tokens: torch.Tensor) -> list[int]:
        """The sampled tokens on the host (through the kernel-written staging buffer on CUDA; see host_io)."""
        return self.staging.download(tokens) if self.staging is not None else tokens.tolist()

    def _append(self, req: Request, token: int) -> None:
        """Add a sampled token; finish the request on a stop condition."""
        req.token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            self._finish(req, "stop")
        elif self._add_text(req, req.detokenizer.push([token])):
            self._finish(req, "stop", flush=False)
        elif req.num_output >= req.max_tokens or len(req.token_ids) >= self.max_context:
            self._finish(req, "length")

    def _add_text(self, req: Request, delta: str) -> bool:
        """Append decoded text; True (text trimmed before it) if it completed a stop string."""
        if not delta:
            return False
        stops = req.params.stop
        start = max(0, len(req.text) - max(map(len, stops), default=0) + 1)
        req.text += delta
        hit = find_stop(req.text, stops, start) if stops else None
        if hit is None:
            return False
        req.text = req.text[:hit]
        return True

    def _finish(self, req: Request, reason: str, flush: bool = True) -> None:
        if flush and self._add_text(req, req.detokenizer.flush()):
            reason = "stop"
        req.finish_reason = reason
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)
        self.counters["finished"] += 1

    def _output(self, req: Request) -> StepOutput:
        """The tokens and text of req not reported yet; text that may begin a stop string is held back."""
        new_ids = req.output_ids[req.sent_tokens :]
        hold = max(map(len, req.params.stop), default=1) - 1
        end = len(req.text) if req.finished else max(req.sent_chars, len(req.text) - hold)
        delta = req.text[req.sent_chars : end]
        req.sent_tokens += len(new_ids)
        req.sent_chars = end
        return StepOutput(
            req.request_id,
            new_ids,
            delta,
            req.finished,
            req.finish_reason,
            req.usage(),
            req.error,
            req.ttft(),
        )

    # ------------------------------------------------------------------ inspection

    def stats(self) -> dict[str, Any]:
        """Cache counters, tier usage, cost model, queue depth and request counts (call on the engine thread)."""
        s = self.scheduler
        return {
            "requests": {"waiting": len(s.waiting), "loading": len(s.loading), "running": len(s.running)},
            "queue_depth": len(s.waiting) + len(s.loading),
            "preemptions": s.preemptions,
            "engine": dict(self.counters),
            "cache": self.ctrl.stats.snapshot(),
            "tiers": self.ctrl.usage(),
            "cost_model": self.ctrl.cost.describe(),
        }

    def close(self) -> None:
        """Abort what is left and close the cache stack (finishes queued L3 writes)."""
        for request_id in list(self.requests):
            self.abort(request_id)
        self.ctrl.launch_loads()  # held loads (a step that failed after scheduling): drained tickets wait for them
        while self.scheduler.draining:
            self.ctrl.poll()
            self.scheduler.settle()
            if self.scheduler.draining:
                time.sleep(0.001)
        if self._trace is not None and self._trace["profiler"] is not None:
            self._trace["last"] = self.counters["steps"]  # the window is cut short: write what was recorded
            self._trace_end()
        if self._step_log is not None:
            self._flush_step_log(wait=True)
            self._step_log.close()
            self._gc_timer.remove()
            self._gc_timer = None
            self._step_log = None
        self.cache.close()
