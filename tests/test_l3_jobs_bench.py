"""bench/l3_jobs.py drives the L3 store with one-chunk jobs and checks the bytes it loads back; a small run keeps it
working (its figures are for bench/RESULTS.md, not for a test)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import l3_jobs  # noqa: E402


def test_the_bench_stores_and_loads_every_chunk_at_every_window_and_batch(tmp_path):
    # 12 chunks: a window of 8 drains part-full, and a 1 MiB read batch holds 4 of these 0.25 MiB chunks
    results = l3_jobs.main(["--dir", str(tmp_path), "--chunks", "12", "--chunk-mib", "0.25", "--inflight", "1", "8",
                            "--read-batch-mib", "0", "1", "--repeats", "2", "--jobs-threads", "2",
                            "--io-threads", "2"])
    assert sorted(results) == [(1, 0), (1, 1), (8, 0), (8, 1)]
    assert all(store > 0 and load > 0 for store, load in results.values())
    assert list(tmp_path.iterdir()) == []  # every run's store removed
