"""The replay command end to end: trace formats, bad lines, JSON figures, sweeps, the sample trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.reuse import TRAFFIC_REUSE_MIN, TRAFFIC_REUSE_WEIGHT
from hicache.cli import main
from hicache.replay.core import Replayer, ReplaySetup
from hicache.replay.reuse import stack_depths
from hicache.replay.trace import TRACE_LOG, TraceError, parse_lines, read_trace, trace_line
from radix import page_keys

SAMPLE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")


def write(path: Path, rows: list[dict | str]) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def mooncake(ts: float, ids: list[int], bt: int = 4) -> dict:
    return {"timestamp": ts, "input_length": len(ids) * bt, "output_length": 1, "hash_ids": ids}


def test_bad_lines_skipped_with_line_numbers_or_strict(tmp_path: Path) -> None:
    rows = [mooncake(0, [1, 2]), "{not json", {"timestamp": 1, "input_length": 8}, mooncake(2, [1, 2, 3]),
            {"timestamp": 3, "input_length": 100, "output_length": 1, "hash_ids": [1]}]
    trace = read_trace(write(tmp_path / "t.jsonl", rows), block_tokens=4)
    assert [r.line for r in trace.records] == [1, 4]
    assert [n for n, _ in trace.bad_lines] == [2, 3, 5]
    assert "output_length" in trace.bad_lines[1][1] and "want 25" in trace.bad_lines[2][1]
    with pytest.raises(TraceError, match=":2: invalid JSON"):
        read_trace(tmp_path / "t.jsonl", block_tokens=4, strict=True)
    assert main(["replay", str(tmp_path / "t.jsonl"), "--block-tokens", "4", "--strict", "--no-progress",
                 "--device-tokens", "64"]) == 2
    with pytest.raises(TraceError, match="no valid request lines"):
        parse_lines(["garbage\n"])


def test_trace_log_round_trip_and_server_cap(tmp_path: Path) -> None:
    """The server's trace-log line is detected; replay leaves the last token to compute, as a server does."""
    ns = bytes(16)
    tokens = list(range(32))
    keys = page_keys(ns, tokens, 8)  # 4 full pages of 8 tokens
    lines = [trace_line(1000.0, 32, 5, keys, 8, {}, 12.5),
             trace_line(2000.0, 32, 5, keys, 8, {"device": 24}, 3.0)]
    trace = parse_lines(lines)
    assert trace.format == TRACE_LOG and trace.block_tokens == 8
    assert trace.records[1].cached_tokens == {"device": 24, "host": 0, "disk": 0}
    rep = Replayer(ReplaySetup(8, 16))
    rep.run(trace.records, server_log=True)
    assert rep.totals.server_checked == 2 and rep.totals.server_mismatches == []
    with pytest.raises(TraceError, match="block_tokens 8"):
        parse_lines(lines, block_tokens=16)
    with pytest.raises(ValueError, match="page ids"):
        trace_line(0.0, 33, 1, keys[:3], 8, {}, None)
    future = [json.dumps({**json.loads(line), "v": 99}) for line in lines]
    with pytest.raises(TraceError, match=r":1: trace log version 99; this hicache reads version 1"):
        parse_lines(future)
    mixed = parse_lines([lines[0], future[1]])  # a later line of another version is a bad line, named
    assert len(mixed.records) == 1 and mixed.bad_lines == [(2, "trace log version 99, not 1")]


def test_json_figures_and_exit_codes(tmp_path: Path) -> None:
    rows = [mooncake(i * 500.0, ids) for i, ids in enumerate([[1, 2, 3], [4, 5, 6], [1, 2, 3, 7], [4, 5, 6]])]
    trace = write(tmp_path / "t.jsonl", rows)
    out = tmp_path / "r.json"
    args = ["replay", trace, "--block-tokens", "4", "--device-tokens", "16", "--host-tokens", "20",
            "--disk-tokens", "32", "--write-host-to-disk", "write_through", "--kv-bytes-per-token", "100",
            "--l3-admit", "all", "--no-time", "--no-progress", "--json", str(out)]
    assert main([*args[:6], "--host-tokens", "0", "--disk-tokens", "32", "--no-progress"]) == 2  # disk needs host
    assert main(args) == 0
    s = json.loads(out.read_text())
    assert (s["requests"], s["blocks"]) == (4, 13)
    assert s["hit_blocks"] == {"device": 1, "host": 2, "disk": 3}  # as in test_hand_built_trace_known_answers
    assert s["hit_rate"]["disk"] == pytest.approx(3 / 13) and s["total_hit_rate"] == pytest.approx(6 / 13)
    assert s["token_hit_rate"]["host"] == pytest.approx(8 / 52)
    assert s["requests_with_disk_hit"] == 2
    d = s["disk"]
    assert d["bytes_read"] == 3 * 400 and d["pages_written"] == 7
    assert d["never_read_share"] == pytest.approx(4 / 7)
    assert d["read_bandwidth"]["peak_bytes_per_s"] == pytest.approx(3 * 400)  # 1 + 2 blocks at 1.0 s and 1.5 s
    assert s["prefill_time"]["assumed"] == ["prefill_tokens_per_s", "host_to_device_gbps", "disk_to_device_gbps"]
    assert s["disk_sizing"]["ideal_hit_rate"] == pytest.approx(6 / 13)


def test_blocks_nothing_suggests_are_reused_are_not_written_and_the_summary_says_why(tmp_path: Path, capsys) -> None:
    """l3_admit reuse (the server's default): one-off prompts are written only while the traffic is taken to reuse
    (controller/reuse.py: the first TRAFFIC_REUSE_MIN-th of a decaying share); after the 60 one-off prompts below,
    two more are not written; a third that continues one of them is written (its conversation came back), the
    blocks it hit too."""
    warm = [mooncake(i * 10.0, [100 + i]) for i in range(60)]  # one block each, never seen again
    once = warm + [mooncake(1000.0 + i * 500.0, ids) for i, ids in enumerate([[1, 2, 3], [4, 5, 6]])]
    share, spare = 1.0, 0
    for _ in warm:
        share -= TRAFFIC_REUSE_WEIGHT * share
        spare += share >= TRAFFIC_REUSE_MIN
    # host copies at once (no deferral), so each prompt's write is decided with the share its own arrival left
    base = ["--block-tokens", "4", "--device-tokens", "16", "--host-tokens", "20", "--disk-tokens", "32",
            "--write-host-to-disk", "write_through", "--defer-above-free", "1.0", "--kv-bytes-per-token", "100",
            "--no-time", "--no-progress"]
    out = tmp_path / "once.json"
    assert main(["replay", write(tmp_path / "once.jsonl", once), *base, "--json", str(out)]) == 0
    d = json.loads(out.read_text())["disk"]
    assert 0 < spare < 60 and d["pages_written"] == spare and d["not_reused_pages"] == 60 - spare + 6
    assert f"disk writes skipped: {60 - spare + 6} blocks" in capsys.readouterr().out
    out = tmp_path / "all.json"
    assert main(["replay", write(tmp_path / "once.jsonl", once), *base, "--l3-admit", "all", "--json", str(out)]) == 0
    d = json.loads(out.read_text())["disk"]
    assert d["pages_written"] == 60 + 6 and d["not_reused_pages"] == 0
    again = once + [mooncake(3000.0, [1, 2, 3, 7])]
    out = tmp_path / "again.json"
    assert main(["replay", write(tmp_path / "again.jsonl", again), *base, "--json", str(out)]) == 0
    d = json.loads(out.read_text())["disk"]
    assert d["pages_written"] == spare + 4 and d["not_reused_pages"] == 60 - spare + 6  # [1, 2, 3] on their hit, 7


def test_replay_prices_deep_blocks_dearer_with_an_attention_cost(tmp_path: Path, capsys) -> None:
    """A disk that loads a 4-token block in 6 us against 4 us to recompute it at the start of a prompt: with a flat
    cost its blocks are recomputed; with 1 us per token pair the prompts' blocks cost more than they load, so the
    disk serves hits."""
    rows = [mooncake(i * 500.0, ids) for i, ids in enumerate([[1, 2, 3], [4, 5, 6], [1, 2, 3, 7], [4, 5, 6]])]
    trace = write(tmp_path / "t.jsonl", rows)
    base = ["replay", trace, "--block-tokens", "4", "--device-tokens", "16", "--host-tokens", "20",
            "--disk-tokens", "32", "--write-host-to-disk", "write_through", "--kv-bytes-per-token", "100",
            "--load-mode", "auto", "--prefill-tokens-per-s", "1e6", "--host-to-device-gbps", "100",
            "--disk-to-device-gbps", str(400 / 6e-6 / 1e9), "--l3-admit", "all", "--no-time", "--no-progress"]
    flat, deep = tmp_path / "flat.json", tmp_path / "deep.json"
    assert main([*base, "--json", str(flat)]) == 0
    s = json.loads(flat.read_text())
    assert s["disk"]["pages_written"] == 7 and s["hit_blocks"]["disk"] == 0
    assert main([*base, "--attention-ns-per-pair", "1000", "--json", str(deep)]) == 0
    s = json.loads(deep.read_text())
    assert s["disk"]["pages_written"] == 7 and s["hit_blocks"]["disk"] == 3
    # prefill time prices each token at its position: c(t) = t / 1e6 + 1e-6 * t (t - 1) / 2 for a prompt's first
    # t tokens; prompts of 12, 12, 16 and 12 tokens, and two 12-token prefixes served (the GPU's hit: tokens 0-3)
    c = lambda t: t / 1e6 + 1e-6 * t * (t - 1) / 2  # noqa: E731
    pt = s["prefill_time"]
    assert pt["recompute_all_s"] == pytest.approx(3 * c(12) + c(16))
    assert pt["saved_s"]["device"] == pytest.approx(c(4))
    assert sum(pt["saved_s"].values()) + sum(pt["load_s"].values()) == pytest.approx(2 * c(12))
    assert pt["attention_ns_per_pair"] == pytest.approx(1000)
    assert "tokens/s + 1000 ns per (token, earlier token) pair" in capsys.readouterr().out
    flat_pt = json.loads(flat.read_text())["prefill_time"]
    assert flat_pt["recompute_all_s"] == pytest.approx(52 / 1e6)  # no pair cost: tokens / speed
    assert main([*base, "--attention-ns-per-pair", "-1"]) == 2


def test_sweep_writes_points_and_plot(tmp_path: Path) -> None:
    rows = [mooncake(float(i), [i % 5, 10 + i % 5, 20 + i % 3]) for i in range(30)]
    trace = write(tmp_path / "t.jsonl", rows)
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    assert main(["replay", trace, "--block-tokens", "4", "--device-tokens", "12", "--kv-bytes-per-token", "10",
                 "--sweep", "host=0,24", "--sweep", "disk=0,16,40", "--json", str(out), "--plot", str(png),
                 "--no-progress"]) == 0
    s = json.loads(out.read_text())
    assert len(s["points"]) == 6
    skipped = [p for p in s["points"] if "skipped" in p]
    assert [p["sweep"] for p in skipped] == [{"host": 0, "disk": 16}, {"host": 0, "disk": 40}]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["replay", trace, "--sweep", "nvme=1,2", "--no-progress"]) == 2


@pytest.mark.skipif(not SAMPLE.exists(), reason="sample trace not present")
def test_sample_trace_ideal_and_single_pool_lru() -> None:
    """64.0% of blocks with unlimited capacity, 42.4% with one 10,000-block LRU pool (trace README)."""
    trace = read_trace(SAMPLE)
    assert (len(trace.records), trace.blocks) == (3993, 121877)
    for blocks, want in ((10**6, 0.640), (10_000, 0.424)):
        rep = Replayer(ReplaySetup(512, blocks))
        t = rep.run(trace.records)
        assert t.hit_blocks["host"] == t.hit_blocks["disk"] == 0
        assert round(t.hit_blocks["device"] / t.blocks, 3) == want
        if blocks == 10**6:
            assert round(t.hit_tokens["device"] / t.tokens, 3) == 0.651
    reuse = stack_depths(trace.records)
    assert round(reuse.hits_within(10_000) / trace.blocks, 3) == 0.424


def _lines(path, records):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_string_and_huge_hash_ids_replay_like_small_ones(tmp_path, capsys):
    from hicache.cli import main

    def rec(i, ids):
        return {"timestamp": i, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}

    small = _lines(tmp_path / "small.jsonl", [rec(i, [1, 2 + i % 2]) for i in range(10)])
    strings = _lines(tmp_path / "strings.jsonl", [rec(i, ["a", f"b{i % 2}"]) for i in range(10)])
    huge = _lines(tmp_path / "huge.jsonl", [rec(i, [2**63 + 1, 2**80 + i % 2]) for i in range(10)])
    out = {}
    for name, path in (("small", small), ("strings", strings), ("huge", huge)):
        assert main(["replay", str(path), "--no-progress", "--json", str(tmp_path / f"{name}.json")]) == 0
        out[name] = json.loads((tmp_path / f"{name}.json").read_text())["hit_blocks"]
    assert out["small"] == out["strings"] == out["huge"] and sum(out["small"].values()) > 0
    capsys.readouterr()


def test_a_trace_mostly_skipped_is_an_error_not_a_report(tmp_path, capsys):
    from hicache.cli import main

    # at 64 tokens a block, 2 ids fit a 128-token prompt, not a 1,024-token one: 45 of 50 lines are bad
    records = [{"timestamp": i, "input_length": 128 if i % 10 == 0 else 1024, "output_length": 1,
                "hash_ids": [1, 2]} for i in range(50)]
    path = _lines(tmp_path / "t.jsonl", records)
    assert main(["replay", str(path), "--block-tokens", "64", "--no-progress"]) == 2
    assert "45 of 50 lines are bad" in capsys.readouterr().err


def test_a_line_longer_than_the_bound_is_a_bad_line_read_in_pieces(tmp_path, monkeypatch):
    from hicache.replay import trace as trace_module

    monkeypatch.setattr(trace_module, "MAX_LINE_BYTES", 1000)
    good = '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n'
    path = tmp_path / "t.jsonl"
    path.write_text(good + "x" * 5000 + "\n" + good + "y" * 3000)  # the last line has no newline at all
    t = trace_module.read_trace(path)
    assert len(t.records) == 2 and [n for n, _ in t.bad_lines] == [2, 4]
    assert all("longer than 1000 bytes" in why for _, why in t.bad_lines)


def _agent_file(path, ids_per_turn, sub=None):
    requests = [{"t": float(i * 10), "in": 64 * len(ids), "out": 5, "hash_ids": ids}
                for i, ids in enumerate(ids_per_turn)]
    if sub is not None:
        requests.insert(1, {"type": "subagent", "requests": [{"t": 5.0, "in": 64 * len(sub), "out": 1,
                                                              "hash_ids": sub}]})
    path.write_text(json.dumps({"id": path.stem, "block_size": 64, "hash_id_scope": "local", "requests": requests}))
    return path


def test_agent_sessions_replay_directly(tmp_path):
    from hicache.replay.agent import is_agent_trace, read_agent_sessions

    d = tmp_path / "agents"
    d.mkdir()
    _agent_file(d / "a.json", [[1, 2], [1, 2, 3]], sub=[1, 9])
    _agent_file(d / "b.json", [[1, 2], [1, 2, 3]])  # the same ids in another session: other blocks
    assert is_agent_trace(d) and is_agent_trace(d / "a.json") and not is_agent_trace(tmp_path / "none.jsonl")
    t = read_agent_sessions([d])
    assert t.format == "agent" and t.block_tokens == 64 and len(t.records) == 5  # the sub-agent's request included
    assert [r.timestamp_ms for r in t.records] == sorted(r.timestamp_ms for r in t.records)
    a_first, b_first = (r for r in t.records if r.timestamp_ms == 0.0)
    assert a_first.hash_ids != b_first.hash_ids  # unique per session
    sub = next(r for r in t.records if r.timestamp_ms == 5000.0)
    assert sub.hash_ids[0] == a_first.hash_ids[0]  # a sub-agent shares its session's ids
    offset = read_agent_sessions([d], offset_s=100.0)
    assert max(r.timestamp_ms for r in offset.records) == 110_000.0
    out = tmp_path / "r.json"
    assert main(["replay", str(d), "--device-tokens", "4096", "--no-progress", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    # per session: turn 2 hits its 2 blocks of turn 1, the sub-agent its session's block 1; no hit across sessions
    assert sum(got["hit_blocks"].values()) == 2 + 1 + 2


def test_an_agent_hash_id_that_is_neither_integer_nor_string_is_refused_by_name(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"id": "s", "block_size": 64,
                                "requests": [{"t": 0, "in": 128, "out": 4, "hash_ids": [1, [2]]}]}))
    assert main(["replay", str(path), "--no-progress"]) == 2
    assert "every hash id must be an integer or a string" in capsys.readouterr().err


def test_the_report_prices_every_hit_with_the_costs_it_ran_with(tmp_path: Path) -> None:
    """No prefill speed given: the assumed 10,000 tokens/s prices recomputing (400 tokens = 0.04 s) and the hits
    alike, so what a loaded hit saves is recompute minus load and never negative; recompute-all is the trace's sum.
    The header's policies are the server's defaults (load mode auto) when no config says otherwise."""
    rows = [mooncake(i, [1, 2, 3, 4, 5] + [100 + i] * 5, bt=40) for i in range(6)]  # 400 tokens, a shared half
    out = tmp_path / "r.json"
    assert main(["replay", write(tmp_path / "t.jsonl", rows), "--block-tokens", "40", "--no-progress",
                 "--device-tokens", "800", "--host-tokens", "4000", "--kv-bytes-per-token", "1000",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    pt = data["prefill_time"]
    assert pt["recompute_all_s"] == pytest.approx(6 * 400 / 10_000)
    assert "prefill_tokens_per_s" in pt["assumed"] and pt["prefill_tokens_per_s"] == 10_000
    assert data["policies"]["load_mode"] == "auto"
    assert sum(data["hit_blocks"].values()) > 0
    for tier in ("device", "host", "disk"):
        assert pt["saved_s"][tier] >= 0.0, tier
    assert 0.0 < pt["total_saved_s"] < pt["recompute_all_s"]


def test_calibration_from_a_servers_metrics_prices_the_replay(tmp_path: Path, capsys) -> None:
    """A server's /metrics (rendered here by the server's own metrics code) fixes the replay's costs: prefill speed,
    attention per pair and the two bandwidths, none of them assumed; a flag still wins; a file with no cost
    metrics, or a server that does not answer, is an error naming the source."""
    from hicache.server.metrics import ServerMetrics

    cost = {"prefill_tokens_per_s": 20_000.0, "attention_ns_per_pair": 0.5, "host_to_device_gbps": 50.0,
            "disk_to_device_gbps": 2.0}
    metrics = tmp_path / "server.metrics"
    metrics.write_bytes(ServerMetrics(1000).render({"cost_model": cost}, None))
    rows = [mooncake(i, [1, 2, 3, 4, 5] + [100 + i] * 5, bt=40) for i in range(6)]
    trace, out = write(tmp_path / "t.jsonl", rows), tmp_path / "r.json"
    common = ["replay", trace, "--block-tokens", "40", "--no-progress", "--device-tokens", "800",
              "--kv-bytes-per-token", "1000", "--json", str(out), "--calibration", str(metrics)]
    assert main(common) == 0
    pt = json.loads(out.read_text())["prefill_time"]
    assert pt["assumed"] == [] and pt["prefill_tokens_per_s"] == 20_000.0 and pt["attention_ns_per_pair"] == 0.5
    assert pt["host_to_device_gbps"] == 50.0 and pt["disk_to_device_gbps"] == 2.0
    tokens = 400
    assert pt["recompute_all_s"] == pytest.approx(6 * (tokens / 20_000 + 0.5e-9 * tokens * (tokens - 1) / 2))
    assert main([*common, "--prefill-tokens-per-s", "5000"]) == 0
    assert json.loads(out.read_text())["prefill_time"]["prefill_tokens_per_s"] == 5000.0
    empty = tmp_path / "other.metrics"
    empty.write_text("# HELP up up\n# TYPE up gauge\nup 1\n")
    capsys.readouterr()
    assert main([*common[:-1], str(empty)]) == 2
    assert "no hicache_cost_* metrics" in capsys.readouterr().err
    assert main([*common[:-1], "http://127.0.0.1:1"]) == 2
    assert "cannot read the server's metrics" in capsys.readouterr().err


def test_the_lru_model_rates_are_of_the_whole_trace_when_the_clock_refuses_prompts(tmp_path: Path) -> None:
    """Two prompts of 10 blocks over a 20-token context limit are refused on the clock; the LRU model still saw
    every block of the trace (26 accesses, 16 of them reuses), and its rates are of those, never above 100%."""
    rows = [mooncake(0, [1, 2, 3]), mooncake(1, [1, 2, 3]), mooncake(2, list(range(1, 11))),
            mooncake(3, list(range(1, 11)))]
    trace, out = write(tmp_path / "t.jsonl", rows), tmp_path / "r.json"
    assert main(["replay", trace, "--block-tokens", "4", "--no-progress", "--device-tokens", "64", "--host-tokens",
                 "128", "--kv-bytes-per-token", "10", "--set", "scheduler.max_context_tokens=20",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["time"]["rejected_requests"] == 2 and r["requests"] == 2 and r["blocks"] == 6
    assert r["disk_sizing"]["ideal_hit_rate"] == pytest.approx(16 / 26)


def test_the_command_line_ends_without_teardown_yet_flushes_its_report_and_keeps_its_exit_code(tmp_path: Path) -> None:
    """`hicache replay` run as a command skips freeing its objects at exit (hicache.cli._exit_now): what it printed
    and wrote still arrives whole, through pipes, and bad input still exits 2 with its error."""
    import subprocess
    import sys

    trace = write(tmp_path / "t.jsonl", [mooncake(float(i), [1, 2, 10 + i]) for i in range(5)])
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "hicache.cli", "replay", trace, "--block-tokens", "4", "--device-tokens", "8",
           "--no-progress", "--no-time", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "hicache replay:" in done.stdout and done.stdout.rstrip().splitlines()[-1].startswith("disk needed")
    assert json.loads(out.read_text())["requests"] == 5
    bad = subprocess.run([*cmd[:4], str(tmp_path / "missing.jsonl"), "--no-progress"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "cannot read trace" in bad.stderr
