"""L3Worker: asynchronous reads and writes, bounded write queue, and reads served before writes."""

from __future__ import annotations

import threading
import time

import torch
from memory_l3 import MemoryL3

from tiers.l3 import worker as l3_io
from tiers.l3.worker import L3Worker

PAGE = 64


class Recording(MemoryL3):
    """MemoryL3 that logs calls in order; reads wait for `gate`; `reading` and `wrote` are set when a read starts
    and when a write runs, so tests wait on the events themselves rather than on the clock."""

    def __init__(self):
        super().__init__(64, PAGE)
        self.gate = threading.Event()
        self.reading = threading.Event()
        self.wrote = threading.Event()
        self.log: list[str] = []

    def read_pages(self, keys, out):
        self.log.append("read start")
        self.reading.set()
        assert self.gate.wait(30)
        self.log.append("read end")
        return super().read_pages(keys, out)

    def write_pages(self, keys, pages):
        self.log.append("write")
        self.wrote.set()
        return super().write_pages(keys, pages)


def wait_until(condition, timeout: float = 30.0) -> bool:
    """Poll `condition` until it holds (True) or `timeout` passes (False): a bound for liveness, not a measurement."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def page(v: int) -> torch.Tensor:
    return torch.full((PAGE,), v, dtype=torch.uint8)


def test_writes_wait_for_reads_in_flight(monkeypatch):
    monkeypatch.setattr(l3_io, "READ_PRIORITY_MAX_WAIT_S", 60.0)  # no bounded wait within the test
    store = Recording()
    store.data[b"k" * 16] = page(7).numpy().tobytes()
    worker = L3Worker(store, threads=1)
    try:
        out = torch.zeros(PAGE, dtype=torch.uint8)
        worker.submit_read("r", [b"k" * 16], [out])
        assert store.reading.wait(30)
        assert worker.submit_write("w", [b"w" * 16], [page(1)])
        assert wait_until(lambda: worker._writes.empty())  # the writer has taken the write
        assert not store.wrote.is_set() and store.log == ["read start"]  # and holds it while the read runs
        store.gate.set()
        assert worker.wait_idle(10)
        assert store.log == ["read start", "read end", "write"]
        done = {c.token: c for c in worker.completions()}
        assert {t: c.results for t, c in done.items()} == {"r": [True], "w": [True]} and torch.equal(out, page(7))
        assert not done["r"].shared  # the disk was the read's alone
        assert done["w"].end >= done["r"].end > 0
    finally:
        store.gate.set()
        worker.close()


def test_a_stream_of_reads_cannot_starve_writes(monkeypatch):
    monkeypatch.setattr(l3_io, "READ_PRIORITY_MAX_WAIT_S", 0.05)
    store = Recording()
    worker = L3Worker(store, threads=1)
    try:
        worker.submit_read("r", [b"k" * 16], [torch.zeros(PAGE, dtype=torch.uint8)])
        assert store.reading.wait(30)
        assert worker.submit_write("w", [b"w" * 16], [page(1)])
        assert store.wrote.wait(30)  # the read never ends: written once the bounded wait is over
        assert "read end" not in store.log
        store.gate.set()
        assert worker.wait_idle(10)
        done = {c.token: c for c in worker.completions()}
        assert done["r"].shared  # a write ran while it read: its time is not the disk's read speed
    finally:
        store.gate.set()
        worker.wait_idle(10)
        worker.close()


def test_a_read_on_the_callers_thread_holds_writes_back_and_completions_go_to_the_callback(monkeypatch):
    """`read_now` reads on the calling thread and counts as a read in progress (the writer waits for it); with
    `on_complete` each completion is handed over on the I/O thread, none is queued for `completions`."""
    monkeypatch.setattr(l3_io, "READ_PRIORITY_MAX_WAIT_S", 60.0)
    store = Recording()
    store.data[b"k" * 16] = page(7).numpy().tobytes()
    handed: list = []
    worker = L3Worker(store, threads=1, on_complete=handed.append)
    out = torch.zeros(PAGE, dtype=torch.uint8)
    results: list = []
    reader = threading.Thread(target=lambda: results.append(worker.read_now([b"k" * 16, b"x" * 16], [out, out])))
    try:
        reader.start()
        assert store.reading.wait(30)
        assert worker.submit_write("w", [b"w" * 16], [page(1)])
        assert wait_until(lambda: worker._writes.empty())
        assert not store.wrote.is_set() and store.log == ["read start"]  # the write waits for the caller's read
        store.gate.set()
        reader.join(30)
        assert results == [[True, False]] and torch.equal(out, page(7))
        assert worker.wait_idle(10)
        assert store.log == ["read start", "read end", "write"]
        assert [(c.token, c.results) for c in handed] == [("w", [True])] and worker.completions() == []
    finally:
        store.gate.set()
        worker.close()
