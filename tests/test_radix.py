"""Radix tree: matching, splitting, insertion, residency, locking, eviction order, keys."""

import pytest

from radix import DEVICE, DISK, HOST, TIERS, RadixTree, TreeNode, namespace_fingerprint, page_keys


def device_page_ids(m):
    """GPU page ids of the leading on-GPU part of a match."""
    out = []
    for node, tier in m.segments:
        if tier != DEVICE:
            break
        out += node.device_pages
    return out


def test_match_empty_and_partial_page_not_cached():
    tree = RadixTree(4)
    tree.insert(list(range(10)), [0, 1])  # 2 full pages; tokens 8, 9 are a partial page
    assert tree.pages_in == [2, 0, 0]
    m = tree.match_prefix(list(range(10)))
    assert (m.num_pages, m.device_pages, m.host_pages, m.disk_pages) == (2, 2, 0, 0)
    assert device_page_ids(m) == [0, 1]
    assert tree.match_prefix([99, 1, 2, 3]).num_pages == 0
    tree.check_integrity()


def test_match_splits_node_at_page_boundary():
    tree = RadixTree(2)
    node, dups = tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    assert dups == [] and node.num_pages == 3
    m = tree.match_prefix([1, 2, 3, 4, 9, 9])
    assert m.num_pages == 2 and device_page_ids(m) == [10, 11]
    assert len(tree.root.children) == 1
    upper = m.last_node
    assert upper.num_pages == 2 and list(upper.children.values())[0].device_pages == [12]
    # a mismatch inside the first page matches nothing
    assert tree.match_prefix([1, 3]).num_pages == 0
    tree.check_integrity()


def test_insert_returns_duplicates_and_adopts_missing_tier():
    tree = RadixTree(2)
    tree.insert([1, 2, 3, 4], [0, 1])
    node, dups = tree.insert([1, 2, 3, 4, 5, 6], [7, 8, 2])
    assert dups == [7, 8]
    assert tree.path_tokens(node) == (1, 2, 3, 4, 5, 6)
    # host copies for the existing pages are adopted, not duplicated
    _, dups = tree.insert([1, 2, 3, 4], [100, 101], tier=HOST)
    assert dups == []
    m = tree.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.device_pages == 3 and [n.pages(HOST) for n in m.nodes] == [[100, 101], None]
    tree.check_integrity()


def test_tier_split_reported_in_order():
    tree = RadixTree(1)
    tree.insert([1, 2, 3], [0, 1, 2])
    tree.insert([1, 2, 3], [5, 6, 7], tier=HOST)
    tree.insert([1, 2, 3, 4, 5], [b"%16d" % i for i in range(5)], tier=DISK)
    node = tree.match_prefix([1, 2, 3], touch=False).last_node
    assert node.num_pages == 3
    upper = tree.split(node, 2)
    assert upper.num_pages == 2 and node.num_pages == 1 and node.parent is upper
    tree.clear_location(node, DEVICE)  # page 3 now on host and disk only
    m = tree.match_prefix([1, 2, 3, 4, 5])
    assert (m.device_pages, m.host_pages, m.disk_pages) == (2, 1, 2)
    assert [t for _, t in m.segments] == [DEVICE, HOST, DISK]
    assert device_page_ids(m) == [0, 1]
    tree.check_integrity()


def test_lru_order_and_lock_protection():
    tree = RadixTree(1)
    tree.insert([1, 2], [0, 1])
    tree.insert([1, 2, 3], [0, 1, 2])
    tree.insert([7], [3])
    leaf_123 = tree.match_prefix([1, 2, 3], touch=False).last_node
    leaf_7 = tree.match_prefix([7], touch=False).last_node
    # [7] was inserted last, so the [3] leaf is the least recently used leaf
    assert tree.pop_evictable(DEVICE) is leaf_123
    tree.match_prefix([1, 2, 3])  # touch: now [7] is least recent
    assert tree.pop_evictable(DEVICE) is leaf_7
    tree.lock(leaf_7)
    assert tree.pop_evictable(DEVICE) is leaf_123
    tree.lock(leaf_123)
    assert tree.pop_evictable(DEVICE) is None  # parent [1,2] is not a leaf; leaves locked
    tree.unlock(leaf_7)
    assert tree.pop_evictable(DEVICE) is leaf_7
    with pytest.raises(ValueError, match="locked"):
        tree.clear_location(leaf_123, DEVICE)
    pages, orphans = tree.clear_location(leaf_7, DEVICE)
    assert pages == [3] and orphans == [] and leaf_7.parent is None
    with pytest.raises(ValueError, match="unlock of unlocked"):
        tree.unlock(leaf_7)
    tree.check_integrity()


def test_pin_keeps_host_copy_but_frees_gpu_copy():
    tree = RadixTree(1)
    tree.insert([1, 2], [0, 1])  # on the GPU only
    tree.insert([1, 2, 3], [0, 1, 2])
    leaf = tree.match_prefix([1, 2, 3], touch=False).last_node
    parent = leaf.parent
    tree.set_location(leaf, HOST, [40])
    tree.pin(leaf)  # an L3 write is reading the leaf's host page
    assert (leaf.pin_ref, parent.pin_ref) == (1, 1)
    assert tree.pop_evictable(HOST) is None  # host copy held
    assert tree.pop_evictable(DEVICE) is leaf  # the GPU copy may go: the host keeps the node
    with pytest.raises(ValueError, match="pinned"):
        tree.clear_location(leaf, HOST)
    pages, orphans = tree.clear_location(leaf, DEVICE)
    assert pages == [2] and orphans == [] and leaf.loc == [None, [40], None]
    # the parent is on the GPU only: leaving it would remove the pinned leaf, so it is held
    assert tree.pop_evictable(DEVICE) is None
    with pytest.raises(ValueError, match="locked or pinned"):
        tree.remove_subtree(parent)
    tree.check_integrity()
    tree.unpin(leaf)
    assert (leaf.pin_ref, parent.pin_ref) == (0, 0)
    assert tree.pop_evictable(HOST) is leaf
    assert tree.pop_evictable(DEVICE) is parent
    with pytest.raises(ValueError, match="unpin of unpinned"):
        tree.unpin(leaf)
    tree.check_integrity()


def parent_and_leaf_with_parent_in_host() -> tuple[RadixTree, TreeNode, TreeNode]:
    """A two-page parent and a one-page leaf below it, both on the GPU, the parent also in host memory."""
    tree = RadixTree(1)
    tree.insert([1, 2], [0, 1])
    tree.insert([1, 2, 3], [0, 1, 2])
    leaf = tree.match_prefix([1, 2, 3], touch=False).last_node
    parent = leaf.parent
    tree.set_location(parent, HOST, [10, 11])
    return tree, parent, leaf


def test_a_host_copy_above_a_pinned_page_may_go_when_l3_holds_it():
    tree, parent, leaf = parent_and_leaf_with_parent_in_host()
    tree.set_location(leaf, HOST, [12])
    tree.pin(leaf)  # an L3 write reads the leaf's host page
    assert tree.pop_evictable(HOST) is None
    assert tree.pop_evictable_interior() is None  # the parent is in no lower tier: its host copy is needed
    with pytest.raises(ValueError, match="may not leave before its children"):
        tree.clear_location(parent, HOST, interior=True)
    tree.set_location(parent, DISK, list(parent.keys))
    assert tree.own_pins(parent) == 0 and tree.own_pins(leaf) == 1
    assert tree.pop_evictable_interior(skip=lambda n: n is parent) is None
    assert tree.pop_evictable_interior() is parent
    with pytest.raises(ValueError, match="children in host"):
        tree.clear_location(parent, HOST)  # not without interior=True
    pages, orphans = tree.clear_location(parent, HOST, interior=True)
    assert pages == [10, 11] and orphans == [] and parent.loc[1:] == [None, list(parent.keys)]
    assert leaf.host_pages == [12] and parent.pin_ref == 1
    tree.check_integrity()
    tree.pin(parent)  # a pin of its own (a prefetch) holds a host copy above host children
    tree.set_location(parent, HOST, [13, 14])
    assert tree.pop_evictable_interior() is None
    tree.unpin(parent)
    assert tree.pop_evictable_interior() is parent
    tree.check_integrity()


def prefixes_above_pinned_host_pages(count: int = 3) -> tuple[RadixTree, list[TreeNode], list[TreeNode]]:
    """`count` one-page prefixes in host memory and L3, each above a one-page leaf in host memory that an L3 write
    pins; (tree, prefixes, leaves), inserted oldest first."""
    tree = RadixTree(1)
    parents, leaves = [], []
    for i in range(count):
        tree.insert([i + 1], [2 * i])
        tree.insert([i + 1, 50 + i], [2 * i, 2 * i + 1])
        leaf = tree.match_prefix([i + 1, 50 + i], touch=False).last_node
        tree.set_location(leaf.parent, HOST, [10 + 2 * i])
        tree.set_location(leaf.parent, DISK, list(leaf.parent.keys))
        tree.set_location(leaf, HOST, [11 + 2 * i])
        tree.pin(leaf)  # an L3 write reads it
        parents.append(leaf.parent)
        leaves.append(leaf)
    return tree, parents, leaves


def test_host_copies_above_pinned_pages_come_lowest_priority_first_and_are_checked_on_their_turn():
    """Three prefixes in host memory and L3, each above a pinned host page: they come by priority (the least
    recently used first, after touches that reorder them), `skip` is asked only of the node whose turn it is, a node
    that gained a pin of its own meanwhile is passed over when its turn comes, and one passed over is there again
    for the next iteration."""
    tree, parents, _ = prefixes_above_pinned_host_pages()
    for i in (1, 0, 2):
        tree.match_prefix([i + 1, 50 + i])  # touched in this order: 1 is the least recently used
    asked = []
    scan = tree.evictable_interiors(skip=lambda n: asked.append(n) or False)
    assert next(scan) is parents[1] and asked == [parents[1]]
    tree.clear_location(parents[1], HOST, interior=True)  # the caller evicts between items
    tree.pin(parents[0])  # a pin of its own (a prefetch) holds it now
    assert list(scan) == [parents[2]] and asked == [parents[1], parents[2]]
    assert tree.pop_evictable_interior(skip=lambda n: n is parents[2]) is None
    tree.unpin(parents[0])
    assert [n.id for n in tree.evictable_interiors()] == [parents[0].id, parents[2].id]
    tree.check_integrity()


def test_a_host_leaf_above_a_pinned_page_reading_from_disk_may_go_when_l3_holds_it():
    """A prefetch pins pages still reading from disk (not yet in host memory) below a prefix that is: that prefix's
    host copy is a leaf of the host tier held only by its descendants' pins. Where L3 holds it too it may go
    (it held host pages that new pages' copies needed); without its L3 copy, or with a pin of its own, it stays."""
    tree, parent, leaf = parent_and_leaf_with_parent_in_host()
    tree.set_location(leaf, DISK, list(leaf.keys))
    tree.clear_location(leaf, DEVICE)
    tree.clear_location(parent, DEVICE)
    tree.pin(leaf)  # its read into host memory is in flight
    assert parent.tier_children[1] == 0 and tree.pop_evictable(HOST) is None
    assert tree.pop_evictable_interior() is None  # the parent is only in host memory: its copy is needed
    tree.set_location(parent, DISK, list(parent.keys))
    assert tree.pop_evictable_interior() is parent
    pages, orphans = tree.clear_location(parent, HOST, interior=True)
    assert pages == [10, 11] and orphans == [] and parent.loc[1:] == [None, list(parent.keys)]
    tree.check_integrity()
    tree.set_location(parent, HOST, [12, 13])
    tree.pin(parent)  # held for a queued request itself
    assert tree.pop_evictable_interior() is None
    tree.unpin(parent)
    tree.unpin(leaf)
    assert tree.pop_evictable_interior() is None and tree.pop_evictable(HOST) is parent  # an ordinary leaf again
    tree.check_integrity()


def test_parent_cannot_leave_tier_before_children():
    tree = RadixTree(1)
    tree.insert([1, 2], [0, 1])
    tree.insert([1, 5], [0, 9])
    parent = tree.root.children[(1,)]
    with pytest.raises(ValueError, match="children in device"):
        tree.clear_location(parent, DEVICE)


def test_node_leaving_last_tier_removes_subtree_and_returns_orphans():
    tree = RadixTree(1)
    tree.insert([1], [0])
    tree.insert([1, 2], [b"x" * 16, b"y" * 16], tier=DISK)
    top = tree.root.children[(1,)]
    child = list(top.children.values())[0]
    assert child.tiers() == [DISK] and top.tiers() == [DEVICE, DISK]
    tree.clear_location(child, DISK)
    assert top.children == {}
    tree.insert([1, 2], [b"x" * 16, b"y" * 16], tier=DISK)
    tree.clear_location(top, DEVICE)  # allowed: its only child is on disk, not on device
    with pytest.raises(ValueError, match="children in disk"):
        tree.clear_location(top, DISK)
    # a continuation found on disk below a memory-only prefix: the prefix leaves its last tier
    tree = RadixTree(1)
    tree.insert([1], [0])
    top = tree.root.children[(1,)]
    tree.insert([2, 3], [b"a" * 16, b"b" * 16], tier=DISK, start=top)
    below = list(top.children.values())[0]
    pages, orphans = tree.clear_location(top, DEVICE)
    assert pages == [0] and orphans == [below] and below.disk_keys == [b"a" * 16, b"b" * 16]
    assert tree.pages_in == [0, 0, 0] and tree.root.children == {}
    tree.check_integrity()


def test_keys_chain_and_namespace():
    ns1 = namespace_fingerprint({"model": "a", "dtype": "bf16"})
    ns2 = namespace_fingerprint({"dtype": "bf16", "model": "a"})
    ns3 = namespace_fingerprint({"model": "a", "dtype": "fp16"})
    assert ns1 == ns2 != ns3 and len(ns1) == 16
    keys = page_keys(ns1, list(range(8)), 4)
    assert len(keys) == 2 and keys[1] == page_keys(keys[0], list(range(4, 8)), 4)[0]
    assert page_keys(ns3, list(range(8)), 4) != keys
    tree = RadixTree(4, ns1)
    node, _ = tree.insert(list(range(9)), [0, 1])
    assert node.keys == keys
    # a split keeps the chain
    tree.match_prefix(list(range(4)) + [0, 0, 0, 0])
    assert tree.root.children[(0, 1, 2, 3)].keys == keys[:1]
    tree.check_integrity()


def test_integrity_detects_corruption():
    tree = RadixTree(2)
    tree.insert([1, 2, 3, 4], [0, 1])
    tree.insert([5, 6], [1])  # page 1 owned twice
    with pytest.raises(AssertionError, match="owned twice"):
        tree.check_integrity()
    tree = RadixTree(2)
    node, _ = tree.insert([1, 2], [0])
    node.tier_children[0] = 3
    with pytest.raises(AssertionError, match="children in device"):
        tree.check_integrity()
    tree = RadixTree(2)
    node, _ = tree.insert([1, 2], [0])
    tree.pages_in[1] = 5
    with pytest.raises(AssertionError, match="page counts"):
        tree.check_integrity()


def test_bad_arguments():
    with pytest.raises(ValueError, match="page_size"):
        RadixTree(0)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        RadixTree(4, eviction_policy="fifo")
    tree = RadixTree(2)
    with pytest.raises(ValueError, match="2 full pages"):
        tree.insert([1, 2, 3, 4], [0])


def test_lfu_prefers_rarely_hit():
    tree = RadixTree(1, eviction_policy="lfu")
    tree.insert([1], [0])
    tree.insert([2], [1])
    for _ in range(3):
        tree.match_prefix([1])
    tree.match_prefix([2])  # most recent but hit once
    assert tree.pop_evictable(DEVICE) is tree.root.children[(2,)]


def eviction_order(tree, tier):
    """Every leaf of `tier` in the order eviction would take them (without evicting any)."""
    return sorted(tree.order.leaves[TIERS.index(tier)], key=tree.priorities[TIERS.index(tier)])


def test_lrfu_keeps_recently_frequent_pages_until_their_count_decays():
    tree = RadixTree(1, eviction_policy="lrfu", half_life=2)
    tree.insert([1], [0])
    tree.insert([2], [1])
    for _ in range(3):
        tree.match_prefix([1])  # four references (creation + 3 hits) within a few ticks
    tree.insert([3], [2])  # newest, referenced once
    order = [n.tokens for n in eviction_order(tree, DEVICE)]
    assert order == [(2,), (3,), (1,)]  # LRU would give [2, 1, 3]
    for t in range(10, 20):  # 10 more ticks: node 1's four references now weigh less than one fresh one
        tree.insert([t], [t])
    tree.insert([4], [4])
    order = [n.tokens for n in eviction_order(tree, DEVICE)]
    assert order.index((1,)) < order.index((4,))
    assert tree.pop_evictable(DEVICE).tokens == (2,)


def test_lrfu_ranks_the_disk_by_recency():
    tree = RadixTree(1, eviction_policy="lrfu", half_life=64)
    tree.insert([1], [b"a" * 16], tier=DISK)
    for _ in range(3):
        tree.match_prefix([1])
    tree.insert([2], [b"b" * 16], tier=DISK)
    assert tree.pop_evictable(DISK).tokens == (1,)  # least recent, however often it was hit
    tree.insert([1], [0])  # the same node on the GPU: there its hits count
    tree.insert([2], [1])
    assert tree.pop_evictable(DEVICE).tokens == (2,)


def test_lrfu_rejects_a_bad_half_life():
    with pytest.raises(ValueError, match="half_life"):
        RadixTree(4, eviction_policy="lrfu", half_life=0)


def test_a_copy_above_pinned_pages_that_l3_has_goes_before_a_host_copy_of_gpu_pages_that_l3_lacks():
    """A host copy of GPU pages is made again when they leave the GPU, and freeing them waits for that copy: when
    such a copy's turn comes, an eviction takes the copies above pinned pages that L3 has first; the other leaves keep
    their order (controller.eviction._HostPicks)."""
    from controller.eviction import _HostPicks

    tree, parents, leaves = prefixes_above_pinned_host_pages(1)
    tree.insert([6], [19])
    older = tree.match_prefix([6], touch=False).last_node
    tree.set_location(older, HOST, [29])
    tree.clear_location(older, DEVICE)  # in host memory only, older than the rest
    tree.insert([7], [20])
    on_gpu = tree.match_prefix([7], touch=False).last_node
    tree.set_location(on_gpu, HOST, [30])  # on the GPU and in host memory, not in L3: the oldest leaf
    tree.insert([8], [21])
    host_only = tree.match_prefix([8], touch=False).last_node
    tree.set_location(host_only, HOST, [31])
    tree.clear_location(host_only, DEVICE)
    picks = _HostPicks(tree, lambda n: False, lambda: [])
    taken = []
    while (pick := picks.next(None))[0] is not None:
        node, interior = pick
        taken.append(pick)
        tree.clear_location(node, HOST, interior=interior)
    picks.done()
    assert taken == [(older, False), (parents[0], True), (on_gpu, False), (host_only, False)]
    assert on_gpu.on_device and leaves[0].on_host  # the pinned leaf stays
    tree.check_integrity()


def test_one_eviction_iterates_the_candidates_once_and_again_only_before_its_last_resort():
    """The host copies one eviction takes (controller.eviction._HostPicks): the copies above pinned pages in
    priority order from one iteration of `evictable_interiors`; when none is left, one more before the last resort,
    a leaf whose L3 write waits (it is dropped). Such a leaf, passed over, stays out of the host order until it is
    requeued."""
    from controller.eviction import _HostPicks

    tree, parents, leaves = prefixes_above_pinned_host_pages()
    scans = []
    real = tree.evictable_interiors
    tree.evictable_interiors = lambda skip=None: scans.append(1) or real(skip)
    waiting = {leaves[2].id}  # its L3 write waits for the queue
    picks = _HostPicks(tree, lambda n: n.id in waiting, lambda: [n for n in leaves if n.id in waiting])
    taken = []
    for _ in range(3):
        node, interior = picks.next(None)
        assert interior
        taken.append(node)
        tree.clear_location(node, HOST, interior=True)
    assert taken == parents and len(scans) == 1  # oldest first (insertion order), one iteration for all three
    tree.unpin(leaves[2])  # its pin dropped: the leaf is evictable, but its write waits
    node, interior = picks.next(None)
    assert (node, interior) == (leaves[2], False) and len(scans) == 2  # the first iteration ran out: one more
    picks.done()
    # an eviction that passes over a leaf whose write waits leaves it out of the host order, until it is requeued
    in_order = lambda n: any(entry[2] is n for heap in tree.order.heaps[1].values() for entry in heap)  # noqa: E731
    other = _HostPicks(tree, lambda n: n.id in waiting, lambda: [])
    assert other.next(None) == (None, False)
    other.done()
    assert not in_order(leaves[2]) and leaves[2] in tree.order.leaves[1]
    waiting.clear()
    tree.requeue(leaves[2])
    assert in_order(leaves[2]) and tree.pop_evictable(HOST) is leaves[2]
    tree.check_integrity()
