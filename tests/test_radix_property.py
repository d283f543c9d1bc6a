"""The radix tree against a reference model: per tier, a dict from each cached page's token prefix to its page id.

Random inserts (any tier), matches (which split nodes), evictions of the tree's chosen leaf, and locks. After
every step the tree's state, read back page by page, must equal the model's, and its own integrity check holds.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from radix import DEVICE, DISK, HOST, TIERS, RadixTree, TreeNode

PAGE = 2
sequences = st.lists(st.integers(0, 2), min_size=0, max_size=10)  # a small alphabet: many shared prefixes
ops = st.one_of(
    st.tuples(st.just("insert"), st.sampled_from(TIERS), sequences),
    st.tuples(st.just("match"), sequences),
    st.tuples(st.just("evict"), st.sampled_from(TIERS)),
    st.tuples(st.just("lock"), sequences),
    st.tuples(st.just("unlock")),
)


class Model:
    """What should be cached: per tier, page prefix (tokens up to the page's end) -> page id."""

    def __init__(self) -> None:
        self.tiers: dict[str, dict[tuple[int, ...], int]] = {t: {} for t in TIERS}

    def cached(self, prefix: tuple[int, ...]) -> bool:
        return any(prefix in pages for pages in self.tiers.values())

    def match(self, tokens: tuple[int, ...]) -> list[str]:
        """Fastest tier of each matched page, in order."""
        out = []
        for end in range(PAGE, len(tokens) // PAGE * PAGE + 1, PAGE):
            prefix = tokens[:end]
            tier = next((t for t in TIERS if prefix in self.tiers[t]), None)
            if tier is None:
                break
            out.append(tier)
        return out

    def insert(self, tokens: tuple[int, ...], tier: str, ids: list[int]) -> list[int]:
        dups = []
        for i, end in enumerate(range(PAGE, len(tokens) // PAGE * PAGE + 1, PAGE)):
            if tokens[:end] in self.tiers[tier]:
                dups.append(ids[i])
            else:
                self.tiers[tier][tokens[:end]] = ids[i]
        return dups

    def drop(self, prefixes: list[tuple[int, ...]], tier: str) -> set[tuple[str, int]]:
        """Remove prefixes from a tier; a prefix left in no tier takes every extension, in every tier, with it.
        Returns the (tier, page id) pairs freed."""
        freed = {(tier, self.tiers[tier].pop(p)) for p in prefixes}
        gone = [p for p in prefixes if not self.cached(p)]
        for t, pages in self.tiers.items():
            for p in [p for p in pages if any(p[: len(g)] == g for g in gone)]:
                freed.add((t, pages.pop(p)))
        return freed


def tree_state(tree: RadixTree) -> dict[str, dict[tuple[int, ...], int]]:
    state: dict[str, dict[tuple[int, ...], int]] = {t: {} for t in TIERS}
    for node in tree.nodes():
        path = tree.path_tokens(node)
        start = len(path) - len(node.tokens)
        for tier in TIERS:
            for i, page in enumerate(node.pages(tier) or ()):
                state[tier][path[: start + (i + 1) * PAGE]] = page
    return state


def node_prefixes(tree: RadixTree, node: TreeNode) -> list[tuple[int, ...]]:
    path = tree.path_tokens(node)
    start = len(path) - len(node.tokens)
    return [path[: start + (i + 1) * PAGE] for i in range(node.num_pages)]


@settings(max_examples=150, deadline=None)
@given(st.lists(ops, max_size=40))
def test_tree_matches_the_reference_model(steps):
    tree, model = RadixTree(PAGE), Model()
    ids = itertools.count()
    locked: list[TreeNode] = []
    for op in steps:
        if op[0] == "insert":
            _, tier, seq = op
            tokens = tuple(seq)
            pages = [next(ids) for _ in range(len(tokens) // PAGE)]
            _, dups = tree.insert(tokens, pages, tier)
            assert dups == model.insert(tokens, tier, pages)
        elif op[0] == "match":
            tokens = tuple(op[1])
            m = tree.match_prefix(tokens)
            want = model.match(tokens)
            got = [tier for node, tier in m.segments for _ in range(node.num_pages)]
            assert got == want
            assert (m.device_pages, m.host_pages, m.disk_pages) == tuple(want.count(t) for t in TIERS)
        elif op[0] == "evict":
            tier = op[1]
            node = tree.pop_evictable(tier)
            held = {id(n) for lock in locked for n in _path(lock)}
            if node is None:
                # nothing evictable: every leaf of the tier is on a locked path
                leaves = [p for p in model.tiers[tier] if not any(
                    q != p and q[: len(p)] == p for q in model.tiers[tier])]
                assert all(_on_locked_path(tree, p, locked) for p in leaves)
                continue
            assert id(node) not in held, "a locked node was offered for eviction"
            prefixes = node_prefixes(tree, node)
            last = prefixes[-1]
            assert not any(q[: len(last)] == last and q != last for q in model.tiers[tier]), "not a leaf of the tier"
            pages, orphans = tree.clear_location(node, tier)
            freed = {(tier, p) for p in pages}
            for orphan in orphans:
                freed |= {(t, p) for t in TIERS for p in (orphan.pages(t) or ())}
            if node.removed:
                freed |= {(t, p) for t in TIERS if t != tier for p in (node.pages(t) or ())}
            assert freed == model.drop(prefixes, tier)
        elif op[0] == "lock":
            m = tree.match_prefix(tuple(op[1]), touch=False)
            if m.nodes:
                tree.lock(m.last_node)
                locked.append(m.last_node)
        elif locked:
            tree.unlock(locked.pop())
        tree.check_integrity()
        assert tree_state(tree) == model.tiers
        assert tree.pages_in == [len(model.tiers[t]) for t in TIERS]
    for node in locked:
        tree.unlock(node)
    assert tree.root.lock_ref == 1


def _path(node: TreeNode) -> list[TreeNode]:
    out = []
    while node is not None and node.parent is not None:
        out.append(node)
        node = node.parent
    return out


def _on_locked_path(tree: RadixTree, prefix: tuple[int, ...], locked: list[TreeNode]) -> bool:
    return any(tree.path_tokens(n)[: len(prefix)] == prefix for n in locked)


def test_model_drop_takes_extensions_of_a_prefix_left_in_no_tier():
    model = Model()
    model.insert((1, 1, 2, 2), DEVICE, [0, 1])
    model.insert((1, 1, 2, 2, 0, 0), HOST, [5, 6, 7])
    model.insert((1, 1, 2, 2, 0, 0), DISK, [8, 9, 10])
    assert model.drop([(1, 1, 2, 2)], DEVICE) == {(DEVICE, 1)}  # still on host: nothing below goes
    assert model.drop([(1, 1, 2, 2), (1, 1, 2, 2, 0, 0)], HOST) == {(HOST, 6), (HOST, 7)}  # still on disk
    # no longer cached anywhere: its extension leaves every tier with it
    assert model.drop([(1, 1, 2, 2)], DISK) == {(DISK, 9), (DISK, 10)}
    assert model.tiers == {DEVICE: {(1, 1): 0}, HOST: {(1, 1): 5}, DISK: {(1, 1): 8}}
