"""`hicache replay TRACE`: replay a request trace through the real cache metadata; see docs/replay.md."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controller import WritePolicy
from controller.policy import WRITE_POLICIES
from controller.reuse import ADMIT_MODES
from hicache.config import ConfigError, TierSize, load_config, override, parse_settings
from hicache.modelinfo import model_shape, resolve_dtype
from hicache.replay.agent import is_agent_trace, load_agent_sessions, read_agent_sessions
from hicache.replay.core import Replayer, ReplayError, ReplaySetup
from hicache.replay.reuse import ReuseProfile, stack_depths
from hicache.replay.summary import CostInputs, format_table, summarize, time_summary
from hicache.replay.sweep import parse_sweep, plot_sweep, run_sweep
from hicache.replay.trace import TRACE_LOG, Trace, TraceError, read_trace
from hicache.sizes import resolve_sizes
from radix import DEVICE, EVICTION_POLICIES, TIERS

if TYPE_CHECKING:
    from hicache.replay.simulate import TimeSetup

# Cost-model values used when neither a flag nor the config gives one (reported as assumed).
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
DEFAULT_HOST_TO_DEVICE_GBPS = 25.0  # PCIe 5.0 x16, pinned memory
DEFAULT_DISK_TO_DEVICE_GBPS = 6.0  # one PCIe 4.0 NVMe drive


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `replay` subcommand."""
    p = sub.add_parser("replay", help="replay a request trace offline: hits per tier, disk traffic, disk sizing",
                       description="Replay a Mooncake JSONL trace or a hicache --trace-log file through the real "
                                   "radix tree and tier controller (metadata only, no KV bytes).")
    p.add_argument("trace", help="trace: Mooncake JSONL, a server --trace-log, or coding-agent session JSON (one file "
                                 "or a directory of them); the format is detected")
    p.add_argument("--session-offset-s", type=float, default=0.0,
                   help="agent sessions: session k starts k times this many seconds in (default 0: all at once, "
                        "their requests interleaved by their own times)")
    p.add_argument("--config", help="YAML config: tier sizes, policies, model (for KV bytes per token)")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="set any config key, as `hicache serve --set` does (VALUE is YAML); repeatable")
    p.add_argument("--block-tokens", type=int, help="tokens per hash_ids block (Mooncake: 512; a trace log "
                                                    "carries its own)")
    for tier in TIERS:
        note = "at least one block" if tier == DEVICE else "0 disables it"
        p.add_argument(f"--{tier}-tokens", type=int, metavar="N", help=f"{tier} tier capacity in tokens ({note})")
    p.add_argument("--policy", choices=sorted(POLICY_PRESETS),
                   help="a preset of the write, eviction and admission policies (default: those of --config, or of "
                        "the server's default config); flags below override it. lru-inclusive: the textbook model, "
                        "every block written through to every tier at once, LRU everywhere")
    p.add_argument("--write-device-to-host", choices=WRITE_POLICIES, help="GPU -> host write policy")
    p.add_argument("--write-host-to-disk", choices=WRITE_POLICIES, help="host -> disk write policy")
    p.add_argument("--defer-above-free", type=float,
                   help="GPU -> host write-through waits while more than this share of the GPU tier is free (1.0: "
                        "copy at once)")
    p.add_argument("--selective-hits", type=int, help="hits before write_through_selective copies a block down")
    p.add_argument("--eviction-policy", choices=sorted(EVICTION_POLICIES))
    p.add_argument("--admission-hits", type=int, help="disk admission: write a block after this many attempts")
    p.add_argument("--l3-admit", choices=ADMIT_MODES, help="which blocks the disk takes: reuse (likely to be read "
                   "again: hit, continuing a hit, computed twice) or all (cache.write_policy.l3_admit)")
    p.add_argument("--load-mode", choices=("always", "auto", "never"),
                   help="load every cached block (always), let the cost model decide what is cheaper to load than "
                        "to recompute (auto), or use GPU hits only (never); default: the config's "
                        "(cache.load_policy.mode; the server's default is auto)")
    p.add_argument("--kv-bytes-per-token", type=int, help="KV bytes per token (default: from the config's model)")
    p.add_argument("--calibration", metavar="SOURCE",
                   help="price with a running server's measured costs: its /metrics text saved to a file, or its "
                        "address (http://HOST:PORT); flags below override them")
    p.add_argument("--prefill-tokens-per-s", type=float, help="prefill speed for the time-saved estimate")
    p.add_argument("--attention-ns-per-pair", type=float,
                   help="load mode auto: prefill ns per (token, earlier token) pair, so deep blocks cost more to "
                        "recompute (cache.load_policy.attention_ns_per_pair; default: the config's, else 0)")
    p.add_argument("--host-to-device-gbps", type=float, help="host -> GPU bandwidth, GB/s")
    p.add_argument("--disk-to-device-gbps", type=float, help="disk -> GPU bandwidth, GB/s")
    p.add_argument("--bandwidth-window-ms", type=float, default=1000.0,
                   help="window for the peak disk read bandwidth (default 1000 ms)")
    p.add_argument("--strict", action="store_true", help="fail on the first bad trace line (default: skip)")
    p.add_argument("--limit", type=int, help="replay only the first N requests (agent sessions run closed-loop: the "
                                             "first N sessions)")
    p.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=A,B,C",
                   help="sweep a tier's capacity (device, host, disk: tokens with k/M/G, or bytes with GiB/GB...) "
                        "or a bandwidth in GB/s (host_gbps, disk_gbps, disk_write_gbps); repeat for a grid")
    p.add_argument("--plot", metavar="OUT.png", help="with --sweep: plot hit rates, and the predicted TTFT and "
                                                     "duration, against the last swept key")
    t = p.add_argument_group("time model (docs/replay.md)")
    t.add_argument("--no-time", action="store_true",
                   help="hits only: replay requests one after another to completion, no clock (faster; exact "
                        "against an LRU model)")
    t.add_argument("--decode-step-ms", type=float, help="a decode-only step's time without its sequences' share "
                                                        "(default: the calibration's, else 10 ms, assumed)")
    t.add_argument("--decode-seq-ms", type=float, help="each decoding sequence's share of a step (default: the "
                                                       "calibration's, else 0)")
    t.add_argument("--step-overhead-ms", type=float, help="the engine thread's own time a step with prefill, "
                   "besides the forward (default: the calibration's, else 0)")
    t.add_argument("--disk-write-gbps", type=float, help="disk write bandwidth, GB/s (default: the read bandwidth)")
    t.add_argument("--output-length", type=int, default=16,
                   help="agent sessions: answer tokens at most, as `hicache bench agent` sends them (default 16)")
    t.add_argument("--think-scale", type=float, default=0.0,
                   help="agent sessions: wait think_time x this before each turn (default 0, as bench agent)")
    t.add_argument("--max-think", type=float, default=60.0, help="agent sessions: cap on that wait (s)")
    t.add_argument("--concurrency", type=int, help="agent sessions in flight at most (default: all)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    # a replay leaves millions of tree nodes, heap entries and trace blocks: freeing them one by one at exit was a
    # tenth of a large trace's run (bench/RESULTS.md, 'Offline replay'); the command line skips that (hicache.cli.main)
    p.set_defaults(func=run, exit_without_teardown=True)


def _error(msg: str) -> int:
    print(f"hicache replay: {msg}", file=sys.stderr)
    return 2


def kv_bytes_per_token(args: argparse.Namespace, cfg: Any) -> int:
    if args.kv_bytes_per_token is not None:
        if args.kv_bytes_per_token <= 0:
            raise ValueError(f"--kv-bytes-per-token must be > 0, got {args.kv_bytes_per_token}")
        return args.kv_bytes_per_token
    dtype = resolve_dtype(cfg.model.dtype, cfg.model.device)
    return model_shape(cfg.model.name).kv_bytes_per_token(dtype)


# named policy sets for --policy; what a preset leaves out comes from the config
POLICY_PRESETS: dict[str, dict[str, Any]] = {
    "lru-inclusive": {"device_to_host": "write_through", "host_to_disk": "write_through", "defer_above_free": 1.0,
                      "eviction_policy": "lru", "admission_hits": 0, "l3_admit": "all"},
    "server": {},  # the config's own (the server's default config without --config)
}


def make_setup(args: argparse.Namespace, cfg: Any, block_tokens: int, kv_per_token: int,
               tokens: dict[str, int | None], rates: dict[str, float] | None = None) -> ReplaySetup:
    """Tier sizes in blocks (flags or sweep values in tokens over the config), the policies and the costs (`rates`:
    swept bandwidths in GB/s, over the flags)."""
    cache = dataclasses.replace(cfg.cache, page_size=block_tokens)
    for tier in ("device", "host"):
        if tokens.get(tier) is not None:
            cache = dataclasses.replace(cache, **{tier: TierSize(size_tokens=tokens[tier])})
    if tokens.get("disk") is not None:
        l3 = dataclasses.replace(cache.l3, path=cache.l3.path or "<replay>", size_tokens=tokens["disk"], size_gib=None)
        cache = dataclasses.replace(cache, l3=l3)
    if args.attention_ns_per_pair is not None and not args.attention_ns_per_pair >= 0:
        raise ReplayError(f"--attention-ns-per-pair must be >= 0, got {args.attention_ns_per_pair}")
    for tier, n in tokens.items():
        if n is not None and n < 0:
            raise ReplayError(f"{tier} capacity must be >= 0 tokens, got {n}")
    try:
        sizes = resolve_sizes(dataclasses.replace(cfg, cache=cache), kv_per_token)
    except ConfigError as e:
        raise ReplayError(f"{e} (block = {block_tokens} tokens)") from None
    wp = cfg.cache.write_policy
    preset = POLICY_PRESETS.get(args.policy or "", {})
    defer = preset.get("defer_above_free", wp.defer_above_free) if args.defer_above_free is None else \
        args.defer_above_free
    policy = WritePolicy(args.write_device_to_host or preset.get("device_to_host", wp.device_to_host),
                         args.write_host_to_disk or preset.get("host_to_disk", wp.host_to_disk),
                         args.selective_hits or wp.selective_hits, defer,
                         args.l3_admit or preset.get("l3_admit", wp.l3_admit),
                         # without the clock I/O is instant: no write waits for the disk, none needs a cap
                         l3_host_share=1.0 if args.no_time else wp.l3_host_share)
    lp = cfg.cache.load_policy
    # one set of costs for the controller's decisions (mode auto) and for the report's prefill times: a value that
    # neither a flag nor the config gives is the assumed default, and the report says so
    defaults = {"prefill_tokens_per_s": DEFAULT_PREFILL_TOKENS_PER_S,
                "host_to_device_gbps": DEFAULT_HOST_TO_DEVICE_GBPS,
                "disk_to_device_gbps": DEFAULT_DISK_TO_DEVICE_GBPS}
    rates = rates or {}
    swept = {"host_to_device_gbps": rates.get("host_gbps"), "disk_to_device_gbps": rates.get("disk_gbps")}
    given = {name: swept.get(name) or getattr(args, name) or getattr(lp, name) for name in defaults}
    prefill, h2d, d2d = (given[name] or default for name, default in defaults.items())
    assumed = tuple(name for name in defaults if not given[name])
    if cfg.cache.l3.read_limit_gbps and not rates.get("disk_gbps"):  # the server's store reads no faster than its cap
        d2d = min(d2d, cfg.cache.l3.read_limit_gbps)
    return ReplaySetup(
        block_tokens, sizes.device_pages, sizes.host_pages, sizes.disk_pages, kv_per_token * block_tokens, policy,
        args.eviction_policy or preset.get("eviction_policy", cfg.cache.eviction_policy),
        preset.get("admission_hits", cfg.cache.l3.admission_hits) if args.admission_hits is None else
        args.admission_hits,
        args.load_mode or lp.mode, prefill, h2d * 1e9, d2d * 1e9,
        attention_seconds_per_pair=1e-9 * (args.attention_ns_per_pair if args.attention_ns_per_pair is not None
                                           else lp.attention_ns_per_pair or 0.0),
        assumed_costs=assumed,
    )


DEFAULT_DECODE_STEP_MS = 10.0  # a decode-only step of an 8B model on one H200 at small batch


def time_setup(args: argparse.Namespace, cfg: Any, block_tokens: int, calibration: Any = None,
               rates: dict[str, float] | None = None) -> tuple[TimeSetup, tuple[str, ...]]:
    """The time model's own inputs: decode costs (flags, else the calibration, else assumed), the disk's write
    bandwidth, and the server's scheduler and prefetch settings from the config; with the names of those assumed."""
    from hicache.replay.simulate import TimeSetup

    rates = rates or {}
    assumed = []
    step_ms = args.decode_step_ms
    if step_ms is None and calibration is not None and calibration.decode_step_s is not None:
        step_ms = calibration.decode_step_s * 1e3
    if step_ms is None:
        step_ms = DEFAULT_DECODE_STEP_MS
        assumed.append("decode_step_ms")
    seq_ms = args.decode_seq_ms
    if seq_ms is None and calibration is not None and calibration.decode_seq_s is not None:
        seq_ms = calibration.decode_seq_s * 1e3
    overhead_ms = args.step_overhead_ms
    if overhead_ms is None and calibration is not None and calibration.step_overhead_s is not None:
        overhead_ms = calibration.step_overhead_s * 1e3
    for name, value in (("--decode-step-ms", step_ms), ("--decode-seq-ms", seq_ms), ("--think-scale", args.think_scale),
                        ("--max-think", args.max_think), ("--step-overhead-ms", overhead_ms)):
        if value is not None and not value >= 0:
            raise ReplayError(f"{name} must be >= 0, got {value}")
    if args.output_length < 1 or (args.concurrency is not None and args.concurrency < 1):
        raise ReplayError("--output-length and --concurrency must be >= 1")
    l3 = cfg.cache.l3  # a server with its L3 capped (cache.l3.read_limit_gbps, write_limit_gbps) runs at the caps
    if args.disk_write_gbps is not None and not args.disk_write_gbps > 0:
        raise ReplayError(f"--disk-write-gbps must be > 0, got {args.disk_write_gbps}")
    write = (rates.get("disk_write_gbps") or args.disk_write_gbps or rates.get("disk_gbps") or l3.write_limit_gbps
             or None)
    sc, lp = cfg.scheduler, cfg.cache.load_policy
    page = cfg.cache.page_size
    try:  # the server's context limit besides its GPU tier: the model's positions and the configured cap
        limits = [model_shape(cfg.model.name).max_context]
    except ValueError:
        limits = []
    if sc.max_context_tokens:
        limits.append(sc.max_context_tokens)
    return TimeSetup(
        decode_step_s=step_ms * 1e-3, decode_seq_s=(seq_ms or 0.0) * 1e-3, step_overhead_s=(overhead_ms or 0.0) * 1e-3,
        disk_write_bytes_per_s=None if write is None else write * 1e9,
        disk_read_limit_bytes_per_s=None if rates.get("disk_gbps") or not l3.read_limit_gbps else
        l3.read_limit_gbps * 1e9,
        disk_shared=not (l3.read_limit_gbps or l3.write_limit_gbps),
        max_running=sc.max_running_requests, chunk_tokens=sc.chunk_tokens, batch_tokens=sc.prefill_batch_tokens,
        admit_during_forward=sc.admit_during_forward, overlap=lp.overlap, layered=lp.layered, prefetch=lp.prefetch,
        prefetch_host_share=lp.prefetch_host_share, prefetch_queue_s=lp.prefetch_queue_s, stage=lp.stage,
        l3_queue_pages=max(1, cfg.cache.l3.queue_pages * page // block_tokens),
        max_context_tokens=min(limits) if limits else None,
    ), tuple(assumed)


def cost_inputs(setup: ReplaySetup) -> CostInputs:
    """The costs the replay ran with, as the report states them."""
    return CostInputs(setup.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S,
                      setup.host_to_device_bytes_per_s or DEFAULT_HOST_TO_DEVICE_GBPS * 1e9,
                      setup.disk_to_device_bytes_per_s or DEFAULT_DISK_TO_DEVICE_GBPS * 1e9, setup.assumed_costs)


def _disk_stats(s: Any, controller: Any) -> dict[str, int] | None:
    """The replay L3 store's traffic, and the writes the controller skipped (None without a disk tier)."""
    if s is None:
        return None
    return {"pages_written": s.pages_written, "pages_read": s.pages_read, "deleted_unread": s.deleted_unread,
            "unread_at_end": s.unread_pages(), "not_admitted": s.not_admitted,
            "not_reused": controller.stats.drops["not_reused"]}


class _NoBar:
    """A progress bar that shows nothing (asked for none, or tqdm is not installed)."""

    def __init__(self, **_: Any) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *_: Any) -> None:
        return None

    def update(self, n: int = 1) -> None:
        return None


def _progress_bar(shown: bool) -> Any:
    """tqdm on stderr, or _NoBar where none is shown or tqdm is missing (a GPU box carries what serving needs)."""
    if not shown:
        return _NoBar
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar
    return lambda **kw: tqdm(file=sys.stderr, leave=False, **kw)


def replay_once(trace: Trace, setup: ReplaySetup, reuse: ReuseProfile | None, window_ms: float,
                progress: bool, timing: tuple[TimeSetup, tuple[str, ...]] | None = None,
                sessions: list[Any] | None = None, args: argparse.Namespace | None = None) -> dict[str, Any]:
    """Replay the trace with one setup; the summary dict with timing. `timing`: run on the clock (the time model),
    agent `sessions` closed-loop, other traces at their timestamps."""
    start = time.perf_counter()
    bar = _progress_bar(progress)
    if timing is not None:
        from hicache.replay.simulate import TimedReplay, closed_loop, open_loop

        timed = TimedReplay(setup, timing[0])
        if sessions is not None:
            assert args is not None
            closed_loop(timed, sessions, args.output_length, args.think_scale, args.max_think, args.concurrency)
        else:
            open_loop(timed, trace.records)
        with bar(total=len(trace.records), unit="req", desc="replay (timed)") as b:
            timed.progress = b.update
            result = timed.run()
        totals = timed.totals
        if timed.worker is not None:
            totals.disk_reads = list(timed.worker.reads)
        if reuse is not None and sessions is None:
            for req in result.requests:
                if req.disk_positions:
                    depths, ages = reuse.depths[req.record], reuse.ages_ms[req.record]
                    totals.disk_hit_depths.extend(depths[p] for p in req.disk_positions)
                    totals.disk_hit_ages_ms.extend(ages[p] for p in req.disk_positions)
        disk_stats = _disk_stats(timed.store, timed.ctrl)
    else:
        rep = Replayer(setup)
        with bar(total=trace.blocks, unit="block", unit_scale=True, desc="replay") as b:
            totals = rep.run(trace.records, reuse, server_log=trace.format == TRACE_LOG, progress=b.update)
        disk_stats = _disk_stats(rep.store, rep.controller)
    elapsed = time.perf_counter() - start
    summary = summarize(totals, setup, cost_inputs(setup), reuse, disk_stats, window_ms)
    if timing is not None:
        summary["time"] = time_summary(result, timing[0], timing[1], open_loop=sessions is None)
    summary["replay_seconds"] = elapsed
    summary["blocks_per_s"] = totals.blocks / elapsed if elapsed > 0 else None
    return summary


def _sweep_table(points: list[dict], keys: list[str]) -> str:
    """One line per grid point: capacities (tokens), swept bandwidths, hit rates, disk reads and, timed, the
    predicted duration and TTFT."""
    rates = [k for k in keys if k not in TIERS]
    timed = any("time" in p for p in points)
    head = (f"{'device':>12}{'host':>12}{'disk':>12}" + "".join(f"{k:>16}" for k in rates)
            + f"{'GPU':>8}{'host':>8}{'disk':>8}{'total':>8}{'disk rd GiB':>13}")
    if timed:
        head += f"{'duration s':>12}{'TTFT mean':>11}{'p50':>8}{'p90':>8}"
    lines = ["capacities in tokens, bandwidths in GB/s; hit rates as % of blocks; times predicted, in seconds", head]
    for p in points:
        t = p.get("tiers")
        sizes = [t[k]["tokens"] for k in TIERS] if t else [p["sweep"].get(k, "-") for k in TIERS]
        cells = "".join(f"{s:>12,.0f}" if isinstance(s, (int, float)) else f"{s:>12}" for s in sizes)
        cells += "".join(f"{p['sweep'][k]:>16g}" for k in rates)
        if "skipped" in p:
            lines.append(f"{cells}  skipped: {p['skipped']}")
            continue
        rd = p.get("disk", {}).get("bytes_read", 0) / (1 << 30)
        line = (cells + "".join(f"{p['hit_rate'][k]:>8.1%}" for k in TIERS)
                + f"{p['total_hit_rate']:>8.1%}{rd:>13,.2f}")
        m = p.get("time")
        if m and m["requests"]:
            q = m["ttft_s"]
            line += f"{m['duration_s']:>12,.2f}{q['mean']:>11,.3f}{q['p50']:>8,.3f}{q['p90']:>8,.3f}"
        lines.append(line)
    return "\n".join(lines)


REPLAY_GC_THRESHOLD = 50_000  # allocations between young-generation collections while replaying (see `run`)
BAD_LINES_MAX_FRACTION = 0.01  # more bad lines than this share of the trace: no report, an error


def run(args: argparse.Namespace) -> int:
    """Entry point of `hicache replay`; 0 on success, 2 on bad input."""
    calibration = None
    sessions = None
    try:
        cfg = load_config(args.config)
        if args.settings:
            cfg = override(cfg, parse_settings(args.settings), "--set")
        if args.calibration:
            from hicache.replay.calibration import apply_calibration, read_calibration

            calibration = read_calibration(args.calibration)
            cfg = apply_calibration(cfg, calibration)
        if args.block_tokens is not None and args.block_tokens < 1:
            raise ValueError(f"--block-tokens must be >= 1, got {args.block_tokens}")
        kv = kv_bytes_per_token(args, cfg)
        grid = parse_sweep(args.sweep, kv)
        if args.plot and not grid:
            raise ValueError("--plot needs --sweep")
        if is_agent_trace(args.trace):
            trace = read_agent_sessions([args.trace], args.session_offset_s)
            if not args.no_time:  # closed loop, as bench agent runs them
                sessions = load_agent_sessions([args.trace])[1]
        else:
            trace = read_trace(args.trace, args.block_tokens, args.strict)
        flags = {"device": args.device_tokens, "host": args.host_tokens, "disk": args.disk_tokens}
        base = make_setup(args, cfg, trace.block_tokens, kv, flags) if not grid else None
        timing = None if args.no_time else time_setup(args, cfg, trace.block_tokens, calibration)
    except (ConfigError, TraceError, ReplayError, ValueError) as e:
        return _error(str(e))
    if trace.bad_lines:
        shown = "; ".join(f"line {n}: {why}" for n, why in trace.bad_lines[:5])
        print(f"hicache replay: skipped {len(trace.bad_lines)} bad line(s): {shown}"
              + (" ..." if len(trace.bad_lines) > 5 else ""), file=sys.stderr)
        total = len(trace.bad_lines) + len(trace.records)
        if len(trace.bad_lines) > BAD_LINES_MAX_FRACTION * total:
            return _error(f"{args.trace}: {len(trace.bad_lines)} of {total} lines are bad "
                          f"({len(trace.bad_lines) / total:.0%}, more than {BAD_LINES_MAX_FRACTION:.0%}): a report "
                          "on the rest would mislead (is --block-tokens right for this trace?)")
    if args.limit is not None:
        trace.records = trace.records[: max(0, args.limit)]
        if sessions is not None:
            sessions = sessions[: max(0, args.limit)]
    progress = not args.no_progress
    start = time.perf_counter()
    reuse = stack_depths(trace.records)
    reuse_s = time.perf_counter() - start
    gc.freeze()  # the trace and reuse profile live to the end: keep them out of the collector's scans
    # the tree's nodes and the heaps' entries churn by the hundred thousand and form no garbage cycles the replay
    # depends on freeing: young-generation collections every 700 allocations were a tenth of its time (bench/RESULTS.md,
    # 'Offline replay')
    thresholds = gc.get_threshold()
    gc.set_threshold(REPLAY_GC_THRESHOLD, *thresholds[1:])
    info = {"path": trace.path, "format": trace.format, "block_tokens": trace.block_tokens,
            "bad_lines": len(trace.bad_lines), "first_bad_lines": trace.bad_lines[:20],
            "kv_bytes_per_token": kv, "reuse_pass_seconds": reuse_s,
            "arrivals": None if timing is None else "closed loop (sessions)" if sessions is not None else
            "open loop (timestamps)"}
    title = (f"hicache replay: {trace.path} ({trace.format}, {len(trace.records):,} requests, {trace.blocks:,} blocks "
             f"of {trace.block_tokens} tokens, {kv:,} KV bytes/token; {len(trace.bad_lines)} bad lines skipped)")
    run_ = _Run(args, cfg, trace, kv, flags, reuse, progress, calibration, sessions)
    try:
        result = run_.sweep(grid, info, title) if grid else run_.once(base, timing, info, title)
    except ReplayError as e:
        return _error(str(e))
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


@dataclasses.dataclass
class _Run:
    """What every replay of one invocation shares: the flags, the config, the trace and its reuse profile."""

    args: argparse.Namespace
    cfg: Any
    trace: Trace
    kv: int
    flags: dict[str, int | None]
    reuse: ReuseProfile
    progress: bool
    calibration: Any
    sessions: list[Any] | None

    def replay(self, setup: ReplaySetup, timing: tuple[TimeSetup, tuple[str, ...]] | None) -> dict[str, Any]:
        return replay_once(self.trace, setup, self.reuse, self.args.bandwidth_window_ms, self.progress, timing,
                           self.sessions, self.args)

    def once(self, setup: ReplaySetup | None, timing: tuple[TimeSetup, tuple[str, ...]] | None,
             info: dict[str, Any], title: str) -> dict[str, Any]:
        assert setup is not None
        summary = self.replay(setup, timing)
        summary["blocks_per_s_with_reuse_pass"] = self.trace.blocks / (summary["replay_seconds"] +
                                                                       info["reuse_pass_seconds"])
        print(format_table(summary, title))
        return {"trace": info, **summary}

    def sweep(self, grid: dict[str, list[float]], info: dict[str, Any], title: str) -> dict[str, Any]:
        args, bt = self.args, self.trace.block_tokens

        def point(values: dict[str, float]) -> dict[str, Any]:
            sizes = {k: int(v) for k, v in values.items() if k in TIERS}
            rates = {k: v for k, v in values.items() if k not in TIERS}
            setup = make_setup(args, self.cfg, bt, self.kv, {**self.flags, **sizes}, rates)
            setup.check()
            timing = None if args.no_time else time_setup(args, self.cfg, bt, self.calibration, rates)
            return self.replay(setup, timing)

        points = run_sweep(grid, point)
        print(title)
        print(_sweep_table(points, list(grid)))
        result: dict[str, Any] = {"trace": info, "sweep": grid, "points": points}
        if args.plot:
            setup = make_setup(args, self.cfg, bt, self.kv, self.flags)  # the sizes and policies held fixed
            wp = setup.write_policy
            policy = (f"GPU->host {wp.device_to_host}, host->disk {wp.host_to_disk}, eviction {setup.eviction_policy}"
                      f", admission {setup.admission_hits}, load {setup.load_mode}")
            held = [f"{t} {n * bt * self.kv / 2**30:,.1f} GiB" if self.kv else f"{t} {n * bt:,} tokens"
                    for t, n in zip(TIERS, (setup.device_blocks, setup.host_blocks, setup.disk_blocks))
                    if t not in grid]
            held += [f"{name} {value / 1e9:g} GB/s" for name, value in
                     (("host", setup.host_to_device_bytes_per_s), ("disk", setup.disk_to_device_bytes_per_s))
                     if value and f"{name}_gbps" not in grid]
            plot_sweep(points, grid, args.plot, Path(self.trace.path).name, self.kv, ", ".join(held), policy)
            print(f"plot: {args.plot}")
        return result
