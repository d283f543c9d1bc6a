"""A timed replay: the server's scheduler and tier controller over metadata pools, on a simulated clock.

`hicache replay` without `--no-time` predicts what a request would wait for its first token, and how long a trace
takes, with a given set of tiers. It runs the server's own code, `hicache.engine.scheduler.Scheduler` (admission,
chunked prefill, prefetch of queued requests' disk pages, staging of their host pages on the GPU, read deadlines in
load mode auto, preemption) over the real `TierController`, and gives each thing that takes time its time
(hicache/replay/timed.py for the byte movers):
- a step's forward: its prefill tokens priced as the server's cost model prices them (tokens / prefill speed plus
  the attention term for each token's position) and the engine thread's own time a step (`step_overhead_s`), plus
  `decode_seq_s` per decoding sequence; a step of decodes only costs `decode_step_s` plus the same per sequence;
- host <-> GPU copies at the host bandwidth, L3 reads and writes at the disk's, queued as the server queues them.

Units: one trace block is one page of the tree, and the scheduler counts blocks where the server counts tokens
(its chunk budget is chunk_tokens / block_tokens blocks). A request's prompt is its blocks, plus one block of its
own for tokens past its last full block where the trace names only full blocks (agent sessions). The scheduler
computes a prompt's last block as the step that yields the first token; the request then decodes its output
outside the scheduler (one token per step for every decoding request, many steps at once when nothing else
happens), holding GPU pages for its output, and leaves.

Arrivals: a Mooncake trace or a server trace log arrives open-loop at its timestamps; agent sessions run
closed-loop as `hicache bench agent` runs them (a turn is sent when the previous one has answered, after its think
time x think_scale; sub-agents run beside their parent).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from controller import CostModel, TierController
from hicache.engine.params import SamplingParams
from hicache.engine.request import Request, Status
from hicache.engine.scheduler import Scheduler
from hicache.engine.waiting import PREFETCH_RECHECK_S
from hicache.replay.agent import AgentSession
from hicache.replay.core import ReplayError, ReplaySetup, ReplayTotals
from hicache.replay.store import ReplayL3
from hicache.replay.timed import SimClock, TimedCopier, TimedWorker
from hicache.replay.trace import TraceRecord, block_token
from radix import DISK, HOST, TIERS, RadixTree, namespace_fingerprint
from tiers import MetadataPool

_PARAMS = SamplingParams()  # a simulated request samples nothing; the scheduler does not read it


@dataclass(frozen=True)
class TimeSetup:
    """What a timed replay needs besides the tiers and policies of its ReplaySetup."""

    decode_step_s: float = 0.010  # a step of decodes only, without its sequences' own part
    decode_seq_s: float = 0.0  # each decoding sequence in a step
    step_overhead_s: float = 0.0  # the engine thread's own time a step with prefill, besides the forward
    disk_write_bytes_per_s: float | None = None  # None: the read bandwidth
    disk_read_limit_bytes_per_s: float | None = None  # a cap on the disk's reads (cache.l3.read_limit_gbps)
    disk_shared: bool = True  # reads and writes take turns on one disk (False: an L3 capped per direction)
    max_running: int = 64
    chunk_tokens: int = 2048
    batch_tokens: int = 0
    admit_during_forward: bool = False
    overlap: bool = True
    layered: bool = True  # host -> GPU loads stream in under the forward that reads them (cache.load_policy.layered)
    prefetch: bool = True
    prefetch_host_share: float = 0.5
    prefetch_queue_s: float = 0.25
    stage: bool = True  # queued requests' host pages are copied onto free GPU pages (cache.load_policy.stage)
    l3_queue_pages: int = 4096
    max_context_tokens: int | None = None  # the server's context limit besides the GPU tier (model, config)


@dataclass(eq=False)
class SimRequest(Request):
    """A request of the timed replay: its prompt in blocks, and what it still has to decode."""

    input_length: int = 0  # prompt tokens
    output_length: int = 1  # tokens it generates (the first comes from the prefill's last step)
    record: int = -1  # index in the trace (open loop), -1 for a session turn
    decode_left: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    hits: dict[str, int] = field(default_factory=dict)  # blocks per tier at the first token
    disk_positions: list[int] = field(default_factory=list)  # the prompt's blocks served from disk
    on_finish: Callable[[float], None] | None = None
    # seconds its first token waited for its loads: in LOADING past the GPU's queue at entry (BlockScheduler)
    load_wait_s: float = 0.0
    loading_entry: tuple[float, float] | None = None  # (when it entered LOADING, the GPU's prefill backlog then)


class BlockScheduler(Scheduler):
    """The server's scheduler, counting blocks where it counts tokens: only its prefill backlog, priced by the
    cost model in tokens, needs converting."""

    def __init__(self, controller: TierController, block_tokens: int, t: TimeSetup):
        bt = block_tokens
        super().__init__(controller, t.max_running, max(1, t.chunk_tokens // bt),
                         max(1, t.batch_tokens // bt) if t.batch_tokens else 0, t.admit_during_forward)
        self.block_tokens = bt

    def prefill_backlog_seconds(self) -> float:
        cost, bt = self.ctrl.cost, self.block_tokens
        return sum(cost.prefill_seconds(r.computed * bt, r.input_length) for r in self.running
                   if isinstance(r, SimRequest))

    # What waiting for loads cost a request: the time it spent in LOADING beyond the GPU's prefill backlog when it
    # entered, which it would have queued behind had it computed its prefix instead. The report's load time of a
    # timed replay (summary.summarize): bytes over bandwidth overstates a load the request rode while it queued.
    def _wait_for_loads(self, req: Request, admitted: bool = False) -> None:
        if isinstance(req, SimRequest):
            req.loading_entry = (self.clock(), self.prefill_backlog_seconds())
        super()._wait_for_loads(req, admitted)

    def _start(self, req: Request) -> None:
        if isinstance(req, SimRequest) and req.loading_entry is not None:
            at, backlog = req.loading_entry
            req.load_wait_s += max(0.0, self.clock() - at - backlog)
            req.loading_entry = None
        super()._start(req)


@dataclass
class TimedResult:
    """What a timed replay predicts."""

    duration_s: float
    ttft_s: list[float]
    requests: list[SimRequest]
    prefill_s: float  # with the engine thread's scheduling time of those steps
    decode_s: float
    engine_blocked_s: float
    disk_busy_s: dict[str, float]
    preemptions: int
    gave_up_reads: int
    rejected: int  # requests refused: their prompt is as long as the context limit
    skipped: int  # agent turns not sent: prompt and answer over the context limit (as `bench agent` skips them)

    @property
    def gpu_busy_s(self) -> float:
        return self.prefill_s + self.decode_s


class TimedReplay:
    """One timed replay of a ReplaySetup (tiers, policies, costs) and a TimeSetup; see the module doc."""

    def __init__(self, setup: ReplaySetup, t: TimeSetup):
        setup.check()
        if not setup.prefill_tokens_per_s:
            raise ReplayError("a timed replay needs a prefill speed")
        self.setup, self.t = setup, t
        bt, bb = setup.block_tokens, setup.block_bytes
        self.clock = clock = SimClock()
        tree = RadixTree(1, namespace_fingerprint({"replay_block_tokens": bt}), setup.eviction_policy)
        device = MetadataPool(setup.device_blocks, bb, "device")
        host = MetadataPool(setup.host_blocks, bb, "host") if setup.host_blocks else None
        self.store = ReplayL3(setup.disk_blocks, bb, setup.admission_hits) if setup.disk_blocks else None
        self.copier = TimedCopier(clock, bb, setup.host_to_device_bytes_per_s, layered=t.layered)
        self.worker = None
        if self.store is not None:
            read_bw = setup.disk_to_device_bytes_per_s
            if t.disk_read_limit_bytes_per_s:
                read_bw = min(read_bw or t.disk_read_limit_bytes_per_s, t.disk_read_limit_bytes_per_s)
            write_bw = t.disk_write_bytes_per_s or read_bw
            self.worker = TimedWorker(clock, self.store, bb, read_bw, write_bw, t.l3_queue_pages,
                                      shared=t.disk_shared)
        cost = CostModel(bt, bb, setup.load_mode, setup.prefill_tokens_per_s, setup.host_to_device_bytes_per_s,
                         setup.disk_to_device_bytes_per_s, attention_seconds_per_pair=setup.attention_seconds_per_pair,
                         adaptive=False, overlap=t.overlap, host_streams=t.layered)
        self.ctrl = TierController(tree, device, host, self.store, self.copier, setup.write_policy, cost, self.worker,
                                   setup.disk_blocks or None, prefetch=t.prefetch,
                                   prefetch_host_share=t.prefetch_host_share, prefetch_queue_s=t.prefetch_queue_s,
                                   stage=t.stage)
        self.ctrl.loads.clock = clock
        self.sched = BlockScheduler(self.ctrl, bt, t)
        self.sched.clock = clock
        self.totals = ReplayTotals(load_wait_s=dict.fromkeys(TIERS, 0.0))
        self.arrivals: list[tuple[float, int, SimRequest]] = []  # heap: (time, seq, request)
        self._seq = 0
        self.decoding: list[SimRequest] = []
        self.done: list[SimRequest] = []
        self.rejected: list[SimRequest] = []  # as long as the context limit: the server refuses them
        self.skipped: list[SimRequest] = []  # prompt and answer over the context limit: the bench client skips them
        self.busy = {"prefill": 0.0, "decode": 0.0}
        self.progress: Callable[[int], None] | None = None  # called with 1 as each request ends (a progress bar)
        self._tails = 0  # requests' own last blocks (unique tokens)

    # ------------------------------------------------------------------ requests in

    def request(self, hash_tokens: Sequence[int], input_length: int, output_length: int, record: int = -1,
                on_finish: Callable[[float], None] | None = None) -> SimRequest:
        """A request for the prompt whose full blocks have these tree tokens (the trace's ids via block_token)."""
        bt = self.setup.block_tokens
        blocks = list(hash_tokens[: -(-input_length // bt)])
        if len(blocks) * bt < input_length:  # tokens past the last named block: a block of its own
            self._tails += 1
            blocks.append(block_token(f"replay-tail:{self._tails}"))
        out = max(1, output_length)
        decode_blocks = -(-(input_length + out - 1) // bt) - len(blocks)
        self._seq += 1
        return SimRequest(str(self._seq), len(blocks), blocks, _PARAMS, max(0, decode_blocks),
                          input_length=input_length, output_length=out, record=record, on_finish=on_finish)

    @property
    def context_limit(self) -> int:
        """The server's context limit: what the GPU tier holds, the model's positions, the configured cap."""
        limit = self.setup.device_blocks * self.setup.block_tokens
        return min(limit, self.t.max_context_tokens) if self.t.max_context_tokens else limit

    def arrive(self, at: float, req: SimRequest) -> None:
        """Queue req at time `at`. A prompt as long as the context limit is refused, as the server refuses it:
        counted in `rejected`, and its session goes on."""
        req.arrival = at
        limit = self.context_limit
        if req.input_length >= limit:
            self.rejected.append(req)
            if req.on_finish is not None:
                req.on_finish(at)
            return
        req.output_length = min(req.output_length, limit - req.input_length)
        heapq.heappush(self.arrivals, (at, int(req.request_id), req))

    def _admit_arrivals(self) -> None:
        now = self.clock.now
        while self.arrivals and self.arrivals[0][0] <= now:
            self.sched.add(heapq.heappop(self.arrivals)[2])

    # ------------------------------------------------------------------ the loop

    def _forward_seconds(self, plan: Sequence[tuple[Request, int]], steps: int = 1) -> tuple[float, float]:
        """(prefill seconds, decode seconds) of `steps` steps running `plan` (its tokens over all of them) beside
        the decoding requests."""
        bt, cost = self.setup.block_tokens, self.ctrl.cost
        prefill = 0.0
        for req, n in plan:
            assert isinstance(req, SimRequest)
            prefill += cost.prefill_seconds(req.computed * bt, min((req.computed + n) * bt, req.input_length))
        decode = len(self.decoding) * self.t.decode_seq_s
        if plan:
            prefill += self.t.step_overhead_s * steps
        elif self.decoding:
            decode += self.t.decode_step_s  # its fit already holds the engine thread's time of such a step
        return prefill, decode * steps

    def _next_event(self) -> float | None:
        """The earliest moment something changes without a step: an arrival, a copy or disk job ending, a loading
        request's read deadline."""
        times = [self.arrivals[0][0]] if self.arrivals else []
        for end in (self.copier.next_end(), self.worker.next_end() if self.worker is not None else None):
            if end is not None:
                times.append(end)
        now = self.clock.now  # a deadline passed and not acted on waits for its reads (their ends are above)
        times += [r.load_deadline for r in self.sched.loading if now < r.load_deadline != float("inf")]
        return min(times) if times else None

    def _decode_steps(self, step_s: float) -> int:
        """How many decode-only steps run before anything else can happen: until the first decoding request
        finishes or the next event."""
        k = min(r.decode_left for r in self.decoding)
        event = self._next_event()
        if event is not None and step_s > 0:
            k = min(k, max(1, math.ceil((event - self.clock.now) / step_s)))
        return max(1, k)

    def _stretch(self, plan: list[tuple[Request, int]]) -> tuple[list[tuple[Request, int]], int]:
        """A plan of one request's prefill chunk, widened to the next k chunks where the scheduler would plan
        nothing else until they are done: nothing loading, no gap, its own backlog keeping admission shut
        (`_admit` admits below one chunk of backlog), no decoding request finishing, and no arrival or prefetch
        recheck due before the last of them starts. The same prefill seconds, k decode tokens for
        the decoding requests, one commit: a long prompt costs the replay one step instead of k. (plan, k)."""
        sched = self.sched
        chunk = sched.chunk_tokens
        if len(plan) != 1 or sched.loading:
            return plan, 1
        req, n = plan[0]
        if n != chunk or not isinstance(req, SimRequest) or req.ticket is None or req.ticket.gap is not None:
            return plan, 1
        k = (len(req.token_ids) - req.computed - 1) // chunk
        if sched.admit_during_forward:  # admission runs during each forward, counting its chunk as computed: it
            k -= 1  # would open one chunk sooner (Scheduler.admit_ahead)
        if self.decoding:
            k = min(k, min(r.decode_left for r in self.decoding))
        if k <= 1:
            return plan, 1
        # I/O that ends meanwhile changes nothing the plan reads (nothing is loading): applied after, as a step's is
        event = self.arrivals[0][0] if self.arrivals else None
        if sched.waiting:  # the front of the queue rechecks its prefetches this often (WaitingQueue.prefetch)
            recheck = self.clock.now + PREFETCH_RECHECK_S
            event = recheck if event is None else min(event, recheck)
        if event is not None:  # step j (0-based) starts after j chunks: the last merged one must start before it
            bt, cost, start = self.setup.block_tokens, self.ctrl.cost, self.clock.now
            per_step = len(self.decoding) * self.t.decode_seq_s + self.t.step_overhead_s
            j = 1
            while j < k:
                start += cost.prefill_seconds((req.computed + (j - 1) * chunk) * bt,
                                              (req.computed + j * chunk) * bt) + per_step
                if start >= event:
                    break
                j += 1
            k = j
        if k <= 1:
            return plan, 1
        need = req.computed + k * chunk - len(req.pages)
        pages = self.ctrl.alloc_device(need) if need > 0 else []
        if pages is None:
            return plan, 1
        req.pages.extend(pages)
        return [(req, k * chunk)], k

    def run(self) -> TimedResult:
        clock, sched = self.clock, self.sched
        while True:
            self._admit_arrivals()
            with sched.step() as plan:
                if plan:
                    plan, steps = self._stretch(plan)
                    waits = sched.before_forward(plan)
                    prefill, decode = self._forward_seconds(plan, steps)
                    # a forward that streams its loads in ends no sooner than they land (its last layer after)
                    landing = max((getattr(h, "end", 0.0) for h in waits), default=0.0) - clock.now
                    prefill += max(0.0, landing - prefill - decode)
                    sched.after_forward(plan)
            if not plan and self.decoding:
                steps = self._decode_steps(self._forward_seconds(plan)[1])
                prefill, decode = self._forward_seconds(plan, steps)
            elif not plan:
                event = self._next_event()
                if event is None:
                    if sched.has_work():
                        raise ReplayError(f"the timed replay stalled at {clock.now:.3f} s with requests queued "
                                          f"and nothing in flight: {sched.queue_lengths()}")
                    break
                clock.advance_to(event)
                continue
            self.busy["prefill"] += prefill
            self.busy["decode"] += decode
            clock.advance_to(clock.now + prefill + decode)
            decoders, self.decoding = self.decoding, []
            if plan:
                sched.advance(plan)
            for req in decoders:
                if req.status is not Status.RUNNING:  # preempted: it decodes again once re-admitted
                    continue
                req.decode_left -= steps
                if req.decode_left > 0:
                    self.decoding.append(req)
                else:
                    self._finish(req)
            for req, _ in plan:
                if isinstance(req, SimRequest) and req.computed == len(req.token_ids):
                    self._prefilled(req)
        self.ctrl.close()
        ttft = [r.first_token_at - r.arrival for r in self.done if r.first_token_at is not None]
        start = min((r.arrival for r in self.done), default=0.0)
        end = max((r.finished_at or 0.0 for r in self.done), default=start)
        return TimedResult(end - start, ttft, self.done, self.busy["prefill"], self.busy["decode"], clock.blocked_s,
                           dict(self.worker.busy_s) if self.worker is not None else {"read": 0.0, "write": 0.0},
                           sched.preemptions, self.ctrl.stats.gave_up_reads, len(self.rejected), len(self.skipped))

    def _prefilled(self, req: SimRequest) -> None:
        """req's prompt is computed: its first token now (the first time), then its output."""
        if req.first_token_at is None:
            req.first_token_at = self.clock.now
            req.decode_left = req.output_length - 1
            self._count(req)
        if req.decode_left <= 0:
            self._finish(req)
            return
        need = req.max_tokens - (len(req.pages) - len(req.token_ids))
        if need > 0:  # GPU pages for the output, as the server holds them (none left: it decodes without)
            pages = self.ctrl.alloc_device(need)
            if pages is not None:
                req.pages.extend(pages)
        self.decoding.append(req)

    def _finish(self, req: SimRequest) -> None:
        self.sched.remove(req)
        req.finished_at = self.clock.now
        self.done.append(req)
        if self.progress is not None:
            self.progress(1)
        if req.on_finish is not None:
            req.on_finish(self.clock.now)

    def _count(self, req: SimRequest) -> None:
        """Credit the request's hits, by tier and position, as the server reports them at the first token."""
        t, bt, cost = self.totals, self.setup.block_tokens, self.ctrl.cost
        t.requests += 1
        t.blocks += len(req.token_ids)
        t.tokens += req.input_length
        t.recompute_s += cost.prefix_compute_seconds(req.input_length)
        hits = dict.fromkeys(TIERS, 0)
        for a, b, tier in req.ticket.hit_runs if req.ticket is not None else ():
            hits[tier] += b - a
            t.hit_compute_s[tier] += cost.prefix_compute_seconds(min(b * bt, req.input_length)) - \
                cost.prefix_compute_seconds(a * bt)
            if tier == DISK:
                req.disk_positions.extend(range(a, b))
        for tier in TIERS:
            t.hit_blocks[tier] += hits[tier]
            t.hit_tokens[tier] += min(hits[tier] * bt, req.input_length)
        t.requests_with_disk_hit += hits[DISK] > 0
        if req.load_wait_s:  # it waits for disk reads; for host copies without any
            assert t.load_wait_s is not None  # a timed replay prices loads by waits (TimedReplay.__init__)
            t.load_wait_s[DISK if hits[DISK] else HOST] += req.load_wait_s
        req.hits = hits


def open_loop(replay: TimedReplay, records: Sequence[TraceRecord]) -> None:
    """Queue a trace's requests at their timestamps (the first at 0)."""
    if not records:
        return
    start = min(r.timestamp_ms for r in records)
    for i, rec in enumerate(records):
        replay.arrive((rec.timestamp_ms - start) / 1e3,
                      replay.request(rec.hash_ids, rec.input_length, rec.output_length, record=i))


def closed_loop(replay: TimedReplay, sessions: Sequence[tuple[str, AgentSession]], output_length: int,
                think_scale: float = 0.0, max_think: float = 60.0, concurrency: int | None = None) -> None:
    """Agent sessions ((hash id scope, session), hicache/replay/agent.py) run as `hicache bench agent` runs them:
    each turn sent when the one before it answered, after its think time x think_scale (at most max_think; none
    before a session's first turn); a group of sub-agents starts together and its parent goes on once all have
    ended; at most `concurrency` top-level sessions at once (None: all)."""
    tokens: dict[tuple[str, Any], int] = {}

    def block(scope: str, h: Any) -> int:
        key = (scope, h)
        tok = tokens.get(key)
        if tok is None:
            tok = tokens[key] = block_token(f"{scope}:{h}")
        return tok

    def walk(scope: str, session: AgentSession, at: float, first: bool, done: Callable[[float], None]) -> None:
        steps = iter(session.steps)

        def next_step(t: float, first: bool = False) -> None:
            step = next(steps, None)
            if step is None:
                done(t)
                return
            if isinstance(step, list):
                left = [len(step)]

                def sub_done(end: float) -> None:
                    left[0] -= 1
                    if not left[0]:
                        next_step(end)

                for sub in step:
                    walk(scope, sub, t, False, sub_done)
                return
            wait = 0.0 if first else min(step.think_s * think_scale, max_think)
            out = min(max(step.output_length, 1), output_length)
            req = replay.request([block(scope, h) for h in step.hash_ids], step.input_length, out,
                                 on_finish=next_step)
            if step.input_length + out > replay.context_limit:  # the bench client does not send it
                replay.skipped.append(req)
                next_step(t + wait)
                return
            replay.arrive(t + wait, req)

        next_step(at, first)

    queue = list(sessions)
    slots = concurrency or len(queue)

    def start_next(t: float) -> None:
        if queue:
            scope, session = queue.pop(0)
            walk(scope, session, t, True, start_next)

    for _ in range(min(slots, len(queue))):
        start_next(0.0)
