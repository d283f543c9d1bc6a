"""Which pages reach the L3 (write_policy.l3_admit, controller/reuse.py) and how much host memory the disk's
traffic may hold (write_policy.l3_host_share, load_policy.prefetch_host_share): a slow or stuck disk never leaves
GPU -> host copies without room."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from memory_l3 import MemoryL3
from test_controller import LAYOUT, Harness, seq

from controller import CostModel, WritePolicy
from controller.reuse import TRAFFIC_REUSE_MIN, TRAFFIC_REUSE_WEIGHT, ReuseFilter
from radix import DEVICE, DISK, HOST, RadixTree
from tiers.l3.worker import L3Worker

REUSE = dataclasses.replace(WritePolicy.eager(), l3_admit="reuse")


def no_reuse_seen(h: Harness) -> Harness:
    """The harness as after traffic without reuse: pages without a likely reader are not written at all."""
    h.ctrl.writes.reuse.traffic_reuse = 0.0
    return h


def test_a_prompt_sent_once_is_not_written_and_its_continuation_is():
    h = no_reuse_seen(Harness(device=8, host=16, disk=64, policy=REUSE))
    h.run(seq(1, 3))
    assert h.l3.used_pages() == 0 and h.ctrl.stats.drops["not_reused"] == 3
    # the next turn of the conversation: its prefix is hit (so written now) and its new pages continue a hit
    turn2 = seq(1, 3)[:-1] + [5000 + i for i in range(2 * LAYOUT.page_size + 1)]
    assert h.run(turn2) == {DEVICE: 3}
    assert h.l3.used_pages() == 5
    assert h.ctrl.tree.match_prefix(turn2, touch=False).num_pages == 5
    h.check_all_bytes()
    h.close()


def test_one_off_prompts_take_spare_write_bandwidth_until_the_traffic_shows_no_reuse():
    """A session's first turn looks like a one-off prompt: it is written while the queue has room and the traffic
    is assumed to reuse. Each prompt that matches nothing lowers the traffic's reuse share; below TRAFFIC_REUSE_MIN
    one-off pages are not written at all, and one prompt that hits does not reopen the gate by itself."""
    h = Harness(device=8, host=16, disk=256, policy=REUSE)
    share, written = 1.0, 0
    for b in range(1, 61):
        share += TRAFFIC_REUSE_WEIGHT * (0 - share)  # the prompt matches nothing
        written += 2 if share >= TRAFFIC_REUSE_MIN else 0
        h.run(seq(b, 2))
        assert h.l3.used_pages() == written, b
    assert 0 < written < 2 * 60 and h.ctrl.stats.drops["not_reused"] == 2 * 60 - written
    assert h.ctrl.writes.reuse.traffic_reuse == pytest.approx(share)
    h.check_all_bytes()
    h.close()


def test_a_one_off_write_never_waits_for_the_disk_and_goes_once_it_has_room():
    """Spare-bandwidth writes take at most half the write queue and never wait in host memory for room: with the
    disk stuck, one-off prompts fill half the queue and the rest are remembered (not pinned, not queued), while a
    likely page's write still finds room. Once the disk drains, the remembered ones are written, newest first; one
    that leaves host memory before its turn is counted as not reused."""
    l3 = StuckL3(256, LAYOUT.page_bytes)
    l3.go.clear()
    policy = dataclasses.replace(REUSE, l3_host_share=1.0)
    h = Harness(device=8, host=64, disk=256, policy=policy, l3=l3,
                worker=lambda store: L3Worker(store, threads=1, queue_pages=8))
    for b in range(1, 7):
        h.run(seq(b, 2))
    writes = h.ctrl.writes
    assert h.ctrl.worker.queued_write_pages == 4 and not writes.waiting_disk and not h.ctrl.stats.drops
    assert sorted(n.num_pages for n in writes._spare.values()) == [2, 2, 2, 2]  # prompts 3 to 6
    turn2 = seq(1, 2)[:-1] + [5000 + i for i in range(LAYOUT.page_size + 1)]  # continues prompt 1: likely
    h.run(turn2)
    assert h.ctrl.worker.queued_write_pages == 5
    third = h.ctrl.tree.match_prefix(seq(3, 2), touch=False).last_node
    h.ctrl.eviction.evict_node(HOST, third)  # its host copy leaves before its turn came
    assert h.ctrl.stats.drops["not_reused"] == 2
    l3.go.set()
    for _ in range(4):  # each poll lands what was queued and queues the next remembered ones
        assert h.ctrl.worker.wait_idle(30)
        h.ctrl.poll()
    assert l3.used_pages() == 5 + 6 and not writes._spare
    assert h.ctrl.tree.match_prefix(seq(6, 2), touch=False).last_node.on_disk
    h.ctrl.check_integrity()
    h.close()


def test_a_page_computed_twice_is_written_the_second_time():
    h = no_reuse_seen(Harness(device=2, host=2, disk=64, policy=REUSE))
    h.run(seq(1, 2))
    for b in (2, 3):  # push seq 1 out of GPU and host memory: it is gone
        h.run(seq(b, 2))
    assert h.ctrl.tree.match_prefix(seq(1, 2), touch=False).num_pages == 0 and h.l3.used_pages() == 0
    assert h.run(seq(1, 2)) == {}  # computed again: now it is known to come back
    assert h.l3.used_pages() == 2
    assert h.ctrl.tree.match_prefix(seq(1, 2), touch=False).disk_pages + h.ctrl.tree.match_prefix(
        seq(1, 2), touch=False).device_pages >= 2
    h.close()


def test_admit_all_writes_every_page_and_the_filter_forgets_oldest_first():
    h = Harness(device=8, host=16, disk=64, policy=WritePolicy.eager())  # l3_admit all
    h.run(seq(1, 3))
    assert h.l3.used_pages() == 3 and not h.ctrl.stats.drops
    h.close()
    tree = RadixTree(LAYOUT.page_size)
    a, _ = tree.insert(seq(1, 1)[:-1], [0])
    b, _ = tree.insert(seq(2, 1)[:-1], [1])
    f = ReuseFilter("reuse", capacity=1)
    f.computed([a], continues_hit=False)
    f.computed([b], continues_hit=False)  # a is forgotten
    f.computed([a], continues_hit=False)
    assert not f.likely(a)
    f.computed([a], continues_hit=False)
    assert f.likely(a) and not f.likely(b)
    with pytest.raises(ValueError, match="l3_admit"):
        ReuseFilter("sometimes")


class StuckL3(MemoryL3):
    """A MemoryL3 whose reads and writes block until `go` is set: a disk that has stopped answering."""

    def __init__(self, capacity_pages: int, page_bytes: int):
        super().__init__(capacity_pages, page_bytes)
        self.go = threading.Event()
        self.go.set()

    def write_pages(self, keys, pages):
        assert self.go.wait(30)
        return super().write_pages(keys, pages)

    def read_pages(self, keys, out):
        assert self.go.wait(30)
        return super().read_pages(keys, out)


def stuck_prefix(pages: int, pool: int = 16) -> StuckL3:
    """A store holding seq(1, pages), written by an earlier server with `pool`-page tiers, that has stopped
    answering: reads of it queue and do not land until `go` is set."""
    l3 = StuckL3(256, LAYOUT.page_bytes)
    first_server = Harness(device=pool, host=pool, disk=256, l3=l3)
    first_server.run(seq(1, pages))
    first_server.close()
    l3.go.clear()
    return l3


def clocked_disk(l3: StuckL3, pages_per_s: float, host: int) -> tuple[Harness, list[float]]:
    """A server over `l3` whose cost model reads it at `pages_per_s`, on a clock the test moves (`now[0]`)."""
    now = [0.0]
    cost = CostModel(LAYOUT.page_size, LAYOUT.page_bytes, "auto", prefill_tokens_per_s=1e3,
                     host_to_device_bytes_per_s=1e12, disk_to_device_bytes_per_s=pages_per_s * LAYOUT.page_bytes,
                     adaptive=False, overlap=True)
    h = Harness(device=4, host=host, disk=256, l3=l3, cost=cost, worker=lambda store: L3Worker(store, threads=1))
    h.ctrl.loads.clock = lambda: now[0]
    return h, now


def release_and_close(h: Harness, hold) -> None:
    """Let the stuck reads land, give the hold back, and close once the integrity check passes."""
    h.l3.go.set()
    h.ctrl.release_prefetch(hold)
    assert h.ctrl.worker.wait_idle(30)
    h.ctrl.poll()
    h.ctrl.check_integrity()
    h.close()


def count_matches(h: Harness) -> list[int]:
    """The prefix matches prefetch makes from now on, one entry each."""
    matches: list[int] = []
    match = h.ctrl.prefetcher.match
    h.ctrl.prefetcher.match = lambda *a, **k: matches.append(1) or match(*a, **k)
    return matches


@pytest.mark.parametrize("share, starved", [(0.25, False), (1.0, True)])
def test_writes_stuck_behind_a_slow_disk_pin_at_most_their_share_of_host_memory(share, starved):
    """Every page is sent to a disk that does not answer. Within the writes' share, new pages keep finding host room
    (the writes waiting for their turn are not pinned, and leave host memory first); with the whole pool as their
    share the pinned writes fill it and new pages' host copies are refused."""
    l3 = StuckL3(256, LAYOUT.page_bytes)
    l3.go.clear()
    policy = dataclasses.replace(WritePolicy.eager(), l3_host_share=share)
    h = Harness(device=4, host=16, disk=256, policy=policy, l3=l3,
                worker=lambda store: L3Worker(store, threads=1, queue_pages=64))
    staging = h.ctrl.writes.staging_pages
    assert staging == int(16 * share)
    most = 0
    for b in range(1, 16):
        h.run(seq(b, 2))
        most = max(most, h.ctrl.eviction.disk_inflight)
    assert most <= staging
    assert (h.ctrl.stats.drops["host_full"] > 0) == starved
    l3.go.set()
    assert h.ctrl.worker.wait_idle(30)
    h.ctrl.poll()
    h.ctrl.check_integrity()
    assert l3.used_pages() > 0
    h.close()


def test_prefetch_reads_stuck_on_the_disk_hold_at_most_their_share_and_backups_still_land():
    l3 = StuckL3(256, LAYOUT.page_bytes)
    first = Harness(device=4, host=16, disk=256, l3=l3)
    for b in range(1, 7):
        first.run(seq(b, 4))  # written through: 24 pages on the disk
    first.close()
    assert l3.used_pages() == 24
    l3.go.clear()  # the disk stops answering
    h = Harness(device=4, host=16, disk=256, l3=l3, worker=lambda store: L3Worker(store, threads=2))
    staging = h.ctrl.loads.staging_pages
    assert staging == 8  # half of 16 host pages
    holds = [h.ctrl.prefetch(seq(b, 4), max_pages=4) for b in range(1, 7)]  # six queued requests, all on disk
    assert h.ctrl.loads.prefetching <= staging and h.ctrl.stats.prefetched_pages == 8
    assert holds[0].pages == 4 and holds[1].pages == 4 and holds[2].short
    for b in range(10, 14):  # new prompts computed meanwhile: their host copies find room
        h.run(seq(b, 2))
    assert h.ctrl.stats.drops["host_full"] == 0
    assert sum(n.num_pages for n in h.ctrl.tree.nodes() if n.on_host and not n.on_disk) >= 8
    for hold in holds:
        h.ctrl.release_prefetch(hold)
    l3.go.set()
    assert h.ctrl.worker.wait_idle(30)
    h.ctrl.poll()
    h.ctrl.check_integrity()
    assert h.run(seq(1, 4)) in ({HOST: 4}, {DISK: 4})  # the prefetched pages, or read again
    h.close()


def test_a_prefetch_that_found_the_staging_share_used_up_asks_again_only_once_there_is_room():
    """Two queued requests' reads fill the staging share (8 of 16 host pages) on a disk that does not answer. The
    third request's hold stops short; I/O applied elsewhere (the room version moves) does not make it match its
    prompt again while the share stays used up, nor does a hold given back while its reads still fill host pages;
    those reads landing does."""
    l3 = StuckL3(256, LAYOUT.page_bytes)
    first = Harness(device=4, host=16, disk=256, l3=l3)
    for b in range(1, 4):
        first.run(seq(b, 4))
    first.close()
    l3.go.clear()
    h = Harness(device=4, host=16, disk=256, l3=l3, worker=lambda store: L3Worker(store, threads=2))
    holds = [h.ctrl.prefetch(seq(b, 4), max_pages=4) for b in range(1, 4)]
    assert [hold.pages for hold in holds] == [4, 4, 0] and holds[2].short and not holds[2].queue_bound
    assert h.ctrl.loads.staged_pages == h.ctrl.loads.staging_pages == 8
    matches = count_matches(h)
    h.ctrl.host_room_version += 1  # a completion applied
    assert h.ctrl.prefetch(seq(3, 4), max_pages=4, hold=holds[2]) is holds[2] and not matches
    h.ctrl.release_prefetch(holds[0])  # given back, but its reads in flight still fill 4 host pages
    assert h.ctrl.prefetch(seq(3, 4), max_pages=4, hold=holds[2]) is holds[2] and not matches
    l3.go.set()  # they land: 4 pages of the share back
    assert h.ctrl.worker.wait_idle(30)
    h.ctrl.poll()
    assert h.ctrl.loads.staged_pages == 4
    holds[2] = h.ctrl.prefetch(seq(3, 4), max_pages=4, hold=holds[2])
    assert matches == [1] and holds[2].pages == 4
    for hold in holds[1:]:
        h.ctrl.release_prefetch(hold)
    assert h.ctrl.worker.wait_idle(30)
    h.ctrl.poll()
    h.ctrl.check_integrity()
    h.close()


@pytest.mark.parametrize("queue_s, first", [(0.25, 3), (0.0, 8)])
def test_prefetch_keeps_at_most_its_queue_of_seconds_on_the_disk_and_goes_on_as_reads_land(queue_s, first):
    """cache.load_policy.prefetch_queue_s: a disk that reads 10 pages a second takes 0.25 s of reads, 3 pages (the
    deepest first), and the rest waits; once they have landed and the disk's queue has drained by the estimate, the
    next 3 go. Reads still queued at admission are mostly computed instead, so a deep queue wastes the disk.
    Unbounded (0), the prefetch takes the host pool's whole staging share (8 pages) at once."""
    l3 = stuck_prefix(12)
    assert l3.used_pages() == 12
    h, now = clocked_disk(l3, 10, host=16)
    h.ctrl.prefetcher.queue_s = queue_s
    hold = h.ctrl.prefetch(seq(1, 12), max_pages=12)
    assert h.ctrl.stats.prefetched_pages == first and hold.short
    deepest = h.ctrl.tree.match_prefix(seq(1, 12), touch=False).segments[-1][0]
    assert any(node is deepest for node, _ in hold.pins)  # the deepest pages read first
    if queue_s:
        assert h.ctrl.prefetch(seq(1, 12), max_pages=12, hold=hold).pages == 3  # nothing landed: nothing more
        l3.go.set()
        assert h.ctrl.worker.wait_idle(30)
        h.ctrl.poll()  # the reads landed
        now[0] = 0.3  # and the queue estimate has drained
        hold = h.ctrl.prefetch(seq(1, 12), max_pages=12, hold=hold)
        assert h.ctrl.stats.prefetched_pages == 6 and hold.pages == 6
    release_and_close(h, hold)


def test_a_prefetch_the_disk_queue_stopped_asks_again_once_a_quarter_of_the_queue_is_free():
    """A disk that reads 100 pages a second holds a 0.25 s queue of 25 pages. Once that is queued the prefetch does
    not match its prompt again for the page or two each landing read frees, only for a quarter of the queue (7
    pages): the match of a long prompt each step cost the engine thread milliseconds for nothing."""
    h, now = clocked_disk(stuck_prefix(40, pool=64), 100, host=128)  # the reads queue and do not land
    h.ctrl.prefetcher.queue_s = 0.25  # the server's default (configs/default.yaml)
    assert h.ctrl.loads.staging_pages == 64
    matches = count_matches(h)
    hold = h.ctrl.prefetch(seq(1, 40), max_pages=40)
    assert h.ctrl.stats.prefetched_pages == 25 and hold.short and hold.queue_bound and len(matches) == 1
    now[0] = 0.03  # 3 pages' worth of the queue drained, and a read landed (each completion bumps the version)
    h.ctrl.host_room_version += 1
    assert h.ctrl.prefetch(seq(1, 40), max_pages=40, hold=hold) is hold
    assert len(matches) == 1 and h.ctrl.stats.prefetched_pages == 25
    now[0] = 0.1  # 10 pages' worth: the queue is refilled
    hold = h.ctrl.prefetch(seq(1, 40), max_pages=40, hold=hold)
    assert len(matches) == 2 and h.ctrl.stats.prefetched_pages == 35 and hold.pages == 35 and hold.queue_bound
    release_and_close(h, hold)


def test_a_prefetch_never_pins_below_a_page_whose_only_copy_is_on_the_gpu():
    """Pins count along the path and a parent outlives its children, so a hold on disk pages below a GPU-only page
    would make that page unevictable: queued requests could fill the GPU pool with pages nobody may evict, and the
    running request would starve. Such a prefix is not prefetched past the GPU-only page."""
    l3 = MemoryL3(64, LAYOUT.page_bytes)
    first = Harness(device=8, host=8, disk=64, l3=l3)
    first.run(seq(1, 4))
    keys = [k for node, _ in first.ctrl.tree.match_prefix(seq(1, 4), touch=False).segments for k in node.keys]
    first.close()
    for k in keys[:2]:  # only the last two pages stay on the disk
        del l3.data[k]
    gpu_only = dataclasses.replace(WritePolicy.eager(), device_to_host="write_back")  # no host copy until evicted
    h = Harness(device=8, host=8, disk=64, l3=l3, policy=gpu_only)
    h.run(seq(1, 2)[:-1] + [99])  # the first two pages computed again: on the GPU only
    m = h.ctrl.tree.match_prefix(seq(1, 4), touch=False)
    assert m.device_pages == 2 and m.host_pages == 0 and h.ctrl.match(seq(1, 4)).disk_pages == 2
    hold = h.ctrl.prefetch(seq(1, 4), max_pages=4)
    assert hold.pages == 0 and h.ctrl.loads.prefetching == 0
    assert all(node.pin_ref == 0 for node in h.ctrl.tree.nodes())
    h.ctrl.release_prefetch(hold)
    h.close()


def test_a_write_backs_up_a_parent_whose_only_copy_is_on_the_gpu_first():
    """A write pins its node's path, and a pinned page whose only copy is on the GPU cannot leave the GPU until the
    write lands: so the parent is copied to host first; with no host room for it the write is dropped."""
    policy = dataclasses.replace(WritePolicy.eager(), l3_admit="reuse")
    h = no_reuse_seen(Harness(device=16, host=16, disk=64, policy=policy))
    h.run(seq(1, 2))  # sent once: on GPU and host, not on the disk
    parent = h.ctrl.tree.match_prefix(seq(1, 2), touch=False).last_node
    h.ctrl.eviction.evict_node(HOST, parent)  # its host copy leaves: its only copy is on the GPU
    assert parent.on_device and not parent.on_host and not parent.on_disk
    tree = h.ctrl.tree
    child, _ = tree.insert([7] * LAYOUT.page_size, h.dev.allocate(1), DEVICE, start=parent)  # a page below it
    tree.set_location(child, HOST, h.host.allocate(1))
    child.hit_count = 1  # likely to be read again
    assert h.ctrl.writes.write_to_disk(child)
    assert parent.on_host  # copied to host before the child's write pinned the path
    h.ctrl.worker.wait_idle()
    h.ctrl.poll()
    assert child.on_disk and parent.on_host and parent.pin_ref == 0  # nothing holds the parent now
    assert h.ctrl.stats.drops["not_reused"] == 2 + 2  # the parent, computed once, at its commit and its backup
    h.ctrl.check_integrity()
    h.close()


def test_a_burst_that_outruns_the_disk_waits_in_free_host_memory_and_is_all_written():
    """With every page sent to L3, a burst of commits (eight prompts at once) outruns the write queue for a moment.
    A backlog is a rate, not a lack of room: past twice their share of host memory, waiting writes may still hold
    what is free, so none is dropped as `l3_backlog` while the disk is nearly empty."""
    l3 = StuckL3(256, LAYOUT.page_bytes)
    l3.go.clear()  # the disk is busy for the whole burst
    policy = dataclasses.replace(WritePolicy.eager(), l3_host_share=0.25)
    h = Harness(device=8, host=64, disk=256, policy=policy, l3=l3,
                worker=lambda store: L3Worker(store, threads=1, queue_pages=4))
    for b in range(1, 21):  # 40 pages: 4 in the queue, 36 waiting, over twice the share (32)
        h.run(seq(b, 2))
    assert h.ctrl.writes.waiting_disk_pages > 2 * h.ctrl.writes.staging_pages
    assert h.ctrl.stats.drops["l3_backlog"] == 0 and h.host.allocator.free_pages > 0
    l3.go.set()  # the disk catches up
    for _ in range(20):  # each round the emptied queue takes more of the waiting writes
        h.ctrl.worker.wait_idle(30)
        h.ctrl.poll()
    assert h.ctrl.writes.waiting_disk_pages == 0
    assert sum(h.ctrl.stats.drops.values()) == 0
    assert all(h.ctrl.tree.match_prefix(seq(b, 2), touch=False).last_node.on_disk for b in range(1, 21))
    h.ctrl.check_integrity()
    h.close()


def test_writes_waiting_for_a_stuck_disk_hold_at_most_twice_their_share_and_free_memory_then_are_dropped():
    l3 = StuckL3(256, LAYOUT.page_bytes)
    l3.go.clear()
    policy = dataclasses.replace(WritePolicy.eager(), l3_host_share=0.25)
    h = Harness(device=8, host=32, disk=256, policy=policy, l3=l3,
                worker=lambda store: L3Worker(store, threads=1, queue_pages=64))
    most, grew_when_full = 0, []
    for b in range(1, 20):
        before, free = h.ctrl.writes.waiting_disk_pages, h.host.allocator.free_pages
        h.run(seq(b, 2))
        waiting = h.ctrl.writes.waiting_disk_pages
        most = max(most, waiting)
        if free == 0 and waiting > max(16, before):  # past twice their share, writes wait only in free memory
            grew_when_full.append(b)
    assert h.ctrl.writes.staging_pages == 8 and most > 16 and grew_when_full == []
    assert h.ctrl.stats.drops["l3_backlog"] > 0 and h.ctrl.stats.drops["host_full"] == 0
    l3.go.set()
    assert h.ctrl.worker.wait_idle(30)
    h.ctrl.poll()
    h.ctrl.check_integrity()
    h.close()
