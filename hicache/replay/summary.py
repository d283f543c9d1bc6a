"""Figures of a replay: hit rates per tier, disk traffic, reuse distances, bandwidth, time saved, sizing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hicache.replay.core import ReplaySetup, ReplayTotals
from hicache.replay.reuse import ReuseProfile
from radix import TIERS

GIB = 1 << 30


@dataclass(frozen=True)
class CostInputs:
    """The prefill cost model of the analysis; `assumed` names the values that are defaults."""

    prefill_tokens_per_s: float
    host_to_device_bytes_per_s: float
    disk_to_device_bytes_per_s: float
    assumed: tuple[str, ...] = ()


def percentiles(values: Sequence[float], points: Sequence[int] = (50, 90, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles and the max of values (None when empty)."""
    if not values:
        return {**{f"p{p}": None for p in points}, "max": None}
    s = sorted(values)
    out: dict[str, float | None] = {f"p{p}": s[min(len(s) - 1, max(0, -(-p * len(s) // 100) - 1))] for p in points}
    out["max"] = s[-1]
    return out


def peak_read_rate(reads: Sequence[tuple[float, int]], block_bytes: int, window_ms: float) -> dict[str, float]:
    """Peak and mean disk read bandwidth (bytes/s) over the trace timeline in windows of window_ms."""
    if not reads:
        return {"peak_bytes_per_s": 0.0, "mean_bytes_per_s": 0.0, "window_ms": window_ms}
    buckets: dict[int, int] = {}
    for ts, blocks in reads:
        b = int(ts // window_ms)
        buckets[b] = buckets.get(b, 0) + blocks
    span_s = max(window_ms, max(ts for ts, _ in reads) - min(ts for ts, _ in reads) + window_ms) / 1000
    seconds = window_ms / 1000
    return {
        "peak_bytes_per_s": max(buckets.values()) * block_bytes / seconds,
        "mean_bytes_per_s": sum(buckets.values()) * block_bytes / span_s,
        "window_ms": window_ms,
    }


def disk_sizing(reuse: ReuseProfile, memory_blocks: int, block_bytes: int, disk_blocks: int) -> dict[str, Any]:
    """How much disk is worth buying, from LRU stack depths (write_through + LRU model).

    With every tier holding its most recent blocks, total hits at disk size D are the accesses of
    depth <= max(D, memory); disk hits are those deeper than the memory tiers. Rates are of the block accesses the
    model saw, every request of the trace: a replay on the clock may refuse some (over the context limit), and
    counted against the blocks it served the model's rates went past 100%.
    """
    blocks = max(1, sum(reuse.histogram.values()))
    ideal = reuse.hits_within(1 << 62)
    memory = reuse.hits_within(memory_blocks)

    def point(d: int) -> dict[str, Any]:
        total = reuse.hits_within(max(d, memory_blocks))
        return {"disk_blocks": d, "disk_bytes": d * block_bytes, "hit_rate": total / blocks,
                "disk_hit_rate": (total - memory) / blocks}

    sizes = sorted({int(disk_blocks * f) for f in (0.25, 0.5, 1, 2, 4, 8)} - {0}) if disk_blocks else []
    share = {}
    for frac in (0.5, 0.9, 0.99):
        need = reuse.capacity_for(memory + int((ideal - memory) * frac + 0.999999)) if ideal > memory else 0
        share[f"{int(frac * 100)}%"] = {"disk_blocks": need, "disk_bytes": need * block_bytes}
    return {
        "model": "LRU stack depth (exact for write_through + LRU when requests fit every tier)",
        "ideal_hit_rate": ideal / blocks,
        "memory_hit_rate": memory / blocks,
        "disk_for_share_of_remaining_hits": share,
        "points": [point(d) for d in sizes],
    }


def summarize(totals: ReplayTotals, setup: ReplaySetup, cost: CostInputs, reuse: ReuseProfile | None = None,
              disk_stats: dict[str, int] | None = None, window_ms: float = 1000.0) -> dict[str, Any]:
    """The replay's figures as a JSON-ready dict (block rates are fractions of all blocks)."""
    t = totals
    blocks, tokens = max(t.blocks, 1), max(t.tokens, 1)
    bb = setup.block_bytes
    out: dict[str, Any] = {
        "requests": t.requests,
        "blocks": t.blocks,
        "tokens": t.tokens,
        "hit_blocks": dict(t.hit_blocks),
        "hit_rate": {k: v / blocks for k, v in t.hit_blocks.items()},
        "total_hit_rate": sum(t.hit_blocks.values()) / blocks,
        "hit_tokens": dict(t.hit_tokens),
        "token_hit_rate": {k: v / tokens for k, v in t.hit_tokens.items()},
        "total_token_hit_rate": sum(t.hit_tokens.values()) / tokens,
        "requests_with_disk_hit": t.requests_with_disk_hit,
        "matched_not_served_blocks": t.matched_not_served_blocks,
        "not_cached_blocks": t.not_cached_blocks,
        "cut_requests": t.cut_requests,
        "tiers": {tier: {"blocks": getattr(setup, f"{tier}_blocks"),
                         "tokens": getattr(setup, f"{tier}_blocks") * setup.block_tokens,
                         "bytes": getattr(setup, f"{tier}_blocks") * bb} for tier in TIERS},
        "policies": {"device_to_host": setup.write_policy.device_to_host,
                     "host_to_disk": setup.write_policy.host_to_disk,
                     "selective_hits": setup.write_policy.selective_hits,
                     "defer_above_free": setup.write_policy.defer_above_free,
                     "eviction": setup.eviction_policy, "admission_hits": setup.admission_hits,
                     "load_mode": setup.load_mode},
        "block_tokens": setup.block_tokens,
        "block_bytes": bb,
    }
    # a load's cost: on the clock, what requests waited for their loads beyond the GPU's queue (a read made while a
    # request queued costs it nothing, however slow the disk); without it, its bytes over the tier's bandwidth
    load_s = dict(t.load_wait_s) if t.load_wait_s is not None else {
        "device": 0.0,
        "host": t.hit_blocks["host"] * bb / cost.host_to_device_bytes_per_s,
        "disk": t.hit_blocks["disk"] * bb / cost.disk_to_device_bytes_per_s}
    # each hit token priced at its position (attention to the tokens before it): a tier's hits, prompts' first
    # tokens, save less than their share of the tokens
    saved = {k: t.hit_compute_s[k] - load_s[k] for k in TIERS}
    out["prefill_time"] = {
        "recompute_all_s": t.recompute_s,
        "load_s": load_s,
        "saved_s": saved,
        "total_saved_s": sum(saved.values()),
        "load_priced_by": "waits beyond the GPU queue" if t.load_wait_s is not None else "bytes / bandwidth",
        "prefill_tokens_per_s": cost.prefill_tokens_per_s,
        "attention_ns_per_pair": setup.attention_seconds_per_pair * 1e9,
        "host_to_device_gbps": cost.host_to_device_bytes_per_s / 1e9,
        "disk_to_device_gbps": cost.disk_to_device_bytes_per_s / 1e9,
        "assumed": list(cost.assumed),
    }
    if setup.disk_blocks and disk_stats is not None:
        written = disk_stats["pages_written"]
        never = disk_stats["deleted_unread"] + disk_stats["unread_at_end"]
        out["disk"] = {
            "pages_written": written,
            "bytes_written": written * bb,
            "pages_read": disk_stats["pages_read"],
            "bytes_read": disk_stats["pages_read"] * bb,
            "never_read_share": never / written if written else 0.0,
            "evicted_unread_pages": disk_stats["deleted_unread"],
            "unread_at_end_pages": disk_stats["unread_at_end"],
            "not_admitted_pages": disk_stats["not_admitted"],
            # writes skipped: nothing suggested the page would be read again (write_policy.l3_admit: reuse)
            "not_reused_pages": disk_stats.get("not_reused", 0),
            "read_bandwidth": peak_read_rate(t.disk_reads, bb, window_ms),
            "reuse_distance_of_hits": {
                "blocks": percentiles(t.disk_hit_depths),
                "bytes": {k: None if v is None else v * bb for k, v in percentiles(t.disk_hit_depths).items()},
                "seconds": {k: None if v is None else v / 1000 for k, v in percentiles(t.disk_hit_ages_ms).items()},
            },
        }
    if reuse is not None:
        memory = max(setup.device_blocks, setup.host_blocks)
        out["disk_sizing"] = disk_sizing(reuse, memory, bb, setup.disk_blocks)
    if t.server_checked:
        out["server_check"] = {"requests": t.server_checked, "mismatches": len(t.server_mismatches),
                               "first_mismatches": [{"line": line, "server": s, "replay": r}
                                                    for line, s, r in t.server_mismatches[:5]]}
    return out


# an open-loop trace is overloaded when the GPU is busy longer than its arrivals span and the first tokens of its
# last quarter of requests wait at least this many times as long as those of its first quarter
OVERLOAD_TTFT_GROWTH = 2.0


def overload(result: Any) -> dict[str, float] | None:
    """Whether arrivals at the trace's timestamps outpace the GPU (queues grow to the end, so TTFT says more about
    the trace's length than about the tiers): the GPU's busy time against the arrivals' span, and the mean TTFT of
    the first and last quarter of requests by arrival; None when it keeps up."""
    reqs = sorted((r for r in result.requests if r.first_token_at is not None), key=lambda r: r.arrival)
    if len(reqs) < 8:
        return None
    span = reqs[-1].arrival - reqs[0].arrival
    q = len(reqs) // 4
    first, last = (sum(r.first_token_at - r.arrival for r in part) / q for part in (reqs[:q], reqs[-q:]))
    if span <= 0 or result.gpu_busy_s <= span or last < OVERLOAD_TTFT_GROWTH * first:
        return None
    return {"gpu_busy_s": result.gpu_busy_s, "arrival_span_s": span, "first_quarter_ttft_s": first,
            "last_quarter_ttft_s": last}


def time_summary(result: Any, t: Any, assumed: Sequence[str] = (), open_loop: bool = True) -> dict[str, Any]:
    """The time model's predictions (a simulate.TimedResult) and its inputs (a simulate.TimeSetup). `open_loop`:
    requests arrived at their timestamps (closed-loop sessions wait for their answers, so they cannot overload it)."""
    ttft = result.ttft_s
    duration = result.duration_s
    return {
        "duration_s": duration,
        "requests": len(result.requests),
        "overloaded": overload(result) if open_loop else None,
        "ttft_s": {"mean": sum(ttft) / len(ttft) if ttft else None, **percentiles(ttft)},
        "gpu_busy_s": result.gpu_busy_s,
        "gpu_busy_share": result.gpu_busy_s / duration if duration > 0 else None,
        "prefill_s": result.prefill_s,
        "decode_s": result.decode_s,
        "engine_blocked_s": result.engine_blocked_s,
        "disk_busy_s": dict(result.disk_busy_s),
        "preemptions": result.preemptions,
        "gave_up_reads": result.gave_up_reads,
        "rejected_requests": result.rejected,
        "skipped_requests": result.skipped,
        "inputs": {"decode_step_ms": t.decode_step_s * 1e3, "decode_seq_ms": t.decode_seq_s * 1e3,
                   "step_overhead_ms": t.step_overhead_s * 1e3,
                   "disk_write_gbps": None if t.disk_write_bytes_per_s is None else t.disk_write_bytes_per_s / 1e9,
                   "max_running": t.max_running, "chunk_tokens": t.chunk_tokens, "overlap": t.overlap,
                   "prefetch": t.prefetch, "assumed": list(assumed)},
    }


def _time_lines(m: dict[str, Any]) -> list[str]:
    q = m["ttft_s"]
    rejected = (f"; {m['rejected_requests']:,} requests refused, their prompts as long as the server's context "
                "limit") if m["rejected_requests"] else ""
    if m.get("skipped_requests"):
        rejected += (f"; {m['skipped_requests']:,} agent turns not sent, prompt and answer over the context limit "
                     "(as bench agent skips them)")
    if not m["requests"]:
        return ["predicted: no request finished" + rejected]
    inputs = m["inputs"]
    busy = m["gpu_busy_share"]
    lines = [f"predicted: duration {m['duration_s']:,.2f} s for {m['requests']:,} requests; TTFT mean "
             f"{q['mean']:,.3f} s, p50 {q['p50']:,.3f} s, p90 {q['p90']:,.3f} s, p99 {q['p99']:,.3f} s{rejected}",
             f"GPU busy {m['gpu_busy_s']:,.2f} s" + (f" ({busy:.0%} of it)" if busy is not None else "")
             + f": prefill {m['prefill_s']:,.2f} s, decode {m['decode_s']:,.2f} s; disk busy: reads "
             f"{m['disk_busy_s']['read']:,.2f} s, writes {m['disk_busy_s']['write']:,.2f} s; engine thread blocked on "
             f"copies {m['engine_blocked_s']:,.2f} s; preemptions {m['preemptions']:,}; disk reads given up "
             f"{m['gave_up_reads']:,}"]
    over = m.get("overloaded")
    if over:
        lines.append(f"overloaded: the GPU is busy {over['gpu_busy_s']:,.0f} s for arrivals over "
                     f"{over['arrival_span_s']:,.0f} s; queues grow to the end (mean TTFT "
                     f"{over['first_quarter_ttft_s']:,.2f} s in the first quarter of requests, "
                     f"{over['last_quarter_ttft_s']:,.2f} s in the last), so these times measure the backlog: this "
                     "trace needs more GPU than this setup has")
    assumed = f" (assumed: {', '.join(inputs['assumed'])})" if inputs["assumed"] else ""
    write = f"{inputs['disk_write_gbps']:g} GB/s" if inputs["disk_write_gbps"] else "as reads"
    lines.append(f"time model: decode step {inputs['decode_step_ms']:g} ms + {inputs['decode_seq_ms']:g} ms a "
                 f"sequence, {inputs.get('step_overhead_ms', 0):g} ms of scheduling a prefill step, disk writes "
                 f"{write}{assumed}; scheduler: {inputs['max_running']} running, chunks of "
                 f"{inputs['chunk_tokens']:,} tokens, overlap {'on' if inputs['overlap'] else 'off'}, prefetch "
                 f"{'on' if inputs['prefetch'] else 'off'}")
    return lines


def _gib(n: float) -> str:
    """Bytes in binary units (B, KiB, ..., TiB)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def format_table(s: dict[str, Any], title: str) -> str:
    """A readable terminal report of a summary."""
    lines = [title]
    tiers = s["tiers"]
    lines.append("tiers: " + " | ".join(
        f"{k} {v['blocks']:,} blocks ({v['tokens']:,} tokens, {_gib(v['bytes'])})" if v["blocks"] else f"{k} off"
        for k, v in tiers.items()))
    p = s["policies"]
    defer = p.get("defer_above_free", 1.0)
    deferred = f" (deferred while > {defer:.0%} of the GPU is free)" if (
        p["device_to_host"] == "write_through" and defer < 1.0) else ""
    lines.append(f"policies: GPU->host {p['device_to_host']}{deferred}, host->disk {p['host_to_disk']}, "
                 f"eviction {p['eviction']}, admission {p['admission_hits']}, load {p['load_mode']}")
    lines.append("")
    pt = s["prefill_time"]
    lines.append(f"{'tier':<8}{'hit blocks':>12}{'% blocks':>10}{'hit tokens':>14}{'% tokens':>10}"
                 f"{'prefill saved':>15}")
    for k in TIERS:
        lines.append(f"{k:<8}{s['hit_blocks'][k]:>12,}{s['hit_rate'][k]:>10.1%}{s['hit_tokens'][k]:>14,}"
                     f"{s['token_hit_rate'][k]:>10.1%}{pt['saved_s'][k]:>14,.1f}s")
    lines.append(f"{'total':<8}{sum(s['hit_blocks'].values()):>12,}{s['total_hit_rate']:>10.1%}"
                 f"{sum(s['hit_tokens'].values()):>14,}{s['total_token_hit_rate']:>10.1%}{pt['total_saved_s']:>14,.1f}s")
    lines.append(f"{'of':<8}{s['blocks']:>12,}{'':>10}{s['tokens']:>14,}{'':>10}"
                 f"{pt['recompute_all_s']:>14,.1f}s (recompute all)")
    lines.append(f"prefill saved: the hits' recompute time minus their load time, priced as "
                 f"{pt['load_priced_by']}")
    lines.append("")
    lines.append(f"requests: {s['requests']:,}; with a disk hit: {s['requests_with_disk_hit']:,}; "
                 f"blocks matched but not served: {s['matched_not_served_blocks']:,}; "
                 f"not cached: {s['not_cached_blocks']:,} blocks of {s.get('cut_requests', 0):,} requests longer "
                 "than the GPU tier (a server caches only their first GPU-capacity blocks too)")
    assumed = f" (assumed defaults: {', '.join(pt['assumed'])})" if pt["assumed"] else ""
    pair = pt.get("attention_ns_per_pair", 0.0)
    attention = f" + {pair:g} ns per (token, earlier token) pair" if pair else ""
    lines.append(f"cost model: prefill {pt['prefill_tokens_per_s']:,.0f} tokens/s{attention}, host->GPU "
                 f"{pt['host_to_device_gbps']:g} GB/s, disk->GPU {pt['disk_to_device_gbps']:g} GB/s{assumed}")
    d = s.get("disk")
    if d:
        bw = d["read_bandwidth"]
        rd = d["reuse_distance_of_hits"]
        lines.append(f"disk: written {_gib(d['bytes_written'])} ({d['pages_written']:,} blocks), read "
                     f"{_gib(d['bytes_read'])} ({d['pages_read']:,} blocks); never read back "
                     f"{d['never_read_share']:.1%} of written blocks; not admitted {d['not_admitted_pages']:,}")
        if d["not_reused_pages"]:
            lines.append(f"disk writes skipped: {d['not_reused_pages']:,} blocks that nothing suggested would be "
                         "read again: not hit, not continuing a hit, computed once (cache.write_policy.l3_admit)")
        lines.append(f"disk read bandwidth over the trace timeline: peak {bw['peak_bytes_per_s'] / 1e9:,.2f} GB/s "
                     f"({bw['window_ms']:g} ms windows), mean {bw['mean_bytes_per_s'] / 1e9:,.3f} GB/s")
        if rd["blocks"]["p50"] is not None:
            lines.append("reuse distance of disk hits: " + ", ".join(
                f"{k} {v:,} blocks ({_gib(rd['bytes'][k])}, {rd['seconds'][k]:,.0f} s)"
                for k, v in rd["blocks"].items()))
    z = s.get("disk_sizing")
    if z:
        lines.append(f"LRU model: ideal hit rate {z['ideal_hit_rate']:.1%} of blocks (unlimited capacity); "
                     f"memory tiers alone {z['memory_hit_rate']:.1%}")
        lines.append("disk needed for a share of the hits memory misses: " + ", ".join(
            f"{k} {v['disk_blocks']:,} blocks ({_gib(v['disk_bytes'])})"
            for k, v in z["disk_for_share_of_remaining_hits"].items()))
    if s.get("time"):
        lines.append("")
        lines += _time_lines(s["time"])
    sc = s.get("server_check")
    if sc:
        lines.append(f"server trace log: {sc['requests']:,} requests compared, {sc['mismatches']:,} with different "
                     "cached tokens per tier than the server reported")
    return "\n".join(lines)
