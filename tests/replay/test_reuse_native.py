"""The LRU stack-depth pass in C equals the Python one (hicache/replay/reuse.py), and builds fall back by name."""

from __future__ import annotations

import logging
import random
import shutil

import pytest

from hicache.replay import reuse
from hicache.replay.trace import TraceRecord
from tiers import native_build


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
    if reuse._native_lib() is None:
        assert not native_build.enabled() or native_build.compiler() is None, "cc is here, yet it did not build"
        pytest.skip("no C compiler here (or $HICACHE_NATIVE=0): only the Python pass runs")
    records = _records(seed)
    native, python = reuse.stack_depths(records), reuse.stack_depths(records, native=False)
    assert native.depths == python.depths and native.ages_ms == python.ages_ms
    assert native.histogram == python.histogram and sum(python.histogram.values()) == sum(
        len(r.hash_ids) for r in records)
    assert 0 < python.histogram[0] < sum(python.histogram.values())  # cold and warm accesses both occur


def test_a_build_that_cannot_happen_falls_back_by_name(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HICACHE_NATIVE_CACHE", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="tiers.native_build")
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")  # a compiler that fails
    assert native_build.build("probe", "int f(void) { return 1; }", "probe loop") is None
    assert "probe loop: the Python loop (the native one did not build" in caplog.text
    monkeypatch.setenv("HICACHE_NATIVE", "0")
    assert native_build.build("probe", "int f(void) { return 1; }", "probe loop") is None
    assert "probe loop: the Python loop ($HICACHE_NATIVE=0)" in caplog.text
    assert not list((tmp_path / "cache").glob("*.so"))


def test_an_unwritable_cache_folder_builds_under_the_temporary_directory(tmp_path, monkeypatch):
    if native_build.compiler() is None or not native_build.enabled():
        pytest.skip("no C compiler here (or $HICACHE_NATIVE=0)")
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("HICACHE_NATIVE_CACHE", str(blocked / "cache"))  # under a file: cannot be created
    monkeypatch.setattr(native_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    lib = native_build.build("probe", "int hicache_probe(void) { return 41 + 1; }", "probe loop")
    assert lib is not None and lib.hicache_probe() == 42
    assert len(list((tmp_path / "tmp").glob("hicache-native-*/probe-*.so"))) == 1
