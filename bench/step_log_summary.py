"""Summarise `hicache serve --step-log` files: where the engine thread's time went, step by kind.

Kinds: prefill (the step computed prompt tokens, possibly with decodes riding along), decode-only (eager), and
decode-only replayed from a CUDA graph. Per kind: steps, forward seconds, mean sequences; then scheduling and
gap seconds (time in neither), tokens per prefill step, and the longest queue. Also: prefill steps by size (per
1,024 prompt tokens: steps, seconds, microseconds per token; small steps cost more a token), and how many
decode-only steps ran while loads were pending (the rest had nothing to prefill: the queue was empty or the GPU
pool full), and the cost per token of prefill steps that came right after GPU pages were freed with their copy to
host in flight (`backup_wait_pages` in that step or the one before: the compute stream waited for those copies)
against the others.

With the CUDA step-log fields, each kind also shows the CPU time spent queueing its forwards (`enqueue`), the
GPU's time from first to last kernel (`gpu`), the compute stream's waits for copies (`wait`), the engine thread's CPU
time while queueing (`enqueue_cpu`) and garbage collection (`gc`).

Usage: python3 bench/step_log_summary.py FILE [FILE ...]
"""

from __future__ import annotations

import argparse
import json
import statistics


def summarise(path: str) -> dict:
    steps = [json.loads(line) for line in open(path) if line.strip()]
    kinds: dict[str, list[dict]] = {"prefill": [], "decode-only": [], "decode-only, graph": []}
    for s in steps:
        kind = "prefill" if s["prefill_tokens"] else "decode-only, graph" if s["graph"] else "decode-only"
        kinds[kind].append(s)
    prefill = kinds["prefill"]
    return {
        "file": path,
        "steps": len(steps),
        "span_s": steps[-1]["t"] - steps[0]["t"] if steps else 0.0,
        "kinds": {k: {"steps": len(v), "forward_s": sum(s["forward_ms"] for s in v) / 1e3,
                      "mean_sequences": statistics.fmean(s["sequences"] for s in v) if v else 0.0,
                      **_gpu_timings(v)}
                  for k, v in kinds.items()},
        "schedule_s": sum(s["schedule_ms"] for s in steps) / 1e3,
        "overlapped_s": sum(s.get("overlapped_ms", 0.0) for s in steps) / 1e3,
        "gap_s": sum(max(0.0, s["gap_ms"]) for s in steps[1:]) / 1e3,  # the first gap is the wait for work
        "prefill_tokens_per_step": statistics.fmean(s["prefill_tokens"] for s in prefill) if prefill else 0.0,
        "prefill_by_size": _by_size(prefill),
        "decode_only_while_loading": sum(1 for s in steps if not s["prefill_tokens"] and s["loading"] > 0),
        "after_backup_waits": _after_backup_waits(steps),
        "first_tokens": sum(s["first_tokens"] for s in steps),
        "max_waiting": max((s["waiting"] for s in steps), default=0),
        "max_loading": max((s["loading"] for s in steps), default=0),
    }


def _gpu_timings(steps: list[dict]) -> dict:
    """Seconds of CPU queueing (enqueue_ms), GPU forward (gpu_ms) and stream waits (wait_ms), over the steps that
    have them (logs before these fields have none; gpu_ms and wait_ms are CUDA only)."""
    out = {}
    for field in ("enqueue_ms", "enqueue_cpu_ms", "gpu_ms", "wait_ms", "gc_ms"):
        values = [s[field] for s in steps if field in s]
        if values:
            out[field[:-3] + "_s"] = sum(values) / 1e3
    return out


def _after_backup_waits(steps: list[dict]) -> dict:
    """Prefill steps whose line or the previous one counts backup waits, against the rest: steps, us per token."""
    split: dict[str, list[dict]] = {"after_waits": [], "others": []}
    for i, s in enumerate(steps):
        if s["prefill_tokens"]:
            waited = s.get("backup_wait_pages", 0) or (i > 0 and steps[i - 1].get("backup_wait_pages", 0))
            split["after_waits" if waited else "others"].append(s)
    return {k: {"steps": len(v), "us_per_token": sum(s["forward_ms"] for s in v) * 1e3 / max(1, sum(
        s["prefill_tokens"] for s in v))} for k, v in split.items()}


def _by_size(prefill: list[dict]) -> list[dict]:
    """Prefill steps grouped by prompt tokens, rounded up to a multiple of 1,024."""
    groups: dict[int, list[dict]] = {}
    for s in prefill:
        groups.setdefault(-(-s["prefill_tokens"] // 1024) * 1024, []).append(s)
    rows = []
    for size in sorted(groups):
        group = groups[size]
        tokens = sum(s["prefill_tokens"] for s in group)
        seconds = sum(s["forward_ms"] for s in group) / 1e3
        rows.append({"up_to_tokens": size, "steps": len(group), "tokens": tokens, "forward_s": seconds,
                     "us_per_token": seconds * 1e6 / tokens})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    for path in args.files:
        r = summarise(path)
        print(f"{r['file']}: {r['steps']} steps over {r['span_s']:.2f} s; scheduling {r['schedule_s']:.2f} s "
              f"({r['overlapped_s']:.2f} s of it while a forward ran), "
              f"gaps {r['gap_s']:.2f} s; {r['prefill_tokens_per_step']:.0f} prompt tokens per prefill step; "
              f"{r['first_tokens']} first tokens; queues up to {r['max_waiting']} waiting, {r['max_loading']} loading")
        for kind, k in r["kinds"].items():
            timings = "".join(f", {name[:-2]} {k[name]:.2f} s" for name in (
                "enqueue_s", "enqueue_cpu_s", "gpu_s", "wait_s", "gc_s") if name in k)
            print(f"  {kind:>20}: {k['steps']:5d} steps, forward {k['forward_s']:7.2f} s{timings}, "
                  f"{k['mean_sequences']:5.1f} sequences on average")
        decode_only = r["kinds"]["decode-only"]["steps"] + r["kinds"]["decode-only, graph"]["steps"]
        print(f"  decode-only steps while loads were pending: {r['decode_only_while_loading']} of {decode_only}")
        waits = r["after_backup_waits"]
        print(f"  prefill steps after backup waits: {waits['after_waits']['steps']} "
              f"({waits['after_waits']['us_per_token']:.1f} us/token), others: {waits['others']['steps']} "
              f"({waits['others']['us_per_token']:.1f} us/token)")
        for row in r["prefill_by_size"]:
            print(f"  prefill steps of <= {row['up_to_tokens']:6d} tokens: {row['steps']:4d} steps, "
                  f"{row['forward_s']:6.2f} s, {row['us_per_token']:6.1f} us/token")


if __name__ == "__main__":
    main()
