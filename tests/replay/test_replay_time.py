"""The replay's time model (hicache/replay/simulate.py, timed.py): its clock against figures worked out by hand,
and through `hicache replay` the report and JSON it gives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controller import WritePolicy
from hicache.cli import main
from hicache.replay.cli import cost_inputs
from hicache.replay.core import ReplaySetup
from hicache.replay.simulate import TimedReplay, TimeSetup, open_loop
from hicache.replay.store import ReplayL3
from hicache.replay.summary import summarize, time_summary
from hicache.replay.timed import SimClock, TimedCopier, TimedWorker
from hicache.replay.trace import TraceRecord
from hicache.server.metrics import ServerMetrics, decode_step_fit

BT = 100  # tokens per block
SPEED = 10_000.0  # prefill tokens per second
PAIR = 1e-7  # attention seconds per (token, earlier token) pair


def setup(device: int = 100, host: int = 0, disk: int = 0, **kw) -> ReplaySetup:
    args = {"block_bytes": 1_000_000, "load_mode": "always", "prefill_tokens_per_s": SPEED,
            "host_to_device_bytes_per_s": 1e9, "disk_to_device_bytes_per_s": 1e8, "attention_seconds_per_pair": PAIR}
    return ReplaySetup(BT, device, host, disk, **{**args, **kw})


def prefill(tokens: int) -> float:
    """A prompt's first `tokens` tokens, by hand: tokens / speed + the pairs x the attention price."""
    return tokens / SPEED + PAIR * tokens * (tokens - 1) / 2


def record(t_ms: float, ids: list[int], tokens: int, out: int = 1) -> TraceRecord:
    return TraceRecord(t_ms, tokens, out, ids, 1)


def test_one_request_takes_its_prefill_then_its_decode_steps() -> None:
    """1,000 tokens (10 blocks) alone: the first token after 0.1 s + 1e-7 x 1000 x 999 / 2 s, then 4 more tokens at
    20 ms a step and 1 ms a sequence."""
    rep = TimedReplay(setup(), TimeSetup(decode_step_s=0.020, decode_seq_s=0.001, chunk_tokens=300))
    open_loop(rep, [record(0, list(range(10)), 1000, out=5)])
    res = rep.run()
    assert res.ttft_s == [pytest.approx(prefill(1000))]
    assert res.duration_s == pytest.approx(prefill(1000) + 4 * 0.021)
    assert res.prefill_s == pytest.approx(prefill(1000))  # chunked in 3-block steps: the same sum
    assert rep.totals.recompute_s == pytest.approx(prefill(1000))
    # 5 ms of scheduling a step with prefill: 4 of them (3 chunks of 3 blocks, then the last block)
    slow = TimedReplay(setup(), TimeSetup(decode_step_s=0.020, chunk_tokens=300, step_overhead_s=0.005))
    open_loop(slow, [record(0, list(range(10)), 1000, out=1)])
    assert slow.run().ttft_s == [pytest.approx(prefill(1000) + 4 * 0.005)]


def test_two_requests_that_arrive_together_take_the_gpu_in_turn() -> None:
    """Chunks of one prompt's length: the second request's first token comes one prefill after the first's; one
    arriving later than the first finished waits for nothing."""
    rep = TimedReplay(setup(), TimeSetup(decode_step_s=0.0, chunk_tokens=1000))
    open_loop(rep, [record(0, list(range(10)), 1000), record(0, list(range(20, 30)), 1000)])
    res = rep.run()
    assert sorted(res.ttft_s) == [pytest.approx(prefill(1000)), pytest.approx(2 * prefill(1000))]
    assert res.duration_s == pytest.approx(2 * prefill(1000))
    late = TimedReplay(setup(), TimeSetup(decode_step_s=0.0, chunk_tokens=1000))
    open_loop(late, [record(0, list(range(10)), 1000), record(5000, list(range(20, 30)), 1000)])
    res = late.run()
    assert res.ttft_s == [pytest.approx(prefill(1000))] * 2
    assert res.duration_s == pytest.approx(5.0 + prefill(1000))


def test_a_disk_read_of_n_bytes_at_b_bytes_a_second_lands_after_n_over_b() -> None:
    """3 pages of 1 MB at 0.1 GB/s: 30 ms. A write queued first yields to it (reads first), and takes its own
    time at the write bandwidth after it."""
    clock = SimClock()
    worker = TimedWorker(clock, ReplayL3(10, 1_000_000), 1_000_000, 1e8, 5e7)
    worker.submit_read("r", [b"a", b"b", b"c"], [0, 1, 2])
    assert worker.completions() == [] and worker.next_end() == pytest.approx(0.03)
    clock.advance_to(0.0299)
    assert worker.completions() == []
    clock.advance_to(0.03)
    assert [c.token for c in worker.completions()] == ["r"]
    clock2 = SimClock()
    w = TimedWorker(clock2, ReplayL3(10, 1_000_000), 1_000_000, 1e8, 5e7)
    # a write queued behind a copy that lands at 10 ms; a read submitted meanwhile goes first
    copy = TimedCopier(clock2, 1_000_000, 1e8).to_host([0], [0])  # 1 MB at 0.1 GB/s: lands at 10 ms
    assert w.submit_write("w", [b"x"], [0], before=copy.wait)
    w.submit_read("r", [b"a"], [1])
    assert w.next_end() == pytest.approx(0.01)  # the read: 1 MB at 0.1 GB/s
    clock2.advance_to(0.01)
    assert [c.token for c in w.completions()] == ["r"] and w.queued_write_pages == 1
    assert w.next_end() == pytest.approx(0.01 + 0.02)  # then the write: 1 MB at 0.05 GB/s
    clock2.advance_to(0.03)
    assert [c.token for c in w.completions()] == ["w"] and w.queued_write_pages == 0
    assert w.busy_s == {"read": pytest.approx(0.01), "write": pytest.approx(0.02)}
    # an L3 capped per direction: a read that comes while a write batch runs runs beside it, each at its own rate
    clock3 = SimClock()
    apart = TimedWorker(clock3, ReplayL3(10, 1_000_000), 1_000_000, 1e8, 5e7, shared=False)
    assert apart.submit_write("w", [b"x"], [0])
    assert apart.completions() == []  # the write starts at once: no read is queued or running
    apart.submit_read("r", [b"a"], [1])
    clock3.advance_to(0.01)
    assert [c.token for c in apart.completions()] == ["r"]
    clock3.advance_to(0.02)
    assert [c.token for c in apart.completions()] == ["w"]


def test_a_write_capped_on_its_own_channel_yields_to_reads_for_at_most_a_second() -> None:
    """As the server's writer (tiers/l3/worker.py): a write batch does not start while a read is queued or running,
    however the L3 is capped, and waits for them at most READ_PRIORITY_MAX_WAIT_S (1 s). 1 MB pages, reads at 0.1 GB/s
    (10 ms a page), writes at 0.05 GB/s (20 ms)."""
    clock = SimClock()
    w = TimedWorker(clock, ReplayL3(300, 1_000_000), 1_000_000, 1e8, 5e7, shared=False)
    w.submit_read("r", [bytes([i]) for i in range(10)], list(range(10)))  # 100 ms
    assert w.submit_write("w", [b"x"], [10])
    assert w.next_end() == pytest.approx(0.1)
    clock.advance_to(0.1)
    assert [c.token for c in w.completions()] == ["r"]
    assert w.next_end() == pytest.approx(0.12)  # the write: after the read, 20 ms
    clock.advance_to(w.next_end())
    assert [c.token for c in w.completions()] == ["w"]
    # a read stream longer than a second: the write waits 1 s, then runs beside it
    clock2 = SimClock()
    w2 = TimedWorker(clock2, ReplayL3(300, 1_000_000), 1_000_000, 1e8, 5e7, shared=False)
    w2.submit_read("long", [i.to_bytes(2, "big") for i in range(200)], list(range(200)))  # 2 s
    assert w2.submit_write("w", [b"x"], [200])
    assert w2.next_end() == pytest.approx(1.0)  # when the write's wait for reads runs out
    clock2.advance_to(1.0)
    assert w2.completions() == [] and w2.next_end() == pytest.approx(1.02)
    clock2.advance_to(w2.next_end())
    assert [c.token for c in w2.completions()] == ["w"]
    assert w2.busy_s == {"read": pytest.approx(2.0), "write": pytest.approx(0.02)}
    # run to the end at once (the engine waits for the disk): each write's wait starts when it is next in line
    clock3 = SimClock()
    w3 = TimedWorker(clock3, ReplayL3(300, 1_000_000), 1_000_000, 1e8, 5e7, shared=False)
    w3.submit_read("long", [i.to_bytes(2, "big") for i in range(200)], list(range(200)))
    assert w3.submit_write("w", [b"x"], [200])
    w3.wait_idle()
    assert clock3.now == pytest.approx(2.0)
    assert [c.token for c in w3.completions()] == ["w", "long"]  # the write ran from 1 s on, beside the read
    w3.submit_read("r", [b"y"], [201])  # 10 ms
    assert w3.submit_write("w2", [b"z"], [202])
    clock3.advance_to(w3.next_end())
    assert clock3.now == pytest.approx(2.01) and [c.token for c in w3.completions()] == ["r"]
    assert w3.next_end() == pytest.approx(2.03)  # after the read, not 1 s after the first write's wait began


def test_a_prefix_on_disk_waits_for_its_read_then_its_copy() -> None:
    """Load mode always: a 10-block prompt computed once (the GPU and host tiers too small to keep it after two
    fillers), then asked again: its first 9 blocks come from disk (9 MB at 0.1 GB/s = 90 ms) and its last block is
    computed (the server computes a prompt's last token). The reads land part by part, each part copied to the GPU
    as it lands, so at 1 GB/s only the last part's copy adds to the wait: at most 9 MB, 9 ms. Copied layer by layer
    (cache.load_policy.layered) that copy runs under the last block's forward: it adds only what outlasts it."""
    policy = WritePolicy("write_through", "write_through", defer_above_free=1.0, l3_admit="all", l3_host_share=1.0)
    last_block = prefill(1000) - prefill(900)
    for layered, host_bytes_per_s, copy_s in ((False, 1e12, (0.0, 1e-5)), (False, 1e9, (0.001, 0.009)),
                                              (True, 1e9, (0.0, max(0.0, 0.009 - last_block)))):
        rep = TimedReplay(setup(device=11, host=10, disk=100, write_policy=policy,
                                host_to_device_bytes_per_s=host_bytes_per_s),
                          TimeSetup(decode_step_s=0.0, chunk_tokens=10_000, disk_write_bytes_per_s=1e12,
                                    layered=layered))
        prompt, fillers = list(range(10)), [list(range(50, 60)), list(range(70, 80))]
        open_loop(rep, [record(0, prompt, 1000), record(1000, fillers[0], 1000), record(2000, fillers[1], 1000),
                        record(4000, prompt, 1000)])
        res = rep.run()
        again = max(res.requests, key=lambda r: r.arrival)
        assert again.hits == {"device": 0, "host": 0, "disk": 9}
        waited = again.first_token_at - again.arrival - 0.09 - last_block
        assert copy_s[0] - 1e-9 <= waited <= copy_s[1] + 1e-9


def test_a_disk_hit_slower_to_read_than_to_recompute_saves_what_the_request_did_not_wait_for() -> None:
    """Load mode auto, a disk at 20 MB/s: a 1 MB block takes 50 ms to read and 10-20 ms to recompute. A prompt pushed
    to disk comes back behind three other prompts: its reads run while it queues, and it takes what has landed.
    Priced at bytes over bandwidth those hits would cost more than they save; on the clock a load costs what the
    request waited for it beyond the GPU's queue, so no tier's saving is negative, and neither is the wait."""
    policy = WritePolicy("write_through", "write_through", defer_above_free=1.0, l3_admit="all", l3_host_share=1.0)
    for running in (1, 64):
        s = setup(device=22, host=20, disk=100, write_policy=policy, load_mode="auto", disk_to_device_bytes_per_s=2e7)
        rep = TimedReplay(s, TimeSetup(decode_step_s=0.0, chunk_tokens=1000, disk_write_bytes_per_s=1e12,
                                       max_running=running))
        prompt, fillers = list(range(10)), [list(range(100 + 10 * i, 110 + 10 * i)) for i in range(6)]
        open_loop(rep, [record(0, prompt, 1000)] + [record(1000 * (i + 1), fillers[i], 1000) for i in range(3)]
                  + [record(4000, f, 1000) for f in fillers[3:]] + [record(4001, prompt, 1000)])
        res = rep.run()
        again = max(res.requests, key=lambda r: r.arrival)
        t = rep.totals
        assert again.hits["disk"] > 0 and t.hit_blocks["disk"] == again.hits["disk"]
        assert t.hit_blocks["disk"] * 1_000_000 / 2e7 > t.hit_compute_s["disk"]  # bytes / bandwidth: a loss
        assert t.load_wait_s is not None and t.load_wait_s["disk"] == pytest.approx(again.load_wait_s)
        assert 0.0 <= again.load_wait_s < t.hit_compute_s["disk"]
        pt = summarize(t, s, cost_inputs(s), None, None, 1000.0)["prefill_time"]
        assert pt["load_priced_by"] == "waits beyond the GPU queue"
        assert pt["load_s"]["disk"] == pytest.approx(again.load_wait_s)
        assert pt["saved_s"]["disk"] == pytest.approx(t.hit_compute_s["disk"] - again.load_wait_s)
        assert all(v >= 0.0 for v in pt["saved_s"].values()), pt["saved_s"]


def test_arrivals_faster_than_the_gpu_computes_are_reported_as_overload() -> None:
    """20 prompts of 1,000 tokens (about 0.15 s of prefill each) arriving every 50 ms: the GPU is busy 3 s for 0.95 s
    of arrivals and the last quarter waits far longer than the first: overloaded. Arriving a second apart, or in a
    closed loop, it is not."""
    def run(gap_ms: float) -> tuple[TimedReplay, Any]:
        rep = TimedReplay(setup(device=400), TimeSetup(decode_step_s=0.0, chunk_tokens=1000))
        open_loop(rep, [record(i * gap_ms, list(range(100 * i, 100 * i + 10)), 1000) for i in range(20)])
        return rep, rep.run()

    _, res = run(50.0)
    over = time_summary(res, TimeSetup())["overloaded"]
    assert over is not None
    assert over["gpu_busy_s"] == pytest.approx(20 * prefill(1000))
    assert over["arrival_span_s"] == pytest.approx(0.95)
    assert over["last_quarter_ttft_s"] > 2 * over["first_quarter_ttft_s"]
    assert time_summary(res, TimeSetup(), open_loop=False)["overloaded"] is None
    _, calm = run(1000.0)
    assert time_summary(calm, TimeSetup())["overloaded"] is None


def test_hicache_replay_reports_predicted_time_and_sweeps_bandwidth(tmp_path: Path, capsys) -> None:
    """The report and --json give the predicted duration and TTFT; a sweep over the disk's bandwidth plots them, and
    the fastest disk, the only one that pays for these reads, predicts the lowest mean TTFT."""
    rows = [json.dumps({"timestamp": i * 300, "input_length": 2000, "output_length": 4,
                        "hash_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10 + i % 3] + [100 + i] * 10}) for i in range(12)]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(rows) + "\n")
    out, png = tmp_path / "r.json", tmp_path / "s.png"
    common = ["replay", str(trace), "--block-tokens", "100", "--device-tokens", "2400", "--host-tokens", "2400",
              "--disk-tokens", "100000", "--kv-bytes-per-token", "100000", "--prefill-tokens-per-s", "20000",
              "--host-to-device-gbps", "50", "--decode-step-ms", "5", "--no-progress"]
    assert main([*common, "--disk-to-device-gbps", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    m = json.loads(out.read_text())["time"]
    assert m["requests"] == 12 and m["duration_s"] > 0 and 0 < m["ttft_s"]["p50"] <= m["ttft_s"]["p90"]
    assert m["inputs"]["decode_step_ms"] == 5 and m["inputs"]["assumed"] == []
    assert f"predicted: duration {m['duration_s']:,.2f} s for 12 requests" in text
    assert main([*common, "--sweep", "disk_gbps=0.1,1,10", "--json", str(out), "--plot", str(png)]) == 0
    points = json.loads(out.read_text())["points"]
    assert [p["sweep"]["disk_gbps"] for p in points] == [0.1, 1.0, 10.0]
    # arrivals 0.3 s apart set the duration; the disk shows in the TTFT. Only the fastest disk is read from, and it
    # gives the lowest mean. The two slower points need not be ordered: pages whose write waits for a slow disk leave
    # host memory last, and a later request may hit them there
    ttft = [p["time"]["ttft_s"]["mean"] for p in points]
    assert ttft[2] < min(ttft[:2]) and [p["disk"]["pages_read"] > 0 for p in points] == [False, False, True]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([*common, "--sweep", "disk_gbps=0,1"]) == 2
    assert main([*common, "--decode-step-ms", "-1"]) == 2


def test_the_decode_costs_come_from_a_servers_decode_only_steps(tmp_path: Path) -> None:
    """Steps of 1 and 3 sequences taking 12 and 16 ms: 10 ms a step and 2 ms a sequence, exported and read back by
    --calibration with the engine thread's own time a step; one batch size only gives its mean time and nothing per
    sequence."""
    counters = {"decode_steps": 4, "decode_step_s": 0.012 * 2 + 0.016 * 2, "decode_step_seqs": 1 * 2 + 3 * 2,
                "decode_step_seqs2": 1 * 2 + 9 * 2, "decode_step_seq_s": 0.012 * 2 + 3 * 0.016 * 2}
    base, per_seq = decode_step_fit(counters)
    assert (base, per_seq) == (pytest.approx(0.010), pytest.approx(0.002))
    assert decode_step_fit({**counters, "decode_steps": 0}) is None
    same = {"decode_steps": 2, "decode_step_s": 0.03, "decode_step_seqs": 4, "decode_step_seqs2": 8,
            "decode_step_seq_s": 0.06}
    assert decode_step_fit(same) == (pytest.approx(0.015), 0.0)
    metrics = tmp_path / "server.metrics"
    engine = {**counters, "steps": 10, "schedule_s": 0.5, "overlapped_s": 0.1}  # 40 ms of the thread's own a step
    metrics.write_bytes(ServerMetrics(1000).render({"cost_model": {"prefill_tokens_per_s": 20_000.0},
                                                    "engine": engine}, None))
    rows = [json.dumps({"timestamp": 0, "input_length": 400, "output_length": 3, "hash_ids": [1, 2, 3, 4]})]
    trace, out = tmp_path / "t.jsonl", tmp_path / "r.json"
    trace.write_text("\n".join(rows) + "\n")
    assert main(["replay", str(trace), "--block-tokens", "100", "--device-tokens", "1000", "--kv-bytes-per-token",
                 "10", "--no-progress", "--json", str(out), "--calibration", str(metrics)]) == 0
    m = json.loads(out.read_text())["time"]
    assert m["inputs"]["decode_step_ms"] == pytest.approx(10) and m["inputs"]["decode_seq_ms"] == pytest.approx(2)
    assert m["inputs"]["step_overhead_ms"] == pytest.approx(40)
    # 400 tokens at 20,000 tokens/s in one step (a chunk holds 20 blocks) with its 40 ms of scheduling, then 2
    # decode steps of one sequence at 12 ms
    assert m["duration_s"] == pytest.approx(400 / 20_000 + 0.040 + 2 * 0.012)
    # a server that counts its prefill steps' own scheduling apart (25 ms a step): that, not the mean over all steps
    split = {**engine, "prefill_steps": 4, "prefill_schedule_s": 0.1}
    metrics.write_bytes(ServerMetrics(1000).render({"cost_model": {"prefill_tokens_per_s": 20_000.0},
                                                    "engine": split}, None))
    assert main(["replay", str(trace), "--block-tokens", "100", "--device-tokens", "1000", "--kv-bytes-per-token",
                 "10", "--no-progress", "--json", str(out), "--calibration", str(metrics)]) == 0
    m = json.loads(out.read_text())["time"]
    assert m["inputs"]["step_overhead_ms"] == pytest.approx(25)
    assert m["duration_s"] == pytest.approx(400 / 20_000 + 0.025 + 2 * 0.012)


def test_the_context_limit_refuses_prompts_and_the_closed_loop_skips_turns_over_it() -> None:
    """A context limit of 1,500 tokens (the model's positions, say): an open-loop prompt of 1,500 is refused as the
    server refuses it; a session's turn whose prompt and answer exceed it is not sent, as `bench agent` skips it,
    and the session goes on with its next turn at once."""
    from hicache.replay.agent import AgentSession, AgentTurn
    from hicache.replay.simulate import closed_loop

    t = TimeSetup(decode_step_s=0.0, chunk_tokens=10_000, max_context_tokens=1500)
    rep = TimedReplay(setup(), t)
    open_loop(rep, [record(0, list(range(15)), 1500), record(0, list(range(20, 30)), 1000)])
    res = rep.run()
    assert res.rejected == 1 and len(res.requests) == 1 and res.ttft_s == [pytest.approx(prefill(1000))]
    turns = [AgentTurn(i, n, 4, list(range(n // BT)), 0.0, None, None) for i, n in enumerate((1000, 1498, 1200))]
    session = AgentSession(None, list(turns))
    rep = TimedReplay(setup(), t)
    closed_loop(rep, [("s", session)], output_length=4)
    res = rep.run()
    assert res.skipped == 1 and [r.input_length for r in res.requests] == [1000, 1200]
    # the third turn follows the first at once: 1,000 tokens and 3 decode steps (free here), then 1,200 tokens of
    # which the first 1,000 are the first turn's blocks, on the GPU
    assert res.duration_s == pytest.approx(prefill(1000) + prefill(1200) - prefill(1000))
