"""Cache namespaces: which part of the cache a request may match and fill.

Requests match prefixes only within their namespace, on every tier: each namespace has its own root in the
tree (`RadixTree.namespaces`) and its own key chains, so its pages have their own L3 and remote-tier keys,
and a restart keeps them apart. The server derives a namespace from the request's tenant and `cache_salt`
(hicache/server/tenants.py); the id is a hash, so neither the salt nor the tenant's key is ever stored.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from radix.hashing import KEY_BYTES
from radix.node import NamespaceRoot, TreeNode


@dataclass(frozen=True)
class CacheNamespace:
    """`id`: 16 bytes naming the namespace (None: the default one); `group`: the share group its pages count
    against (a tenant's quota per tier, `RadixTree.set_quotas`)."""

    id: bytes | None = None
    group: int = 0

    def __repr__(self) -> str:
        name = self.id.hex()[:8] if self.id is not None else "default"
        return f"CacheNamespace({name}, group={self.group})"


DEFAULT_NAMESPACE = CacheNamespace()


def namespace_seed(fingerprint: bytes, ns: bytes | None) -> bytes:
    """The first link of namespace `ns`'s key chains in a cache whose namespace fingerprint is `fingerprint`
    (radix.hashing): the fingerprint itself for the default namespace."""
    if ns is None:
        return fingerprint
    return hashlib.blake2b(fingerprint + ns, digest_size=KEY_BYTES, person=b"hicache-tenant").digest()


def namespace_id(*parts: str) -> bytes:
    """A 16-byte namespace id for `parts` (a tenant's name, a salt): equal parts, equal ids; the parts are
    length-prefixed, so ("ab", "c") and ("a", "bc") differ."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"hicache-ns-id")
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


class NamespaceRoots:
    """The roots of a tree's namespaces other than the default one (whose root is the tree's), hung under the
    tree's root keyed by their 16-byte id (bytes keys never equal a child's token tuple)."""

    def __init__(self, root: NamespaceRoot, fingerprint: bytes):
        self.root = root
        self.fingerprint = fingerprint
        self._count = 0
        self._kept = 0  # how many the last prune kept

    def __len__(self) -> int:
        return self._count

    def get(self, ns: bytes | None, group: int = 0) -> NamespaceRoot:
        """The root of namespace `ns` (None: the default namespace, the tree's root), made on first use with share
        group `group`. Its key chains start from `namespace_seed`. Roots left empty are removed by `prune`."""
        if ns is None:
            return self.root
        children: dict[Any, TreeNode] = self.root.children
        node = children.get(ns)
        if node is None:
            if len(ns) != KEY_BYTES:
                raise ValueError(f"a namespace id is {KEY_BYTES} bytes, got {len(ns)}")
            node = children[ns] = NamespaceRoot(self.root, ns, namespace_seed(self.fingerprint, ns), group)
            self._count += 1
        elif node.group != group:
            raise ValueError(f"namespace {ns.hex()[:8]} is in share group {node.group}, not {group}")
        assert isinstance(node, NamespaceRoot)
        return node

    def prune(self, force: bool = False) -> int:
        """Remove the roots that hold nothing (no child, lock or pin); returns how many. Unless `force`, only once
        their number has doubled since the last prune (a client sending a new salt with each request makes a root
        each time). Call it where no caller holds an unlocked root (the controller's step start)."""
        if not force and self._count <= 2 * self._kept + 64:
            return 0
        children: dict[Any, TreeNode] = self.root.children
        empty = [key for key, node in children.items()
                 if node.base and not node.children and node.lock_ref == 0 and node.pin_ref == 0]
        for key in empty:
            children.pop(key).parent = None
        self._count -= len(empty)
        self._kept = self._count
        return len(empty)
