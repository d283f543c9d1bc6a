"""bench/gpu/noloss_summary.py on hand-written client reports: medians over each server's rounds, against `off`."""

from __future__ import annotations

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_summary():
    spec = importlib.util.spec_from_file_location("noloss_summary", ROOT / "bench" / "gpu" / "noloss_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(path: pathlib.Path, p50_ms: float, mean_ms: float, tok_s: float) -> None:
    path.write_text(json.dumps({"overall": {"ttft_ms": {"p50": p50_ms, "mean": mean_ms}, "input_tokens_per_s": tok_s}}))


def test_medians_over_rounds_against_off(tmp_path, capsys):
    summary = load_summary()
    for seed, (p50, mean, tok) in zip((7, 8, 9), ((1000.0, 900.0, 15_000.0), (1100.0, 1000.0, 14_000.0),
                                                 (1050.0, 950.0, 16_000.0))):
        report(tmp_path / f"nr2k_off.s{seed}.json", p50, mean, tok)
    # one slow round among three: the median ignores it
    for seed, (p50, mean, tok) in zip((7, 8, 9), ((1071.0, 969.0, 15_500.0), (1400.0, 1300.0, 11_000.0),
                                                 (1060.0, 950.0, 15_200.0))):
        report(tmp_path / f"nr2k_on_d0.25.s{seed}.json", p50, mean, tok)
    assert summary.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("nr2k   off        3 rounds  median TTFT p50   1050.0 ms")
    assert "vs off: p50 1.020x  mean 1.020x  tok/s 1.013x" in lines[1]


def test_a_case_without_an_off_server_fails(tmp_path, capsys):
    summary = load_summary()
    report(tmp_path / "nr32k_on_d0.25.s7.json", 7000.0, 7000.0, 20_000.0)
    assert summary.main([str(tmp_path)]) == 1
    assert "nr32k: no 'off' server to compare with" in capsys.readouterr().out
    assert summary.main([str(tmp_path / "empty")]) == 1
