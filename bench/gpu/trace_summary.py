"""Summarise a `hicache serve --trace-gpu` Chrome trace step by step: where each step's GPU time went.

For every `step N` range the engine recorded: its CPU time, the span of the GPU work it launched (first kernel start
to last kernel end), the GPU time inside that span with no kernel of the step running (idle: the GPU waited for the
CPU or for another stream), and kernel time by kind (GEMMs, the prefix attention kernel, the decode kernel, SDPA,
copies, the rest). Kernels are matched to steps through the launch calls' correlation ids, so copier work on other
streams is counted separately (`other streams`), by the step whose time window it overlaps.

Usage: python3 bench/gpu/trace_summary.py TRACE.json[.gz] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json

KINDS = (  # (kind, substrings of the kernel name), first match wins
    ("prefix attn", ("_prefix",)),
    ("decode attn", ("decode",)),
    ("sdpa", ("flash", "fmha", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
    ("fused elementwise", ("_silu", "_rope")),
    ("norm", ("rms", "norm")),
    ("copy", ("copy", "index", "scatter", "gather", "cat")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, keys in KINDS:
        if any(k in lowered for k in keys):
            return kind
    return "other"


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e3


def summarise(events: list[dict]) -> list[dict]:
    steps = sorted((e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("step ")
                    and e.get("cat") in ("user_annotation", "cpu_op", None)), key=lambda e: e["ts"])
    launches = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})]
    gpu = {e["args"]["correlation"]: e for e in events if e.get("ph") == "X"
           and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "correlation" in e.get("args", {})}
    out = []
    for s in steps:
        start, end = s["ts"], s["ts"] + s["dur"]
        mine = [gpu[c] for c in (e["args"]["correlation"] for e in launches if start <= e["ts"] <= end) if c in gpu]
        if not mine:
            continue
        streams = collections.Counter(k.get("tid") for k in mine)
        main = streams.most_common(1)[0][0]
        on_main = [k for k in mine if k.get("tid") == main]
        span = (max(k["ts"] + k["dur"] for k in on_main) - min(k["ts"] for k in on_main)) / 1e3
        busy = union_ms([(k["ts"], k["ts"] + k["dur"]) for k in on_main])
        by_kind: dict[str, float] = collections.defaultdict(float)
        for k in on_main:
            by_kind[kind_of(k["name"]) if k.get("cat") == "kernel" else "copy"] += k["dur"] / 1e3
        by_kind["other streams"] = sum(k["dur"] for k in mine if k.get("tid") != main) / 1e3
        out.append({"step": s["name"], "cpu_ms": s["dur"] / 1e3, "gpu_span_ms": span, "busy_ms": busy,
                    "idle_ms": span - busy, "kernels": len(on_main), "by_kind": dict(by_kind)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    args = p.parse_args()
    rows = summarise(load(args.trace))
    kinds = sorted({k for r in rows for k in r["by_kind"]})
    print(f"{'step':>10} {'cpu':>7} {'span':>7} {'busy':>7} {'idle':>6} {'kern':>5}  " + " ".join(
        f"{k[:12]:>12}" for k in kinds))
    for r in rows:
        print(f"{r['step']:>10} {r['cpu_ms']:7.1f} {r['gpu_span_ms']:7.1f} {r['busy_ms']:7.1f} {r['idle_ms']:6.1f} "
              f"{r['kernels']:5d}  " + " ".join(f"{r['by_kind'].get(k, 0.0):12.2f}" for k in kinds))
    if rows:
        print("total      " + f"{sum(r['cpu_ms'] for r in rows):7.1f} {sum(r['gpu_span_ms'] for r in rows):7.1f} "
              f"{sum(r['busy_ms'] for r in rows):7.1f} {sum(r['idle_ms'] for r in rows):6.1f}")


if __name__ == "__main__":
    main()
