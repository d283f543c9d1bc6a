"""Replay a trace through the real radix tree and tier controller, metadata only (no KV bytes).

Each trace block is one page: the tree runs with page_size=1 and a block's hash id is the
"token" of its page, so tier capacities are in blocks (tokens // block_tokens). Per request:
acquire the cached prefix (every matched block counts: no max_pages, except for a server trace
log, where the server leaves the last prompt token to compute), wait for its loads, allocate GPU
pages for the new blocks (a trace log: also the pages the server held for the partial prompt page
and the generated tokens, freed after the request), commit, release. The controller credits each
used block to the fastest tier that held it.

A request whose blocks do not all fit on the GPU (its cached prefix is locked there, everything
else is evictable) commits the leading new blocks that fit; the rest are not cached anywhere
(`not_cached_blocks`), as a server could not hold them either. A hit cut short (no room to load
a host or disk block) counts only the blocks before the cut; the rest are recomputed
(`matched_not_served_blocks`) and committed like new blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from controller import CostModel, TierController, WritePolicy
from hicache.replay.reuse import ReuseProfile
from hicache.replay.store import InlineWorker, ReplayL3
from hicache.replay.trace import TraceRecord
from radix import DEFAULT_NAMESPACE, DISK, TIERS, CacheNamespace, RadixTree, namespace_fingerprint
from tiers import MetadataPool


class ReplayError(ValueError):
    """An impossible replay setup (e.g. a disk tier without a host tier)."""


@dataclass(frozen=True)
class ReplaySetup:
    """Tier sizes in blocks and the policies of one replay."""

    block_tokens: int
    device_blocks: int
    host_blocks: int = 0
    disk_blocks: int = 0
    block_bytes: int = 0  # KV bytes of one block (kv_bytes_per_token * block_tokens); 0 = unknown
    write_policy: WritePolicy = field(default_factory=WritePolicy)
    eviction_policy: str = "lru"
    admission_hits: int = 0
    load_mode: str = "always"  # controller cost model: always load cached blocks, or "auto" / "never"
    prefill_tokens_per_s: float | None = None  # for load_mode "auto"
    host_to_device_bytes_per_s: float | None = None
    disk_to_device_bytes_per_s: float | None = None
    attention_seconds_per_pair: float = 0.0  # CostModel: deeper blocks cost more to recompute
    assumed_costs: tuple[str, ...] = ()  # cost inputs no flag or config gave (the report names them)

    def check(self) -> None:
        """Raise ReplayError for sizes the controller cannot run."""
        if self.block_tokens < 1:
            raise ReplayError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.device_blocks < 1:
            raise ReplayError(f"the GPU tier needs at least one block ({self.block_tokens} tokens), "
                              f"got {self.device_blocks}")
        if self.host_blocks < 0 or self.disk_blocks < 0:
            raise ReplayError("tier sizes must be >= 0")
        if self.disk_blocks and not self.host_blocks:
            raise ReplayError("the disk tier needs a host tier (pages reach disk through host memory): "
                              "give the host tier a size, or set the disk tier to 0")


@dataclass
class RequestOutcome:
    """What one request got: blocks and tokens per fastest tier, in order of the prompt."""

    blocks: int
    hit_blocks: dict[str, int]
    hit_tokens: dict[str, int]
    disk_hit_positions: list[int]  # indices of the prompt's blocks served from disk
    disk_read_blocks: int
    matched_not_served: int
    not_cached: int


@dataclass
class ReplayTotals:
    """Counters over a replay (see `summary.summarize` for the derived figures)."""

    requests: int = 0
    blocks: int = 0
    tokens: int = 0
    hit_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    requests_with_disk_hit: int = 0
    matched_not_served_blocks: int = 0
    not_cached_blocks: int = 0
    cut_requests: int = 0  # requests longer than the GPU tier: only their first GPU-capacity blocks were cached
    disk_reads: list[tuple[float, int]] = field(default_factory=list)  # (timestamp ms, blocks read)
    disk_hit_depths: list[int] = field(default_factory=list)  # LRU stack depth of each disk hit
    disk_hit_ages_ms: list[float] = field(default_factory=list)
    server_mismatches: list[tuple[int, dict[str, int], dict[str, int]]] = field(default_factory=list)
    server_checked: int = 0  # trace-log requests compared with the server's cached_tokens
    # prefill seconds by the cost model, each token priced at its position in its prompt: all prompt tokens, and
    # the tokens each tier served (a hit is a prompt's first tokens, the cheapest to recompute)
    recompute_s: float = 0.0
    hit_compute_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIERS, 0.0))
    # a timed replay's load cost per tier: the seconds requests waited for their loads beyond the GPU's queue
    # (simulate.BlockScheduler); None: the report prices loads at bytes over bandwidth
    load_wait_s: dict[str, float] | None = None


class _ReplayController(TierController):
    """The tier controller, keeping the (tier, pages) runs of its last match for exact crediting."""

    last_runs: list[tuple[str, int]] = []

    def match(self, tokens: Sequence[int], namespace: CacheNamespace = DEFAULT_NAMESPACE,
              reference: bool = True) -> Any:
        m = super().match(tokens, namespace, reference)
        self.last_runs = [(tier, node.num_pages) for node, tier in m.segments]
        return m


class Replayer:
    """One replay: a fresh tree, metadata pools and controller sized by a ReplaySetup."""

    def __init__(self, setup: ReplaySetup):
        setup.check()
        self.setup = setup
        tree = RadixTree(1, namespace_fingerprint({"replay_block_tokens": setup.block_tokens}),
                         setup.eviction_policy)
        device = MetadataPool(setup.device_blocks, setup.block_bytes, "device")
        host = MetadataPool(setup.host_blocks, setup.block_bytes, "host") if setup.host_blocks else None
        self.store = ReplayL3(setup.disk_blocks, setup.block_bytes, setup.admission_hits) if setup.disk_blocks else None
        worker = InlineWorker(self.store) if self.store is not None else None
        # not adaptive: the server follows the disk's measured speed, but here a "read" is a metadata call whose
        # time says nothing about a disk, and decisions that followed it would differ from run to run
        cost = CostModel(setup.block_tokens, setup.block_bytes, setup.load_mode, setup.prefill_tokens_per_s,
                         setup.host_to_device_bytes_per_s, setup.disk_to_device_bytes_per_s,
                         attention_seconds_per_pair=setup.attention_seconds_per_pair, adaptive=False)
        self.controller = _ReplayController(tree, device, host, self.store, None, setup.write_policy, cost,
                                            worker, setup.disk_blocks or None)
        self.totals = ReplayTotals()

    def step(self, rec: TraceRecord, server_log: bool = False) -> RequestOutcome:
        """Replay one request (see the module doc); updates `totals` except per-trace figures."""
        ctrl = self.controller
        bt = self.setup.block_tokens
        ids = rec.hash_ids
        n = len(ids)
        # a server leaves at least one prompt token to compute, so it never uses a last full page
        max_pages = (rec.input_length - 1) // bt if server_log else None
        read_before = self.store.pages_read if self.store is not None else 0
        # a request is one engine step (`TierController.step`): the server renews its slice of deferred GPU -> host
        # copies every step, and without it the deferred backlog only ever moved when eviction forced it
        with ctrl.step():
            ticket = ctrl.acquire(ids, max_pages)
            if not ticket.ready():
                ctrl.wait_ticket(ticket)
            used = ticket.num_pages
            usable = n if max_pages is None else min(n, max_pages)
            matched_not_served = max(0, min(ticket.matched_pages, usable) - used)
            new = n - used
            # a server also holds GPU pages for the prompt's partial last page and the generated tokens (all
            # but the last are computed): tokens [n * bt, input_length + output_length - 1), freed at the end
            tail = -(-(rec.input_length + max(rec.output_length, 1) - 1) // bt) - n if server_log else 0
            pages = ctrl.alloc_device(new + tail) if new + tail else []
            if pages is None:  # blocks [used, n) do not all fit: commit the leading ones that do
                room = ctrl.device.capacity_pages - used
                pages = (ctrl.alloc_device(room) if room > 0 else None) or []
            private = pages[new:]
            pages = pages[:new]
            if pages:
                ctrl.commit(ticket, ids[: used + len(pages)], ticket.device_pages() + pages)
            ctrl.release(ticket)
            if private:
                ctrl.free_device(private)
            ctrl.poll()  # apply this request's L3 writes now, so the tree is settled between requests

        hit_blocks = dict.fromkeys(TIERS, 0)
        hit_tokens = dict.fromkeys(TIERS, 0)
        hit_compute = dict.fromkeys(TIERS, 0.0)
        cost = ctrl.cost  # a prompt's first t tokens by position; 0 where the prefill speed is unknown
        computed_by = cost.prefix_compute_seconds if cost.prefill_tokens_per_s else lambda t: 0.0
        disk_positions: list[int] = []
        pos = 0
        for tier, count in ctrl.last_runs:  # blocks [0, used) in order, by fastest tier at match time
            take = min(count, used - pos)
            if take <= 0:
                break
            hit_blocks[tier] += take
            hit_tokens[tier] += take * bt
            end = min((pos + take) * bt, rec.input_length)  # the last used block may be the partial one
            hit_compute[tier] += computed_by(end) - computed_by(pos * bt)
            if tier == DISK:
                disk_positions.extend(range(pos, pos + take))
            pos += take
            last_tier = tier
        if used and used * bt > rec.input_length:  # the last used block is the partial one
            hit_tokens[last_tier] -= used * bt - rec.input_length
        out = RequestOutcome(n, hit_blocks, hit_tokens, disk_positions,
                             (self.store.pages_read - read_before) if self.store is not None else 0,
                             matched_not_served, new - len(pages))
        t = self.totals
        t.requests += 1
        t.blocks += n
        t.tokens += rec.input_length
        t.recompute_s += computed_by(rec.input_length)
        for tier in TIERS:
            t.hit_blocks[tier] += hit_blocks[tier]
            t.hit_tokens[tier] += hit_tokens[tier]
            t.hit_compute_s[tier] += hit_compute[tier]
        if hit_blocks[DISK]:
            t.requests_with_disk_hit += 1
        if out.disk_read_blocks:
            t.disk_reads.append((rec.timestamp_ms, out.disk_read_blocks))
        t.matched_not_served_blocks += matched_not_served
        t.not_cached_blocks += out.not_cached
        t.cut_requests += out.not_cached > 0
        if rec.cached_tokens is not None:
            t.server_checked += 1
            if rec.cached_tokens != hit_tokens:
                t.server_mismatches.append((rec.line, dict(rec.cached_tokens), hit_tokens))
        return out

    def run(self, records: Sequence[TraceRecord], reuse: ReuseProfile | None = None, server_log: bool = False,
            progress: Callable[[int], None] | None = None) -> ReplayTotals:
        """Replay records in file order; `reuse` adds stack depth and age of each disk hit."""
        t = self.totals
        for i, rec in enumerate(records):
            out = self.step(rec, server_log)
            if reuse is not None and out.disk_hit_positions:
                depths, ages = reuse.depths[i], reuse.ages_ms[i]
                t.disk_hit_depths.extend(depths[p] for p in out.disk_hit_positions)
                t.disk_hit_ages_ms.extend(ages[p] for p in out.disk_hit_positions)
            if progress is not None:
                progress(out.blocks)
        self.controller.close()
        return t

    def check_integrity(self) -> None:
        """The controller's and tree's integrity checks (tests call it after every step)."""
        self.controller.check_integrity()

    def residency(self) -> dict[str, set]:
        """Block ids resident per tier now (tests compare them with a reference model)."""
        out: dict[str, set] = {t: set() for t in TIERS}
        for node in self.controller.tree.nodes():
            for tier, pages in zip(TIERS, node.loc):
                if pages is not None:
                    out[tier].update(node.tokens)
        return out

