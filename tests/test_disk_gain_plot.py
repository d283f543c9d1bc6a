"""bench/disk_gain_plot.py on hand-written agent reports: ratios to GPU only by L3 bandwidth, the table and the plot."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_plot():
    spec = importlib.util.spec_from_file_location("disk_gain_plot", ROOT / "bench" / "disk_gain_plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(path: pathlib.Path, duration: float, ttft_ms: float) -> None:
    path.write_text(json.dumps({"overall": {"duration_s": duration, "ttft_ms": {"mean": ttft_ms}}}))


def make_run(path: pathlib.Path, arms: dict[str, tuple[float, float]]) -> pathlib.Path:
    """A run folder with one client report per arm (`ARM_I`: duration s, mean TTFT ms)."""
    path.mkdir()
    for name, (duration, ttft_ms) in arms.items():
        report(path / f"agent_{name}.json", duration, ttft_ms)
    return path


def test_ratios_by_bandwidth_table_and_plot(tmp_path, capsys):
    plot = load_plot()
    run = make_run(tmp_path / "agent", {
        "gpu_only_1": (100.0, 10_000.0), "host48_2": (30.0, 2_500.0), "host12_l3shm_r16_3": (33.0, 3_000.0),
        "host12_l3shm_r4_4": (55.0, 6_000.0), "host12_l3disk_5": (80.0, 9_000.0), "gpu_only_7b_6": (50.0, 4_000.0),
        "host12_l3shm_r4_7b_7": (25.0, 1_000.0)})
    out = tmp_path / "gain.png"
    assert plot.main([str(run), "--out", str(out), "--disk-gbps", "1.9"]) == 0
    text = capsys.readouterr().out
    assert "| host12_l3disk | 1.9 | 0.800 | 0.900 |" in text
    assert "| host12_l3shm_r4 | 4 | 0.550 | 0.600 |" in text and "| host48 | | 0.300 | 0.250 |" in text
    assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"
    pts, _ = plot.points(plot.load_arms(run, "_7b"), None)
    assert pts == [(4.0, 0.5, 0.25, "host12_l3shm_r4")]  # the 7B arms against the 7B GPU-only arm


def test_a_run_without_gpu_only_or_rate_limited_arms_says_so(tmp_path, capsys):
    plot = load_plot()
    run = tmp_path / "agent"
    run.mkdir()
    report(run / "agent_host48_1.json", 30.0, 2_500.0)
    with pytest.raises(SystemExit, match="no gpu_only arm"):
        plot.main([str(run), "--out", str(tmp_path / "x.png")])
    report(run / "agent_gpu_only_2.json", 100.0, 10_000.0)
    assert plot.main([str(run), "--out", str(tmp_path / "x.png")]) == 1
    assert "no rate-limited L3 arm" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_runs_of_two_leases_each_compared_with_their_own_gpu_only_arm(tmp_path, capsys):
    plot = load_plot()
    first = make_run(tmp_path / "a", {"gpu_only_1": (100.0, 10_000.0), "host12_l3shm_r4_2": (55.0, 6_000.0),
                                      "host48_3": (30.0, 2_500.0)})
    second = make_run(tmp_path / "b", {"gpu_only_1": (80.0, 8_000.0), "host12_l3shm_r1_2": (72.0, 6_000.0)})
    assert plot.main([str(first), str(second), "--out", str(tmp_path / "x.png")]) == 0
    text = capsys.readouterr().out
    assert "| host12_l3shm_r1 | 1 | 0.900 | 0.750 |" in text  # against 80 s, not the first run's 100 s
    assert "| host12_l3shm_r4 | 4 | 0.550 | 0.600 |" in text and "| host48 | | 0.300 | 0.250 |" in text
    report(second / "agent_host12_l3shm_r4_3.json", 40.0, 4_000.0)
    with pytest.raises(SystemExit, match="host12_l3shm_r4 is in two runs"):
        plot.main([str(first), str(second), "--out", str(tmp_path / "y.png")])
    empty = make_run(tmp_path / "c", {"host12_l3shm_r8_1": (40.0, 4_000.0)})
    with pytest.raises(SystemExit, match=f"no gpu_only arm in {empty}"):
        plot.main([str(first), str(empty), "--out", str(tmp_path / "z.png")])
