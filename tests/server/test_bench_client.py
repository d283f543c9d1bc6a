"""`hicache bench multiturn` against a real server: rounds grow on the cache; figures and JSON."""

from __future__ import annotations

import asyncio
import json
import math
import random

from hicache.bench_client.multiturn import MultiTurnOptions, parse_metrics, random_text, run_multiturn
from hicache.bench_client.report import TurnResult, percentile, summarize
from hicache.cli import main


def test_percentile_and_summary() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and math.isnan(percentile([], 50))
    turns = [TurnResult(0, 0, 0.0, 1.0, 0.1, 100, 10, 50, {"device": 30, "host": 20, "disk": 0}),
             TurnResult(1, 0, 0.5, 2.0, 0.3, 100, 10, 0, {"device": 0, "host": 0, "disk": 0}),
             TurnResult(2, 0, 0.5, 2.0, error="HTTP 500")]
    s = summarize(turns)
    assert s["requests"] == 3 and s["errors"] == 1 and s["duration_s"] == 2.0
    assert s["ttft_ms"]["mean"] == 200.0 and s["ttft_ms"]["p50"] == 200.0
    assert s["input_tokens_per_s"] == 100.0 and s["output_tokens_per_s"] == 10.0
    assert s["cache_hit_rate"] == 0.25
    assert s["cache_hit_rate_per_tier"] == {"device": 0.15, "host": 0.1, "disk": 0, "remote": 0}


def test_parse_metrics_and_text() -> None:
    text = '# HELP x\nhicache_cache_hit_tokens_total{tier="disk"} 12.0\nhicache_prompt_tokens_total 40\nother 1\n'
    assert parse_metrics(text) == {'hicache_cache_hit_tokens_total{tier="disk"}': 12.0,
                                   "hicache_prompt_tokens_total": 40.0}
    assert len(random_text(random.Random(1), 300)) == 300


def test_multiturn_against_server(server) -> None:
    opts = MultiTurnOptions(url=server.url, clients=3, rounds=3, request_length=64, output_length=8, seed=7)
    report = asyncio.run(asyncio.wait_for(run_multiturn(opts), timeout=120))
    assert report.settings["chars_per_token"] == 1.0  # byte-level tokenizer of random models
    assert [r["requests"] for r in report.rounds] == [3, 3, 3] and report.overall["errors"] == 0
    assert report.overall["completion_tokens"] == 9 * 8  # ignore_eos forces exactly output_length tokens
    assert report.rounds[0]["cache_hit_rate"] == 0
    for r in report.rounds[1:]:  # every later prompt extends the previous one: its pages are cached
        assert r["cache_hit_rate"] > 0.3
        assert set(r["cache_hit_rate_per_tier"]) == {"device", "host", "disk", "remote"}
    assert report.overall["ttft_ms"]["p99"] >= report.overall["ttft_ms"]["p50"] > 0
    assert report.server_metrics['hicache_cache_hit_tokens_total{tier="device"}'] > 0


def test_cli_chat_with_barrier(server, tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    code = main(["bench", "multiturn", "--url", server.url, "--clients", "2", "--rounds", "2", "--request-length",
                 "32", "--output-length", "4", "--api", "chat", "--round-barrier", "--request-rate", "50",
                 "--max-parallel", "1", "--chars-per-token", "1", "--json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "ttft mean" in table and "\n  all " in table
    data = json.loads(out.read_text())
    assert data["settings"]["api"] == "chat" and len(data["rounds"]) == 2
    assert data["rounds"][1]["cached_tokens"] > 0
