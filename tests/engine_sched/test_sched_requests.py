"""random:tiny: preemption, pool-sized and over-capacity requests, seeds, stop ids, abort, the async runner."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from sched_helpers import assert_no_leaks, make_engine, run_all, settle_l3

from hicache.engine.engine import pack_aligned
from hicache.engine.params import SamplingParams
from hicache.engine.runner import AsyncEngine

LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 7) % 250 + 1 for i in range(n)]


def solo(tiny, tokens: list[int], params: SamplingParams) -> list[int]:
    engine = make_engine(tiny, cache__page_size=4, cache__device__size_tokens=1024)
    engine.add_request("solo", tokens, params)
    return run_all(engine)["solo"][0]


def test_admission_keeps_admitted_requests_within_the_pool(tiny):
    # 4 requests of 30 + 40 tokens need ~18 pages each; the pool has 30: admission runs them one after
    # another instead of admitting all and preempting
    engine = make_engine(tiny, cache__page_size=4, cache__device__size_tokens=120, cache__host__size_tokens=512)
    for i in range(4):
        engine.add_request(f"p{i}", prompt(i, 30), LONG)
    results = run_all(engine)
    assert engine.stats()["preemptions"] == 0
    assert all(len(results[f"p{i}"][0]) == 40 for i in range(4))
    assert_no_leaks(engine)


def test_preemption_resumes_from_cache(tiny, monkeypatch):
    # admission counts only 4 decode tokens per request, so decode growth runs out of pages:
    # 4 requests of 30 + 40 tokens need ~18 pages each; the pool has 30: the newest get preempted
    monkeypatch.setattr("hicache.engine.scheduler.DECODE_RESERVE_TOKENS", 4)
    engine = make_engine(tiny, cache__page_size=4, cache__device__size_tokens=120, cache__host__size_tokens=512)
    for i in range(4):
        engine.add_request(f"p{i}", prompt(i, 30), LONG)
    results = run_all(engine)
    assert engine.stats()["preemptions"] > 0
    for i in range(4):
        ids, _, out = results[f"p{i}"]
        assert out.finish_reason == "length" and len(ids) == 40
        assert ids == solo(tiny, prompt(i, 30), LONG)
    assert_no_leaks(engine)


def test_request_needing_most_of_the_pool(tiny):
    engine = make_engine(tiny, cache__page_size=4, cache__device__size_tokens=96)  # 24 pages
    for i in range(3):
        engine.add_request(f"small{i}", prompt(i, 10), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    engine.add_request("big", prompt(9, 50), LONG)  # 50 + 40 - 1 tokens = 23 pages
    results = run_all(engine)
    assert results["big"][2].finish_reason == "length" and len(results["big"][0]) == 40
    assert all(len(results[f"small{i}"][0]) == 20 for i in range(3))
    assert_no_leaks(engine)


def test_over_capacity_is_a_request_error(tiny):
    engine = make_engine(tiny, cache__page_size=4, cache__device__size_tokens=64)  # 16 pages
    engine.add_request("huge", prompt(1, 70), SamplingParams(max_tokens=10))  # more than the pool holds
    engine.add_request("ok", prompt(2, 10), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    engine.add_request("empty", [], SamplingParams())
    results = run_all(engine)
    huge = results["huge"][2]
    assert huge.finished and huge.finish_reason == "error" and "the context limit is 64" in huge.error
    assert engine.max_context == 64  # 16 pages of 4: a request longer than the pool cannot run
    assert results["empty"][2].finish_reason == "error"
    assert results["ok"][2].finish_reason == "length" and len(results["ok"][0]) == 5
    assert_no_leaks(engine)


def test_seeds_reproducible_and_batch_independent(tiny):
    sampled = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=123, max_tokens=12, ignore_eos=True)
    alone = solo(tiny, prompt(3, 12), sampled)
    engine = make_engine(tiny, cache__page_size=4, cache__device__size_tokens=1024)
    engine.add_request("a", prompt(3, 12), sampled)
    engine.add_request("b", prompt(4, 20), SamplingParams(temperature=1.0, seed=5, max_tokens=12))
    engine.add_request("c", prompt(3, 12), SamplingParams(temperature=1.0, seed=124, max_tokens=12, ignore_eos=True))
    results = run_all(engine)
    assert results["a"][0] == alone
    assert results["c"][0] != alone


def test_stop_token_ids_and_max_tokens(tiny):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ids = solo(tiny, prompt(5, 9), greedy)
    stop_id = ids[5]
    stopped = solo(tiny, prompt(5, 9), SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(stop_id,),
                                                      ignore_eos=True))
    assert stopped == ids[: ids.index(stop_id) + 1]
    assert solo(tiny, prompt(5, 9), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)) == ids[:3]


def test_abort_frees_pages(tiny):
    engine = make_engine(tiny, cache__page_size=4, cache__device__size_tokens=256)
    engine.add_request("x", prompt(1, 30), LONG)
    engine.add_request("y", prompt(2, 30), LONG)
    for _ in range(3):
        engine.step()
    out = engine.abort("x")
    assert out.finished and out.finish_reason == "abort" and engine.abort("x") is None
    results = run_all(engine)
    assert len(results["y"][0]) + len(engine.requests) >= 1
    assert_no_leaks(engine)


def test_async_engine_streams_and_aborts(tiny):
    engine = make_engine(tiny, cache__page_size=4, cache__device__size_tokens=512)
    runner = AsyncEngine(engine)

    async def collect(request_id: str, tokens: list[int], limit: int | None = None) -> list:
        outs = []
        async for out in runner.generate(request_id, tokens, LONG):
            outs.append(out)
            if limit is not None and len(outs) >= limit:
                break  # closing the iterator aborts the request
        return outs

    async def main() -> tuple:
        results = await asyncio.gather(*(collect(f"s{i}", prompt(i, 20)) for i in range(4)),
                                       collect("cut", prompt(9, 20), limit=2))
        stats = await runner.stats()
        return results, stats

    try:
        results, stats = asyncio.run(main())
    finally:
        runner.shutdown()
    for outs in results[:4]:
        assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 40
    assert not results[4][-1].finished
    assert stats["requests"] == {"waiting": 0, "loading": 0, "running": 0}
    assert runner.runner.error is None
    assert_no_leaks(engine)


def test_invalid_params_raise():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="unknown"):
        SamplingParams.of(None, max_token=3)
    assert SamplingParams(stop="x").stop == ("x",)


def test_failed_l3_read_is_recomputed(tiny, tmp_path):
    engine = make_engine(
        tiny, cache__page_size=4, cache__device__size_tokens=64, cache__host__size_tokens=64,
        cache__l3__path=str(tmp_path / "l3"), cache__l3__size_gib=None, cache__l3__size_tokens=1024,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", prompt(1, 33), greedy)
    first = run_all(engine)["a"][0]
    for i in range(2, 8):  # push A out of GPU and host: it is left on L3 only
        engine.add_request(f"push{i}", prompt(i, 33), greedy)
        run_all(engine)
    settle_l3(engine)
    store = engine.cache.controller.l3
    real_read = store.read_pages
    store.read_pages = lambda keys, out, *args, **kwargs: [False] * len(keys)  # every page fails verification
    before = engine.stats()["cache"]
    engine.add_request("again", prompt(1, 33), greedy)
    ids, _, out = run_all(engine)["again"]
    store.read_pages = real_read
    cache = engine.stats()["cache"]
    assert cache["load_failures"] >= 1
    assert out.usage.cached_tokens["disk"] == 0
    assert ids == first
    # the counters say what the request got: its prompt once, no disk hit for pages that failed verification
    assert cache["prompt_tokens"] - before["prompt_tokens"] == 33
    assert cache["hit_tokens"]["disk"] == before["hit_tokens"]["disk"]
    served = sum(cache["hit_tokens"][t] - before["hit_tokens"][t] for t in cache["hit_tokens"])
    assert served == sum(out.usage.cached_tokens.values())
    assert_no_leaks(engine)


def test_engine_thread_profile_is_written_at_shutdown(tiny, tmp_path):
    import pstats

    engine = make_engine(tiny, cache__page_size=4, cache__device__size_tokens=512)
    path = tmp_path / "engine.prof"
    runner = AsyncEngine(engine, profile_path=str(path))

    async def main() -> list:
        return [out async for out in runner.generate("p", prompt(3, 20), LONG)]

    try:
        outs = asyncio.run(main())
    finally:
        runner.shutdown()
    assert outs[-1].finished
    functions = {name for _, _, name in pstats.Stats(str(path)).stats}
    assert {"step", "schedule", "_forward"} <= functions


def test_prefill_batch_tokens_finishes_short_prompts_in_turn(tiny):
    """With prefill_batch_tokens 24, a step takes requests until it holds 24 prefill tokens: 20-token prompts go
    two per step and get their first tokens in turn, where the plain 96-token budget takes all four in one step.
    Outputs do not depend on the batching."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def first_token_steps(batch_tokens: int) -> tuple[dict[str, int], dict[str, list[int]], list[list[int]]]:
        engine = make_engine(tiny, cache__page_size=4, cache__device__size_tokens=1024, scheduler__chunk_tokens=96,
                             scheduler__prefill_batch_tokens=batch_tokens)
        for i in range(4):
            engine.add_request(f"r{i}", prompt(i, 20), params)
        prefills: list[list[int]] = []
        real_plan = engine.scheduler._plan

        def spy():  # record each step's prefill chunk sizes
            result = real_plan()
            prefills.append([n for _, n in result if n > 1])
            return result

        engine.scheduler._plan = spy
        first, ids, step = {}, {}, 0
        while engine.has_unfinished():
            for out in engine.step():
                ids.setdefault(out.request_id, []).extend(out.new_token_ids)
                first.setdefault(out.request_id, step)
            step += 1
        assert_no_leaks(engine)
        return first, ids, [p for p in prefills if p]

    first, ids, prefills = first_token_steps(24)
    assert prefills == [[20, 20], [20, 20]]  # the first request's 20 tokens are below 24: one more joins
    assert [first[f"r{i}"] for i in range(4)] == [0, 0, 1, 1]
    whole_first, whole_ids, whole_prefills = first_token_steps(0)
    assert whole_prefills == [[20, 20, 20, 20]]
    assert [whole_first[f"r{i}"] for i in range(4)] == [0, 0, 0, 0]
    assert ids == whole_ids and all(len(v) == 3 for v in ids.values())


def test_step_log_accounts_for_every_step(tiny, tmp_path):
    """One JSON line per forward step; its tokens and first tokens add up to the run's, and it closes with the
    engine."""
    import json

    engine = make_engine(tiny, cache__page_size=4, cache__device__size_tokens=1024, scheduler__chunk_tokens=32)
    log = tmp_path / "steps.jsonl"
    step_log = engine.open_step_log(str(log))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for i, n in enumerate((70, 10, 25)):  # 70 tokens take three 32-token chunks
        engine.add_request(f"r{i}", prompt(i, n), params)
    run_all(engine)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    counters = engine.counters
    assert len(lines) == counters["steps"]
    assert sum(s["prefill_tokens"] for s in lines) == counters["prefill_tokens"] == 105
    assert sum(s["decode_tokens"] for s in lines) == counters["decode_tokens"] == 3 * 4  # after each first token
    assert sum(s["first_tokens"] for s in lines) == 3
    assert all(s["prefill_tokens"] + s["decode_tokens"] <= 32 for s in lines)
    assert [s["t"] for s in lines] == sorted(s["t"] for s in lines)
    assert all(s["forward_ms"] > 0 and s["schedule_ms"] >= 0 and s["gap_ms"] >= -1 for s in lines)
    assert all(0 <= s["overlapped_ms"] <= s["schedule_ms"] for s in lines)
    overlapped = sum(s["overlapped_ms"] for s in lines)
    assert overlapped == pytest.approx(counters["overlapped_s"] * 1e3, abs=0.01 * len(lines))  # rounded per line
    prefill = [s for s in lines if s["prefill_tokens"]]
    assert counters["prefill_steps"] == len(prefill) >= 4  # 70 tokens in three chunks, beside the other prompts
    own = sum(s["schedule_ms"] - s["overlapped_ms"] for s in prefill)  # what the replay adds to such a step
    assert own == pytest.approx(counters["prefill_schedule_s"] * 1e3, abs=0.02 * len(lines))
    assert not any(s["graph"] for s in lines)  # CPU: no CUDA graphs
    assert lines[0]["waiting"] + lines[0]["running"] + lines[0]["loading"] == 3  # all queued or running at first
    assert lines[-1]["waiting"] == lines[-1]["running"] == 0 and lines[-1]["device_used_pages"] > 0
    waits = engine.cache.controller.stats.backup_waits
    assert sum(s["backup_wait_pages"] for s in lines) == waits == 0  # CPU copies: done
    assert all(0 < s["enqueue_ms"] <= s["forward_ms"] and 0 <= s["enqueue_cpu_ms"] for s in lines)
    assert all(s["gc_ms"] >= 0 for s in lines)
    assert not any("gpu_ms" in s or "wait_ms" in s for s in lines)  # CUDA events only
    import gc

    timer = step_log.gc
    assert timer in gc.callbacks
    before = timer.total
    gc.collect()
    assert timer.total > before and timer.longest > 0  # the hook times collections
    engine.close()
    assert step_log.file.closed and timer not in gc.callbacks


class FakeEvent:
    """A CUDA event stand-in: completes when the test says so; elapsed_time from set timestamps."""

    def __init__(self, at_ms: float, done: bool = True):
        self.at_ms, self.done, self.synced = at_ms, done, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = self.synced = True

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.at_ms - self.at_ms


def test_step_log_writes_lines_in_order_once_their_gpu_events_complete(tiny, tmp_path):
    """A line whose events have not completed holds back the lines after it (no waiting on the GPU); close waits."""
    import json

    engine = make_engine(tiny, cache__page_size=4, cache__device__size_tokens=256)
    log = tmp_path / "steps.jsonl"
    step_log = engine.open_step_log(str(log))
    pending = step_log.pending
    slow = (FakeEvent(0.0), FakeEvent(2.5), FakeEvent(40.0, done=False))
    pending.append(({"n": 0}, (FakeEvent(0.0), FakeEvent(0.0), FakeEvent(10.0))))
    pending.append(({"n": 1}, slow))
    pending.append(({"n": 2}, None))  # no events (a CPU step): still written after the one before it
    step_log.flush()
    assert [json.loads(line) for line in log.read_text().splitlines()] == [{"n": 0, "wait_ms": 0.0, "gpu_ms": 10.0}]
    assert not slow[2].synced  # not waited for
    step_log.flush(wait=True)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[1:] == [{"n": 1, "wait_ms": 2.5, "gpu_ms": 37.5}, {"n": 2}] and slow[2].synced
    assert not pending
    engine.close()


def test_trace_gpu_records_the_window_of_steps(tiny, tmp_path):
    """The profiler covers steps [first, first + count): a Chrome trace with one range per step, and a kernel
    table; steps outside the window are not recorded, and the engine goes on untraced."""
    import json

    engine = make_engine(tiny, cache__page_size=4, cache__device__size_tokens=1024, scheduler__chunk_tokens=32)
    path = tmp_path / "trace.json"
    trace = engine.trace_gpu(str(path), 2, 3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, n in enumerate((70, 10)):
        engine.add_request(f"r{i}", prompt(i, n), params)
    run_all(engine)
    assert engine.counters["steps"] > 5 and trace.done
    events = json.loads(path.read_text())["traceEvents"]
    steps = sorted({e["name"] for e in events if e.get("name", "").startswith("step ")})
    assert steps == ["step 2", "step 3", "step 4"]
    table = (tmp_path / "trace.json.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    engine.close()
    with pytest.raises(ValueError, match="first_step"):
        engine.trace_gpu(str(path), -1, 3)


def test_pack_aligned_starts_every_part_on_16_bytes():
    parts = [np.arange(3), np.arange(10, 12), np.zeros(0, dtype=np.int64), np.arange(20, 25)]
    packed, offsets = pack_aligned([p.astype(np.int64) for p in parts])
    assert offsets == [(0, 3), (4, 6), (6, 6), (6, 11)]
    assert packed.dtype == np.int64 and len(packed) == 12
    for part, (start, end) in zip(parts, offsets):
        assert start % 2 == 0 and packed[start:end].tolist() == part.tolist()


def test_every_forward_input_is_16_byte_aligned(tiny, monkeypatch):
    """Odd token counts and page tables of odd lengths in one step: each device view starts on 16 bytes (Triton
    compiles a kernel variant per pointer alignment; an 8-byte page table cost a ~0.4 s compile mid-serving)."""
    engine = make_engine(tiny, cache__page_size=4, cache__device__size_tokens=1024)
    seen = []
    forward = engine.model.forward

    def spy(batch, kv, page_size, **kw):
        seen.append(batch)
        return forward(batch, kv, page_size, **kw)

    monkeypatch.setattr(engine.model, "forward", spy)
    engine.add_request("a", prompt(1, 9), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    engine.add_request("b", prompt(2, 16), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    results = run_all(engine)
    assert len(results["a"][0]) == 3 and len(results["b"][0]) == 3
    assert seen and any(len(b.page_tables) == 2 for b in seen)
    for b in seen:
        views = [b.input_ids, b.positions, b.out_slots, *b.page_tables, b.decode_rows, b.decode_lens, b.last_rows]
        assert all(v.data_ptr() % 16 == 0 for v in views), [v.data_ptr() % 16 for v in views]
    assert any(t.numel() % 2 for b in seen for t in b.page_tables)  # odd lengths occurred, so padding mattered


def test_a_request_whose_sampling_raises_fails_alone(tiny, monkeypatch):
    """A request's own sampling parameters fail at sampling: that request ends with an error, the others in the same
    step carry on to their tokens, and the engine goes on."""
    from hicache.engine import engine as engine_module

    engine = make_engine(tiny, cache__page_size=4, cache__device__size_tokens=512)
    real = engine_module.sample

    def picky(logits, params, generators=None):
        if any(p.seed == 13 for p in params):
            raise RuntimeError("bad parameters")
        return real(logits, params, generators)

    monkeypatch.setattr(engine_module, "sample", picky)
    good = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("good", prompt(1, 9), good)
    engine.add_request("bad", prompt(2, 9), SamplingParams(temperature=1.0, seed=13, max_tokens=3, ignore_eos=True))
    results = run_all(engine)
    assert results["bad"][2].finish_reason == "error" and "bad parameters" in results["bad"][2].error
    assert results["good"][2].finish_reason == "length" and len(results["good"][0]) == 3
    engine.add_request("after", prompt(3, 9), good)
    assert run_all(engine)["after"][2].finish_reason == "length"
    assert_no_leaks(engine)
