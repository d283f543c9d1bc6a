"""L3Worker: asynchronous reads and writes, bounded write queue, and reads served before writes."""

from __future__ import annotations

import threading
import time

import torch
from memory_l3 import MemoryL3

from controller import L3Worker, l3_io

PAGE = 64


class Recording(MemoryL3):
    """MemoryL3 that logs calls in order; reads wait for `gate`."""

    def __init__(self):
        super().__init__(64, PAGE)
        self.gate = threading.Event()
        self.log: list[str] = []

    def read_pages(self, keys, out):
        self.log.append("read start")
        assert self.gate.wait(10)
        self.log.append("read end")
        return super().read_pages(keys, out)

    def write_pages(self, keys, pages):
        self.log.append("write")
        return super().write_pages(keys, pages)


def page(v: int) -> torch.Tensor:
    return torch.full((PAGE,), v, dtype=torch.uint8)


def test_writes_wait_for_reads_in_flight():
    store = Recording()
    store.data[b"k" * 16] = page(7).numpy().tobytes()
    worker = L3Worker(store, threads=1)
    try:
        out = torch.zeros(PAGE, dtype=torch.uint8)
        worker.submit_read("r", [b"k" * 16], [out])
        for _ in range(100):
            if store.log:
                break
            time.sleep(0.01)
        assert worker.submit_write("w", [b"w" * 16], [page(1)])
        time.sleep(0.2)
        assert store.log == ["read start"]  # the write is held back while the read runs
        store.gate.set()
        assert worker.wait_idle(10)
        assert store.log == ["read start", "read end", "write"]
        done = {c.token: c.results for c in worker.completions()}
        assert done == {"r": [True], "w": [True]} and torch.equal(out, page(7))
    finally:
        store.gate.set()
        worker.close()


def test_a_stream_of_reads_cannot_starve_writes(monkeypatch):
    monkeypatch.setattr(l3_io, "READ_PRIORITY_MAX_WAIT_S", 0.05)
    store = Recording()
    worker = L3Worker(store, threads=1)
    try:
        worker.submit_read("r", [b"k" * 16], [torch.zeros(PAGE, dtype=torch.uint8)])
        assert worker.submit_write("w", [b"w" * 16], [page(1)])
        for _ in range(100):
            if "write" in store.log:
                break
            time.sleep(0.01)
        assert "write" in store.log and "read end" not in store.log  # written after the bounded wait
    finally:
        store.gate.set()
        worker.wait_idle(10)
        worker.close()
