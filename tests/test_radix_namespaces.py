"""Namespaces and share groups in the radix tree: equal tokens in two namespaces share nothing (not a match, not
a key), the default namespace keeps its keys, empty namespace roots are pruned, and eviction takes a group over
its quota first."""

import pytest

from radix import DEVICE, HOST, RadixTree, namespace_fingerprint, namespace_id, page_keys

NS = namespace_fingerprint({"model": "m"})
A, B = namespace_id("tenant", "alice"), namespace_id("tenant", "bob")
PROMPT = list(range(1, 17))  # 4 pages of 4


def test_equal_tokens_in_two_namespaces_share_no_match_and_no_key():
    tree = RadixTree(4, namespace=NS)
    alice = tree.namespaces.get(A, group=1)
    node, _ = tree.insert(PROMPT, [0, 1, 2, 3], start=alice)
    assert tree.match_prefix(PROMPT, base=alice).num_pages == 4
    assert tree.match_prefix(PROMPT).num_pages == 0  # the default namespace
    bob = tree.namespaces.get(B, group=2)
    m = tree.match_prefix(PROMPT, base=bob)
    assert m.num_pages == 0 and m.last_node is bob and m.base is bob
    bob_node, _ = tree.insert(PROMPT, [4, 5, 6, 7], start=bob)
    assert set(node.keys).isdisjoint(bob_node.keys)
    assert tree.path_tokens(bob_node) == tuple(PROMPT)
    # the default namespace's chain is the one it always was: an L3 written without tenants still matches
    plain, _ = tree.insert(PROMPT, [8, 9, 10, 11])
    assert plain.keys == page_keys(NS, PROMPT, 4)
    assert tree.group_pages(DEVICE) == {0: 4, 1: 4, 2: 4}
    assert [n.num_pages for n in tree.nodes()] == [4, 4, 4]  # namespace roots hold no pages and are not listed
    tree.check_integrity()


def test_a_namespace_id_is_bound_to_its_group_and_its_length():
    tree = RadixTree(4)
    assert tree.namespaces.get(None) is tree.root
    assert tree.namespaces.get(A, group=1) is tree.namespaces.get(A, group=1)
    with pytest.raises(ValueError, match="share group 1, not 2"):
        tree.namespaces.get(A, group=2)
    with pytest.raises(ValueError, match="16 bytes"):
        tree.namespaces.get(b"short")
    assert namespace_id("ab", "c") != namespace_id("a", "bc")


def test_empty_namespace_roots_are_pruned_once_they_doubled():
    tree = RadixTree(4)
    held = tree.namespaces.get(namespace_id("held"))
    node, _ = tree.insert(PROMPT, [0, 1, 2, 3], start=held)
    tree.lock(node)
    for i in range(63):  # a client sending a new salt with every request
        tree.namespaces.get(namespace_id(f"salt-{i}"))
    assert len(tree.namespaces) == 64 and tree.namespaces.prune() == 0  # not past the floor of 64 yet
    tree.namespaces.get(namespace_id("one more"))
    assert tree.namespaces.prune() == 64  # all but the one holding pages
    assert len(tree.namespaces) == 1 and tree.match_prefix(PROMPT, base=held).num_pages == 4
    locked = tree.namespaces.get(namespace_id("locked"))
    tree.lock(locked)  # a ticket with nothing cached holds its namespace root
    assert tree.namespaces.prune(force=True) == 0
    tree.unlock(locked)
    tree.unlock(node)
    assert tree.namespaces.prune(force=True) == 1
    tree.check_integrity()


def fill(tree, ns, group, pages, first_id, salt):
    """`pages` one-page prompts of namespace ns, their host page ids from first_id."""
    root = tree.namespaces.get(ns, group)
    for i in range(pages):
        tree.insert([salt, i, 0, 0], [first_id + i], tier=HOST, start=root)


def evict_host(tree, n):
    """Evict n host leaves in eviction order; the groups they belonged to."""
    groups = []
    for _ in range(n):
        node = tree.pop_evictable(HOST)
        groups.append(node.group)
        tree.clear_location(node, HOST)
    return groups


def test_a_group_over_its_quota_is_evicted_first_however_recent():
    tree = RadixTree(4)
    fill(tree, A, 1, 4, 0, salt=1)  # alice's hot prefixes, older than everything bob sends
    fill(tree, B, 2, 12, 100, salt=2)  # bob floods
    assert evict_host(tree, 3) == [1, 1, 1]  # no quotas: least recently used first, alice's
    tree = RadixTree(4)
    fill(tree, A, 1, 4, 0, salt=1)
    fill(tree, B, 2, 12, 100, salt=2)
    tree.set_quotas(HOST, {1: 8, 2: 8})  # 16 pages, half each
    assert evict_host(tree, 4) == [2, 2, 2, 2]  # bob is over his share: his own pages go, oldest first
    assert tree.group_pages(HOST) == {1: 4, 2: 8}
    assert evict_host(tree, 2) == [1, 1]  # nobody over: plain LRU again
    tree.check_integrity()


def test_a_group_over_its_quota_with_nothing_evictable_leaves_room_to_the_others():
    tree = RadixTree(4)
    fill(tree, A, 1, 2, 0, salt=1)
    fill(tree, B, 2, 6, 100, salt=2)
    for node in list(tree.nodes()):
        if node.group == 2:
            tree.lock(node)  # bob's pages are all in use
    tree.set_quotas(HOST, {1: 4, 2: 4})
    assert evict_host(tree, 1) == [1]
    tree.check_integrity()


def test_room_for_a_group_that_would_go_over_its_quota_comes_only_from_itself_and_groups_over_theirs():
    tree = RadixTree(4)
    fill(tree, A, 1, 6, 0, salt=1)
    fill(tree, B, 2, 2, 100, salt=2)
    tree.set_quotas(HOST, {1: 8, 2: 4})
    assert tree.quota_victims(HOST, None, 3) == (None, False)  # nobody asks: the plain order
    assert tree.quota_victims(HOST, 1, 2) == (None, False)  # alice stays within her quota: any group's pages
    assert tree.quota_victims(HOST, 2, 3) == ([2], True)  # bob would go over his: only his own
    groups, strict = tree.quota_victims(HOST, 2, 3)
    assert tree.pop_evictable(HOST, groups=groups).group == 2
    fill(tree, B, 2, 4, 200, salt=3)  # bob is over his quota now: alice's room may come from him
    assert tree.quota_victims(HOST, 1, 1) == ([2], False)
    assert tree.quota_victims(HOST, 1, 3) == ([2, 1], True)
