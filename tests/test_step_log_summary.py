"""bench/step_log_summary.py on a hand-written step log: kinds, sizes, decode-only steps behind loads."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_summary():
    spec = importlib.util.spec_from_file_location("step_log_summary", ROOT / "bench" / "step_log_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step(t, prefill, decode, forward_ms, loading=0, graph=False, overlapped_ms=0.0):
    return {"t": t, "gap_ms": 0.5, "schedule_ms": 2.0, "overlapped_ms": overlapped_ms, "forward_ms": forward_ms,
            "sequences": 1 + decode, "prefill_tokens": prefill, "decode_tokens": decode, "graph": graph,
            "first_tokens": 1 if prefill else 0, "waiting": 3, "loading": loading, "running": 1 + decode,
            "device_used_pages": 10}


def test_summary_groups_prefill_steps_by_size_and_counts_decode_steps_behind_loads(tmp_path):
    lines = [
        step(0.1, 1000, 0, 50.0, overlapped_ms=1.0),  # <= 1,024 tokens
        step(0.2, 1024, 2, 40.0),  # <= 1,024
        step(0.3, 3000, 1, 90.0),  # <= 3,072
        step(0.31, 0, 3, 8.0, loading=2, graph=True),  # decode-only behind loads
        step(0.32, 0, 3, 8.0, graph=True),  # decode-only, nothing loading
        step(0.33, 0, 3, 20.0),  # eager decode-only
    ]
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in lines))
    r = load_summary().summarise(str(path))
    assert r["steps"] == 6 and r["span_s"] == pytest.approx(0.23)
    assert r["kinds"]["prefill"]["steps"] == 3 and r["kinds"]["prefill"]["forward_s"] == pytest.approx(0.18)
    assert r["kinds"]["decode-only, graph"]["steps"] == 2 and r["kinds"]["decode-only"]["steps"] == 1
    assert r["decode_only_while_loading"] == 1
    assert r["schedule_s"] == pytest.approx(0.012) and r["overlapped_s"] == pytest.approx(0.001)
    assert r["gap_s"] == pytest.approx(0.0025)  # the first step's gap is the wait for work
    sizes = [(row["up_to_tokens"], row["steps"], row["tokens"]) for row in r["prefill_by_size"]]
    assert sizes == [(1024, 2, 2024), (3072, 1, 3000)]
    assert r["prefill_by_size"][0]["us_per_token"] == pytest.approx(90.0 * 1e3 / 2024)
    assert r["first_tokens"] == 3 and r["max_loading"] == 2


def test_summary_splits_prefill_steps_after_backup_waits(tmp_path):
    lines = [step(0.1, 1000, 0, 40.0), step(0.2, 0, 3, 8.0, graph=True), step(0.3, 1000, 0, 60.0),
             step(0.4, 2000, 0, 100.0), step(0.5, 1000, 0, 45.0)]
    lines[1]["backup_wait_pages"] = 4  # a decode step freed pages mid-copy: the next prefill step counts as after
    lines[3]["backup_wait_pages"] = 2  # and this prefill step itself, and the one after it
    # the other lines lack the field, as logs written before it did
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in lines))
    waits = load_summary().summarise(str(path))["after_backup_waits"]
    assert waits["after_waits"]["steps"] == 3 and waits["others"]["steps"] == 1
    assert waits["after_waits"]["us_per_token"] == pytest.approx((60 + 100 + 45) * 1e3 / 4000)
    assert waits["others"]["us_per_token"] == pytest.approx(40.0)


def test_summary_adds_gpu_timings_where_the_log_has_them(tmp_path):
    lines = [step(0.1, 1000, 0, 50.0), step(0.2, 1000, 0, 40.0), step(0.3, 0, 3, 8.0, graph=True)]
    lines[0].update(enqueue_ms=10.0, gpu_ms=45.0, wait_ms=1.5)
    lines[1].update(enqueue_ms=12.0, gpu_ms=30.0, wait_ms=0.5)
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in lines))
    kinds = load_summary().summarise(str(path))["kinds"]
    assert kinds["prefill"]["enqueue_s"] == pytest.approx(0.022) and kinds["prefill"]["gpu_s"] == pytest.approx(0.075)
    assert kinds["prefill"]["wait_s"] == pytest.approx(0.002)
    assert "gpu_s" not in kinds["decode-only, graph"]  # its line has no GPU fields
