"""The L3 store in a process of its own (tiers/l3/process.py): the bytes, the write queue, staging, errors
raised in the child, and a child that goes away. The controller over it: tests/test_controller.py."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch

from tiers import HostPool, KVLayout
from tiers.l3 import L3Error
from tiers.l3.process import L3Process

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, itemsize=4)  # 1 KiB pages
NAMESPACE = b"l3-process-test1"


def _host(pages: int = 16) -> HostPool:
    return HostPool(LAYOUT, pages, torch.float32, pin_memory=False, shared=True)


def _store_args(path, pages: int = 64) -> dict:
    slot = -(-LAYOUT.page_bytes // 4096) * 4096
    return dict(path=str(path), capacity_bytes=pages * slot, page_bytes=LAYOUT.page_bytes, namespace=NAMESPACE,
                io_backend="buffered", io_threads=2, sync_batch_pages=8)


def _fill(host: HostPool, pages, seed: int) -> None:
    for i, p in enumerate(pages):
        host.page_view(p).copy_(torch.randint(0, 256, (LAYOUT.page_bytes,), dtype=torch.uint8,
                                              generator=torch.Generator().manual_seed(seed + i)))


def _bytes(host: HostPool, first: int, end: int) -> torch.Tensor:
    """Pages [first, end) of the pool as bytes (random bytes as float32 hold NaNs, which compare unequal)."""
    return torch.stack([host.page_view(p) for p in range(first, end)])


def _keys(n: int, base: int = 0) -> list[bytes]:
    return [(base + i).to_bytes(16, "little") for i in range(n)]


@pytest.fixture(scope="module")
def proc_and_host(tmp_path_factory):
    """One process for the tests below (starting one takes about a second): each uses keys of its own."""
    host = _host()
    proc = L3Process(host, _store_args(tmp_path_factory.mktemp("shared") / "l3"), threads=2, queue_pages=8,
                     batch_pages=4, staging_pages=4)
    yield proc, host
    proc.worker.close()
    proc.store.close()


def _wait(worker, timeout: float = 30.0) -> list:
    assert worker.wait_idle(timeout)
    return worker.completions()


def test_pages_written_by_the_child_read_back_byte_for_byte(proc_and_host):
    proc, host = proc_and_host
    _fill(host, range(4), seed=1)
    written = _bytes(host, 0, 4).clone()
    keys = _keys(4)
    assert proc.worker.submit_write("w", keys, [host.page_view(p) for p in range(4)])
    (c,) = _wait(proc.worker)
    assert (c.kind, c.token, c.results, c.keys) == ("write", "w", [True] * 4, frozenset(keys))
    assert proc.store.contains(keys + _keys(1, 99)) == [True] * 4 + [False]
    assert proc.store.used_pages() == 4
    proc.worker.submit_read("r", keys, [host.page_view(p) for p in range(8, 12)])
    (c,) = _wait(proc.worker)
    assert (c.kind, c.token, c.results) == ("read", "r", [True] * 4)
    assert torch.equal(_bytes(host, 8, 12), written)


def test_the_write_queue_is_bounded_in_the_parent(proc_and_host):
    proc, host = proc_and_host
    views = [host.page_view(p) for p in range(8)]
    assert proc.worker.submit_write("a", _keys(8, 100), views)
    assert proc.worker.queued_write_pages == 8
    assert not proc.worker.submit_write("b", _keys(1, 50), views[:1])  # 8 of 8 queued
    assert proc.worker.refusal == "l3_queue_full"
    _wait(proc.worker)
    assert proc.worker.queued_write_pages == 0
    assert proc.worker.submit_write("c", _keys(1, 50), views[:1])
    assert [c.results for c in _wait(proc.worker)] == [[True]]


def test_staged_pages_are_the_writes_own_and_the_slots_come_back(proc_and_host):
    proc, host = proc_and_host
    _fill(host, range(4), seed=7)
    expected = _bytes(host, 0, 4).clone()
    staged = proc.worker.stage([host.page_view(p) for p in range(4)])
    assert staged is not None and len(staged) == 4
    host.buffer[:4].zero_()  # the host pages are freed and reused at once: the write does not see it
    assert proc.worker.stage([host.page_view(0)]) is None  # all 4 staging slots are taken
    assert proc.worker.submit_write("s", _keys(4, 200), staged)
    assert [c.results for c in _wait(proc.worker)] == [[True] * 4]
    assert proc.worker.stage([host.page_view(0)]) is not None  # released with the write
    proc.worker.submit_read("r", _keys(4, 200), [host.page_view(p) for p in range(4, 8)])
    _wait(proc.worker)
    assert torch.equal(_bytes(host, 4, 8), expected)


def test_a_buffer_outside_shared_memory_is_refused_by_name(proc_and_host):
    proc, _ = proc_and_host
    with pytest.raises(ValueError, match="outside the shared host pool"):
        proc.worker.submit_write("x", _keys(1), [torch.zeros(LAYOUT.page_bytes, dtype=torch.uint8)])


def test_store_calls_delete_and_calibration_style_io(proc_and_host):
    proc, host = proc_and_host
    _fill(host, range(2), seed=3)
    expected = _bytes(host, 0, 2).clone()
    views = [host.page_view(p) for p in range(2)]
    used, deletes = proc.store.used_pages(), proc.store.stats()["deletes"]
    assert proc.store.write_pages(_keys(2, 300), views) == [True, True]
    host.buffer[:2].zero_()
    assert proc.store.read_pages(_keys(2, 300), views) == [True, True]
    assert torch.equal(_bytes(host, 0, 2), expected)
    proc.store.delete(_keys(1, 300), wait=False)
    assert proc.store.contains(_keys(2, 300)) == [False, True]  # the delete went first, though nothing waited for it
    assert proc.store.delete(_keys(2, 300), wait=True) == 1
    assert proc.store.used_pages() == used
    stats = proc.store.stats()
    assert stats["deletes"] == deletes + 2 and stats["process"] > 0 and stats["io_backend"] == "buffered"
    # the answered calls are timed (the one-way delete is not: nobody waited for it)
    assert stats["calls"] >= 7 and 0 < stats["slowest_call_s"] <= stats["call_seconds"]
    proc.store.check_integrity()


def test_an_error_opening_the_store_is_raised_in_the_parent(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(L3Error, match="file"):
        L3Process(_host(), _store_args(blocker / "l3"), threads=1, queue_pages=8, batch_pages=4)


def test_a_second_writer_is_refused_while_the_process_holds_the_lock(proc_and_host):
    from tiers.l3 import L3Store

    with pytest.raises(L3Error, match="lock|writer|use"):
        L3Store(**_store_args(proc_and_host[0].store.path))


def test_a_killed_process_fails_reads_refuses_writes_and_probes_miss(tmp_path):
    host = _host()
    proc = L3Process(host, _store_args(tmp_path / "l3"), threads=1, queue_pages=8, batch_pages=4, restart=False)
    try:
        assert proc.store.write_pages(_keys(2), [host.page_view(p) for p in range(2)]) == [True, True]
        os.kill(proc.store._link.proc.pid, signal.SIGKILL)
        proc.store._link.proc.wait(10)
        proc.worker.submit_read("r", _keys(2), [host.page_view(p) for p in range(2, 4)])
        assert proc.worker.wait_idle(10)
        assert [(c.token, c.results) for c in proc.worker.completions()] == [("r", [False, False])]
        assert proc.store.contains(_keys(2)) == [False, False]
        assert not proc.worker.submit_write("w", _keys(1, 9), [host.page_view(0)])
        assert proc.worker.refusal == "l3_gone"
        assert proc.store.stats()["state"] == "gone"
    finally:
        proc.worker.close()
        proc.store.close()
    # what it stored before it went survives for the next start
    again = L3Process(host, _store_args(tmp_path / "l3"), threads=1, queue_pages=8, batch_pages=4)
    try:
        assert again.store.contains(_keys(2)) == [True, True]
    finally:
        again.worker.close()
        again.store.close()


def test_a_killed_process_is_replaced_and_serves_what_it_had_stored(tmp_path):
    host = _host()
    proc = L3Process(host, _store_args(tmp_path / "l3"), threads=1, queue_pages=8, batch_pages=4,
                     restart_min_s=0.1)
    try:
        _fill(host, range(2), seed=11)
        expected = _bytes(host, 0, 2).clone()
        assert proc.store.write_pages(_keys(2), [host.page_view(p) for p in range(2)]) == [True, True]
        first = proc.store._link.proc
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        proc.worker.submit_read("r", _keys(2), [host.page_view(p) for p in range(2, 4)])  # fails: it is gone
        assert proc.worker.wait_idle(10) and proc.worker.completions()[0].results == [False, False]
        deadline = time.monotonic() + 60
        while proc.store.stats().get("restarts", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = proc.store.stats()
        assert stats["restarts"] == 1 and stats["state"] == "ok" and stats["process"] != first.pid
        proc.worker.submit_read("r2", _keys(2), [host.page_view(p) for p in range(4, 6)])
        assert proc.worker.wait_idle(10) and proc.worker.completions()[0].results == [True, True]
        assert torch.equal(_bytes(host, 4, 6), expected)  # committed before the crash, served after it
        assert proc.worker.submit_write("w", _keys(1, 40), [host.page_view(0)])
        assert proc.worker.wait_idle(10) and proc.worker.completions()[0].results == [True]
    finally:
        proc.worker.close()
        proc.store.close()


def test_slow_answers_are_counted_and_logged_without_flooding(caplog):
    from tiers.l3.process_proxies import SLOW_CALL_S, CallTimes

    times = CallTimes()
    caplog.set_level(logging.WARNING, logger="tiers.l3.process")
    times.add("/l3", "contains", 0.001)
    times.add("/l3", "contains", SLOW_CALL_S + 0.1)
    times.add("/l3", "stats", SLOW_CALL_S + 0.2)  # right after: counted, not logged again
    assert times.calls == 3 and times.slowest_s == SLOW_CALL_S + 0.2
    assert abs(times.seconds - (2 * SLOW_CALL_S + 0.301)) < 1e-9
    slow = [r.getMessage() for r in caplog.records if "to answer" in r.getMessage()]
    assert len(slow) == 1 and "contains" in slow[0] and "/l3" in slow[0]
