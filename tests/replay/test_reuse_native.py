"""The LRU stack-depth pass in C equals the Python one (hicache/replay/reuse.py); a library turned off or not
built falls back by name."""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import pytest

from hicache.replay import reuse
from hicache.replay.trace import TraceRecord
from tiers import native


def _records(seed: int) -> list[TraceRecord]:
    rng = random.Random(seed)
    out = []
    for i in range(1500):
        n = rng.randint(1, 25)
        if i % 3:
            ids = [rng.randint(0, 300) for _ in range(n)]  # repeats inside a request too
        else:
            ids = [f"agent-{rng.randint(0, 40)}" for _ in range(n)]
        out.append(TraceRecord(float(i * 5 + rng.random()), n * 16, 1, ids, i + 1))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_native_pass_gives_the_python_pass_results(seed):
    assert reuse._native_lib() is not None, f"the replay's native pass is not built: {native.BUILD_HINT}"
    records = _records(seed)
    fast, python = reuse.stack_depths(records), reuse.stack_depths(records, native=False)
    assert fast.depths == python.depths and fast.ages_ms == python.ages_ms
    assert fast.histogram == python.histogram and sum(python.histogram.values()) == sum(
        len(r.hash_ids) for r in records)
    assert 0 < python.histogram[0] < sum(python.histogram.values())  # cold and warm accesses both occur


def test_a_library_turned_off_or_missing_falls_back_by_name(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="tiers.native")
    assert native.load(tmp_path, "_nothing_here", "probe loop") is None
    assert "probe loop: the Python loop, slower: the native library _nothing_here is not built" in caplog.text
    assert "pip install -e ." in caplog.text
    monkeypatch.setenv("HICACHE_NATIVE", "0")
    assert native.load(Path(reuse.__file__).parent, "_reuse_stack", "probe loop") is None
    assert "probe loop: the Python loop ($HICACHE_NATIVE=0)" in caplog.text


def test_a_library_built_for_another_interpreter_is_used(tmp_path):
    """The libraries use no Python API: a build named for another Python version serves this one."""
    built = native.library_path(Path(reuse.__file__).parent, "_reuse_stack")
    assert built is not None
    other = tmp_path / "_reuse_stack.cpython-399-x86_64-linux-gnu.so"
    shutil.copy(built, other)
    assert native.library_path(tmp_path, "_reuse_stack") == other
    assert native.load(tmp_path, "_reuse_stack", "probe loop") is not None
