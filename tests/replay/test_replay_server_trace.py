"""A real server's --trace-log replayed with the server's tier sizes gives the server's hits, per request and tier."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import httpx

from hicache.cli import main
from hicache.replay.trace import read_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import ServerProcess, metric, metrics, tiny_config, wait_for  # noqa: E402

PAGE = 16
DEVICE_TOKENS, HOST_TOKENS, DISK_TOKENS = 16 * PAGE, 24 * PAGE, 256 * PAGE
TIERS = ("device", "host", "disk")


def conversation_prompts(conversations: int = 6, turns: int = 4, seed: int = 0) -> list[list[int]]:
    """Multi-turn prompts in arrival order: round-robin over conversations, each turn extends the last prompt.

    A conversation's own system prompt (40 tokens) plus 24 new tokens a turn, so a prompt is 64-136 tokens
    (4-8 full pages, mostly a partial last page; 4 generated tokens may open one more GPU page) and shares
    every full page of its previous turn. 30-50 pages of other conversations come between two turns of one
    conversation: more than the GPU (16 pages) and host (24 pages) hold, so a later turn finds its prefix on
    host or disk; even conversations resend each prompt at once (a retry), which the GPU serves.
    """
    rng = random.Random(seed)
    history = [[rng.randrange(1, 500) for _ in range(40)] for _ in range(conversations)]
    prompts = []
    for _ in range(turns):
        for c in range(conversations):
            history[c] = history[c] + [rng.randrange(1, 500) for _ in range(24)]
            prompts.append(history[c])
            if c % 2 == 0:
                prompts.append(history[c])
    return prompts


def l3_writes_settled(url: str) -> bool:
    """Every page the controller queued for L3 is written: replay applies L3 writes at once."""
    values = metrics(url)
    queued = metric(values, "hicache_pages_demoted_total", src="host", dst="disk")
    return metric(values, "hicache_l3_operations_total", op="writes") == queued


def test_replayed_trace_log_matches_server_hits_per_tier(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path,
        **{"cache.device.size_tokens": DEVICE_TOKENS, "cache.host.size_tokens": HOST_TOKENS,
           "cache.l3.size_tokens": DISK_TOKENS, "cache.write_policy.host_to_disk": "write_back"},
    )
    trace = tmp_path / "trace.jsonl"
    server = ServerProcess(["--config", str(config), "--trace-log", str(trace)], tmp_path / "server.log")
    prompts = conversation_prompts()
    reported = []
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for prompt in prompts:  # one at a time: each response ends its request
                body = {"model": "random:tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                reported.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens_per_tier"])
                assert wait_for(lambda: l3_writes_settled(server.url), timeout=10, interval=0.02)
        assert server.stop() == 0, server.log()
    finally:
        server.kill()

    records = read_trace(trace, strict=True).records
    # the trace log holds what the responses said (the remote tier's hits as disk hits: the replay has one disk tier)
    assert [rec.cached_tokens for rec in records] == [
        {"device": r["device"], "host": r["host"], "disk": r["disk"] + r["remote"]} for r in reported]
    assert [(rec.input_length, rec.output_length) for rec in records] == [(len(p), 4) for p in prompts]
    served = {t: sum(rec.cached_tokens[t] for rec in records) for t in TIERS}
    assert all(served[t] > 0 for t in TIERS), served

    out = tmp_path / "replay.json"
    assert main(["replay", str(trace), "--no-time", "--config", str(config), "--device-tokens", str(DEVICE_TOKENS),
                 "--host-tokens", str(HOST_TOKENS), "--disk-tokens", str(DISK_TOKENS), "--load-mode", "always",
                 "--no-progress", "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["server_check"]["requests"] == len(records)
    assert s["server_check"]["first_mismatches"] == [] and s["server_check"]["mismatches"] == 0
    assert s["hit_tokens"] == served
