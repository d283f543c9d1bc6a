"""The store's bandwidth caps (cache.l3.read_limit_gbps / write_limit_gbps): a token bucket per direction."""

from __future__ import annotations

import time

import pytest
from l3_helpers import content, empty, key

from tiers.l3.ratelimit import TokenBucket


class FakeClock:
    """A clock that moves only when a caller sleeps (or the test advances it): pacing checked without timing."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept += seconds
        self.now += seconds


@pytest.mark.parametrize("call_bytes", [4096, 1 << 20, 8 << 20])
def test_the_rate_holds_within_ten_percent_whatever_the_call_size(call_bytes):
    clock = FakeClock()
    bucket = TokenBucket(1e9, clock=clock, sleep=clock.sleep)  # 1 GB/s
    total = 2_000_000_000
    start = clock.now
    for _ in range(total // call_bytes):
        bucket.take(call_bytes)
    moved = (total // call_bytes) * call_bytes
    elapsed = clock.now - start
    assert moved / elapsed == pytest.approx(1e9, rel=0.10)
    assert elapsed >= (moved - 0.02 * 1e9) / 1e9 - 1e-9  # never faster than the cap, but for one burst
    assert bucket.waited_s == pytest.approx(clock.slept)


def test_idle_time_banks_at_most_one_burst():
    clock = FakeClock()
    bucket = TokenBucket(1e8, burst_s=0.02, clock=clock, sleep=clock.sleep)  # 100 MB/s, 2 MB of burst
    clock.now += 60.0  # a minute idle banks 2 MB, not 6 GB
    assert bucket.take(2_000_000) == 0.0
    assert bucket.take(1_000_000) == pytest.approx(0.01)


def test_concurrent_callers_queue_behind_each_others_debt():
    """Two callers that take before either sleeps: the second waits for both calls' bytes."""
    clock = FakeClock()
    naps: list[float] = []
    bucket = TokenBucket(1e8, burst_s=0.0, clock=clock, sleep=naps.append)  # sleeps recorded, clock frozen
    assert bucket.take(10_000_000) == pytest.approx(0.1)
    assert bucket.take(10_000_000) == pytest.approx(0.2)
    assert naps == pytest.approx([0.1, 0.2])


def test_zero_is_unlimited_and_negative_is_refused():
    clock = FakeClock()
    bucket = TokenBucket(0, clock=clock, sleep=clock.sleep)
    assert not bucket.limited
    assert bucket.take(1 << 40) == 0.0 and clock.slept == 0.0
    with pytest.raises(ValueError, match="rate limit"):
        TokenBucket(-1.0)


def test_store_reads_and_writes_keep_to_their_caps(open_store):
    """Sleep never returns early, so the caps give a lower bound on the time; the stats and /metrics see them."""
    page = 8192
    store = open_store(page, pages=64, io_backend="posix", sync_batch_pages=8,
                       read_limit_bytes_per_s=2e6, write_limit_bytes_per_s=4e6)
    keys = [key(i) for i in range(48)]
    nbytes = len(keys) * page  # 393 KB: ~0.1 s of writes at 4 MB/s, ~0.2 s of reads at 2 MB/s
    start = time.monotonic()
    assert store.write_pages(keys, [content(k, page) for k in keys]) == [True] * 48
    wrote = time.monotonic() - start
    out = empty(page, 48)
    start = time.monotonic()
    assert store.read_pages(keys, out) == [True] * 48
    read = time.monotonic() - start
    burst = 0.02
    assert wrote >= nbytes / 4e6 - burst
    assert read >= nbytes / 2e6 - burst
    stats = store.stats()
    assert stats["read_limit_gbps"] == pytest.approx(0.002) and stats["write_limit_gbps"] == pytest.approx(0.004)
    assert stats["read_limit_wait_s"] >= nbytes / 2e6 - burst - 1e-6
    assert stats["write_limit_wait_s"] > 0
    assert all(bytes(o.numpy()) == bytes(content(k, page).numpy()) for k, o in zip(keys, out))
