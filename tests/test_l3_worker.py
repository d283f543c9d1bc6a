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


class Calls(Recording):
    """Recording that also keeps the keys of each read call."""

    def __init__(self):
        super().__init__()
        self.read_calls: list[list[bytes]] = []

    def read_pages(self, keys, out):
        self.read_calls.append(list(keys))
        return super().read_pages(keys, out)


def test_reads_waiting_together_are_served_by_one_store_call_up_to_the_batch_bytes():
    """While a read holds the one reader thread, five more queue: they are read in calls of at most 3 pages'
    bytes (3 then 2, in order), and each read completes on its own with its own pages' results."""
    store = Calls()
    keys = [bytes([i]) * 16 for i in range(6)]
    for i, k in enumerate(keys):
        if i != 4:  # key 4 is missing: its read fails, the others in its call do not
            store.data[k] = page(10 + i).numpy().tobytes()
    worker = L3Worker(store, threads=1, read_batch_bytes=3 * PAGE)
    outs = [torch.zeros(PAGE, dtype=torch.uint8) for _ in keys]
    try:
        worker.submit_read(0, keys[:1], outs[:1])
        assert store.reading.wait(30)
        for i in range(1, 6):
            worker.submit_read(i, keys[i:i + 1], outs[i:i + 1])
        store.gate.set()
        assert worker.wait_idle(10)
        assert store.read_calls == [keys[:1], keys[1:4], keys[4:6]]
        done = {c.token: c for c in worker.completions()}
        assert {t: c.results for t, c in done.items()} == {0: [True], 1: [True], 2: [True], 3: [True], 4: [False],
                                                          5: [True]}
        assert all(done[t].keys == frozenset({keys[t]}) for t in done)
        assert all(torch.equal(outs[i], page(10 + i)) for i in range(6) if i != 4)
        assert done[1].end == done[2].end == done[3].end and done[1].seconds == done[3].seconds  # one call's span
    finally:
        store.gate.set()
        worker.close()


def test_without_a_batch_size_every_read_is_its_own_store_call():
    store = Calls()
    keys = [bytes([i]) * 16 for i in range(4)]
    worker = L3Worker(store, threads=1)
    try:
        for i in range(4):
            worker.submit_read(i, keys[i:i + 1], [torch.zeros(PAGE, dtype=torch.uint8)])
        store.gate.set()
        assert worker.wait_idle(10)
        assert store.read_calls == [[k] for k in keys]
        assert sorted(c.token for c in worker.completions()) == [0, 1, 2, 3]
    finally:
        worker.close()


def test_a_short_queue_is_shared_among_the_reader_threads():
    """Four reads queue while both reader threads hold one; then one thread serves the queue alone, the other
    still held. It takes its share of what waits (half, of two threads) each time, not the whole queue, though the
    batch bytes would allow all four: 2, then 1, then 1."""
    store = Calls()
    held = threading.Event()
    first_read = store.read_pages

    def read_pages(keys, out):  # the read of key 0 waits for `held`, the others for the store's gate
        if keys == [keys_[0]]:
            store.read_calls.append(list(keys))
            assert held.wait(30)
            return MemoryL3.read_pages(store, keys, out)
        return first_read(keys, out)

    keys_ = [bytes([i]) * 16 for i in range(6)]
    store.read_pages = read_pages
    worker = L3Worker(store, threads=2, read_batch_bytes=64 * PAGE)
    try:
        worker.submit_read(0, keys_[:1], [torch.zeros(PAGE, dtype=torch.uint8)])
        assert wait_until(lambda: len(store.read_calls) == 1)
        worker.submit_read(1, keys_[1:2], [torch.zeros(PAGE, dtype=torch.uint8)])
        assert store.reading.wait(30)  # both threads hold a read
        for i in range(2, 6):
            worker.submit_read(i, keys_[i:i + 1], [torch.zeros(PAGE, dtype=torch.uint8)])
        store.gate.set()
        assert wait_until(lambda: len(store.read_calls) == 5)
        held.set()
        assert worker.wait_idle(10)
        assert store.read_calls == [keys_[:1], keys_[1:2], keys_[2:4], keys_[4:5], keys_[5:6]]
    finally:
        store.gate.set()
        held.set()
        worker.close()


class GatedWrites(Recording):
    """Recording whose writes wait for `write_gate` and keep each call's keys and thread."""

    def __init__(self):
        super().__init__()
        self.write_gate = threading.Event()
        self.write_calls: list[tuple[list[bytes], str]] = []

    def write_pages(self, keys, pages):
        self.write_calls.append((list(keys), threading.current_thread().name))
        self.wrote.set()
        assert self.write_gate.wait(30)
        return MemoryL3.write_pages(self, keys, pages)


def test_a_write_on_the_callers_thread_only_where_no_other_is_queued_or_running():
    """`write_now` writes on the calling thread when the writer has nothing; while a queued write runs it writes
    nothing and returns None (the caller submits instead, to share the writer's batch)."""
    store = GatedWrites()
    worker = L3Worker(store, threads=1)
    try:
        assert worker.submit_write("w", [b"w" * 16], [page(1)])
        assert store.wrote.wait(30)
        assert worker.write_now([b"n" * 16], [page(2)]) is None
        store.write_gate.set()
        assert worker.wait_idle(10)
        assert worker.write_now([b"n" * 16, b"w" * 16], [page(2), page(1)]) == ([True, True], [None, None])
        assert [(keys, thread == threading.current_thread().name) for keys, thread in store.write_calls] == [
            ([b"w" * 16], False), ([b"n" * 16, b"w" * 16], True)]
        assert store.data[b"n" * 16] == page(2).numpy().tobytes()
        assert [(c.token, c.results) for c in worker.completions()] == [("w", [True])]
    finally:
        store.write_gate.set()
        worker.close()
    assert worker.write_now([b"c" * 16], [page(3)]) is None  # closed: nothing written
    assert b"c" * 16 not in store.data
