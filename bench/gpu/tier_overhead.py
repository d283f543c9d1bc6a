"""What the tiers cost when nothing is reused, and where a multi-turn run spends its GPU time (bench/RESULTS.md,
'In-process tier cost'; the served figures: 'No-reuse overhead', 'Multi-turn TTFT, host tier vs GPU only').

In-process, without the server: one model (random weights of real shapes), a fresh engine per arm, the same
random prompts in every arm of a case. Two modes:

  no-reuse   single-turn random prompts, all submitted at once (as `hicache bench multiturn --rounds 1` does):
             arms `off` (no host, no L3), `through` (host + L3, write-through copies at commit:
             defer_above_free 1.0) and `deferred` (the same with defer_above_free 0.25), each run --repeats
             times in turn. `--steady` adds a case whose GPU pool is already full of other requests' KV when
             the measured batch starts, so write-through has to copy and evict as it goes (a long-running
             server's state). `--profile` adds one torch.profiler run of the 2k case per arm: kernel tables.
  multiturn  32 conversations x N rounds of 1,024 new tokens and 8 answer tokens, rounds in lockstep, GPU pool
             8 GiB; arms GPU-only and host. Per round: wall time, forward time, TTFT p50; `--profile-round R`
             writes the kernel table of round R.

Usage (H200): python3 bench/gpu/tier_overhead.py no-reuse --out DIR [--steady] [--profile]
              python3 bench/gpu/tier_overhead.py multiturn --out DIR [--rounds 8] [--profile-round 6]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hicache.config import load_config, override
from hicache.engine.builder import build_engine
from hicache.engine.params import SamplingParams
from hicache.engine.weights import load_model

CONFIG = "configs/h200-llama8b.yaml"
L3_PATH = "/tmp/hicache-l3-overhead"
# fixed costs instead of startup calibration (the H200 values of bench/RESULTS.md): no arm pays for calibrating
FIXED_COSTS = {"cache.load_policy.prefill_tokens_per_s": 35700.0, "cache.load_policy.host_to_device_gbps": 50.0,
               "cache.load_policy.disk_to_device_gbps": 1.46}


def arm_config(device_tokens: int, host_gib: float, l3_gib: float, defer: float) -> dict[str, Any]:
    values: dict[str, Any] = {**FIXED_COSTS, "cache.device": {"size_tokens": device_tokens},
                              "cache.host": {"size_gib": host_gib} if host_gib else {"size_tokens": 0},
                              "cache.write_policy.defer_above_free": defer}
    values["cache.l3.path"] = L3_PATH if l3_gib else None
    if l3_gib:
        values["cache.l3.size_gib"] = l3_gib
    return values


def build(model_pair: tuple[Any, Any], values: dict[str, Any], args: argparse.Namespace) -> Any:
    shutil.rmtree(L3_PATH, ignore_errors=True)
    cfg = override(load_config(args.config), {"model.name": args.model, "model.device": args.device,
                                                "model.dtype": "bfloat16" if args.device == "cuda" else "float32",
                                                **values})
    return build_engine(cfg, *model_pair, calibrate=False)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def dispose(engine: Any) -> None:
    engine.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    shutil.rmtree(L3_PATH, ignore_errors=True)


def prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def run_batch(engine: Any, batch: list[list[int]], out_len: int, tag: str) -> dict[str, Any]:
    """Submit every prompt at once, step to idle; throughput, TTFT and engine/cache counter deltas."""
    sync()
    before, cache0 = dict(engine.counters), engine.cache.controller.stats.snapshot()
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(f"{tag}-{i}", p, params)
    ttfts, outputs = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs += len(out.new_token_ids)
            if out.finished:
                if out.finish_reason != "length":
                    raise RuntimeError(f"{out.request_id}: {out.finish_reason} {out.error}")
                ttfts.append(out.ttft)
    sync()
    wall = time.perf_counter() - start
    engine.step()  # one idle step: deferred copies start here, outside the timed part
    cache = engine.cache.controller.stats.snapshot()
    delta = lambda key: engine.counters[key] - before[key]  # noqa: E731
    return {
        "wall_s": wall, "ttft_p50": statistics.median(ttfts), "ttft_mean": statistics.fmean(ttfts),
        "input_tok_s": sum(map(len, batch)) / wall, "output_tok_s": outputs / wall,
        "forward_s": delta("forward_s"), "schedule_s": delta("schedule_s"), "inputs_s": delta("inputs_s"),
        "steps": delta("steps"),
        "pages_to_host": cache["pages_demoted"].get("device->host", 0) - cache0["pages_demoted"].get("device->host", 0),
        "pages_deferred": cache["deferred_pages"] - cache0["deferred_pages"],
        "evicted_device": cache["evictions"]["device"] - cache0["evictions"]["device"],
    }


def kernel_table(prof: Any, rows: int = 40) -> str:
    averages = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            return averages.table(sort_by=key, row_limit=rows)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=rows)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline(trace_path: Path) -> dict[str, float]:
    """From a chrome trace: how long the GPU computed, copied host -> GPU and GPU -> host, how much of each copy
    direction overlapped compute, and how long the GPU sat idle (milliseconds)."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    compute, h2d, d2h = [], [], []
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat, name = ev.get("cat", ""), ev.get("name", "")
        span = (float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]))
        if cat == "kernel":
            compute.append(span)
        elif cat == "gpu_memcpy" and "HtoD" in name:
            h2d.append(span)
        elif cat == "gpu_memcpy" and "DtoH" in name:
            d2h.append(span)
    compute, h2d, d2h = _union(compute), _union(h2d), _union(d2h)
    every = _union(compute + h2d + d2h)
    if not every:
        return {}
    ms = 1e-3
    return {"span_ms": (every[-1][1] - every[0][0]) * ms, "kernels_ms": _length(compute) * ms,
            "h2d_ms": _length(h2d) * ms, "h2d_hidden_ms": _intersect(h2d, compute) * ms,
            "d2h_ms": _length(d2h) * ms, "d2h_hidden_ms": _intersect(d2h, compute) * ms,
            "gpu_idle_ms": (every[-1][1] - every[0][0] - _length(every)) * ms}


def profiled(path: Path | None, fn: Any, *args: Any) -> Any:
    """fn(*args), under torch.profiler with its kernel table written to path (None: not profiled), and a GPU
    timeline summary (`timeline`) in the result under "timeline"; the trace is kept beside it, gzipped."""
    if path is None:
        return fn(*args)
    import gzip

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = fn(*args)
    path.write_text(kernel_table(prof))
    trace = path.with_suffix(".trace.json")
    prof.export_chrome_trace(str(trace))
    if isinstance(result, dict):
        result["timeline"] = timeline(trace)
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    return result


def no_reuse(args: argparse.Namespace, model_pair: tuple[Any, Any]) -> dict[str, Any]:
    vocab = model_pair[0].config.vocab_size
    h, d = args.host_gib, args.l3_gib
    arms = {"off": (0, 0, 1.0), "through": (h, d, 1.0), "deferred": (h, d, 0.25)}
    k = args.scale
    cases = [("2k_in_256_out", 32, 2048 // k, 256 // k, 262144 // k, False),
             ("32k_in_8_out", 8, 32768 // k, 8, 262144 // k, False)]
    if args.steady:
        cases.append(("2k_in_256_out_full_pool", 32, 2048 // k, 256 // k, 98304 // k, True))
    results: dict[str, Any] = {}
    for case, n, length, out_len, device_tokens, fill in cases:
        if args.cases and not any(case.startswith(c) for c in args.cases.split(",")):
            continue
        repeats = args.repeats if case.startswith("2k_in_256_out") and not fill else 1
        rng = random.Random(7)
        warm = prompts(rng, 2, 2048 // k, vocab)
        filler = prompts(rng, 32, 2048 // k, vocab) if fill else []
        batch = prompts(rng, n, length, vocab)
        for rep in range(repeats):
            for arm, (host_gib, l3_gib, defer) in arms.items():
                engine = build(model_pair, arm_config(device_tokens, host_gib, l3_gib, defer), args)
                run_batch(engine, warm, 8, "warm")
                if filler:
                    run_batch(engine, filler, 8, "fill")
                r = run_batch(engine, batch, out_len, "run")
                results.setdefault(case, {}).setdefault(arm, []).append(r)
                print(f"{case} {arm} #{rep}: " + ", ".join(
                    f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()), flush=True)
                dispose(engine)
    if args.profile:
        rng = random.Random(7)
        warm, batch = prompts(rng, 2, 2048 // k, vocab), prompts(rng, 32, 2048 // k, vocab)
        for arm, (host_gib, l3_gib, defer) in arms.items():
            engine = build(model_pair, arm_config(262144 // k, host_gib, l3_gib, defer), args)
            run_batch(engine, warm, 8, "warm")
            r = profiled(Path(args.out) / f"kernels_2k_{arm}.txt", run_batch, engine, batch, 256 // k, "prof")
            print(f"profiled 2k {arm}: wall {r['wall_s']:.3f} forward {r['forward_s']:.3f}", flush=True)
            dispose(engine)
    return results


def multiturn(args: argparse.Namespace, model_pair: tuple[Any, Any]) -> dict[str, Any]:
    vocab = model_pair[0].config.vocab_size
    arms = {"gpu_only": (0, 0, 1.0), "host": (args.host_gib, 0, 1.0)}
    results: dict[str, Any] = {}
    for arm, (host_gib, l3_gib, defer) in arms.items():
        k = args.scale
        engine = build(model_pair, arm_config(65536 // k, host_gib, l3_gib, defer), args)
        rng = random.Random(11)
        run_batch(engine, prompts(rng, 2, 2048 // k, vocab), 8, "warm")
        history: list[list[int]] = [[] for _ in range(args.clients)]
        seen: dict[str, int] = {}
        for r in range(args.rounds):
            batch = [h + [rng.randrange(100, vocab) for _ in range(1024 // k)] for h in history]
            profile = str(r) in args.profile_round.split(",")
            path = Path(args.out) / f"kernels_multiturn_{arm}_round{r}.txt" if profile else None
            res = profiled(path, run_batch, engine, batch, 8, f"r{r}")
            hits = engine.cache.controller.stats.snapshot()["hit_tokens"]
            res["hits"] = {t: hits[t] - seen.get(t, 0) for t in hits}
            seen = hits
            results.setdefault(arm, []).append(res)
            print(f"{arm} round {r}: wall {res['wall_s']:.3f} forward {res['forward_s']:.3f} "
                  f"schedule {res['schedule_s']:.3f} inputs {res['inputs_s']:.3f} ttft p50 {res['ttft_p50']:.3f} "
                  f"hits {res['hits']}" + (f" timeline {res['timeline']}" if "timeline" in res else ""), flush=True)
            # the answer joins the history (8 greedy tokens; random ids of the same length keep arms identical)
            history = [b + [rng.randrange(100, vocab) for _ in range(8)] for b in batch]
        dispose(engine)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["no-reuse", "multiturn"])
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--repeats", type=int, default=2, help="runs per arm of the fresh-pool 2k case (others: 1)")
    ap.add_argument("--cases", default="", help="comma list of case-name prefixes (default: all)")
    ap.add_argument("--steady", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--host-gib", type=float, default=None, help="host tier (default 16 no-reuse, 40 multiturn)")
    ap.add_argument("--l3-gib", type=float, default=24.0)
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", type=int, default=1, help="divide lengths and pool sizes (a CPU smoke run: 64)")
    ap.add_argument("--profile-round", default="", help="comma list of rounds to profile (multiturn)")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.host_gib is None:
        args.host_gib = 16.0 if args.mode == "no-reuse" else 40.0
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model_pair = load_model(args.model, dtype, torch.device(args.device))
    results = (no_reuse if args.mode == "no-reuse" else multiturn)(args, model_pair)
    path = Path(args.out) / f"tier_overhead_{args.mode}.json"
    path.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
