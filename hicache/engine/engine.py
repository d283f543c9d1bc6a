"""The engine: requests in, per-step incremental outputs out, over the scheduler, the model and the cache.

`Engine.step()` plans a batch (scheduler), runs one forward over the shared GPU KV pool, samples the
requests whose prompt is fully computed, applies stop conditions and reports what changed. Not thread
safe: drive it from one thread (see hicache.engine.runner for a background-thread runner).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hicache.config import SchedulerConfig
from hicache.engine.cuda_graph import DecodeGraphs, decode_graph_pages
from hicache.engine.host_io import HostStaging
from hicache.engine.instruments import GpuTrace, Instruments, StepLog, StepTimes
from hicache.engine.model import ForwardBatch
from hicache.engine.params import SamplingParams
from hicache.engine.request import Request, Status, StepOutput
from hicache.engine.sampling import make_generator, sample
from hicache.engine.scheduler import Scheduler
from radix import DEFAULT_NAMESPACE, CacheNamespace
from tiers.layered_copy import layer_waits

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
    a second variant (~0.4 s) in the middle of serving (bench/gpu/align_probe.py measures it)."""
    offsets, chunks, at = [], [], 0
    for part in parts:
        offsets.append((at, at + len(part)))
        pad = -len(part) % ALIGN_INT64
        chunks.append(part)
        if pad:
            chunks.append(np.zeros(pad, dtype=np.int64))
        at += len(part) + pad
    return (np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)), offsets


class EngineHalted(RuntimeError):
    """The engine cannot go on (a tensor-parallel rank was lost): `Engine.step` lets it through instead of failing
    only the step's requests, and the engine thread then fails every request and stops."""


@dataclass
class ForwardInputs:
    """One forward batch on the host, as sent to the device: one int64 array [ids | positions | slots | page
    tables | decode rows | decode lens | last rows] (`pack_aligned`), each part's [start, end), and the lengths.
    Small and picklable: tensor-parallel ranks receive it in their step's plan."""

    packed: np.ndarray
    offsets: list[tuple[int, int]]
    seq_lens: list[int]
    new_lens: list[int]


def pack_inputs(plan: Sequence[tuple[Request, int]], page_size: int) -> ForwardInputs:
    """The forward inputs of a plan, (request, new tokens) pairs whose pages are allocated."""
    ps = page_size
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
    return ForwardInputs(packed, offsets, [req.computed + n for req, n in plan], [n for _, n in plan])


def unpack_inputs(inputs: ForwardInputs, device: torch.device,
                  upload: Callable[[np.ndarray], torch.Tensor] | None = None) -> ForwardBatch:
    """The ForwardBatch of packed inputs, sent to `device` in one transfer (`upload`: on CUDA through HostStaging,
    which no page load in the copy engines delays)."""
    packed = inputs.packed
    flat = upload(packed) if upload is not None else torch.from_numpy(packed).to(device)
    views = [flat[start:end] for start, end in inputs.offsets]
    tables = len(views) - 6
    ids_d, positions_d, slots_d = views[:3]
    decode_rows_d, decode_lens_d, last_rows_d = views[3 + tables :]
    return ForwardBatch(
        input_ids=ids_d,
        positions=positions_d,
        out_slots=slots_d,
        seq_lens=list(inputs.seq_lens),
        new_lens=list(inputs.new_lens),
        page_tables=views[3 : 3 + tables],
        decode_rows=decode_rows_d,
        decode_lens=decode_lens_d,
        last_rows=last_rows_d,
    )


class Engine:
    """Continuous-batching generation over a CacheStack. The scheduler makes every cache call of a step; the
    engine runs the forward, samples, and reports."""

    def __init__(
        self, model: Any, tokenizer: Any, cache: Any, config: SchedulerConfig | None = None,
        cuda_graph_max_batch: int = 0,
    ):
        """cuda_graph_max_batch > 0 captures decode CUDA graphs up to that batch (CUDA and the decode kernel only)."""
        config = config or SchedulerConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.cache = cache
        self.kv = cache.kv
        self.page_size = cache.layout.page_size
        self.device_pages = cache.sizes.device_pages
        self.device = model.device
        self.config = config
        self.scheduler = Scheduler(
            cache.controller, config.max_running_requests, config.chunk_tokens, config.prefill_batch_tokens,
            admit_during_forward=config.admit_during_forward,
        )
        # the longest sequence it can serve: the model's positions, the configured cap, and what the GPU pool holds
        # for one request alone (its KV cannot live anywhere else while it runs); /v1/models reports it
        limit = min(model.config.max_position_embeddings, self.device_pages * cache.layout.page_size)
        self.max_context = min(config.max_context_tokens or limit, limit)
        self.eos_ids = set(tokenizer.eos_token_ids) | set(model.config.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._pending: list[StepOutput] = []  # errors found at add_request, reported by the next step
        self.counters = {
            "steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "forward_s": 0.0, "finished": 0, "graph_steps": 0,
            "schedule_s": 0.0, "inputs_s": 0.0, "overlapped_s": 0.0,
            # steps with prefill: count, and their scheduling besides what overlapped the forward (the replay's step
            # cost; a decode-only step's scheduling is in its wall time below)
            "prefill_steps": 0, "prefill_schedule_s": 0.0,
            # decode-only steps: count, wall seconds, sequences, sequences squared, sequences x seconds (a line fit)
            "decode_steps": 0, "decode_step_s": 0.0, "decode_step_seqs": 0, "decode_step_seqs2": 0,
            "decode_step_seq_s": 0.0,
        }
        self.times = StepTimes(self.counters)
        self.instruments = Instruments(self.times)
        self.staging = HostStaging(self.device) if self.device.type == "cuda" else None
        self.graphs: DecodeGraphs | None = None
        max_batch = min(cuda_graph_max_batch, config.max_running_requests)
        if max_batch > 0 and self.device.type == "cuda" and model.uses_decode_kernel(self.page_size):
            if self.scheduler.cache_gauges()["device_used_pages"]:
                raise RuntimeError("decode CUDA graphs must be captured before the GPU pool holds any KV")
            pages = decode_graph_pages(self.max_context, self.page_size, self.device_pages)
            self.graphs = DecodeGraphs(model, self.kv, self.page_size, max_batch, pages).capture()
        elif max_batch > 0:
            logger.info("decode CUDA graphs off: they need CUDA and the paged decode kernel (Triton)")

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: Any = None,
                    namespace: CacheNamespace = DEFAULT_NAMESPACE) -> None:
        """Queue a request. Bad prompts or limits do not raise: the next step() reports an "error" output.
        `namespace`: the part of the cache it may match and fill (radix.namespace; a tenant's, a salt's).

        Raises ValueError only for a request id already in use or invalid sampling parameters.
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = SamplingParams.of(sampling_params)
        prompt = [int(t) for t in prompt_token_ids]
        max_tokens = min(params.max_tokens or self.config.default_max_tokens, max(self.max_context - len(prompt), 1))
        req = Request(request_id, len(prompt), prompt, params, max_tokens, namespace)
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
        if n >= self.max_context:  # the context is at most what the GPU pool holds: max_tokens is capped to fit it
            return f"the prompt has {n} tokens; the context limit is {self.max_context}"
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

    def open_step_log(self, path: str) -> StepLog:
        """Append one JSON line per forward step to `path` (closed by `close`): see instruments.StepLog."""
        log = StepLog(path, self.times, self.scheduler.queue_lengths, self.scheduler.cache_gauges,
                      self.device.type == "cuda")
        self.instruments.add(log)
        return log

    def trace_gpu(self, path: str, first_step: int, steps: int) -> GpuTrace:
        """Record steps [first_step, first_step + steps) (counted from 0, forward steps only) with torch's profiler:
        see instruments.GpuTrace."""
        trace = GpuTrace(path, first_step, steps, self.counters, self.device.type == "cuda")
        self.instruments.add(trace)
        return trace

    def step(self) -> list[StepOutput]:
        """Run one scheduling step and forward; returns outputs of requests that produced tokens or ended."""
        outputs, self._pending = self._pending, []
        probe = self.instruments
        probe.begin()
        with self.scheduler.step() as plan:  # every cache call of the step is the scheduler's
            probe.planned(plan)
            if not plan:
                probe.end(plan, 0)
                return outputs
            try:
                waits = self.scheduler.before_forward(plan)  # copies bringing pages the plan reads
                probe.forward_begin()
                logits = self._forward(plan, waits)
                probe.forward_queued()
                self.scheduler.after_forward(plan)  # next-step admission meanwhile; the step's held loads start
                probe.sampling()
                done = [(i, req) for i, (req, n) in enumerate(plan) if req.computed + n == len(req.token_ids)]
                tokens = self._sample(logits, done)
                probe.sampled()
                # commit after the sampled tokens reached the host: the GPU -> host backups that commits start are
                # queued after this step's work, so reading the sampled tokens never waits behind them
                self.scheduler.advance(plan)
            except EngineHalted:
                raise
            except Exception as e:  # noqa: BLE001 - one step's failure ends its requests, not the engine
                outputs.extend(self._fail(plan, e))
                probe.end([], 0)
                return outputs
        first_tokens = 0
        for (_, req), token in zip(done, tokens):
            if isinstance(token, Exception):
                outputs.extend(self._fail([(req, 0)], token))
                continue
            first_tokens += req.num_output == 0
            self._append(req, token)
            outputs.append(self._output(req))
        probe.end(plan, first_tokens)
        return outputs

    def _fail(self, plan: Sequence[tuple[Request, int]], error: Exception) -> list[StepOutput]:
        """A step raised: its requests end with an error output (their pages go back, computed pages stay cached);
        requests outside the step, and the engine, go on."""
        logger.error("a step of %d sequences failed; ending its requests: %r", len(plan), error, exc_info=error)
        outputs = []
        for req in dict.fromkeys(req for req, _ in plan):
            if self.requests.pop(req.request_id, None) is None:
                continue
            self.scheduler.remove(req)
            req.finish_reason, req.error = "error", f"the engine failed while computing this request: {error!r}"
            outputs.append(self._output(req))
        return outputs

    def _sample(self, logits: torch.Tensor, done: list[tuple[int, Request]]) -> list[int | Exception]:
        """The next token of each request whose prompt is computed (rows of `logits`), on the host. Sampling is
        where a request's own parameters act: if the batch raises, each row is sampled alone, so that a row that
        still raises gets its exception in place of a token and the others go on."""
        if not done:
            return []
        rows, reqs = [i for i, _ in done], [req for _, req in done]
        picked = logits[rows]  # a copy (advanced indexing): masking it leaves the forward's buffer alone
        self._hold_stops(picked, reqs)
        try:
            chosen = sample(picked, [r.params for r in reqs], [r.generator for r in reqs])
        except Exception:  # noqa: BLE001 - find the row: one request's parameters must not fail the others
            out: list[int | Exception] = []
            for j, req in enumerate(reqs):
                try:
                    out += self._download(sample(picked[[j]], [req.params], [req.generator]))
                except Exception as e:  # noqa: BLE001
                    out.append(e)
            return out
        return self._download(chosen)

    def _hold_stops(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """Set, in place and in one write, the logits of the stop ids (EOS unless ignore_eos, and stop_token_ids)
        to -inf in the rows of requests short of their min_tokens, so that they cannot be sampled."""
        vocab = logits.shape[-1]
        row_ids: list[int] = []
        token_ids: list[int] = []
        for j, req in enumerate(reqs):
            p = req.params
            if req.num_output < p.min_tokens:
                banned = [t for t in {*p.stop_token_ids, *(() if p.ignore_eos else self.eos_ids)} if t < vocab]
                row_ids += [j] * len(banned)
                token_ids += banned
        if token_ids:
            logits[row_ids, token_ids] = float("-inf")

    def _forward(self, plan: Sequence[tuple[Request, int]], waits: Sequence[Any] = ()) -> torch.Tensor:
        """The plan's logits. `waits`: copies bringing pages it reads, waited for on the GPU before the layers that
        read them (`tiers.layered_copy.layer_waits`; a CUDA graph waits for all of them first)."""
        ps = self.page_size
        graphs = self.graphs
        if (
            graphs is not None
            and all(n == 1 for _, n in plan)
            and graphs.can_run(len(plan), max(req.computed for req, _ in plan) // ps + 1)
        ):
            self.counters["graph_steps"] += 1
            for h in waits:
                if (wait := getattr(h, "stream_wait", None)) is not None:
                    wait()
            return graphs.run(
                [req.token_ids[req.computed] for req, _ in plan],
                [req.computed for req, _ in plan],
                [req.pages for req, _ in plan],
            )
        start_inputs = time.perf_counter()
        inputs = pack_inputs(plan, ps)
        self.counters["inputs_s"] += time.perf_counter() - start_inputs
        return self._run_forward(inputs, waits)

    def _run_forward(self, inputs: ForwardInputs, waits: Sequence[Any] = ()) -> torch.Tensor:
        """The model's logits for a packed batch (tensor parallelism overrides it: every rank runs it at once, each
        waiting for its own copies)."""
        start_inputs = time.perf_counter()
        upload = self.staging.upload if self.staging is not None else None
        batch = unpack_inputs(inputs, self.device, upload)
        self.counters["inputs_s"] += time.perf_counter() - start_inputs
        return self.model(batch, self.kv, self.page_size, before_layer=layer_waits(waits))

    def _download(self, tokens: torch.Tensor) -> list[int]:
        """The sampled tokens on the host (through the kernel-written staging buffer on CUDA; see host_io)."""
        return self.staging.download(tokens) if self.staging is not None else tokens.tolist()

    def _append(self, req: Request, token: int) -> None:
        """Add a sampled token; finish the request on a stop condition."""
        req.token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        p = req.params
        if req.num_output < p.min_tokens:  # too early to stop (its stop ids were not sampleable)
            req.text += req.detokenizer.push([token])
            if req.num_output >= req.max_tokens or len(req.token_ids) >= self.max_context:
                self._finish(req, "length")
        elif token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
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
        queues = s.queue_lengths()
        return {
            "requests": queues,
            "queue_depth": queues["waiting"] + queues["loading"],
            "preemptions": s.preemptions,
            "engine": dict(self.counters),
            **s.cache_report(),
        }

    def close(self) -> None:
        """Abort what is left, close the instruments and the cache stack (finishes queued L3 writes)."""
        for request_id in list(self.requests):
            self.abort(request_id)
        self.scheduler.drain()
        self.instruments.close()
        self.instruments = Instruments(self.times)
        self.cache.close()
