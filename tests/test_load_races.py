"""Races of a ticket's loads and a prefetch that the replay's time model found (hicache/replay/simulate.py, with
eviction ties broken at random), on metadata pools:

- a node of a ticket's path split while its loads are set up (the room a disk read makes in host memory may evict
  part of a host copy that is on the GPU): the tail after a gap must still be loaded, not taken for gap pages;
- a node whose disk read is in flight leaves the tree (its prefetch released, an ancestor's last copy evicted):
  the read's completion gives its host pages back instead of failing the engine step;
- a prefetch backs its prefix up to host memory before it reads: that room comes from other pages than the
  prefix's own.
"""

from __future__ import annotations

from controller import CostModel, WritePolicy
from hicache.replay.core import Replayer, ReplaySetup

BB = 1000  # bytes a block


def controller(device: int = 64, host: int = 64, disk: int = 256, host_to_disk: str = "write_through"):
    """Blocks of one token, on metadata pools; every page written down (to disk as `host_to_disk` says)."""
    policy = WritePolicy("write_through", host_to_disk, defer_above_free=1.0, l3_admit="all", l3_host_share=1.0)
    rep = Replayer(ReplaySetup(1, device, host, disk, block_bytes=BB, write_policy=policy, load_mode="always"))
    return rep.controller


def slow_disk() -> CostModel:
    """1 s to compute a block, 3 s to read one from disk, 0.25 s from host: a prefix on disk is part computed
    (its first blocks) while its last blocks load."""
    return CostModel(1, BB, "auto", 1.0, BB * 4.0, BB / 3.0, adaptive=False, overlap=True)


def on_disk_only(ctrl, tokens: list[int]) -> None:
    """tokens cached, then pushed out of the GPU and host tiers by other prompts: they stay on disk only."""
    for prompt in (tokens, *([1000 * i + j for j in range(64)] for i in range(1, 4))):
        t = ctrl.acquire(prompt)
        pages = ctrl.alloc_device(len(prompt) - t.num_pages)
        ctrl.commit(t, prompt, t.device_pages() + pages)
        ctrl.release(t)
        ctrl.poll()
    m = ctrl.match(tokens)
    assert [tier for _, tier in m.segments] == ["disk"] * len(m.segments), m.segments


def test_a_path_node_split_while_loads_start_keeps_the_tail_loading() -> None:
    ctrl = controller()
    tokens = list(range(1, 21))
    on_disk_only(ctrl, tokens)
    ctrl.cost = slow_disk()
    loads = ctrl.loads
    real = loads._allocate_loads
    split = []

    def allocate_then_split(nodes, k, s):
        """A gap node is split while the loads are set up, as host room made for a read may split a node."""
        inside = [n for n, start in zip(nodes, [sum(x.num_pages for x in nodes[:i]) for i in range(len(nodes))])
                  if k <= start < s and n.num_pages > 1]
        if inside and not split:
            split.append(ctrl.tree.split(inside[0], 1))
        return real(nodes, k, s)

    loads._allocate_loads = allocate_then_split
    ticket = ctrl.acquire(tokens, max_pages=19, overlap=True)
    loads._allocate_loads = real
    assert split and ticket.gap is not None
    k, s = ticket.gap
    assert s < ticket.num_pages  # a tail that loads
    assert all(n.on_device for n in ticket.part(0, k) + ticket.part(s, ticket.num_pages))  # loading to the GPU
    assert not any(n.on_device for n in ticket.part(k, s))  # computed by the caller
    ctrl.check_integrity()
    assert ctrl.wait_ticket(ticket)
    gap = ctrl.alloc_device(s - k)
    ctrl.commit_gap(ticket, tokens, gap)
    pages = ticket.device_pages()  # every page on the GPU: loaded, or the gap's
    assert len(pages) == ticket.num_pages and pages[k:s] == gap
    assert ticket.hit_runs[-1][1] == ticket.num_pages  # the hits' page ranges reach the end of the prefix
    ctrl.commit(ticket, tokens[: len(pages)], pages)
    ctrl.release(ticket)
    ctrl.check_integrity()


def test_a_read_whose_node_left_the_tree_gives_its_host_pages_back() -> None:
    ctrl = controller()
    tokens = list(range(1, 21))
    on_disk_only(ctrl, tokens)
    hold = ctrl.prefetch(tokens)
    assert hold.started == 20 and len(ctrl.loads.loading_host_pages()) == 20  # reads in flight into host pages
    host_free = ctrl.host.allocator.free_pages
    ctrl.release_prefetch(hold)  # its request left the queue: nothing pins the nodes now
    top = ctrl.match(tokens).segments[0][0]
    removed = ctrl.tree.remove_subtree(top)  # as when an ancestor's last copy leaves
    ctrl.eviction.free_nodes(removed)
    assert all(n.removed for n in removed)
    ctrl.check_integrity()  # the reads' host pages are still the reads'
    ctrl.poll()  # their completions: the pages go back, nothing lands
    assert ctrl.host.allocator.free_pages == host_free + 20
    assert not ctrl.transfers.orphan_reads and not ctrl.transfers.loading
    assert ctrl.loads.reading == 0
    ctrl.check_integrity()
    assert not ctrl.match(tokens).segments  # the prefix is gone from every tier


def test_a_prefetch_backing_up_its_prefix_keeps_the_prefix_in_the_tree() -> None:
    """A queued request's prefix: [1, 2] in host memory only, [3, 4] on the GPU only, [5, 6] on disk only; the host
    tier (4 pages) also holds another request's [100, 101]. Its prefetch first backs [3, 4] up to host memory (a
    hit). The room for that copy must not come from the prefix's own [1, 2]: here that copy would be written back
    to disk on its way out, but where no write can take it (a full L3 queue, a dropped write), [1, 2] and
    everything below it leave the tree while the prefetch goes on to read [5, 6] from disk (a fuzzed replay of an
    agent workload failed so)."""
    ctrl = controller(device=8, host=4, disk=64, host_to_disk="write_back")  # a hit writes nothing to disk
    tree = ctrl.tree
    top, _ = tree.insert([1, 2], ctrl.host.allocate(2), "host")
    middle, _ = tree.insert([3, 4], ctrl.device.allocate(2), "device", start=top)
    bottom, _ = tree.insert([5, 6], ctrl.device.allocate(2), "device", start=middle)
    other, _ = tree.insert([100, 101], ctrl.host.allocate(2), "host")
    tree.lock(other)  # another request's: the prefix's own [1, 2] is the only host copy that could go
    assert ctrl.l3.write_pages(bottom.keys, [None, None]) == [True, True]
    tree.set_location(bottom, "disk", bottom.keys)
    pages, _ = tree.clear_location(bottom, "device")
    ctrl.device.free(pages)  # [5, 6] on disk only
    ctrl.check_integrity()
    hold = ctrl.prefetch([1, 2, 3, 4, 5, 6])
    assert not any(n.removed for n in (top, middle, bottom))
    assert top.on_host and not middle.on_host  # no room for the backup: it was refused, not made of the prefix
    assert hold.started == 0 and ctrl.stats.drops["host_full"] == 2
    tree.unlock(other)
    ctrl.release_prefetch(hold)
    ctrl.check_integrity()


def test_a_request_giving_up_its_reads_keeps_the_gpu_pages_another_ticket_holds() -> None:
    """Two requests hold tickets on one prefix whose disk reads are in flight into GPU pages. The first giving its
    reads up must leave those GPU pages to the second, however the read is marked: the timed replay of the
    Mooncake sample reached a read marked for host memory only on a node with GPU pages the second ticket held,
    freed them, and failed the second request's commit ("has no copy in the GPU")."""
    ctrl = controller()
    tokens = list(range(1, 21))
    on_disk_only(ctrl, tokens)
    real = ctrl.worker.completions
    ctrl.worker.completions = lambda: []  # the reads stay in flight
    first = ctrl.acquire(tokens, max_pages=19)
    second = ctrl.acquire(tokens, max_pages=19)
    reading = [n for n in second.nodes if ctrl.transfers.disk_load(n) is not None]
    assert reading and all(n.on_device for n in reading)
    assert ctrl.give_up_reads(first) is None  # the second ticket waits for the same reads
    for node in reading:
        ctrl.transfers.disk_load(node).to_device = False  # the state the replay reached
    assert ctrl.give_up_reads(first) is None
    assert all(n.on_device for n in second.nodes)
    ctrl.worker.completions = real
    assert ctrl.wait_ticket(first) and ctrl.wait_ticket(second)
    ctrl.release(first)
    pages = ctrl.alloc_device(1)
    ctrl.commit(second, tokens, second.device_pages() + pages)  # every page of its prefix still on the GPU
    ctrl.release(second)
    ctrl.check_integrity()
