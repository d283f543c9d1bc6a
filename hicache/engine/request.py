"""A request's state inside the engine, and what the engine reports about it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from controller.stats import HIT_TIERS
from hicache.engine.params import SamplingParams
from radix import DEFAULT_NAMESPACE, CacheNamespace


class Status(enum.Enum):
    WAITING = "waiting"  # queued (new or preempted): holds no pages and no ticket
    LOADING = "loading"  # admitted: its cached prefix is still being copied to the GPU
    RUNNING = "running"  # admitted: prefilling or decoding
    FINISHED = "finished"


@dataclass(frozen=True)
class Usage:
    """Token counts of a request; cached_tokens: prompt tokens served from each tier (first admission)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: dict[str, int]

    @property
    def total_cached_tokens(self) -> int:
        return sum(self.cached_tokens.values())


@dataclass(frozen=True)
class StepOutput:
    """What one engine step produced for one request (streaming granularity).

    finish_reason: "stop" (EOS, stop token or stop string), "length" (max_tokens or context),
    "abort", or "error" (then `error` says why; no tokens were generated).
    """

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    usage: Usage
    error: str | None = None
    ttft: float | None = None  # seconds from add_request to the first token, once there is one


@dataclass(frozen=True)
class RequestOutput:
    """The complete result of one request (LLM.generate)."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: dict[str, int]
    ttft: float | None
    error: str | None = None


@dataclass(eq=False)
class Request:
    """Mutable engine-side state of one request; touched only on the engine thread."""

    request_id: str
    prompt_len: int
    token_ids: list[int]  # prompt + generated so far; the last one's KV is not computed yet in decode
    params: SamplingParams
    max_tokens: int
    namespace: CacheNamespace = DEFAULT_NAMESPACE  # the part of the cache it may match and fill (a tenant's)
    arrival: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    ticket: Any = None  # controller LoadTicket while admitted
    pages: list[int] = field(default_factory=list)  # GPU page table; [0, committed_pages) are tree-owned
    computed: int = 0  # tokens whose KV is in `pages`
    committed_pages: int = 0
    admitted_seq: int = -1  # admission order: the newest is preempted first
    cached_tokens: dict[str, int] | None = None
    gap_tokens: int = 0  # prompt tokens computed in a ticket's gap (not hits when a retry finds them on GPU)
    preemptions: int = 0
    prefetched: bool = False  # its disk-only prefix pages were sent towards host memory while it queued
    prefetched_at: float = 0.0  # when its prefix was last matched for prefetch (Scheduler clock)
    prefetch_hold: Any = None  # the controller's PrefetchHold while it queues (released on admission)
    stage: Any = None  # queued: a LoadTicket locking its prefix pages staged on the GPU (engine/waiting.py)
    stage_pages: int = 0  # GPU pages that stage locks
    stage_share: int = 0  # the GPU pages its share was when it last asked to stage
    staged_at: float = float("-inf")  # when it last asked (Scheduler clock)
    awaiting_loads: bool = False  # its committed pages were deduplicated onto pages still loading: not planned
    load_deadline: float = float("inf")  # while LOADING: when it stops waiting for disk reads (Scheduler.settle)
    needs_stream_wait: bool = False
    generator: Any = None
    detokenizer: Any = None
    text: str = ""
    sent_tokens: int = 0  # generated tokens already reported
    sent_chars: int = 0  # characters of `text` already reported
    first_token_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def usage(self) -> Usage:
        cached = self.cached_tokens or {}
        return Usage(self.prompt_len, self.num_output, {t: cached.get(t, 0) for t in HIT_TIERS})

    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival
