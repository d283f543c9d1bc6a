"""Where a lone host hit's time goes, in-process: a 32k-token prefix pushed from the GPU to host memory, then one
request of that prefix + 1,024 new tokens, against the same request with the prefix still on the GPU (bench/RESULTS.md,
'A host hit against a GPU hit'; bench/gpu/host_hit.py measures it through the server).

Per arm, ROUNDS hits are timed (TTFT of a one-token answer, the engine's own clock), and one more runs under
torch.profiler: its GPU timeline by stream (`streams`: busy time, first start and last end from the step's first GPU
work), the host -> GPU copies, and the compute stream's idle gaps, longest first. So a host hit that is slower than
the copies' floor shows whether the forward waited for a layer's copy, for the loader's scatter, or for the CPU.

Usage (H200): python3 bench/gpu/host_hit_trace.py --out DIR [--rounds 3] [--arms gpu layered whole]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tier_overhead import CONFIG, _union, arm_config, build, dispose, prompts, run_batch, sync  # noqa: E402

from hicache.engine.weights import load_model  # noqa: E402

ARMS = {"gpu": None, "layered": True, "whole": False}  # arm -> cache.load_policy.layered (gpu: the prefix stays)


def stream_timeline(trace: dict[str, Any]) -> dict[str, Any]:
    """GPU work of a chrome trace by stream: busy ms, first start and last end (ms from the first GPU work) and the
    kernels' names by time; the compute stream's (the busiest's) idle gaps over 50 us, longest first."""
    spans: dict[str, list[tuple[float, float]]] = {}
    names: dict[str, dict[str, float]] = {}
    for ev in trace["traceEvents"]:
        if ev.get("ph") != "X" or "dur" not in ev or ev.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        stream = f"{ev['cat']}@{ev.get('args', {}).get('stream', '?')}"
        start, dur = float(ev["ts"]), float(ev["dur"])
        spans.setdefault(stream, []).append((start, start + dur))
        by_name = names.setdefault(stream, {})
        by_name[ev["name"][:60]] = by_name.get(ev["name"][:60], 0.0) + dur / 1e3
    if not spans:
        return {}
    t0 = min(s for v in spans.values() for s, _ in v)
    out: dict[str, Any] = {"span_ms": (max(e for v in spans.values() for _, e in v) - t0) / 1e3, "streams": {}}
    for stream, v in spans.items():
        u = _union(v)
        top = sorted(names[stream].items(), key=lambda kv: -kv[1])[:4]
        out["streams"][stream] = {"busy_ms": sum(e - s for s, e in u) / 1e3, "first_ms": (u[0][0] - t0) / 1e3,
                                  "last_ms": (u[-1][1] - t0) / 1e3, "count": len(v),
                                  "top": {k: round(ms, 2) for k, ms in top}}
    kernels = {k: v for k, v in out["streams"].items() if k.startswith("kernel@")}
    if kernels:
        compute = max(kernels, key=lambda k: kernels[k]["busy_ms"])
        u = _union(spans[compute])
        gaps = sorted(((b[0] - a[1]) / 1e3, (a[1] - t0) / 1e3) for a, b in zip(u, u[1:]) if b[0] - a[1] > 50)
        out["compute_stream"] = compute
        out["compute_gaps"] = {"count": len(gaps), "total_ms": round(sum(g for g, _ in gaps), 2),
                               "longest (ms, at ms)": [(round(g, 2), round(at, 2)) for g, at in gaps[::-1][:12]]}
    return out


def hit(engine: Any, prefix: list[int], evictors: list[list[int]], new: list[int], tag: str,
        trace: Path | None = None) -> dict[str, Any]:
    """Push the prefix off the GPU (evictors; none for the GPU arm), let the copies settle, then time the hit."""
    seen = dict(engine.cache.controller.stats.snapshot()["hit_tokens"])
    for i, e in enumerate(evictors):
        run_batch(engine, [e], 1, f"{tag}-evict{i}")
    for _ in range(3):
        engine.step()
    sync()
    if trace is None:
        r = run_batch(engine, [prefix + new], 1, tag)
    else:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            r = run_batch(engine, [prefix + new], 1, tag)
        prof.export_chrome_trace(str(trace))
        r["timeline"] = stream_timeline(json.loads(trace.read_text()))
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            dst.write(src.read())
        trace.unlink()
    hits = engine.cache.controller.stats.snapshot()["hit_tokens"]
    r["hit_tokens"] = {tier: n - seen.get(tier, 0) for tier, n in hits.items() if n - seen.get(tier, 0)}
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--prefix-tokens", type=int, default=32768)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--device-gib", type=float, default=8.0)
    ap.add_argument("--host-gib", type=float, default=48.0)
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32  # as tier_overhead.build asks
    model_pair = load_model(args.model, dtype, torch.device(args.device))
    vocab = model_pair[0].config.vocab_size
    results: dict[str, Any] = {}
    for arm in args.arms:
        layered = ARMS[arm]
        values = arm_config(0, args.host_gib, 0, 1.0)
        values["cache.device"] = {"size_gib": args.device_gib}
        if layered is not None:
            values["cache.load_policy.layered"] = layered
        engine = build(model_pair, values, args)
        rng = random.Random(11)
        prefix = prompts(rng, 1, args.prefix_tokens, vocab)[0]
        run_batch(engine, prompts(rng, 1, min(2048, args.prefix_tokens), vocab), 1, "warm")
        run_batch(engine, [prefix], 1, "prefix")
        rows = []
        for r in range(args.rounds + 1):
            evictors = prompts(rng, 3, args.prefix_tokens, vocab) if layered is not None else []
            new = prompts(rng, 1, args.new_tokens, vocab)[0]
            trace = out / f"host_hit_{arm}.trace.json" if r == args.rounds else None
            res = hit(engine, prefix, evictors, new, f"{arm}{r}", trace)
            rows.append(res)
            print(f"{arm} round {r}{' (profiled)' if trace else ''}: ttft {res['ttft_p50'] * 1e3:.1f} ms, forward "
                  f"{res['forward_s'] * 1e3:.1f} ms, steps {res['steps']}, hits {res['hit_tokens']}", flush=True)
            if trace:
                print(json.dumps(res["timeline"], indent=1), flush=True)
        timed = [r["ttft_p50"] for r in rows[:args.rounds]]
        results[arm] = {"ttft_median_ms": statistics.median(timed) * 1e3, "rounds": rows}
        print(f"== {arm}: TTFT median {results[arm]['ttft_median_ms']:.1f} ms", flush=True)
        dispose(engine)
    (out / "host_hit_trace.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
