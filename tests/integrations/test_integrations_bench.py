"""bench/integrations_bench.py runs every system against the engines' real classes and checks the bytes it loads
back; a small run here keeps it working (its figures are for bench/RESULTS.md, not for a test)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import integrations_bench  # noqa: E402


def test_the_bench_runs_every_system_at_every_window_and_loads_what_it_stored(tmp_path):
    # 12 chunks: SGLang's calls of 8 leave a short last call, and vLLM's window of 8 drains part-full
    results = integrations_bench.main(["--dirs", str(tmp_path), "--chunks", "12", "--chunk-mib", "0.25",
                                       "--inflight", "1", "8", "--repeats", "2", "--raw-threads", "1"])
    entry = results[str(tmp_path)]
    figures = {k: v for k, v in entry.items() if "@" in k}
    assert sorted(figures) == sorted(f"{name} @{n}" for name in integrations_bench.SYSTEMS for n in (1, 8))
    for name, got in figures.items():
        assert got["store_gbps"] > 0 and got["load_gbps"] > 0, name
        assert got["durable_gbps"] <= got["store_gbps"], name  # the sync only adds time
        if "Hicache" not in name:
            assert got["ready_s"] == 0.0, name  # the engines' own tiers have nothing to settle
    assert list(tmp_path.iterdir()) == []  # every run's directory removed


def test_median_figures_takes_each_figures_median():
    runs = [{"store_gbps": 1.0, "load_gbps": 9.0}, {"store_gbps": 3.0, "load_gbps": 1.0},
            {"store_gbps": 2.0, "load_gbps": 5.0}]
    assert integrations_bench.median_figures(runs) == {"store_gbps": 2.0, "load_gbps": 5.0}
