"""random:tiny under load: every tier fills and evicts, integrity holds after every step, nothing leaks."""

from __future__ import annotations

import random

from sched_helpers import assert_no_leaks, make_engine

from hicache.engine.params import SamplingParams


def test_mixed_workload_all_tiers(tiny, tmp_path, monkeypatch):
    # admission reserves little decode room, so decode growth also exercises preemption
    monkeypatch.setattr("hicache.engine.scheduler.DECODE_RESERVE_TOKENS", 2)
    engine = make_engine(
        tiny, cache__page_size=4, cache__device__size_tokens=160, cache__host__size_tokens=192,
        cache__l3__path=str(tmp_path / "l3"), cache__l3__size_gib=None, cache__l3__size_tokens=320,
        scheduler__chunk_tokens=48, scheduler__max_running_requests=6,
    )
    rng = random.Random(7)
    prefixes = [[rng.randrange(1, 250) for _ in range(rng.randrange(8, 40))] for _ in range(6)]
    pending = []
    for i in range(70):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 250) for _ in range(rng.randrange(1, 20))]
        params = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=i, max_tokens=rng.randrange(1, 12))
        pending.append((f"q{i}", prompt, params))
    finished, steps = {}, 0
    while pending or engine.has_unfinished():
        for _ in range(rng.randrange(0, 3)):  # requests keep arriving while others run
            if pending:
                engine.add_request(*pending.pop(0))
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.cache.controller.check_integrity()
        steps += 1
        assert steps < 5000
    assert len(finished) == 70
    assert all(out.finish_reason in ("stop", "length") for out in finished.values())
    stats = engine.stats()["cache"]
    assert all(stats["evictions"][tier] > 0 for tier in ("device", "host", "disk")), stats
    assert all(stats["hit_tokens"][tier] > 0 for tier in ("device", "host", "disk")), stats
    assert engine.stats()["preemptions"] > 0
    assert sum(out.usage.cached_tokens["host"] + out.usage.cached_tokens["disk"] for out in finished.values()) > 0
    assert_no_leaks(engine)
    engine.close()
