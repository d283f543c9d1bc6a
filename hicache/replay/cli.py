"""`hicache replay TRACE`: replay a request trace through the real cache metadata; see docs/replay.md."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

from controller import WritePolicy
from controller.policy import WRITE_POLICIES
from controller.reuse import ADMIT_MODES
from hicache.config import ConfigError, TierSize, load_config, resolve_sizes
from hicache.modelinfo import model_shape, resolve_dtype
from hicache.replay.agent import is_agent_trace, read_agent_sessions
from hicache.replay.core import Replayer, ReplayError, ReplaySetup
from hicache.replay.reuse import ReuseProfile, stack_depths
from hicache.replay.summary import CostInputs, format_table, summarize
from hicache.replay.sweep import parse_sweep, plot_sweep, run_sweep
from hicache.replay.trace import TRACE_LOG, Trace, TraceError, read_trace
from radix import DEVICE, EVICTION_POLICIES, TIERS

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
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    p.add_argument("--sweep", action="append", default=[], metavar="TIER=A,B,C",
                   help="sweep a tier's capacity (tokens; k/M suffixes); repeat for a grid")
    p.add_argument("--plot", metavar="OUT.png", help="with --sweep: plot hit rate per tier against capacity")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


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
               tokens: dict[str, int | None]) -> ReplaySetup:
    """Tier sizes in blocks (flags or sweep values in tokens over the config) and the policies."""
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
                         l3_host_share=1.0)  # I/O is instant here: no write waits for the disk, none need a cap
    lp = cfg.cache.load_policy
    # one set of costs for the controller's decisions (mode auto) and for the report's prefill times: a value that
    # neither a flag nor the config gives is the assumed default, and the report says so
    defaults = {"prefill_tokens_per_s": DEFAULT_PREFILL_TOKENS_PER_S,
                "host_to_device_gbps": DEFAULT_HOST_TO_DEVICE_GBPS,
                "disk_to_device_gbps": DEFAULT_DISK_TO_DEVICE_GBPS}
    given = {name: getattr(args, name) or getattr(lp, name) for name in defaults}
    prefill, h2d, d2d = (given[name] or default for name, default in defaults.items())
    assumed = tuple(name for name in defaults if not given[name])
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


def cost_inputs(setup: ReplaySetup) -> CostInputs:
    """The costs the replay ran with, as the report states them."""
    return CostInputs(setup.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S,
                      setup.host_to_device_bytes_per_s or DEFAULT_HOST_TO_DEVICE_GBPS * 1e9,
                      setup.disk_to_device_bytes_per_s or DEFAULT_DISK_TO_DEVICE_GBPS * 1e9, setup.assumed_costs)


def replay_once(trace: Trace, setup: ReplaySetup, reuse: ReuseProfile | None, window_ms: float,
                progress: bool) -> dict[str, Any]:
    """Replay the trace with one setup; the summary dict with timing."""
    from tqdm import tqdm

    rep = Replayer(setup)
    start = time.perf_counter()
    with tqdm(total=trace.blocks, unit="block", unit_scale=True, file=sys.stderr, disable=not progress,
              desc="replay", leave=False) as bar:
        totals = rep.run(trace.records, reuse, server_log=trace.format == TRACE_LOG, progress=bar.update)
    elapsed = time.perf_counter() - start
    disk_stats = None
    if rep.store is not None:
        s = rep.store
        disk_stats = {"pages_written": s.pages_written, "pages_read": s.pages_read, "deleted_unread": s.deleted_unread,
                      "unread_at_end": s.unread_pages(), "not_admitted": s.not_admitted,
                      "not_reused": rep.controller.stats.drops["not_reused"]}
    summary = summarize(totals, setup, cost_inputs(setup), reuse, disk_stats, window_ms)
    summary["replay_seconds"] = elapsed
    summary["blocks_per_s"] = totals.blocks / elapsed if elapsed > 0 else None
    return summary


def _sweep_table(points: list[dict]) -> str:
    head = f"{'device':>12}{'host':>12}{'disk':>12}{'GPU':>8}{'host':>8}{'disk':>8}{'total':>8}{'disk rd GiB':>13}"
    lines = ["capacities in tokens; hit rates as % of blocks", head]
    for p in points:
        t = p.get("tiers")
        sizes = [t[k]["tokens"] for k in TIERS] if t else [p["sizes_tokens"].get(k, "-")
                                                                             for k in TIERS]
        cells = "".join(f"{s:>12,}" if isinstance(s, int) else f"{s:>12}" for s in sizes)
        if "skipped" in p:
            lines.append(f"{cells}  skipped: {p['skipped']}")
            continue
        rd = p.get("disk", {}).get("bytes_read", 0) / (1 << 30)
        lines.append(cells + "".join(f"{p['hit_rate'][k]:>8.1%}" for k in TIERS)
                     + f"{p['total_hit_rate']:>8.1%}{rd:>13,.2f}")
    return "\n".join(lines)


BAD_LINES_MAX_FRACTION = 0.01  # more bad lines than this share of the trace: no report, an error


def run(args: argparse.Namespace) -> int:
    """Entry point of `hicache replay`; 0 on success, 2 on bad input."""
    try:
        cfg = load_config(args.config)
        if args.calibration:
            from hicache.replay.calibration import apply_calibration, read_calibration

            cfg = apply_calibration(cfg, read_calibration(args.calibration))
        grid = parse_sweep(args.sweep)
        if args.plot and not grid:
            raise ValueError("--plot needs --sweep")
        if args.block_tokens is not None and args.block_tokens < 1:
            raise ValueError(f"--block-tokens must be >= 1, got {args.block_tokens}")
        if is_agent_trace(args.trace):
            trace = read_agent_sessions([args.trace], args.session_offset_s)
        else:
            trace = read_trace(args.trace, args.block_tokens, args.strict)
        kv = kv_bytes_per_token(args, cfg)
        flags = {"device": args.device_tokens, "host": args.host_tokens, "disk": args.disk_tokens}
        base = make_setup(args, cfg, trace.block_tokens, kv, flags) if not grid else None
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
    progress = not args.no_progress
    start = time.perf_counter()
    reuse = stack_depths(trace.records)
    reuse_s = time.perf_counter() - start
    gc.freeze()  # the trace and reuse profile live to the end: keep them out of the collector's scans
    info = {"path": trace.path, "format": trace.format, "block_tokens": trace.block_tokens,
            "bad_lines": len(trace.bad_lines), "first_bad_lines": trace.bad_lines[:20],
            "kv_bytes_per_token": kv, "reuse_pass_seconds": reuse_s}
    title = (f"hicache replay: {trace.path} ({trace.format}, {len(trace.records):,} requests, {trace.blocks:,} blocks "
             f"of {trace.block_tokens} tokens, {kv:,} KV bytes/token; {len(trace.bad_lines)} bad lines skipped)")
    try:
        result = _replay(args, cfg, trace, kv, flags, base, grid, reuse, info, title, progress)
    except ReplayError as e:
        return _error(str(e))
    finally:
        gc.unfreeze()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _replay(args: argparse.Namespace, cfg: Any, trace: Trace, kv: int, flags: dict[str, int | None],
            base: ReplaySetup | None, grid: dict[str, list[int]], reuse: ReuseProfile, info: dict[str, Any],
            title: str, progress: bool) -> dict[str, Any]:
    reuse_s = info["reuse_pass_seconds"]
    if grid:
        def point(sizes: dict[str, int]) -> dict[str, Any]:
            setup = make_setup(args, cfg, trace.block_tokens, kv, {**flags, **sizes})
            setup.check()
            return replay_once(trace, setup, reuse, args.bandwidth_window_ms, progress)

        points = run_sweep(grid, point)
        print(title)
        print(_sweep_table(points))
        result: dict[str, Any] = {"trace": info, "sweep": grid, "points": points}
        if args.plot:
            setup = make_setup(args, cfg, trace.block_tokens, kv, flags)  # the sizes and policies held fixed
            wp = setup.write_policy
            policy = (f"GPU->host {wp.device_to_host}, host->disk {wp.host_to_disk}, eviction {setup.eviction_policy}"
                      f", admission {setup.admission_hits}")
            fixed = {t: n * trace.block_tokens for t, n in
                     zip(TIERS, (setup.device_blocks, setup.host_blocks, setup.disk_blocks))}
            plot_sweep(points, grid, args.plot, Path(trace.path).name, kv, fixed, policy)
            print(f"plot: {args.plot}")
    else:
        summary = replay_once(trace, base, reuse, args.bandwidth_window_ms, progress)
        summary["blocks_per_s_with_reuse_pass"] = trace.blocks / (summary["replay_seconds"] + reuse_s)
        print(format_table(summary, title))
        result = {"trace": info, **summary}
    return result
