"""Cache namespaces: which part of the cache a request may match and fill.

Requests match prefixes only within their namespace, on every tier: each namespace has its own root in the
tree (`RadixTree.namespace_root`) and its own key chains, so its pages have their own L3 and shared-tier keys,
and a restart keeps them apart. The server derives a namespace from the request's tenant and `cache_salt`
(hicache/server/tenants.py); the id is a hash, so neither the salt nor the tenant's key is ever stored.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from radix.hashing import KEY_BYTES


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
