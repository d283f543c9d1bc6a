"""The remote tier on a Mooncake Store (tiers/remote/mooncake.py).

Most tests drive the store against a stand-in client with Mooncake's calls and return codes, one dict as the
cluster: two stores share pages, a bad value is a miss, a vanished key is a miss, a master that is down at startup
or stops answering mid-call leaves the store down within its timeout, and it comes back by itself. The last test
runs a real `mooncake_master` and needs the `mooncake` extra (the `mooncake-transfer-engine-non-cuda` wheel and,
on Debian, libibverbs1 / libnl-3-200 / libnl-route-3-200); without it that test is skipped, by name.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

import numpy as np
import pytest

from tiers.remote import HEADER_BYTES, RemoteError
from tiers.remote.mooncake import NOT_FOUND, RPC_FAILED, MooncakeAddress, MooncakeStore

NS_A, NS_B = b"namespace-aaaaaa", b"namespace-bbbbbb"
PAGE = 4096
URL = "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata"


class FakeCluster:
    """What a Mooncake cluster holds, and switches to make its master vanish or hang."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.up = True
        self.hang = threading.Event()  # set: every call blocks until `release` is set
        self.release = threading.Event()
        self.calls = 0  # data calls (probes, reads, writes) that reached the cluster


class FakeClient:
    """The calls of mooncake.store.MooncakeDistributedStore that the store uses, over a FakeCluster."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster
        self.registered: list[tuple[int, int]] = []

    def _wait(self) -> None:
        self.cluster.calls += 1
        if self.cluster.hang.is_set():
            self.cluster.release.wait(30)

    def setup(self, local, metadata, segment, buffer, protocol, device, master) -> int:
        self._wait()
        return 0 if self.cluster.up else -1

    def health_check(self) -> int:
        return 0 if self.cluster.up else 2

    def register_buffer(self, ptr: int, size: int) -> int:
        self.registered.append((ptr, size))
        return 0

    def _inside(self, ptr: int, size: int) -> bool:
        return any(start <= ptr and ptr + size <= start + n for start, n in self.registered)

    def batch_is_exist(self, keys):
        self._wait()
        return [int(k in self.cluster.objects) if self.cluster.up else RPC_FAILED for k in keys]

    def batch_put_from_multi_buffers(self, keys, ptrs, sizes):
        self._wait()
        out = []
        for key, parts, lens in zip(keys, ptrs, sizes):
            if not self.cluster.up:
                out.append(RPC_FAILED)
                continue
            assert all(self._inside(p, n) for p, n in zip(parts, lens)), "a buffer was not registered"
            self.cluster.objects[key] = b"".join(ctypes.string_at(p, n) for p, n in zip(parts, lens))
            out.append(0)
        return out

    def batch_get_into(self, keys, ptrs, sizes):
        self._wait()
        out = []
        for key, ptr, size in zip(keys, ptrs, sizes):
            value = self.cluster.objects.get(key)
            if not self.cluster.up:
                out.append(RPC_FAILED)
                continue
            if value is None:
                out.append(NOT_FOUND)
                continue
            assert self._inside(ptr, size), "a buffer was not registered"
            ctypes.memmove(ptr, value, min(size, len(value)))
            out.append(len(value))
        return out

    def batch_remove(self, keys, force=False):
        return [0 if self.cluster.objects.pop(k, None) is not None else NOT_FOUND for k in keys]

    def close(self) -> None:
        return None


def store(cluster: FakeCluster, namespace: bytes = NS_A, **kw) -> MooncakeStore:
    kw.setdefault("timeout_s", 1.0)
    return MooncakeStore(URL, namespace, PAGE, client_factory=lambda: FakeClient(cluster), **kw)


def pages(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, PAGE), dtype=np.uint8)


def keys(n: int, base: int) -> list[bytes]:
    return [(base + i).to_bytes(16, "little") for i in range(n)]


def test_the_url_names_the_master_and_the_client_settings_and_refuses_what_it_cannot_use():
    a = MooncakeAddress.parse("mooncake://10.0.0.5:50099?metadata=P2PHANDSHAKE&protocol=rdma&device=mlx5_0"
                              "&local=10.0.0.7&segment_mib=2048&buffer_mib=32")
    assert (a.master, a.metadata, a.protocol, a.device, a.local) == ("10.0.0.5:50099", "P2PHANDSHAKE", "rdma",
                                                                     "mlx5_0", "10.0.0.7")
    assert (a.segment_bytes, a.buffer_bytes) == (2048 << 20, 32 << 20) and str(a) == "mooncake://10.0.0.5:50099"
    d = MooncakeAddress.parse("mooncake://m?metadata=http://m:8080/metadata")
    assert (d.master, d.protocol, d.local, d.segment_bytes) == ("m:50051", "tcp", "127.0.0.1", 1024 << 20)
    for url, why in (("redis://m:1?metadata=x", "scheme must be mooncake"),
                     ("mooncake://m:1", "needs metadata"),
                     ("mooncake://m:1?metadata=x&colour=red", "unknown parameters"),
                     ("mooncake://m:1?metadata=x&segment_mib=lots", "segment_mib must be"),
                     ("mooncake://m:1?metadata=x&protocol=udp", "protocol must be")):
        with pytest.raises(RemoteError, match=why):
            MooncakeAddress.parse(url)


def test_a_page_written_by_one_server_is_read_by_another_byte_for_byte():
    cluster = FakeCluster()
    a, b = store(cluster), store(cluster)
    src, dst = pages(5, 1), np.zeros((5, PAGE), dtype=np.uint8)
    ks = keys(5, 100)
    assert a.write_pages(ks, list(src)) == [True] * 5
    assert b.contains(ks + keys(1, 999)) == [True] * 5 + [False]
    assert b.read_pages(ks, list(dst)) == [True] * 5 and np.array_equal(src, dst)
    assert all(len(v) == HEADER_BYTES + PAGE for v in cluster.objects.values())
    s = b.stats()
    assert (s["reads"], s["hits"], s["read_bytes"], s["probes"], s["probe_hits"]) == (5, 5, 5 * PAGE, 6, 5)
    assert a.stats()["writes"] == 5 and a.stats()["write_bytes"] == 5 * PAGE
    assert b.delete(ks[:2]) == 2 and b.contains(ks[:3]) == [False, False, True]


def test_a_corrupt_value_or_one_of_another_namespace_is_a_miss_never_served(caplog):
    cluster = FakeCluster()
    a, other = store(cluster), store(cluster, NS_B)
    src = pages(3, 2)
    ks = keys(3, 200)
    assert a.write_pages(ks, list(src)) == [True] * 3
    name = a.key(ks[0])
    value = bytearray(cluster.objects[name])
    value[HEADER_BYTES + 17] ^= 0xFF  # one flipped byte of the page
    cluster.objects[name] = bytes(value)
    assert other.write_pages(ks[1:2], list(pages(1, 3))) == [True]
    cluster.objects[a.key(ks[1])] = cluster.objects[other.key(ks[1])]  # another namespace's value under our key
    dst = np.zeros((3, PAGE), dtype=np.uint8)
    with caplog.at_level(logging.ERROR, logger="tiers.remote.mooncake"):
        assert a.read_pages(ks, list(dst)) == [False, False, True]
    assert np.array_equal(dst[2], src[2]) and a.stats()["bad_values"] == 2
    assert any("2 values failed verification" in r.getMessage() for r in caplog.records)


def test_a_key_gone_between_the_probe_and_the_read_is_a_miss():
    cluster = FakeCluster()
    a = store(cluster)
    ks = keys(2, 300)
    assert a.write_pages(ks, list(pages(2, 4))) == [True, True]
    assert a.contains(ks) == [True, True]
    del cluster.objects[a.key(ks[0])]  # the cluster evicted it meanwhile
    assert a.read_pages(ks, list(np.zeros((2, PAGE), dtype=np.uint8))) == [False, True]
    assert a.stats()["vanished"] == 1 and a.state == "ok"


def test_a_master_down_at_startup_is_retried_with_backoff_and_the_tier_comes_back(caplog):
    cluster = FakeCluster()
    cluster.up = False
    with caplog.at_level(logging.WARNING, logger="tiers.remote.mooncake"):
        a = store(cluster, retry_min_s=0.2, retry_max_s=1.0)
        assert a.state == "down"
        ks = keys(2, 400)
        calls = cluster.calls
        assert a.write_pages_detailed(ks, list(pages(2, 5))) == ([False, False], ["remote_down", "remote_down"])
        assert a.contains(ks) == [False, False]
        assert cluster.calls == calls  # while down, calls answer at once: none reaches the cluster
        cluster.up = True
        deadline = time.monotonic() + 30  # a bound for liveness: the first backoff is 0.2 s
        while a.write_pages(ks, list(pages(2, 5))) != [True, True]:
            assert time.monotonic() < deadline, "the tier did not come back"
            time.sleep(0.01)
        assert a.state == "ok"
    messages = [r.getMessage() for r in caplog.records]
    assert sum("unavailable at startup" in m for m in messages) == 1 and sum("is back" in m for m in messages) == 1
    assert a.stats()["reconnects"] == 1


def test_a_master_that_stops_answering_mid_run_costs_one_timeout_and_takes_the_tier_down():
    cluster = FakeCluster()
    a = store(cluster, timeout_s=0.3, retry_min_s=5.0)
    ks = keys(2, 500)
    assert a.write_pages(ks, list(pages(2, 6))) == [True, True]
    cluster.hang.set()  # the next call never returns by itself
    start = time.monotonic()
    dst = np.zeros((2, PAGE), dtype=np.uint8)
    assert a.read_pages(ks, list(dst)) == [False, False]
    took = time.monotonic() - start
    assert took >= 0.3 and a.state == "down" and "no answer within" in a.stats()["reason"]  # it waited its timeout
    calls = cluster.calls
    assert a.contains(ks) == [False, False] and cluster.calls == calls  # down: answered without asking the cluster
    (stuck, _), = a._abandoned  # the read given up holds on to its staging buffer
    cluster.release.set()  # the stuck read completes now, into that buffer: never into the host page
    stuck.join(10)
    assert not stuck.is_alive() and not dst.any()
    dead = FakeCluster()
    b = store(dead)
    dead.up = False  # a master gone: the health check before the call says so, and the tier goes down at once
    assert b.contains(ks) == [False, False] and b.state == "down" and "health check 2" in b.stats()["reason"]


def test_two_servers_share_pages_through_a_real_mooncake_master_which_may_die_and_come_back(tmp_path):
    from hicache.mooncake_local import LocalMaster, find_master

    if find_master() is None:
        pytest.skip("the mooncake extra is not installed (pip install 'hicache[mooncake]'): opt-in test")
    try:
        import mooncake.store  # noqa: F401 - loads the native client (needs libibverbs1 and libnl-3 on Debian)
    except ImportError as e:
        pytest.skip(f"the Mooncake client does not load here: {e}")
    master = LocalMaster(str(tmp_path / "master.log")).start()
    url = master.url(segment_mib=64, buffer_mib=16)
    a = b = None
    try:
        a = MooncakeStore(url, NS_A, PAGE, timeout_s=8.0, retry_min_s=0.2, retry_max_s=0.5)
        b = MooncakeStore(url, NS_A, PAGE, timeout_s=8.0, retry_min_s=0.2, retry_max_s=0.5)
        src, dst = pages(8, 7), np.zeros((8, PAGE), dtype=np.uint8)
        ks = keys(8, 700)
        assert a.write_pages(ks, list(src)) == [True] * 8
        assert b.contains(ks) == [True] * 8
        assert b.read_pages(ks, list(dst)) == [True] * 8 and np.array_equal(src, dst)
        assert b.read_pages(keys(1, 9999), list(dst[:1])) == [False] and b.stats()["vanished"] == 1
        master.stop()
        start = time.monotonic()
        assert b.read_pages(ks, list(dst)) == [False] * 8
        assert time.monotonic() - start < 9.0 and b.state == "down"
        master.start()
        deadline = time.monotonic() + 30
        while b.write_pages(keys(1, 800), list(src[:1])) != [True] and time.monotonic() < deadline:
            time.sleep(0.3)
        assert b.state == "ok" and b.contains(keys(1, 800)) == [True]
    finally:
        for s in (a, b):
            if s is not None:
                s.close()
        master.stop()
