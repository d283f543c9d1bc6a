"""The remote tier's Valkey store (tiers/remote/valkey.py) against a real valkey-server: bytes, probes, keys that
vanish, values that fail verification, a wrong password, a server that is down, killed or full, and the persistent tiers
(tiers/persistent.py) with a local L3 in front of it."""

from __future__ import annotations

import os
import socket
import time
import uuid

import pytest
import torch

from hicache.valkey_local import LocalServer
from tiers.persistent import PersistentTiers
from tiers.remote import HEADER_BYTES
from tiers.remote.valkey import ValkeyStore

PAGE = 8192
NS = b"remote-test-ns01"


def _store(url: str, **kw) -> ValkeyStore:
    kw.setdefault("key_prefix", f"t-{uuid.uuid4().hex[:8]}")  # each test its own keys on the shared server
    kw.setdefault("timeout_s", 1.0)
    return ValkeyStore(url, kw.pop("namespace", NS), kw.pop("page_bytes", PAGE), **kw)


def _pages(n: int, seed: int, size: int = PAGE) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(n)]


def _keys(n: int, base: int = 0) -> list[bytes]:
    return [(base + i).to_bytes(16, "little") for i in range(n)]


def _raw(server: LocalServer, *args: bytes) -> bytes:
    """One command through a plain socket: what another client (or a corrupted write) would do."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=2) as s:
        s.sendall(b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args))
        return s.recv(1 << 20)


@pytest.mark.parametrize("size", [PAGE, 180 * 1024 + 7])
def test_pages_round_trip_in_pipelined_batches(valkey, size):
    store = _store(valkey.url, page_bytes=size, batch_pages=16)  # 300 pages: 19 batches each way
    pages, keys = _pages(300, 1, size), _keys(300)
    assert store.write_pages_detailed(keys, pages) == ([True] * 300, [None] * 300)
    assert store.contains(keys[:3] + _keys(1, 999)) == [True, True, True, False]
    out = [torch.zeros(size, dtype=torch.uint8) for _ in range(301)]
    assert store.read_pages(keys + _keys(1, 999), out) == [True] * 300 + [False]
    assert all(torch.equal(a, b) for a, b in zip(pages, out))
    s = store.stats()
    assert (s["writes"], s["hits"], s["misses"], s["vanished"], s["state"]) == (300, 300, 1, 1, "ok")
    store.close()


def test_a_key_gone_between_probe_and_read_is_a_miss(valkey):
    store = _store(valkey.url)
    store.write_pages(_keys(2), _pages(2, 2))
    assert store.contains(_keys(2)) == [True, True]
    assert store.delete(_keys(1)) == 1  # the server's LRU, or another client
    out = [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(2)]
    assert store.read_pages(_keys(2), out) == [False, True]
    assert store.stats()["vanished"] == 1 and store.state == "ok"


def test_corrupted_and_foreign_values_are_counted_misses_never_served(valkey):
    store = _store(valkey.url)
    other = _store(valkey.url, key_prefix=store._prefix.decode().split(":")[0], namespace=b"another-namespace"[:16])
    pages = _pages(3, 3)
    store.write_pages(_keys(3), pages)
    other.write_pages(_keys(1, 50), _pages(1, 4))
    raw = _raw(valkey, b"GET", store.key(_keys(1)[0]))
    body = raw[raw.index(b"\r\n") + 2:-2]
    flipped = bytearray(body)
    flipped[HEADER_BYTES + 100] ^= 0x01  # one bit of the page
    assert _raw(valkey, b"SET", store.key(_keys(1)[0]), bytes(flipped)) == b"+OK\r\n"
    assert _raw(valkey, b"SET", store.key(_keys(1, 1)[0]), b"not a page") == b"+OK\r\n"
    foreign = _raw(valkey, b"GET", other.key(_keys(1, 50)[0]))  # a value of another namespace, under our key
    assert _raw(valkey, b"SET", store.key(_keys(1, 2)[0]), foreign[foreign.index(b"\r\n") + 2:-2]) == b"+OK\r\n"
    out = [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(3)]
    assert store.read_pages(_keys(3), out) == [False, False, False]
    assert store.stats()["bad_values"] == 3 and store.stats()["hits"] == 0
    # read once: deleted, so no probe finds them and no read fetches them again
    assert store.stats()["bad_deleted"] == 3 and store.contains(_keys(3)) == [False, False, False]
    assert store.read_pages(_keys(3), out) == [False, False, False]
    assert store.stats()["bad_values"] == 3 and store.stats()["vanished"] == 3
    store.write_pages(_keys(1), pages[:1])  # rewritten: served again
    assert store.read_pages(_keys(1), out[:1]) == [True] and torch.equal(out[0], pages[0])


def test_a_wrong_password_is_named_and_serves_misses():
    with LocalServer(password="right") as server:
        wrong = _store(server.url, password="wrong")
        assert wrong.state == "auth_failed" and "WRONGPASS" in wrong.stats()["reason"]
        assert wrong.contains(_keys(1)) == [False]
        assert wrong.write_pages_detailed(_keys(1), _pages(1, 5))[1] == ["remote_down"]
        right = _store(f"redis://:right@127.0.0.1:{server.port}/0")
        assert right.state == "ok" and right.write_pages(_keys(1), _pages(1, 5)) == [True]


def test_down_at_startup_then_back_recovers_by_itself():
    server = LocalServer()
    store = _store(server.url, retry_min_s=0.05, retry_max_s=0.2)
    try:
        assert store.state == "down"
        assert store.contains(_keys(1)) == [False]
        assert store.write_pages_detailed(_keys(1), _pages(1, 6))[1] == ["remote_down"]
        server.start()
        deadline = time.monotonic() + 10
        while store.write_pages(_keys(1), _pages(1, 6)) != [True] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.state == "ok" and store.stats()["reconnects"] >= 1
    finally:
        server.close()


def test_a_server_killed_mid_read_fails_the_read_quickly_and_comes_back():
    with LocalServer(maxmemory="256mb") as server:
        store = _store(server.url, page_bytes=1 << 20, timeout_s=60.0, retry_min_s=0.05, retry_max_s=0.2)
        pages = _pages(64, 7, 1 << 20)
        assert all(store.write_pages(_keys(64), pages))
        out = [torch.zeros(1 << 20, dtype=torch.uint8) for _ in range(64)]
        server.proc.kill()
        assert store.read_pages(_keys(64), out) == [False] * 64
        # failed on the broken connection itself, not by waiting out its (long) timeout
        assert store.state == "down" and "timeout" not in store.stats()["reason"].lower(), store.stats()["reason"]
        server.proc.wait()
        server.proc = None
        server.start()
        deadline = time.monotonic() + 10
        while store.write_pages(_keys(1), pages[:1]) != [True] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.state == "ok"


def test_a_full_server_refuses_writes_by_name():
    with LocalServer(maxmemory="4mb", policy="noeviction") as server:
        store = _store(server.url, page_bytes=1 << 20)
        results, reasons = store.write_pages_detailed(_keys(16), _pages(16, 8, 1 << 20))
        assert results.count(True) >= 1 and "remote_full" in reasons
        assert store.stats()["full"] == reasons.count("remote_full") and store.state == "ok"


def test_admission_writes_a_page_once_it_was_offered_twice(valkey):
    store = _store(valkey.url, admission_hits=2)
    assert store.write_pages_detailed(_keys(1), _pages(1, 9)) == ([False], ["not_admitted"])
    assert store.write_pages(_keys(1), _pages(1, 9)) == [True]


def test_local_l3_in_front_of_the_shared_tier(valkey, tmp_path):
    from tiers.l3 import L3Store

    local = L3Store(tmp_path / "l3", 8 * 8192, PAGE, NS, io_backend="buffered")
    shared = _store(valkey.url)
    tiers = PersistentTiers(local, shared, remote_pages=64)
    try:
        pages = _pages(4, 10)
        assert tiers.write_pages(_keys(4), pages) == [True] * 4
        assert local.contains(_keys(4)) == [True] * 4 and shared.contains(_keys(4)) == [True] * 4
        tiers.delete(_keys(2))  # evicted from this server's disk tier: the shared copies stay
        assert local.contains(_keys(4)) == [False, False, True, True] and tiers.contains(_keys(4)) == [True] * 4
        out = [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(4)]
        before = shared.stats()["hits"]
        assert tiers.read_pages(_keys(4), out) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(pages, out))
        assert shared.stats()["hits"] - before == 2  # the two local pages came from the local store
        assert tiers.capacity_pages == 8 + 64 and tiers.stats()["remote"]["state"] == "ok"
        assert tiers.discard(_keys(4)) == 2 + 4
    finally:
        tiers.close()


def test_remote_only_behind_a_process_of_its_own(valkey):
    """The L3 process (tiers/l3/process.py) runs the remote tier alone, no local store."""
    from tiers import HostPool, KVLayout
    from tiers.l3.process import L3Process

    host = HostPool(KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, itemsize=4), 8, torch.float32,
                    pin_memory=False, shared=True)
    remote = dict(url=valkey.url, namespace=NS, page_bytes=host.page_bytes, key_prefix=f"p-{os.getpid()}")
    proc = L3Process(host, None, threads=2, queue_pages=8, batch_pages=4, remote_args=remote, remote_pages=32)
    try:
        assert proc.store.capacity_pages == 32 and proc.store.io_backend == "remote"
        for p in range(2):
            host.page_view(p).fill_(p + 1)
        assert proc.store.write_pages(_keys(2), [host.page_view(p) for p in range(2)]) == [True, True]
        assert proc.store.contains(_keys(3)) == [True, True, False]
        assert proc.store.read_pages(_keys(2), [host.page_view(p) for p in (4, 5)]) == [True, True]
        assert int(host.page_view(5).sum()) == 2 * host.page_bytes
        assert proc.store.stats()["remote"]["writes"] == 2
    finally:
        proc.worker.close()
        proc.store.close()
