"""Figures of a multi-turn run: TTFT percentiles, throughput and cache hit rates, per round and overall."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TIERS = ("device", "host", "disk", "remote")  # hicache's cached_tokens_per_tier; other servers report none


@dataclass
class TurnResult:
    """One request of one client in one round (times in seconds from the run's start)."""

    client: int
    round: int
    start: float
    end: float = 0.0
    ttft: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_per_tier: dict[str, int] | None = None  # hicache's usage extension, when the server sends it
    error: str | None = None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation (numpy's default); nan when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(turns: Sequence[TurnResult], duration: float | None = None) -> dict[str, Any]:
    """Counts, TTFT (ms: mean, p50, p90, p99), token throughput and hit rates of a set of turns.

    duration: the wall time to divide by (default: first start to last end of these turns).
    """
    ok = [t for t in turns if t.error is None]
    ttfts = [t.ttft * 1000.0 for t in ok if t.ttft is not None]
    if duration is None:
        duration = (max(t.end for t in ok) - min(t.start for t in ok)) if ok else 0.0
    prompt = sum(t.prompt_tokens for t in ok)
    output = sum(t.completion_tokens for t in ok)
    cached = sum(t.cached_tokens for t in ok)
    out: dict[str, Any] = {
        "requests": len(turns),
        "errors": len(turns) - len(ok),
        "duration_s": duration,
        "ttft_ms": {
            "mean": sum(ttfts) / len(ttfts) if ttfts else math.nan,
            "p50": percentile(ttfts, 50), "p90": percentile(ttfts, 90), "p99": percentile(ttfts, 99),
        },
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "cached_tokens": cached,
        "input_tokens_per_s": prompt / duration if duration > 0 else math.nan,
        "output_tokens_per_s": output / duration if duration > 0 else math.nan,
        "cache_hit_rate": cached / prompt if prompt else math.nan,
    }
    if ok and all(t.cached_per_tier is not None for t in ok):
        per_tier = {tier: sum(t.cached_per_tier.get(tier, 0) for t in ok) for tier in TIERS}
        out["cached_tokens_per_tier"] = per_tier
        out["cache_hit_rate_per_tier"] = {tier: n / prompt if prompt else math.nan for tier, n in per_tier.items()}
    return out


@dataclass
class BenchReport:
    """The whole run: settings, per-round and overall figures, server metric deltas."""

    settings: dict[str, Any]
    rounds: list[dict[str, Any]] = field(default_factory=list)
    overall: dict[str, Any] = field(default_factory=dict)
    server_metrics: dict[str, float] | None = None  # counter deltas from /metrics, when the server has them
    errors: list[str] = field(default_factory=list)
    turns: list[TurnResult] = field(default_factory=list, repr=False)  # every request (not in the JSON)

    def to_json(self) -> dict[str, Any]:
        return {"settings": self.settings, "rounds": self.rounds, "overall": self.overall,
                "server_metrics": self.server_metrics, "errors": self.errors[:20]}


def build_report(settings: dict[str, Any], turns: Sequence[TurnResult], duration: float,
                 server_metrics: dict[str, float] | None) -> BenchReport:
    report = BenchReport(settings, server_metrics=server_metrics, turns=list(turns))
    for r in sorted({t.round for t in turns}):
        report.rounds.append({"round": r, **summarize([t for t in turns if t.round == r])})
    report.overall = summarize(turns, duration)
    report.errors = [f"client {t.client} round {t.round}: {t.error}" for t in turns if t.error]
    return report


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"


def format_table(report: BenchReport, label: str = "round") -> str:
    """The per-round (or per-`label`) and overall figures as a fixed-width text table."""
    header = [label, "reqs", "err", "ttft mean", "p50", "p90", "p99", "in tok/s", "out tok/s", "hit %",
              "device %", "host %", "disk %"]
    rows = []
    for name, s in [*((str(r["round"]), r) for r in report.rounds), ("all", report.overall)]:
        t = s["ttft_ms"]
        tiers = s.get("cache_hit_rate_per_tier", {})
        rows.append([
            name, str(s["requests"]), str(s["errors"]), _fmt(t["mean"]), _fmt(t["p50"]), _fmt(t["p90"]),
            _fmt(t["p99"]), _fmt(s["input_tokens_per_s"], 0), _fmt(s["output_tokens_per_s"], 0),
            _fmt(100 * s["cache_hit_rate"]), *(_fmt(100 * tiers[k]) if k in tiers else "-" for k in TIERS),
        ])
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.append("(TTFT in ms, measured by the client: first streamed text; hit % = cached / prompt tokens)")
    if report.server_metrics:
        m = report.server_metrics
        prompt = m.get("hicache_prompt_tokens_total", 0.0)
        hits = {k: m.get(f'hicache_cache_hit_tokens_total{{tier="{k}"}}', 0.0) for k in TIERS}
        if prompt:
            lines.append("server /metrics: " + ", ".join(f"{k} {100 * v / prompt:.1f}%" for k, v in hits.items())
                         + f" of {prompt:,.0f} prompt tokens admitted")
    return "\n".join(lines)
