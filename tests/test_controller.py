"""Tier controller: write policies, eviction, promotion from host and L3, probe, failures, and a
hypothesis property test against a reference model with byte checks on every tier."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from memory_l3 import MemoryL3

from controller import CostModel, L3Worker, TierController, WritePolicy
from controller.disk_reads import READ_ESTIMATE_HALF_LIFE_S
from controller.stats import REMOTE
from radix import DEVICE, DISK, HOST, RadixTree
from tiers import DevicePool, HostPool, KVLayout, PageCopier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, page_size=2, itemsize=4)


def page_value(tokens: tuple[int, ...], page: int) -> float:
    """The KV content of a page is a function of the tokens up to and including that page."""
    return float(hash(tuple(tokens[: (page + 1) * LAYOUT.page_size])) % 1_000_003)


class Harness:
    """A controller on tiny CPU pools, with an engine stand-in that computes 'KV' deterministically."""

    def __init__(self, device=4, host=8, disk=16, policy=None, cost=None, l3=None, copier=None, worker=None,
                 prefetch=True, l3_process=None):
        self.dev = DevicePool(LAYOUT, device, torch.float32, "cpu")
        self.host = HostPool(LAYOUT, host, torch.float32, shared=l3_process is not None) if host else None
        self.process = None
        if l3_process is not None:  # store arguments: the L3 in a process of its own, over the shared host pool
            from tiers.l3.process import L3Process

            self.process = L3Process(self.host, l3_process, threads=2, queue_pages=64, batch_pages=4)
            l3, worker = self.process.store, (lambda _: self.process.worker)
        self.l3 = l3 if l3 is not None else (MemoryL3(disk, LAYOUT.page_bytes) if disk else None)
        if copier is not None:
            copier = copier(self.dev, self.host)
        elif self.host:
            copier = PageCopier(self.dev, self.host)
        self.copier = copier
        if self.l3 is not None:
            worker = worker(self.l3) if worker is not None else L3Worker(self.l3, synchronous=True)
        self.ctrl = TierController(RadixTree(LAYOUT.page_size), self.dev, self.host, self.l3, copier,
                                   policy or WritePolicy.eager(), cost, worker, prefetch=prefetch)

    def run(self, tokens: list[int]) -> dict[str, int]:
        """One request: acquire, verify cached bytes, compute the rest, commit, release."""
        tokens = tuple(tokens)
        ps = LAYOUT.page_size
        ticket = self.ctrl.acquire(tokens, max_pages=(len(tokens) - 1) // ps)
        assert self.ctrl.wait_ticket(ticket)
        assert not ticket.failed
        have = ticket.num_pages
        for i, p in enumerate(ticket.device_pages()):
            assert torch.all(self.dev.kv[:, :, p] == page_value(tokens, i)), f"cached page {i} has wrong bytes"
        full = len(tokens) // ps
        new = self.ctrl.alloc_device(full - have)
        assert new is not None
        for i, p in enumerate(new):
            self.dev.kv[:, :, p] = page_value(tokens, have + i)
        pages = self.ctrl.commit(ticket, tokens, ticket.device_pages() + new)
        for i, p in enumerate(pages):
            assert torch.all(self.dev.kv[:, :, p] == page_value(tokens, i))
        self.ctrl.release(ticket)
        if self.process is not None:  # asynchronous L3 writes: let them land, so that what follows is determined
            assert self.ctrl.worker.wait_idle(30)
        self.ctrl.poll()
        self.ctrl.check_integrity()
        return dict(ticket.hit_pages)

    def close(self) -> None:
        self.ctrl.close()
        if self.process is not None:
            self.process.store.close()

    def check_all_bytes(self) -> None:
        """Every page any tier holds equals what was computed for it."""
        tree = self.ctrl.tree
        for node in tree.nodes():
            tokens = tree.path_tokens(node)
            first = len(tokens) // LAYOUT.page_size - node.num_pages
            for j in range(node.num_pages):
                want = page_value(tokens, first + j)
                if node.on_device:
                    assert torch.all(self.dev.kv[:, :, node.device_pages[j]] == want)
                if node.on_host:
                    assert torch.all(self.host.buffer[node.host_pages[j]] == want)
                if node.on_disk and isinstance(self.l3, MemoryL3):
                    raw = self.l3.data.get(node.disk_keys[j])
                    if raw is not None:  # the stand-in may have dropped it on its own cap
                        got = torch.frombuffer(bytearray(raw), dtype=torch.float32)
                        assert torch.all(got == want)


def seq(base: int, pages: int) -> list[int]:
    return [base * 1000 + i for i in range(pages * LAYOUT.page_size + 1)]


def mechanics(*args, **kwargs) -> WritePolicy:
    """A write policy for tests of the write mechanism: every page admitted to the L3, no cap on the host pages
    queued writes pin (the admission rule and the cap have their own tests, tests/test_l3_admit.py)."""
    return WritePolicy(*args, **{"l3_admit": "all", "l3_host_share": 1.0, **kwargs})


def test_write_through_then_hits_from_each_tier():
    h = Harness(device=3, host=6, disk=32)
    assert h.run(seq(1, 2)) == {}
    assert h.run(seq(1, 2)) == {DEVICE: 2}
    h.run(seq(2, 3))  # pushes seq 1 off the GPU (3 pages)
    assert h.run(seq(1, 2)) == {HOST: 2}
    for b in (3, 4, 5):  # push seq 1 off the host too
        h.run(seq(b, 3))
    m = h.ctrl.tree.match_prefix(seq(1, 2), touch=False)
    assert m.disk_pages == 2
    assert h.run(seq(1, 2)) == {DISK: 2}
    s = h.ctrl.stats.snapshot()
    assert s["hit_tokens"] == {DEVICE: 4, HOST: 4, DISK: 4, REMOTE: 0}
    assert s["pages_promoted"]["disk->host"] == 2 and s["pages_demoted"]["device->host"] >= 5
    assert s["evictions"][DEVICE] > 0 and s["evictions"][HOST] > 0
    h.check_all_bytes()


def test_write_through_then_hits_from_each_tier_with_the_l3_in_its_own_process(tmp_path):
    """The same sequence as above, the store in a process of its own: same hits, and every byte as computed."""
    args = dict(path=str(tmp_path / "l3"), capacity_bytes=32 * 4096, page_bytes=LAYOUT.page_bytes,
                namespace=b"controller-test1", io_backend="buffered", io_threads=2, sync_batch_pages=4)
    h = Harness(device=3, host=6, l3_process=args)
    try:
        assert h.run(seq(1, 2)) == {}
        assert h.run(seq(1, 2)) == {DEVICE: 2}
        h.run(seq(2, 3))
        assert h.run(seq(1, 2)) == {HOST: 2}
        for b in (3, 4, 5):
            h.run(seq(b, 3))
        assert h.ctrl.tree.match_prefix(seq(1, 2), touch=False).disk_pages == 2
        assert h.run(seq(1, 2)) == {DISK: 2}  # read by the child into the shared host pool, then copied up
        assert h.ctrl.stats.snapshot()["hit_tokens"] == {DEVICE: 4, HOST: 4, DISK: 4, REMOTE: 0}
        assert h.l3.stats()["reads"] >= 2
        h.check_all_bytes()
    finally:
        h.close()


DEFER = mechanics("write_through", "write_through", defer_above_free=0.5)


def test_deferred_write_through_waits_for_the_pool_to_fill():
    h = Harness(device=8, host=16, disk=32, policy=DEFER)
    h.run(seq(1, 2))  # 6 of 8 GPU pages free (> half): the copy waits
    assert h.host.used_pages() == 0 and h.ctrl.stats.deferred_pages == 2
    assert not h.ctrl.tree.match_prefix(seq(1, 2), touch=False).last_node.on_host
    h.run(seq(2, 2))  # 4 free after allocating (not above half): every waiting copy starts, then this one
    assert h.host.used_pages() == 4 and h.ctrl.stats.deferred_pages == 2
    assert h.ctrl.stats.pages_demoted[(DEVICE, HOST)] == 4 and h.l3.used_pages() == 4  # write-through to disk too
    h.check_all_bytes()


def test_deferred_write_through_copies_on_eviction():
    h = Harness(device=5, host=16, disk=0, policy=mechanics("write_through", "write_through", defer_above_free=0.0))
    h.run(seq(1, 2))
    h.run(seq(2, 2))  # 1 page free: still deferred
    assert h.host.used_pages() == 0 and h.ctrl.stats.deferred_pages == 4
    h.run(seq(3, 2))  # evicts seq 1's last page, copied on its way out; then the pool is full: the rest is copied
    assert h.ctrl.stats.evictions[DEVICE] == 1 and h.host.used_pages() == 6
    assert h.ctrl.stats.eviction_backups == 1
    assert h.run(seq(1, 2)) == {DEVICE: 1, HOST: 1}
    h.check_all_bytes()


def test_without_reuse_in_the_traffic_a_page_leaves_the_gpu_uncopied_unless_it_is_likely_read_again():
    """A deferred copy made as a page leaves the GPU makes the engine wait for it (and every copy queued before it).
    Where the traffic shows no reuse (controller/reuse.py) that wait buys nothing: a page with no sign of a reader
    leaves without a copy. A page computed a second time has one, and is copied as before; so is every page while
    the traffic reuses."""
    policy = mechanics("write_through", "write_through", defer_above_free=0.0, l3_admit="reuse")
    for share, copies in ((1.0, 1), (0.0, 0)):
        h = Harness(device=5, host=16, disk=0, policy=policy)
        h.ctrl.writes.reuse.traffic_reuse = share
        h.run(seq(1, 2))
        h.run(seq(2, 2))  # 1 page free: both deferred
        h.run(seq(3, 2))  # evicts seq 1's last page
        assert h.ctrl.stats.evictions[DEVICE] == 1 and h.ctrl.stats.eviction_backups == copies
        assert h.ctrl.tree.match_prefix(seq(1, 2), touch=False).num_pages == 2 - (1 - copies)
        h.check_all_bytes()
    # the rule itself, on deferred pages (on the GPU only), the traffic showing no reuse
    h = Harness(device=5, host=16, disk=0, policy=policy)
    writes = h.ctrl.writes
    writes.reuse.traffic_reuse = 0.0
    h.run(seq(1, 2))
    node = h.ctrl.tree.match_prefix(seq(1, 2), touch=False).last_node
    assert (node.on_device, node.on_host) == (True, False) and not writes.copies_before_leaving(DEVICE, node)
    node.hit_count = 1  # it was hit: likely read again
    assert writes.copies_before_leaving(DEVICE, node)
    node.hit_count = 0
    writes.reuse.computed([node], continues_hit=True)  # computed again, continuing a hit: likely too
    assert writes.copies_before_leaving(DEVICE, node)
    # write-back's copy on leaving is its only one: made whatever the traffic
    h = Harness(device=2, host=4, disk=0, policy=mechanics("write_back", "write_back", l3_admit="reuse"))
    h.ctrl.writes.reuse.traffic_reuse = 0.0
    h.run(seq(1, 2))
    h.run(seq(2, 2))  # evicts seq 1 from the GPU: copied to host first
    assert h.ctrl.stats.eviction_backups == 2 and h.run(seq(1, 2)) == {HOST: 2}
    h.check_all_bytes()


def test_without_reuse_in_the_traffic_new_pages_are_not_copied_until_it_reuses_again():
    """One-off prompts' pages are not copied to host, full GPU pool or not, busy or idle: the copies would cost
    launches and host churn for bytes nobody reads. The backlog forgets the nodes that left the GPU; once the traffic
    reuses again, an idle engine copies it in one call, or the next allocation starts it, and new pages are copied at
    once."""
    policy = mechanics("write_through", "write_through", defer_above_free=0.0, l3_admit="reuse")
    h = Harness(device=5, host=16, disk=0, policy=policy, copier=CountingCopier)
    writes = h.ctrl.writes
    writes.reuse.traffic_reuse = 0.0
    for base in range(1, 21):
        writes.begin_step()
        h.run(seq(base, 2))
    assert h.copier.to_host_calls == [] and h.host.used_pages() == 0
    assert h.ctrl.stats.evictions[DEVICE] == 35 and h.ctrl.stats.eviction_backups == 0
    queued = list(writes.deferred)  # of the 20 nodes queued, those still on the GPU
    assert [n.num_pages for n in queued] == [2, 2] and all(n.on_device for n in queued)
    writes.begin_step()
    h.ctrl.idle()
    assert h.copier.to_host_calls == [] and not any(node.on_host for node in queued)
    # a little reuse (under TRAFFIC_REUSE_MIN, over TRAFFIC_ONE_OFF_MAX: a trace with partial reuse whose pages are
    # read much later) is not one-off traffic: the idle engine copies the backlog
    writes.reuse.traffic_reuse = 0.1
    h.ctrl.idle()
    assert h.copier.to_host_calls == [4] and all(node.on_host for node in queued)
    assert h.run(seq(20, 2)) == {DEVICE: 2}
    # the traffic reuses again: the backlog's next slice starts at allocation, new pages are copied at once
    h = Harness(device=5, host=16, disk=0, policy=policy, copier=CountingCopier)
    h.ctrl.writes.reuse.traffic_reuse = 0.0
    h.run(seq(1, 2))
    h.run(seq(2, 2))
    assert h.copier.to_host_calls == []
    h.ctrl.writes.reuse.traffic_reuse = 1.0
    h.ctrl.writes.begin_step()
    h.run(seq(3, 2))  # evicts one page of seq 1, copied on its way out; then the backlog, then seq 3
    assert sum(h.copier.to_host_calls) == 6 and h.host.used_pages() == 6
    assert h.run(seq(1, 2)) == {DEVICE: 1, HOST: 1}
    h.check_all_bytes()


def test_gpu_eviction_takes_a_copied_leaf_before_an_older_one_it_would_wait_to_copy():
    """Freeing an uncopied leaf's GPU pages waits for its copy and every copy queued before it: a leaf already in host
    memory goes first, although it was used later."""
    h = Harness(device=5, host=16, disk=0, policy=mechanics("write_through", "write_through", defer_above_free=0.0))
    h.run(seq(2, 2))
    h.run(seq(1, 2))  # both deferred, seq 2 the older
    tree = h.ctrl.tree
    first = tree.match_prefix(seq(1, 2), touch=False).last_node
    assert h.ctrl.writes.backup_to_host(first) and h.host.used_pages() == 2
    h.run(seq(3, 2))  # 1 page free, 2 needed: seq 1's last page goes, no copy made for it
    assert h.ctrl.stats.evictions[DEVICE] == 1 and h.ctrl.stats.eviction_backups == 0
    assert tree.match_prefix(seq(2, 2), touch=False).device_pages == 2
    assert h.run(seq(1, 2)) == {DEVICE: 1, HOST: 1}
    h.check_all_bytes()


def test_deferred_write_through_copies_when_idle():
    h = Harness(device=8, host=16, disk=0, policy=DEFER)
    h.run(seq(1, 2))
    h.run(seq(1, 1)[:-1] + [5] * LAYOUT.page_size + [6])  # a branch after page 1: seq 1's node splits
    assert h.host.used_pages() == 0 and h.ctrl.stats.deferred_pages == 3
    h.ctrl.idle()  # the engine has nothing to run: every page still waiting is copied
    tree = h.ctrl.tree
    assert h.host.used_pages() == 3
    assert all(node.on_host for node in tree.nodes() if node.on_device)
    assert h.ctrl.writes.flush_backups() == 0
    h.check_all_bytes()


def test_deferred_backlog_starts_a_slice_per_step():
    """Once the pool fills, the backlog starts one slice (whole nodes) per engine step, oldest first, while new
    commits are copied at once; idle steps drain the rest a slice at a time."""
    h = Harness(device=16, host=32, disk=0, policy=DEFER)
    h.ctrl.writes.flush_slice_pages = 2
    for base in (1, 2, 3):
        h.ctrl.writes.begin_step()
        h.run(seq(base, 2))
    assert h.host.used_pages() == 0 and h.ctrl.stats.deferred_pages == 6

    def backed() -> dict[int, bool]:
        tree = h.ctrl.tree
        return {base: tree.match_prefix(seq(base, 2), touch=False).last_node.on_host for base in (1, 2, 3)}

    h.ctrl.writes.begin_step()
    h.run(seq(4, 3))  # free falls to 7 of 16: seq 1 starts at allocation (the step's slice); seq 4 is copied at once
    assert backed() == {1: True, 2: False, 3: False} and h.host.used_pages() == 5
    h.ctrl.idle()  # same step: its slice is spent
    assert h.host.used_pages() == 5
    h.ctrl.writes.begin_step()
    h.ctrl.idle()
    assert backed() == {1: True, 2: True, 3: False} and h.host.used_pages() == 7
    h.ctrl.writes.begin_step()
    h.ctrl.idle()
    assert h.host.used_pages() == 9 and h.ctrl.writes.flush_backups() == 0
    h.check_all_bytes()


class CountingCopier(PageCopier):
    """The reference copier, recording the pages of each GPU -> host call."""

    def __init__(self, device_pool, host_pool):
        super().__init__(device_pool, host_pool)
        self.to_host_calls: list[int] = []

    def to_host(self, device_pages, host_pages, *args, **kwargs):
        self.to_host_calls.append(len(device_pages))
        return super().to_host(device_pages, host_pages, *args, **kwargs)


def test_a_deferred_backlog_goes_to_the_copier_in_one_call():
    """The copier's cost on the engine thread is per call: a flushed backlog of several nodes, split parts included,
    is copied by one call, and every page lands where the tree says."""
    h = Harness(device=32, host=16, disk=0, policy=DEFER, copier=CountingCopier)
    h.run(seq(1, 4))
    h.run(seq(1, 4)[: 2 * LAYOUT.page_size] + [5] * 2 * LAYOUT.page_size + [6])  # splits seq 1's node after 2 pages
    h.run(seq(2, 3))
    assert h.host.used_pages() == 0 and h.copier.to_host_calls == []
    assert h.ctrl.writes.flush_backups() == 9
    assert h.copier.to_host_calls == [9]
    assert all(node.on_host for node in h.ctrl.tree.nodes() if node.on_device)
    h.check_all_bytes()


def test_a_batch_copies_the_nodes_the_host_has_room_for():
    """A node the full host tier cannot take is left out of the batch (counted as host_full); the others are copied
    in the same call."""
    h = Harness(device=16, host=5, disk=0, policy=DEFER, copier=CountingCopier)
    for base in (1, 2, 3):
        h.run(seq(base, 2))
    for node in h.ctrl.tree.nodes():
        if node.on_device:
            h.ctrl.tree.pin(node)  # nothing in host memory may be evicted for the backlog
    h.ctrl.writes.reuse.traffic_reuse = 1.0
    assert h.ctrl.writes.flush_backups() == 4
    assert h.copier.to_host_calls == [4] and h.ctrl.stats.drops["host_full"] == 2
    backed = [h.ctrl.tree.match_prefix(seq(base, 2), touch=False).last_node.on_host for base in (1, 2, 3)]
    assert backed == [True, True, False]
    h.check_all_bytes()


def test_deferred_copy_of_a_split_node_covers_both_parts():
    h = Harness(device=16, host=16, disk=0, policy=DEFER)
    h.run(seq(1, 4))
    h.run(seq(1, 4)[: 2 * LAYOUT.page_size] + [5] * 2 * LAYOUT.page_size + [6])  # splits seq 1's node after 2 pages
    assert h.host.used_pages() == 0 and h.ctrl.stats.deferred_pages == 6
    assert h.ctrl.writes.flush_backups() == 6  # the upper part (2 pages) and both tails (2 + 2)
    assert h.host.used_pages() == 6
    h.check_all_bytes()


def test_clean_shutdown_writes_deferred_pages_through_to_disk():
    h = Harness(device=8, host=16, disk=32, policy=DEFER)
    h.run(seq(1, 2))
    assert h.l3.used_pages() == 0
    h.ctrl.close()
    assert h.l3.used_pages() == 2 and h.host.used_pages() == 2
    h.check_all_bytes()


def test_write_back_copies_only_on_eviction():
    h = Harness(device=2, host=4, disk=16, policy=mechanics("write_back", "write_back"))
    h.run(seq(1, 2))
    assert h.ctrl.stats.pages_demoted[(DEVICE, HOST)] == 0 and h.host.used_pages() == 0
    h.run(seq(2, 2))  # evicts seq 1 from GPU -> copied to host first
    assert h.ctrl.stats.pages_demoted[(DEVICE, HOST)] == 2 and h.l3.used_pages() == 0
    assert h.ctrl.stats.eviction_backups == 2
    h.run(seq(3, 2))
    h.run(seq(4, 2))  # host full of 4 pages: seq 1 goes to disk
    assert h.l3.used_pages() >= 2
    assert h.run(seq(1, 2)) == {DISK: 2}
    h.check_all_bytes()


class SlowCopier(PageCopier):
    """PageCopier whose GPU -> host copies stay 'in flight' until `land()`; records GPU-side waits."""

    class Handle:
        def __init__(self, log):
            self.landed, self.log = False, log

        def done(self):
            return self.landed

        def wait(self):
            self.log.append(("host wait", self))

        def stream_wait(self):
            self.log.append(("stream wait", self))

    def __init__(self, *args):
        super().__init__(*args)
        self.log, self.handles = [], []

    def to_host(self, device_pages, host_pages):
        super().to_host(device_pages, host_pages)
        handle = self.Handle(self.log)
        self.handles.append(handle)
        return handle


def test_gpu_eviction_takes_a_leaf_whose_copy_landed_before_an_older_one_still_copying():
    h = Harness(device=4, host=8, disk=0, copier=SlowCopier)
    copier = h.copier
    h.run(seq(1, 2))  # its backup copy: handles[0], still in flight
    h.run(seq(2, 2))  # handles[1]
    copier.handles[1].landed = True
    h.run(seq(3, 2))  # the pool is full: seq 2 leaves it, though seq 1 was used earlier, and nothing waits
    assert copier.log == []
    tree = h.ctrl.tree
    assert tree.match_prefix(seq(1, 2), touch=False).device_pages == 2
    assert tree.match_prefix(seq(2, 2), touch=False).host_pages == 2


def test_eviction_waits_only_for_copies_of_the_evicted_pages():
    h = Harness(device=4, host=8, disk=0, copier=SlowCopier)
    copier = h.copier
    h.run(seq(1, 2))  # its backup copy: handles[0]
    h.run(seq(2, 2))  # handles[1]
    copier.handles[0].landed = True
    h.run(seq(3, 2))  # evicts seq 1 (copy landed): no wait
    assert copier.log == [] and h.ctrl.stats.backup_waits == 0
    h.run(seq(4, 2))  # evicts seq 2, whose copy is still in flight: the GPU waits for that copy only
    assert copier.log == [("stream wait", copier.handles[1])]
    assert h.ctrl.stats.backup_waits == 2  # seq 2's two pages (counted per page, one wait per copy)
    h.check_all_bytes()
    h.ctrl.check_integrity()


def test_a_running_prefix_gives_its_host_copy_to_new_pages():
    # a request holds seq 1 on the GPU; its host copy is a spare: the backup of new pages takes its room instead
    # of being refused, and the prefix stays on the GPU for the request
    h = Harness(device=8, host=2, disk=0)
    h.run(seq(1, 2))
    ticket = h.ctrl.acquire(seq(1, 2), max_pages=2)
    assert ticket.num_pages == 2 and h.ctrl.wait_ticket(ticket)
    h.run(seq(2, 2))
    assert not h.ctrl.stats.drops
    tree = h.ctrl.tree
    first = tree.match_prefix(seq(1, 2), touch=False).last_node
    second = tree.match_prefix(seq(2, 2), touch=False).last_node
    assert first.on_device and not first.on_host and second.on_host
    assert ticket.device_pages() == first.device_pages
    h.ctrl.release(ticket)
    h.check_all_bytes()
    h.ctrl.check_integrity()


def test_a_node_on_disk_leaving_the_gpu_gets_a_host_copy_only_in_free_host_pages():
    h = Harness(device=2, host=2, disk=16)
    tree = h.ctrl.tree
    h.run(seq(1, 2))  # GPU, host and disk
    first = tree.match_prefix(seq(1, 2), touch=False).last_node
    h.ctrl.eviction.evict(HOST, 2)
    assert first.on_device and first.on_disk and not first.on_host
    h.run(seq(2, 2))  # its backup takes the 2 free host pages; its GPU pages push seq 1 off the GPU
    second = tree.match_prefix(seq(2, 2), touch=False).last_node
    assert not first.on_device and not first.on_host and first.on_disk  # no host room made for seq 1's copy
    assert second.on_host and h.ctrl.stats.eviction_backups == 0 and not h.ctrl.stats.drops
    assert h.run(seq(1, 2)) == {DISK: 2}
    h.check_all_bytes()
    h.ctrl.check_integrity()
    # with free host pages the copy is made (GPU -> host write-back: copies are made as pages leave the GPU)
    h = Harness(device=2, host=4, disk=16, policy=mechanics(device_to_host="write_back",
                                                               host_to_disk="write_through"))
    h.run(seq(1, 2))
    first = h.ctrl.tree.match_prefix(seq(1, 2), touch=False).last_node
    h.ctrl.eviction.evict(DEVICE, 2)  # not on disk yet: copied to host, and from there written through
    h.ctrl.poll()
    assert first.on_host and first.on_disk and h.ctrl.stats.eviction_backups == 2
    assert h.run(seq(1, 2)) == {HOST: 2}
    h.ctrl.eviction.evict(HOST, 2)
    assert first.on_device and first.on_disk and not first.on_host
    h.ctrl.eviction.evict(DEVICE, 2)  # on disk, and 4 free host pages: copied
    assert first.on_host and h.ctrl.stats.eviction_backups == 4
    assert h.run(seq(1, 2)) == {HOST: 2}
    h.check_all_bytes()
    h.ctrl.check_integrity()


def test_a_prefix_loading_from_host_keeps_its_host_copy_while_its_disk_part_finds_room():
    # the prefix is 2 pages in host memory, then 2 on disk only; the host's other pages are pinned. The disk read's
    # landing pages must not come from the first part's host copy, whose copy to the GPU has not started yet
    h = Harness(device=8, host=4, disk=16)
    tree = h.ctrl.tree
    h.run(seq(1, 4))
    h.ctrl.eviction.evict(DEVICE, 8)
    h.ctrl.eviction.evict(HOST, 2)  # the last 2 pages leave host memory
    h.run(seq(2, 2))
    other = tree.match_prefix(seq(2, 2), touch=False).last_node
    tree.pin(other)  # an L3 write reading them, say
    ticket = h.ctrl.acquire(seq(1, 4), max_pages=4)
    assert h.ctrl.wait_ticket(ticket) and not ticket.failed
    assert ticket.num_pages == 2 and h.ctrl.stats.drops["host_full_on_load"] == 2
    for i, p in enumerate(ticket.device_pages()):
        assert torch.all(h.dev.kv[:, :, p] == page_value(tuple(seq(1, 4)), i))
    h.ctrl.release(ticket)
    tree.unpin(other)
    h.check_all_bytes()
    h.ctrl.check_integrity()


def test_a_write_back_in_parts_still_frees_the_host_pages_asked_for():
    # host -> disk write-back, a 4-page L3 queue: evicting a 6-page node writes it in parts (4 + 2), splitting it;
    # the eviction must go on to the upper part rather than count the whole node as freed
    policy = mechanics(device_to_host="write_through", host_to_disk="write_back")
    h = Harness(device=8, host=6, disk=32, policy=policy,
                worker=lambda store: L3Worker(store, synchronous=True, queue_pages=4))
    h.run(seq(1, 6))
    pages = h.ctrl.eviction.allocate(HOST, 6)
    assert pages is not None and len(pages) == 6
    h.host.free(pages)
    h.ctrl.poll()
    assert h.ctrl.tree.pages_in == [6, 0, 6] and h.ctrl.stats.evictions[HOST] == 6
    h.ctrl.eviction.evict(DEVICE, 8)  # (into free host pages: it is on disk, and the host has room)
    h.ctrl.eviction.evict(HOST, 6)
    assert h.run(seq(1, 6)) == {DISK: 6}  # both parts came back from disk, bytes checked
    h.check_all_bytes()


class HeldLoadCopier(PageCopier):
    """PageCopier whose host -> GPU loads stay 'in flight' until `land()` (the bytes move at once)."""

    class Handle:
        def __init__(self):
            self.landed = False

        def done(self):
            return self.landed

        def wait(self):
            self.landed = True

    def __init__(self, *args):
        super().__init__(*args)
        self.loads = []

    def to_device(self, host_pages, device_pages):
        super().to_device(host_pages, device_pages)
        self.loads.append(self.Handle())
        return self.loads[-1]


def test_a_host_copy_a_load_still_reads_is_not_evicted():
    h = Harness(device=8, host=2, disk=0, copier=HeldLoadCopier)
    h.run(seq(1, 2))
    first = h.ctrl.tree.match_prefix(seq(1, 2), touch=False).last_node
    h.ctrl.eviction.evict(DEVICE, 8)  # seq 1 now in host memory only
    assert not first.on_device and first.on_host
    ticket = h.ctrl.acquire(seq(1, 2), max_pages=2)  # loads it back: the copy reads the host pages
    assert first.on_device and not ticket.ready()
    assert h.ctrl.eviction.allocate(HOST, 2) is None  # the only host pages are the ones the copy reads
    assert first.on_host
    h.copier.loads[-1].landed = True
    assert ticket.ready()
    room = h.ctrl.eviction.allocate(HOST, 2)  # landed: the spare host copy may go now
    assert room is not None and first.on_device and not first.on_host
    h.host.free(room)
    h.ctrl.release(ticket)
    h.ctrl.check_integrity()


class RefusingWorker(L3Worker):
    """A synchronous worker that refuses writes while `refuse` is set, and records each write's `before`."""

    def __init__(self, store):
        super().__init__(store, synchronous=True)
        self.refuse, self.befores = True, []

    def submit_write(self, token, keys, pages, before=None):
        if self.refuse:
            return False
        self.befores.append(before)
        return super().submit_write(token, keys, pages, before)


def test_a_later_disk_write_waits_for_the_host_copy_still_landing():
    """The commit-time L3 write is refused (queue full) and waits; it goes on a later step while the GPU -> host
    copy is in flight: the write must wait for that copy, or the L3 would checksum and store half-copied pages."""

    h = Harness(device=4, host=8, copier=SlowCopier, worker=RefusingWorker)
    h.run(seq(1, 2))
    worker, copier = h.ctrl.worker, h.copier
    assert not h.ctrl.stats.drops and h.ctrl.writes.waiting_disk_pages == 2
    assert copier.handles and not copier.handles[0].landed
    worker.refuse = False
    h.run(seq(1, 2))  # the next step: the waiting write goes
    assert len(worker.befores) == 1 and worker.befores[0] is not None
    assert ("host wait", copier.handles[0]) in copier.log  # the write waited for the copy before reading the pages
    copier.handles[0].landed = True
    node = h.ctrl.tree.match_prefix(seq(1, 2), touch=False).last_node
    assert node.on_disk and h.ctrl.writes._copy_in_flight(node) is None


def test_a_disk_write_of_a_node_gone_from_the_gpu_still_waits_for_its_host_copy():
    """Freeing GPU pages only makes the GPU wait for their copy to host: the host pages may still be filling when
    the node, now on host only, is written to disk on a hit."""

    h = Harness(device=4, host=8, copier=SlowCopier, worker=RefusingWorker)
    h.run(seq(1, 2))  # GPU + host (copy in flight), the disk write refused
    h.run(seq(2, 3))  # evicts seq 1 from the GPU: its copy is still "in flight"
    node = h.ctrl.tree.match_prefix(seq(1, 2), touch=False).last_node
    assert not node.on_device and node.on_host and not h.copier.handles[0].landed
    h.ctrl.worker.refuse = False
    h.ctrl.poll()  # the waiting write goes
    h.ctrl.poll()  # and its completion is applied
    assert node.on_disk and h.ctrl.writes.waiting_disk_pages == 0
    # both parts of seq 1 (split by the GPU eviction) waited for their copy; seq 2's write came after them
    assert len(h.ctrl.worker.befores) == 3 and all(b is not None for b in h.ctrl.worker.befores[:2])
    assert ("host wait", h.copier.handles[0]) in h.copier.log


def test_host_pages_a_copy_still_lands_in_are_freed_once_it_has_landed_without_waiting():
    h = Harness(device=4, host=6, disk=0, copier=SlowCopier)
    ev, fills = h.ctrl.eviction, h.ctrl.transfers.host_fills
    pages = ev.allocate(HOST, 4)
    landing = SlowCopier.Handle(h.copier.log)
    fills.update({pages[0]: landing, pages[1]: landing})
    ev.free_host_pages(pages)
    assert h.host.allocator.free_pages == 4 and ev.landing_host_pages() == pages[:2]  # two wait for the copy
    assert h.copier.log == []  # the engine thread did not wait
    h.ctrl.poll()
    assert h.host.allocator.free_pages == 4
    landing.landed = True
    h.ctrl.poll()
    assert h.host.allocator.free_pages == 6 and ev.landing == [] and h.copier.log == []
    h.ctrl.check_integrity()


def test_with_no_other_room_the_host_tier_waits_for_the_landing_copy(monkeypatch):
    import controller.eviction

    clock = iter([10.0, 10.25])  # the wait is timed: a quarter of a second here
    monkeypatch.setattr(controller.eviction, "_clock", lambda: next(clock))
    h = Harness(device=4, host=2, disk=0, copier=SlowCopier)
    ev = h.ctrl.eviction
    pages = ev.allocate(HOST, 2)
    landing = SlowCopier.Handle(h.copier.log)
    h.ctrl.transfers.host_fills.update(dict.fromkeys(pages, landing))
    ev.free_host_pages(pages)
    assert ev.allocate(HOST, 2) is not None and h.copier.log == [("host wait", landing)]
    assert h.ctrl.stats.host_free_wait_s == 0.25 and h.ctrl.stats.snapshot()["host_free_wait_s"] == 0.25


def test_an_allocation_waits_for_the_oldest_landing_copies_only_until_it_has_room():
    """Copies land in the order they were queued (after the forward that computes their pages): the newest may wait
    for the GPU to finish a forward, so an allocation waits for the oldest only, as many as it needs; a best-effort
    one (a prefetch) waits for none."""
    h = Harness(device=4, host=4, disk=0, copier=SlowCopier)
    ev = h.ctrl.eviction
    old, new = ev.allocate(HOST, 2), ev.allocate(HOST, 2)
    first, second = SlowCopier.Handle(h.copier.log), SlowCopier.Handle(h.copier.log)
    h.ctrl.transfers.host_fills.update({**dict.fromkeys(old, first), **dict.fromkeys(new, second)})
    ev.free_host_pages(old)
    ev.free_host_pages(new)
    assert ev.allocate(HOST, 2, wait=False) is None and h.copier.log == []
    got = ev.allocate(HOST, 2)
    assert sorted(got) == sorted(old) and h.copier.log == [("host wait", first)]
    assert ev.landing_host_pages() == new  # the newest copy is still landing, not waited for
    h.host.free(got)
    h.ctrl.check_integrity()


def test_host_eviction_passes_over_a_backup_still_landing():
    """A node whose GPU -> host copy has not landed is no room: evicting it would make the next allocation wait for
    that copy (and so for the forward before it) to drop one new page for another. Older host copies go instead;
    with none left the allocation is refused rather than waiting."""
    h = Harness(device=8, host=4, disk=0, copier=SlowCopier)
    h.run(seq(1, 2))  # backed up: its copy has not landed
    older = h.ctrl.tree.match_prefix(seq(1, 2), touch=False).last_node
    h.copier.handles[-1].landed = True
    h.run(seq(2, 2))
    newer = h.ctrl.tree.match_prefix(seq(2, 2), touch=False).last_node
    assert older.on_host and newer.on_host and not h.copier.handles[-1].done()
    got = h.ctrl.eviction.allocate(HOST, 2)
    assert got is not None and not older.on_host and newer.on_host and h.copier.log == []
    h.ctrl.eviction.free_host_pages(got)
    assert h.ctrl.eviction.allocate(HOST, 4) is None and newer.on_host and h.copier.log == []
    h.copier.handles[-1].landed = True
    got = h.ctrl.eviction.allocate(HOST, 4)
    assert got is not None and not newer.on_host
    h.host.free(got)
    h.ctrl.check_integrity()


class GatedL3(MemoryL3):
    """MemoryL3 whose writes wait for `gate`: an L3 write stays in flight as long as a test needs."""

    def __init__(self, *args):
        super().__init__(*args)
        self.gate = threading.Event()

    def write_pages(self, keys, pages):
        assert self.gate.wait(10), "test never opened the gate"
        return super().write_pages(keys, pages)


def test_l3_write_in_flight_holds_host_pages_not_gpu_pages():
    l3 = GatedL3(32, LAYOUT.page_bytes)
    # an asynchronous worker: the write blocks on the gate
    h = Harness(device=4, host=4, l3=l3, worker=lambda store: L3Worker(store, threads=1))
    try:
        h.run(seq(1, 3))  # 3 pages on GPU and host, their L3 write in flight
        node = h.ctrl.tree.match_prefix(seq(1, 3), touch=False).last_node
        assert node.on_device and node.on_host and node.pin_ref == 1
        gpu = h.ctrl.alloc_device(4)  # needs the written pages' GPU copies: they may go
        assert gpu is not None and len(gpu) == 4 and not node.on_device
        assert h.ctrl.eviction.allocate(HOST, 4) is None  # but their host pages are what the write reads
        h.ctrl.free_device(gpu)
        h.check_all_bytes()
        l3.gate.set()
        assert h.ctrl.worker.wait_idle(10)
        h.ctrl.poll()
        assert node.pin_ref == 0 and l3.used_pages() == 3 and node.on_disk
        h.ctrl.check_integrity()
        assert h.run(seq(1, 3)) == {HOST: 3}
        h.check_all_bytes()
    finally:
        l3.gate.set()
        h.ctrl.close()


def test_a_full_host_tier_reports_what_holds_its_pages(caplog):
    l3 = GatedL3(32, LAYOUT.page_bytes)
    h = Harness(device=8, host=4, l3=l3, worker=lambda store: L3Worker(store, threads=1))
    try:
        h.run(seq(1, 3))  # 3 host pages an L3 write in flight reads, 1 free
        census = h.ctrl.eviction.host_census()
        assert {k: v for k, v in census.items() if v} == {"free": 1, "writing": 3}
        with caplog.at_level("WARNING", logger="controller.writes"):
            h.run(seq(2, 2))  # its 2 new pages find no host room
        assert h.ctrl.stats.drops["host_full"] == 2
        (report,) = [r.getMessage() for r in caplog.records if "host tier full" in r.getMessage()]
        assert "copy of 2 pages" in report and "free 1, writing 3" in report
        with caplog.at_level("WARNING", logger="controller.writes"):
            h.run(seq(3, 2))  # refused again: counted, not reported again so soon
        assert h.ctrl.stats.drops["host_full"] == 4
        assert sum("host tier full" in r.getMessage() for r in caplog.records) == 1
    finally:
        l3.gate.set()
        h.ctrl.close()


def test_an_ancestor_of_a_page_being_written_gives_its_host_copy_to_new_pages():
    l3 = GatedL3(32, LAYOUT.page_bytes)
    h = Harness(device=5, host=6, l3=l3, worker=lambda store: L3Worker(store, threads=1))
    try:
        l3.gate.set()
        h.run(seq(1, 4))  # a 4-page prefix in host memory and on disk
        assert h.ctrl.worker.wait_idle(10)
        h.ctrl.poll()
        l3.gate.clear()
        h.run(seq(1, 5))  # one more page below it, its L3 write in flight: it holds its own host page
        tree = h.ctrl.tree
        child = tree.match_prefix(seq(1, 5), touch=False).last_node
        assert child.pin_ref == 1 and child.parent.on_disk and child.parent.tier_children == [1, 1, 0]
        # 3 new pages, 1 host page free: the only room is the prefix's host copy above the pinned page
        # (its bytes are on disk), taken from its last pages
        h.run(seq(2, 3))
        assert h.ctrl.stats.drops["host_full"] == 0
        assert child.on_host and tree.own_pins(child.parent) == 0
        h.check_all_bytes()
        l3.gate.set()
        assert h.ctrl.worker.wait_idle(10)
        h.ctrl.poll()
        hits = h.run(seq(1, 5))  # the prefix comes back from host and disk, the page below it from host
        assert sum(hits.values()) == 5 and hits.get(DISK, 0) >= 2 and hits.get(HOST, 0) >= 1
        h.check_all_bytes()
    finally:
        l3.gate.set()
        h.ctrl.close()


def test_write_through_selective_waits_for_hits():
    h = Harness(device=8, host=8, disk=16, policy=mechanics("write_through_selective", "write_through", 2))
    h.run(seq(1, 2))
    assert h.host.used_pages() == 0
    h.run(seq(1, 2))  # first hit
    assert h.host.used_pages() == 0
    h.run(seq(1, 2))  # second hit: backed up to host, then write-through to disk
    assert h.host.used_pages() == 2 and h.l3.used_pages() == 2


def test_probe_finds_pages_after_restart():
    l3 = MemoryL3(32, LAYOUT.page_bytes)
    h = Harness(device=4, host=8, l3=l3)
    h.run(seq(7, 3))
    assert l3.used_pages() == 3
    fresh = Harness(device=4, host=8, l3=l3)  # a new process: empty tree, same store
    assert fresh.run(seq(7, 3)) == {DISK: 3}
    assert fresh.ctrl.stats.pages_promoted[(DISK, HOST)] == 3
    fresh.check_all_bytes()


def test_failed_l3_read_is_a_miss_and_pages_are_dropped():
    l3 = MemoryL3(32, LAYOUT.page_bytes)
    Harness(device=4, host=8, l3=l3).run(seq(7, 3))
    fresh = Harness(device=4, host=8, l3=l3)
    l3.corrupt = set(list(l3.data)[1:2])  # the second page fails verification
    ticket = fresh.ctrl.acquire(seq(7, 3), max_pages=3)
    fresh.ctrl.wait_ticket(ticket)
    assert ticket.failed
    fresh.ctrl.release(ticket)
    fresh.ctrl.check_integrity()
    assert fresh.ctrl.stats.load_failures == 1
    assert fresh.ctrl.tree.pages_in == [0, 0, 0] and fresh.dev.used_pages() == 0 and fresh.host.used_pages() == 0
    # retry: the bad page is gone; what precedes it still... was in the same node, so recompute all
    assert fresh.run(seq(7, 3)) == {}
    fresh.check_all_bytes()


def on_disk_only(l3: MemoryL3, tokens: list[int], **sizes) -> Harness:
    """A restarted controller (empty tree) over an L3 store that already holds tokens' pages."""
    Harness(l3=l3, **sizes).run(tokens)
    return Harness(l3=l3, **sizes)


def test_prefetch_reads_disk_pages_into_host_and_holds_them():
    l3 = MemoryL3(32, LAYOUT.page_bytes)
    h = on_disk_only(l3, seq(7, 3), device=4, host=8)
    hold = h.ctrl.prefetch(seq(7, 3), max_pages=3)
    assert hold.started == 3 and hold.pages == 3
    h.ctrl.poll()
    node = h.ctrl.tree.match_prefix(seq(7, 3), touch=False).last_node
    assert not node.on_device and node.on_host and node.pin_ref == 1
    assert h.dev.used_pages() == 0 and h.host.used_pages() == 3 and h.ctrl.stats.prefetched_pages == 3
    assert h.ctrl.tree.pop_evictable(HOST) is None  # held for the queued request
    again = h.ctrl.prefetch(seq(7, 3), max_pages=3)  # a second queued request: no new read, held twice
    assert again.started == 0 and again.pages == 3 and node.pin_ref == 2
    h.ctrl.check_integrity()
    h.check_all_bytes()
    h.ctrl.release_prefetch(again)
    h.ctrl.release_prefetch(hold)
    assert node.pin_ref == 0 and h.ctrl.loads.prefetching == 0
    assert h.run(seq(7, 3)) == {DISK: 3}  # the bytes came from L3: a disk hit, loaded from host
    assert h.ctrl.stats.pages_promoted[(DISK, HOST)] == 3 and h.ctrl.stats.pages_promoted[(HOST, DEVICE)] == 3
    assert h.run(seq(7, 3)) == {DEVICE: 3}
    h.check_all_bytes()


def test_prefetch_respects_max_pages_and_half_the_host_pool():
    l3 = MemoryL3(32, LAYOUT.page_bytes)
    h = on_disk_only(l3, seq(7, 3), device=4, host=4)
    never = h.ctrl.prefetch(seq(7, 3))
    assert never.pages == 2 and never.short  # the 2 pages half of a 4-page host pool holds; the third waits
    h = on_disk_only(l3, seq(8, 2), device=4, host=8)  # seq 7 and seq 8 on disk
    assert h.ctrl.prefetch(seq(7, 3), max_pages=0).pages == 0
    assert h.host.used_pages() == 0
    first = h.ctrl.prefetch(seq(7, 3))
    second = h.ctrl.prefetch(seq(8, 2))
    assert first.pages == 3 and second.pages == 1 and second.short  # 3 of 4 read: room for 1 more page
    h.ctrl.release_prefetch(first)
    h.ctrl.release_prefetch(second)
    h.ctrl.poll()
    third = h.ctrl.prefetch(seq(8, 2))  # its first page is in host memory now: the second is read
    assert third.started == 1 and third.pages == 2 and not third.short
    off = Harness(device=4, host=8, l3=l3, prefetch=False)
    assert off.ctrl.prefetch(seq(7, 3)).pages == 0


def test_a_short_prefetch_goes_on_where_it_stopped_once_room_is_freed():
    l3 = MemoryL3(32, LAYOUT.page_bytes)
    h = on_disk_only(l3, seq(8, 2), device=4, host=8)
    Harness(l3=l3, device=4, host=8).run(seq(7, 3))  # seq 7 and seq 8 on disk; h's tree has only seq 8
    first = h.ctrl.prefetch(seq(7, 3))
    assert first.started == 3 and not first.short
    second = h.ctrl.prefetch(seq(8, 2))  # 3 of the 4 pages the half-pool allows are held: it reads 1
    assert second.pages == 1 and second.short
    assert h.ctrl.prefetch(seq(8, 2), hold=second) is second and second.short  # still no room
    matches = []
    h.ctrl.lookup.match = lambda tokens, base=None, reference=True, real=h.ctrl.lookup.match: (
        matches.append(1) or real(tokens, base, reference))
    assert h.ctrl.prefetch(seq(8, 2), hold=second) is second and second.short
    assert not matches  # nothing gave host room back since it stopped: not even matched again
    h.ctrl.release_prefetch(first)
    h.ctrl.poll()  # its reads land: until then they hold their host pages (Loads.staged_pages)
    assert h.ctrl.prefetch(seq(8, 2), hold=second) is second
    assert not second.short and second.started == 2 and second.pages == 2 and h.ctrl.loads.prefetching == 2
    assert matches == [1]
    again = h.ctrl.prefetch(seq(8, 2), hold=second)  # nothing left to take: no further pin, no second read
    assert again.started == 2 and [node.pin_ref for node, _ in again.pins] == [2, 1]  # pins count along the path
    assert h.ctrl.stats.prefetched_pages == 5
    h.ctrl.poll()
    h.ctrl.release_prefetch(second)
    assert h.ctrl.loads.prefetching == 0
    h.ctrl.check_integrity()
    assert h.run(seq(8, 2)) == {DISK: 2}
    h.check_all_bytes()


def test_a_queued_request_asking_again_counts_no_hit_and_reads_what_left_memory_since():
    """A recheck (a hold that is not short, passed back) keeps the prefix recent but is no new use of it: LFU
    eviction and hit-counting write policies see one hit per request, not one per look of a queued one. Pages
    that went to disk only since it first asked are read then."""
    h = Harness(device=4, host=8)
    h.run(seq(7, 3))  # on the GPU, in host memory and in the L3 (eager write-through)
    nodes = h.ctrl.tree.match_prefix(seq(7, 3), touch=False).nodes
    hold = h.ctrl.prefetch(seq(7, 3), max_pages=3)
    assert hold.started == 0 and hold.pages == 0 and not hold.short  # all in memory: nothing to read
    hits, clock = [n.hit_count for n in nodes], h.ctrl.tree._clock
    assert h.ctrl.prefetch(seq(7, 3), max_pages=3, hold=hold) is hold
    assert [n.hit_count for n in nodes] == hits and hold.started == 0  # no hit, no read
    assert all(n.last_access > clock for n in nodes)  # but recent: the request still waits for it
    assert h.ctrl.eviction.evict(DEVICE, 3) == 3 and h.ctrl.eviction.evict(HOST, 3) == 3
    assert all(n.on_disk and not n.on_host and not n.on_device for n in nodes)
    assert h.ctrl.prefetch(seq(7, 3), max_pages=3, hold=hold) is hold
    assert hold.started == 3 and hold.pages == 3 and [n.hit_count for n in nodes] == hits
    h.ctrl.poll()
    h.ctrl.release_prefetch(hold)
    assert h.run(seq(7, 3)) == {DISK: 3}
    assert [n.hit_count for n in h.ctrl.tree.match_prefix(seq(7, 3), touch=False).nodes] == [hits[0] + 1]
    h.ctrl.check_integrity()
    h.check_all_bytes()


def test_request_claims_a_prefetch_in_flight_without_a_second_read():
    l3 = MemoryL3(32, LAYOUT.page_bytes)
    Harness(device=4, host=8, l3=l3).run(seq(7, 3))
    gate, reads = threading.Event(), []
    real = l3.read_pages

    def held_read(keys, out):
        reads.append(len(keys))
        assert gate.wait(10)
        return real(keys, out)

    l3.read_pages = held_read
    h = Harness(device=4, host=8, l3=l3, worker=lambda store: L3Worker(store, threads=2))
    try:
        hold = h.ctrl.prefetch(seq(7, 3), max_pages=3)
        assert hold.started == 3
        ticket = h.ctrl.acquire(seq(7, 3), max_pages=3)
        h.ctrl.release_prefetch(hold)
        assert ticket.num_pages == 3 and not ticket.ready() and ticket.hit_pages == {DISK: 3}
        node = ticket.node
        assert node.on_device and node.pin_ref == 0 and node.lock_ref == 1
        h.ctrl.check_integrity()
        gate.set()
        assert h.ctrl.wait_ticket(ticket, timeout=10) and not ticket.failed
        assert reads == [3]  # the request rode on the prefetch's read
        for i, p in enumerate(ticket.device_pages()):
            assert torch.all(h.dev.kv[:, :, p] == page_value(tuple(seq(7, 3)), i))
        h.ctrl.release(ticket)
        assert node.on_host
        h.ctrl.check_integrity()
        h.check_all_bytes()
    finally:
        gate.set()
        h.ctrl.close()


def test_failed_prefetch_drops_the_pages_once_released():
    l3 = MemoryL3(32, LAYOUT.page_bytes)
    h = on_disk_only(l3, seq(7, 3), device=4, host=8)
    l3.corrupt = set(list(l3.data)[1:2])
    hold = h.ctrl.prefetch(seq(7, 3))
    assert hold.started == 3
    h.ctrl.poll()
    assert h.ctrl.stats.load_failures == 1 and h.host.used_pages() == 0
    h.ctrl.check_integrity()
    h.ctrl.release_prefetch(hold)
    assert h.ctrl.tree.pages_in == [0, 0, 0]
    h.ctrl.check_integrity()
    assert h.run(seq(7, 3)) == {}
    h.check_all_bytes()


def test_l3_write_failure_leaves_page_unindexed():
    h = Harness(device=2, host=2, disk=8)
    h.l3.fail_writes = True
    h.run(seq(1, 2))
    assert h.ctrl.stats.drops["l3_write_failed"] == 2 and h.ctrl.tree.pages_in[2] == 0


def test_a_write_the_full_queue_refuses_waits_and_is_dropped_only_if_it_leaves_host_first():
    class Stuck(L3Worker):
        def submit_write(self, *a, **k):
            return False

    dev = DevicePool(LAYOUT, 4, torch.float32, "cpu")
    host = HostPool(LAYOUT, 8, torch.float32)
    l3 = MemoryL3(8, LAYOUT.page_bytes)
    ctrl = TierController(RadixTree(2), dev, host, l3, PageCopier(dev, host), WritePolicy.eager(), None,
                          Stuck(l3, synchronous=True))
    t = ctrl.acquire(seq(1, 2), max_pages=2)
    pages = ctrl.alloc_device(2)
    ctrl.commit(t, seq(1, 2), pages)
    ctrl.release(t)
    assert not ctrl.stats.drops and ctrl.writes.waiting_disk_pages == 2 and ctrl.tree.pages_in == [2, 2, 0]
    ctrl.poll()  # the queue still refuses: the write keeps waiting
    assert not ctrl.stats.drops and ctrl.writes.waiting_disk_pages == 2
    assert ctrl.eviction.evict(HOST, 8) == 2  # the pages leave host memory before their turn came
    assert ctrl.stats.drops == {"l3_queue_full": 2} and ctrl.writes.waiting_disk_pages == 0
    assert ctrl.tree.pages_in == [2, 0, 0]
    ctrl.check_integrity()


def test_host_eviction_takes_pages_on_disk_before_pages_still_waiting_for_their_write():
    l3 = MemoryL3(16, LAYOUT.page_bytes)
    h = Harness(device=8, host=4, l3=l3, worker=lambda store: RefusingWorker(store))
    h.ctrl.worker.refuse = False
    h.run(seq(1, 2))  # written: on disk and in host memory
    h.ctrl.worker.refuse = True
    h.run(seq(2, 2))  # the queue refuses their write: they wait in host memory
    assert h.run(seq(1, 2)) == {DEVICE: 2}  # used again: the waiting pages are now the least recently used
    waiting = h.ctrl.tree.match_prefix(seq(2, 2), touch=False).last_node
    assert h.ctrl.writes.waiting_disk_pages == 2 and not waiting.on_disk
    assert h.ctrl.eviction.evict(HOST, 2) == 2  # yet the pages on disk go first
    assert waiting.on_host and not h.ctrl.stats.drops
    assert h.ctrl.eviction.evict(HOST, 2) == 2  # nothing else left: the waiting pages go, counted
    assert h.ctrl.stats.drops == {"l3_queue_full": 2}
    h.ctrl.check_integrity()
    h.ctrl.close()


def test_waiting_writes_go_to_disk_in_order_once_the_queue_drains():
    gated = GatedL3(64, LAYOUT.page_bytes)
    h = Harness(device=16, host=16, l3=gated, worker=lambda store: L3Worker(store, threads=1, queue_pages=4))
    try:
        h.run(seq(1, 4))  # fills the queue; the writer thread blocks in the store
        h.run(seq(2, 6))  # waits: 4 + 2 parts
        h.run(seq(3, 2))  # waits behind it
        assert h.ctrl.writes.waiting_disk_pages == 8 and not h.ctrl.stats.drops
        assert h.ctrl.report()["cache"]["l3_write_waiting_pages"] == 8
        # a split of a waiting node (a match of its first pages) leaves both parts waiting
        h.ctrl.tree.split(h.ctrl.tree.match_prefix(seq(2, 6), touch=False).last_node, 1)
        assert h.ctrl.writes.waiting_disk_pages == 8
        gated.gate.set()
        for _ in range(50):
            assert h.ctrl.worker.wait_idle(10)
            h.ctrl.poll()
            if not h.ctrl.writes.waiting_disk:
                break
        assert h.ctrl.worker.wait_idle(10)
        h.ctrl.poll()  # the last writes' completions
        assert h.ctrl.tree.pages_in[2] == 12 and not h.ctrl.stats.drops
        assert h.ctrl.writes.waiting_disk_pages == 0
        h.ctrl.check_integrity()
    finally:
        gated.gate.set()
        h.ctrl.close()
    restarted = Harness(device=16, host=16, l3=gated)
    for base, pages in ((1, 4), (2, 6), (3, 2)):
        assert restarted.run(seq(base, pages)) == {DISK: pages}
    restarted.check_all_bytes()


def test_refused_l3_write_evicts_nothing_from_the_disk():
    """A write the full queue refuses must not first evict the disk's pages to make room for itself."""

    class Busy(L3Worker):
        full = False

        @property
        def queued_write_pages(self) -> int:
            return self.queue_pages if self.full else super().queued_write_pages

    dev = DevicePool(LAYOUT, 4, torch.float32, "cpu")
    host = HostPool(LAYOUT, 8, torch.float32)
    l3 = MemoryL3(2, LAYOUT.page_bytes)
    worker = Busy(l3, synchronous=True)
    ctrl = TierController(RadixTree(2), dev, host, l3, PageCopier(dev, host), WritePolicy.eager(), None, worker)
    for first in (1, 2):
        t = ctrl.acquire(seq(first, 2), max_pages=2)
        ctrl.commit(t, seq(first, 2), ctrl.alloc_device(2))
        ctrl.release(t)
        ctrl.poll()
        worker.full = True  # the first write went to disk; the queue refuses the second
    assert ctrl.writes.waiting_disk_pages == 2 and ctrl.stats.evictions[DISK] == 0
    assert ctrl.tree.pages_in == [4, 4, 2]  # the first request's pages are still on disk
    ctrl.check_integrity()


def test_cost_model_recomputes_slow_disk_pages():
    slow_disk = CostModel(LAYOUT.page_size, LAYOUT.page_bytes, "auto", prefill_tokens_per_s=1e6,
                          host_to_device_bytes_per_s=1e12, disk_to_device_bytes_per_s=1.0)
    assert slow_disk.pages_to_load([(DEVICE, 2), (HOST, 3), (DISK, 4)]) == 5
    fast_disk = CostModel(LAYOUT.page_size, LAYOUT.page_bytes, "auto", 1e6, 1e12, 1e12)
    assert fast_disk.pages_to_load([(DEVICE, 2), (HOST, 3), (DISK, 4)]) == 9
    assert CostModel(2, 64, "never").pages_to_load([(DEVICE, 2), (HOST, 3)]) == 2
    assert CostModel(2, 64, "always", 1e6, 1.0, 1.0).pages_to_load([(HOST, 3), (DISK, 1)]) == 4
    # written although the planner would not load them alone (eager: every page; under load prefetch reads them)
    h = Harness(device=3, host=6, disk=32, cost=slow_disk, policy=WritePolicy.eager())
    h.run(seq(1, 2))
    for b in (2, 3, 4, 5):
        h.run(seq(b, 3))
    assert h.ctrl.tree.match_prefix(seq(1, 2), touch=False).disk_pages == 2
    assert h.run(seq(1, 2)) == {}  # dearer to load than to recompute
    assert h.ctrl.stats.recomputed_tokens == 4


def test_disk_capacity_is_a_hard_cap():
    h = Harness(device=2, host=2, disk=5)
    for b in range(8):
        h.run(seq(b, 2))
        assert h.ctrl.tree.pages_in[2] <= 5
    assert h.ctrl.stats.evictions[DISK] > 0


def test_disk_needs_host():
    dev = DevicePool(LAYOUT, 2, torch.float32, "cpu")
    with pytest.raises(ValueError, match="needs a host tier"):
        TierController(RadixTree(2), dev, None, MemoryL3(4, 64))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4), st.integers(0, 3), st.booleans()),
                 min_size=1, max_size=25),
    sizes=st.sampled_from([(3, 5, 9), (4, 8, 0), (6, 0, 0), (64, 64, 64), (3, 3, 4)]),
    policy=st.sampled_from([
        WritePolicy.eager(), mechanics("write_back", "write_back"),
        mechanics("write_through_selective", "write_through_selective", 1),
        mechanics("write_through", "write_back"),
        mechanics("write_through", "write_through", defer_above_free=0.5),
        mechanics("write_through", "write_back", defer_above_free=0.0),
    ]),
)
# a host eviction writes its node back; room on the disk must not come from the node's disk-only parent (evicting
# it took the node, its prefix gone, out of the tree in the middle of its write)
@example(ops=[(1, 1, 0, False), (2, 1, 0, False), (0, 1, 0, False), (4, 2, 0, False), (2, 2, 0, False),
              (1, 1, 0, False), (4, 2, 0, True), (0, 1, 0, False)],
         sizes=(3, 3, 4), policy=mechanics("write_back", "write_back"))
def test_property_against_reference(ops, sizes, policy):
    """Random requests (shared prefixes via a small base alphabet, branching suffixes) against a
    reference of what was ever computed: hits are only ever of committed prefixes, with unlimited
    capacity every committed prefix hits in full, bytes are always right, integrity always holds."""
    device, host, disk = sizes
    h = Harness(device=device, host=host, disk=disk, policy=policy)
    committed: set[tuple[int, ...]] = set()
    ps = LAYOUT.page_size
    for base, pages, branch, prefetch in ops:
        pages = min(pages, device - 1)
        tokens = [base * 100 + i for i in range(pages * ps)] + [branch]  # branch only affects the partial page
        if pages >= 2 and branch % 2:
            tokens[ps + 1] = 7777 + branch  # a different second page: a branch in the tree
        hold = None
        if prefetch:  # as for a queued request: its disk-only pages go to host first, held until admission
            hold = h.ctrl.prefetch(tokens, max_pages=pages)
            h.ctrl.check_integrity()
            h.ctrl.poll()
            h.ctrl.release_prefetch(hold)
        hits = h.run(tokens)
        hit_pages = sum(hits.values())
        assert hit_pages == 0 or tuple(tokens[: hit_pages * ps]) in committed
        if device >= 64:
            longest = max((k for k in range(1, (len(tokens) - 1) // ps + 1)
                           if tuple(tokens[: k * ps]) in committed), default=0)
            assert hit_pages == longest and set(hits) <= {DEVICE}
        for k in range(1, len(tokens) // ps + 1):
            committed.add(tuple(tokens[: k * ps]))
        h.check_all_bytes()
    h.ctrl.close()
    h.ctrl.check_integrity()


def test_a_host_prefix_of_several_nodes_loads_in_one_copier_call():
    h = Harness(device=8, host=16, disk=0)
    h.run(seq(1, 2))
    h.run(seq(1, 2)[:-1] + [7] * 2 * LAYOUT.page_size + [8])  # branches after page 2: seq 1 splits into nodes
    h.run(seq(1, 2)[:-1] + [9] * 2 * LAYOUT.page_size + [8])
    h.run(seq(2, 8))  # all of the above off the GPU (8 pages), kept on host
    calls = []
    original = h.ctrl.copier.to_device
    h.ctrl.copier.to_device = lambda host, dev: calls.append((list(host), list(dev))) or original(host, dev)
    assert h.run(seq(1, 2)[:-1] + [7] * 2 * LAYOUT.page_size + [8]) == {HOST: 4}
    assert len(calls) == 1 and len(calls[0][0]) == 4  # two nodes (2 + 2 pages), one call
    h.check_all_bytes()


def test_a_host_prefix_of_several_nodes_gets_its_gpu_pages_in_one_eviction_pass():
    h = Harness(device=8, host=32, disk=0)
    h.run(seq(1, 2))
    h.run(seq(1, 2)[:-1] + [7] * 2 * LAYOUT.page_size + [8])  # seq 1's node splits: the prefix is two nodes
    h.run(seq(2, 8))  # the GPU is full of seq 2; seq 1's pages are on host only
    assert h.dev.allocator.free_pages == 0
    passes = []
    original = h.ctrl.eviction.evict
    h.ctrl.eviction.evict = lambda tier, need, *rest: passes.append((tier, need)) or original(tier, need, *rest)
    assert h.run(seq(1, 2)[:-1] + [7] * 2 * LAYOUT.page_size + [8]) == {HOST: 4}
    assert passes == [(DEVICE, 4)]  # both nodes' pages at once (per node: two passes of 2)
    h.check_all_bytes()


class CountingL3(MemoryL3):
    """MemoryL3 that counts the pages it was asked to read."""

    def __init__(self, *args):
        super().__init__(*args)
        self.pages_read = 0

    def read_pages(self, keys, out):
        self.pages_read += len(keys)
        return super().read_pages(keys, out)


class ProbedL3(MemoryL3):
    """MemoryL3 that counts `contains` calls (the lookup's probes past the tree's match)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.probes = 0

    def contains(self, keys):
        self.probes += 1
        return super().contains(keys)


class SharedProbedL3(ProbedL3):
    """The same, written by other servers too (a remote tier behind it)."""

    def shared_pages(self, keys):
        return 0


def test_a_page_the_store_lacks_is_asked_for_once_a_while_unless_others_write_the_store():
    """A queued request's prompt is matched again and again; past its cached prefix the store is asked once, and
    again once MISS_TTL_S has passed. A store other servers write is asked every time. A page the store holds
    (written before a restart) is found on the first probe either way."""
    from controller.lookup import MISS_TTL_S

    for cls, asks in ((ProbedL3, [1, 1, 2]), (SharedProbedL3, [1, 2, 3])):
        l3 = cls(32, LAYOUT.page_bytes)
        Harness(l3=l3, device=4, host=8).run(seq(7, 2))  # pages 0-1 of seq 7 on the store
        h = Harness(l3=l3, device=4, host=8)  # a restart: the tree is empty
        l3.probes = 0
        got = []
        for t in (0.0, 0.5, MISS_TTL_S + 0.1):
            h.ctrl.lookup.clock = lambda t=t: t
            got.append(h.ctrl.match(seq(9, 3)).num_pages)  # nothing of seq 9 anywhere
            assert l3.probes == asks[len(got) - 1], cls.__name__
        assert got == [0, 0, 0]
        assert h.ctrl.match(seq(7, 3)).disk_pages == 2  # found on the store, then in the tree


class ListedL3(ProbedL3):
    """The same, listing its keys (as the L3 store does): a lookup built on it reads them once."""

    def keys(self):
        return list(self.data)


def test_a_private_store_is_asked_only_about_pages_it_held_at_startup():
    """Only this tree writes a private store, so a page neither in the tree nor among the keys the store held when
    the lookup was built is missing without a call; a page held at startup is found by a probe, once, then in the
    tree. A store whose key list falls short of its page count is asked as before."""
    l3 = ListedL3(32, LAYOUT.page_bytes)
    Harness(l3=l3, device=4, host=8).run(seq(7, 2))  # pages 0-1 of seq 7 on the store
    h = Harness(l3=l3, device=4, host=8)  # a restart
    l3.probes = 0
    assert h.ctrl.match(seq(9, 3)).num_pages == 0 and l3.probes == 0
    assert h.ctrl.match(seq(7, 3)).disk_pages == 2 and l3.probes == 2  # page 0, then pages 1-2 (a batch)
    assert h.ctrl.match(seq(7, 3)).disk_pages == 2 and l3.probes == 2  # the tree holds them now
    assert h.run(seq(7, 3)) == {DISK: 2}
    h.run(seq(8, 3))  # written through by this tree
    assert h.ctrl.match(seq(8, 4)).num_pages == 3 and l3.probes == 2
    short = ListedL3(32, LAYOUT.page_bytes)
    Harness(l3=short, device=4, host=8).run(seq(7, 2))
    short.keys = lambda: []  # type: ignore[method-assign]
    h = Harness(l3=short, device=4, host=8)
    short.probes = 0
    assert h.ctrl.match(seq(9, 3)).num_pages == 0 and short.probes == 1


def test_load_mode_never_reads_nothing_from_disk():
    """Neither a request's load nor a queued request's prefetch reads the disk in load mode "never"."""
    l3 = CountingL3(32, LAYOUT.page_bytes)
    Harness(l3=l3, device=4, host=8).run(seq(7, 3))
    never = CostModel(LAYOUT.page_size, LAYOUT.page_bytes, "never")
    h = Harness(l3=l3, device=4, host=8, cost=never)
    assert not h.ctrl.loads.prefetch_enabled
    hold = h.ctrl.prefetch(seq(7, 3), max_pages=3)
    assert hold.started == 0 and hold.pages == 0
    assert h.run(seq(7, 3)) == {}  # on disk, recomputed
    assert l3.pages_read == 0 and h.ctrl.stats.prefetched_pages == 0
    assert h.ctrl.stats.bytes_moved[(DISK, HOST)] == 0
    assert h.ctrl.stats.recomputed_tokens == 3 * LAYOUT.page_size
    always = Harness(l3=l3, device=4, host=8, cost=CostModel(LAYOUT.page_size, LAYOUT.page_bytes, "always"))
    assert always.run(seq(7, 3)) == {DISK: 3} and l3.pages_read == 3  # the same prefix, read when loads pay


def test_prefetch_reads_only_what_loading_from_host_would_use():
    """A host tier too slow to beat recomputing (the cost model's view) makes prefetching pointless: nothing is
    read; a fast one prefetches the whole prefix."""
    l3 = CountingL3(32, LAYOUT.page_bytes)
    Harness(l3=l3, device=4, host=8).run(seq(7, 3))
    page_s = LAYOUT.page_size / 1000.0  # 1000 tokens/s prefill: one page costs 2 ms to recompute
    slow_host = CostModel(LAYOUT.page_size, LAYOUT.page_bytes, "auto", 1000.0, LAYOUT.page_bytes / (10 * page_s))
    h = Harness(l3=l3, device=4, host=8, cost=slow_host)
    assert h.ctrl.prefetch(seq(7, 3), max_pages=3).started == 0 and l3.pages_read == 0
    fast_host = dataclasses.replace(slow_host, host_to_device_bytes_per_s=LAYOUT.page_bytes / (0.1 * page_s))
    h = Harness(l3=l3, device=4, host=8, cost=fast_host)
    assert h.ctrl.prefetch(seq(7, 3), max_pages=3).started == 3 and l3.pages_read == 3


def test_a_node_larger_than_the_write_queue_is_written_in_parts():
    l3 = MemoryL3(64, LAYOUT.page_bytes)
    h = Harness(device=16, host=16, l3=l3, worker=lambda store: L3Worker(store, queue_pages=4, synchronous=True))
    h.run(seq(1, 10))  # one 10-page node, write-through to disk: queue_pages 4 takes it as 4 + 4 + 2
    assert l3.used_pages() == 10 and h.ctrl.tree.pages_in[2] == 10
    assert not h.ctrl.stats.drops
    node = h.ctrl.tree.match_prefix(seq(1, 10), touch=False).last_node
    parts = []
    while node.parent is not None:
        parts.append(node.num_pages)
        node = node.parent
    assert parts[::-1] == [4, 4, 2]
    restarted = Harness(device=16, host=16, l3=l3)
    assert restarted.run(seq(1, 10)) == {DISK: 10}
    restarted.check_all_bytes()


def test_every_dropped_write_is_counted_with_its_reason():
    # the host tier is full of pinned pages (an L3 write reading them): a GPU -> host copy is refused
    h = Harness(device=8, host=2, disk=0)
    h.run(seq(1, 2))
    node = h.ctrl.tree.match_prefix(seq(1, 2), touch=False).last_node
    h.ctrl.tree.pin(node)
    h.run(seq(2, 2))
    assert h.ctrl.stats.drops == {"host_full": 2}
    h.ctrl.tree.unpin(node)
    # a disk tier smaller than the write: refused as disk_full
    h = Harness(device=8, host=8, l3=MemoryL3(2, LAYOUT.page_bytes))
    h.ctrl.eviction.disk_capacity = 2
    h.run(seq(3, 3))
    assert h.ctrl.stats.drops == {"disk_full": 3}
    # a write the store fails: l3_write_failed
    l3 = MemoryL3(16, LAYOUT.page_bytes)
    l3.fail_writes = True
    h = Harness(device=8, host=8, l3=l3)
    h.run(seq(4, 2))
    assert h.ctrl.stats.drops == {"l3_write_failed": 2}
    # the queue holds a write in flight: the next waits, parts and all, and is dropped as l3_queue_full when its
    # pages leave host memory before their turn
    gated = GatedL3(32, LAYOUT.page_bytes)
    h = Harness(device=16, host=16, l3=gated, worker=lambda store: L3Worker(store, threads=1, queue_pages=4))
    try:
        h.run(seq(5, 4))  # fills the queue
        h.run(seq(6, 6))  # 4 + 2 parts wait
        assert not h.ctrl.stats.drops
        h.ctrl.eviction.evict(HOST, 12)  # seq 5's pages are pinned by their write; seq 6's go
        assert h.ctrl.stats.drops == {"l3_queue_full": 6}
    finally:
        gated.gate.set()
        h.ctrl.close()
    assert h.ctrl.tree.pages_in[2] == 4


def test_disk_bandwidth_estimate_counts_concurrent_reads_once():
    """Reads in flight side by side share the disk's time: the estimate is bytes over the busy time, not the mean
    of each read's bytes over its own time (which would understate a disk serving 2 reads at once by half)."""
    cost = CostModel(LAYOUT.page_size, LAYOUT.page_bytes, "auto", 1000.0, 1e9)
    side_by_side, one_by_one = Harness(cost=cost), Harness(cost=cost)
    mb = 1_000_000
    for i in range(60):  # two 8 MB reads over the same second, then the next second
        side_by_side.ctrl.loads._observe_disk_read(8 * mb, 1.0, float(i + 1))
        side_by_side.ctrl.loads._observe_disk_read(8 * mb, 1.0, float(i + 1))
        one_by_one.ctrl.loads._observe_disk_read(8 * mb, 1.0, float(i + 1))  # one read a second
    assert side_by_side.ctrl.cost.disk_to_device_bytes_per_s == pytest.approx(16 * mb, rel=0.1)
    assert one_by_one.ctrl.cost.disk_to_device_bytes_per_s == pytest.approx(8 * mb, rel=0.01)
    fixed = Harness(cost=dataclasses.replace(cost, disk_to_device_bytes_per_s=5e6, adaptive=False))
    fixed.ctrl.loads._observe_disk_read(8 * mb, 1.0, 1.0)
    assert fixed.ctrl.cost.disk_to_device_bytes_per_s == 5e6  # configured, not measured: left alone


def test_writes_waiting_for_the_queue_leave_it_when_the_tree_removes_them_with_an_ancestor():
    """Six pages wait for a full L3 queue. Their prefix proves bad and is removed with its subtree: the waiting
    pages leave the count (they were counted as waiting long after, and held back host eviction), as dropped
    l3_queue_full, and the count still matches the waiting nodes."""
    gated = GatedL3(32, LAYOUT.page_bytes)
    h = Harness(device=16, host=16, l3=gated, worker=lambda store: L3Worker(store, threads=1, queue_pages=4))
    try:
        h.run(seq(5, 4))  # fills the queue
        h.run(seq(6, 6))  # waits for it
        assert h.ctrl.writes.waiting_disk_pages == 6 and not h.ctrl.stats.drops
        h.ctrl.check_integrity()
        top = h.ctrl.tree.match_prefix(seq(6, 6), touch=False).nodes[0]
        h.ctrl.transfers.mark_invalid(top)
        h.ctrl.eviction.remove_invalid()
        assert top.removed and h.ctrl.writes.waiting_disk_pages == 0
        assert h.ctrl.stats.drops == {"l3_queue_full": 6}
        h.ctrl.check_integrity()
    finally:
        gated.gate.set()
        h.ctrl.close()
    assert h.ctrl.tree.pages_in[2] == 4


class SharedReads(L3Worker):
    """An inline worker whose reads report that a write batch ran beside them (`shared`), each taking 1 s."""

    def __init__(self, store, shared: bool):
        super().__init__(store, synchronous=True)
        self.shared = shared

    def completions(self):
        return [dataclasses.replace(c, seconds=1.0, end=float(i + 1), shared=self.shared) if c.kind == "read" else c
                for i, c in enumerate(super().completions())]


def test_disk_bandwidth_estimate_leaves_out_reads_that_shared_the_disk_with_writes():
    """A read that a write batch ran beside measures the two sharing the disk: the estimate stays where the reads
    that had the disk to themselves put it."""
    l3 = CountingL3(32, LAYOUT.page_bytes)
    Harness(l3=l3, device=4, host=8).run(seq(7, 3))
    cost = CostModel(LAYOUT.page_size, LAYOUT.page_bytes, "always", 1000.0, 1e9, 5e6)
    estimates = {}
    for shared in (True, False):
        h = Harness(l3=l3, device=4, host=8, cost=cost, worker=lambda store, s=shared: SharedReads(store, s))
        assert h.run(seq(7, 3)) == {DISK: 3}
        estimates[shared] = h.ctrl.cost.disk_to_device_bytes_per_s
    assert estimates[True] == 5e6  # left out: the starting figure
    # one read of 3 pages in 1 s, folded into the starting figure's one second's worth, decayed over that second
    decay = 0.5 ** (1.0 / READ_ESTIMATE_HALF_LIFE_S)
    assert estimates[False] == pytest.approx((5e6 * decay + 3 * LAYOUT.page_bytes) / (decay + 1.0))


def test_disk_calibration_reads_real_pages_and_leaves_nothing_behind():
    from controller import calibrate

    l3 = CountingL3(64, LAYOUT.page_bytes)
    h = Harness(device=16, host=16, l3=l3)
    bw = calibrate.disk_to_device_bandwidth(l3, h.copier, h.dev, h.host, pages=8)
    assert bw is not None and bw > 0
    assert l3.pages_read == 3 * 8 and l3.used_pages() == 0  # best of three reads of 8 pages, scratch keys deleted
    assert h.dev.used_pages() == 0 and h.host.used_pages() == 0
    small = calibrate.disk_to_device_bandwidth(l3, h.copier, h.dev, h.host, pages=8, max_bytes=2 * LAYOUT.page_bytes)
    assert small is not None and l3.pages_read == 3 * 8 + 3 * 2  # capped by bytes


def test_disk_calibration_on_a_slow_store_writes_about_a_second_of_pages(monkeypatch):
    """A first page that takes 0.4 s to write: the batch shrinks to the 2 pages that take about a second, instead of
    the 8 asked for (a capped store would otherwise hold the server's start for minutes). No real time is spent."""
    from controller import calibrate

    class Clock:  # perf_counter advancing 0.4 s a call
        now = 0.0

        def perf_counter(self) -> float:
            self.now += 0.4
            return self.now

    monkeypatch.setattr(calibrate, "time", Clock())
    l3 = CountingL3(64, LAYOUT.page_bytes)
    h = Harness(device=16, host=16, l3=l3)
    assert calibrate.disk_to_device_bandwidth(l3, h.copier, h.dev, h.host, pages=8) == pytest.approx(
        2 * LAYOUT.page_bytes / 0.4)
    assert l3.pages_read == 3 * 2 and l3.used_pages() == 0
    assert h.dev.used_pages() == 0 and h.host.used_pages() == 0


def test_disk_usage_after_a_restart_counts_what_the_store_holds():
    l3 = MemoryL3(32, LAYOUT.page_bytes)
    h = on_disk_only(l3, seq(7, 3), device=4, host=8)  # a restart: the tree is empty, the store holds 3 pages
    assert h.ctrl.tree.pages_in[2] == 0 and h.ctrl.usage()[DISK] == {"used": 3, "capacity": 32}


def test_a_write_the_admission_rule_refuses_is_counted_as_not_admitted(tmp_path):
    """cache.l3.admission_hits 2: a page goes to the L3 the second time it is offered (its first reuse). The first
    offer's refusal is counted under its own reason, not as a failed write."""
    from tiers.l3 import L3Store

    store = L3Store(tmp_path / "l3", 32 * 4096, LAYOUT.page_bytes, bytes(16), io_backend="posix", admission_hits=2)
    try:
        h = Harness(device=8, host=8, l3=store)
        h.run(seq(1, 2))  # committed and backed up to host: offered to the L3 once
        assert h.ctrl.stats.drops == {"not_admitted": 2}
        assert store.stats()["writes"] == 0 and h.ctrl.tree.pages_in[2] == 0
        assert h.run(seq(1, 2)) == {DEVICE: 2}  # reused: offered again, written
        h.ctrl.poll()
        assert store.stats()["writes"] == 2 and h.ctrl.tree.pages_in[2] == 2
        assert h.ctrl.stats.drops == {"not_admitted": 2}
        h.ctrl.close()
    finally:
        store.close()


def test_freeing_a_batch_asks_its_copy_once_whether_it_has_landed():
    """One batched copy's handle covers every page of the batch; freeing those pages asks it once, and a copy still
    in flight makes the GPU wait for it once."""
    from controller.transfers import InFlight

    class Handle:
        def __init__(self, landed: bool):
            self.landed, self.asked, self.stream_waits = landed, 0, 0

        def done(self) -> bool:
            self.asked += 1
            return self.landed

        def wait(self) -> None:
            raise AssertionError("the host must not block")

        def stream_wait(self) -> None:
            self.stream_waits += 1

    h = Harness(device=16, host=16, disk=0)
    landed, flying = Handle(True), Handle(False)
    pages = h.dev.allocate(8)
    h.ctrl.transfers.backups.update({p: landed if i < 4 else flying for i, p in enumerate(pages)})
    h.ctrl.eviction.free_device_pages(pages)
    assert (landed.asked, flying.asked, flying.stream_waits) == (1, 1, 1)
    assert h.ctrl.stats.backup_waits == 4 and h.dev.used_pages() == 0
    busy = InFlight()
    assert [busy(flying), busy(landed), busy(flying)] == [True, False, True] and flying.asked == 2
